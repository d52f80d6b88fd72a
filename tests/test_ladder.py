"""The DDP ladder (naive, flat, overlapped, bucketed): each rung equals torch's DDP after every step.

One spawned job per world size trains every rung and torch's DDP on the same data: a model
with a parameter used twice in one forward, a frozen layer, and (for the bucketed rung)
several buckets. The assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch, shard

STEPS = 3
RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0005)}  # 512 B: several buckets


class Twice(nn.Module):
    """`shared` is applied twice, `frozen` takes no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.frozen, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))
        return self.out(self.frozen(h))


def _batches(batch=13):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(STEPS)]


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        torch.manual_seed(1)  # rank 1 starts from other weights: the wrappers must copy rank 0's
    models = {name: make(Twice().double()) for name, make in RUNGS.items()}
    models["torch"] = TorchDDP(Twice().double())
    opts = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
            for k, m in models.items()}
    events = {k: [] for k in RUNGS}
    for k in ("overlapped", "bucketed"):  # when does each allreduce start: during backward, or after?
        m = models[k]
        start = m.start_bucket if k == "bucketed" else m.start
        wrapped = (lambda start, log: lambda *a: (log.append("send"), start(*a))[1])(start, events[k])
        setattr(m, "start_bucket" if k == "bucketed" else "start", wrapped)
        end = m._end_of_backward
        m._end_of_backward = (lambda end, log: lambda: (log.append("end"), end())[1])(end, events[k])
    steps = []
    for X, y in _batches():
        Xs, ys = shard(X, y, rank, n)
        grads, params = {}, {}
        for k, m in models.items():
            opts[k].zero_grad()
            (nn.functional.cross_entropy(m(Xs), ys, reduction="sum") / len(X) * n).backward()
            grads[k] = _flat(p.grad for p in m.parameters() if p.requires_grad)
            opts[k].step()
            params[k] = _flat(m.parameters())
        steps.append({"grads": grads, "params": params})
    return {"steps": steps, "events": events,
            "buckets": len(models["bucketed"].buckets)}


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=120.0)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_rung_equals_torch_ddp_after_every_step(n, rung):
    results = _results(n)
    for step in range(STEPS):
        for r in range(n):
            got = results[r]["steps"][step]
            torch.testing.assert_close(got["grads"][rung], got["grads"]["torch"], rtol=0, atol=1e-12,
                                       msg=f"rank {r} step {step}: averaged gradients when backward returned")
            torch.testing.assert_close(got["params"][rung], got["params"]["torch"], rtol=0, atol=1e-12,
                                       msg=f"rank {r} step {step}: parameters")
            assert torch.equal(got["params"][rung], results[0]["steps"][step]["params"][rung]), "ranks differ"


def test_the_overlapping_rungs_send_during_backward():
    results = _results(2)
    assert results[0]["buckets"] >= 3
    per_step = {"overlapped": 6, "bucketed": results[0]["buckets"]}  # inp, shared, out: 6 need a gradient
    for rung, sends in per_step.items():
        events = results[0]["events"][rung]
        assert events == (["send"] * sends + ["end"]) * STEPS, f"{rung}: {events}"


def _bad_input_job():
    out = {}
    for name, make in RUNGS.items():
        frozen = nn.Linear(2, 2).requires_grad_(False)
        try:
            make(frozen)
        except ValueError as e:
            out[name] = str(e)
    try:
        NaiveDDP(nn.Linear(2, 2), algorithm="fastest")
    except ValueError as e:
        out["algorithm"] = str(e)
    try:
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=-1)
    except ValueError as e:
        out["cap"] = str(e)
    return out


def test_rungs_refuse_bad_input_naming_it():
    got = launch(_bad_input_job, 2, timeout=60.0)[0]
    for name in RUNGS:
        assert "no parameter that requires grad" in got[name]
    assert "algorithm" in got["algorithm"] and "fastest" in got["algorithm"]
    assert "bucket_cap_mb" in got["cap"] and "-1" in got["cap"]
