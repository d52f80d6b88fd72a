"""A rung lives while someone holds it or a graph of its forward awaits backward; then its module is plain again.
A deep copy of a rung (after a step, on every rank) is a rung of its own over a copy of the module: it trains as a
one-process model on the global batch, and the original goes on as before (before: refused)."""
import copy
import gc
import pickle

import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = (NaiveDDP, FlatDDP, OverlappedDDP, BucketedDDP)


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for rung in RUNGS:
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
        x = torch.full((4, 3), float(rank + 1))
        rung(net, timeout=30)(x).sum().backward()  # no one holds the rung: its graph does, until backward
        gc.collect()
        want = sum(torch.full((4, 3), float(r + 1)).sum(0) for r in range(n)) / n
        out[f"{rung.__name__} inline"] = torch.allclose(net.weight.grad[0], want)
        net.zero_grad()
        net(x).sum().backward()  # the rung is gone: the rank's own gradient
        out[f"{rung.__name__} after"] = torch.equal(net.weight.grad[0], x.sum(0))
        out[f"{rung.__name__} pickles"] = pickle.loads(pickle.dumps(net)).weight.shape == net.weight.shape
    return out


def _batch(rank, step):
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * step + rank))


def _sgd(model, x, divisor=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    (model(x).pow(2).sum() / divisor).backward()
    opt.step()


def _seeded():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _copy_job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for rung in RUNGS:
        kwargs = {"bucket_cap_mb": 1e-5} if rung is BucketedDDP else {}
        net = _seeded()
        original = rung(net, timeout=30, **kwargs)
        _sgd(original, _batch(rank, 0))
        twin = copy.deepcopy(original)
        _sgd(twin, _batch(rank, 1))
        _sgd(original, _batch(rank, 1))
        reference = _seeded()
        for step in range(2):  # one process, the global batch: the ranks' losses averaged
            _sgd(reference, torch.cat([_batch(r, step) for r in range(n)]), divisor=n)
        out[rung.__name__] = {"twin": [p.detach().clone() for p in twin.module.parameters()],
                              "original": [p.detach().clone() for p in original.module.parameters()],
                              "reference": [p.detach().clone() for p in reference.parameters()],
                              "own module": twin.module is not net and twin.number != original.number,
                              "settings": getattr(twin, "bucket_cap_mb", None) == kwargs.get("bucket_cap_mb")}
    return out


def test_a_deep_copied_rung_is_a_rung_of_its_own_and_trains_as_one_process():
    for r, got in enumerate(launch(_copy_job, 2, timeout=120)):
        for name, case in got.items():
            assert case["own module"] and case["settings"], (r, name)
            for twin, original, want in zip(case["twin"], case["original"], case["reference"]):
                torch.testing.assert_close(twin, want, rtol=0, atol=1e-6, msg=f"rank {r} {name}: the copy")
                torch.testing.assert_close(original, want, rtol=0, atol=1e-6, msg=f"rank {r} {name}: the original")


def test_an_inline_rung_averages_then_lets_its_module_go():
    for r, got in enumerate(launch(_job, 2, timeout=120)):
        assert all(got.values()), (r, {k: v for k, v in got.items() if not v})
