"""ZeRO-1/2 across processes: parameters equal torch's ZeroRedundancyOptimizer, plain DDP and one process.

One spawned job per world size (gloo on 127.0.0.1, one thread per rank, killed after a
timeout) returns the parameters after every step; the assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch, shard
from manualdp.spmd.zero import ZeroRedundancyOptimizer

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
STEPS = 3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batches(batch=13):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(STEPS)]


def _flat(module):
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _shard_loss(model, X, y, rank, n):
    Xs, ys = shard(X, y, rank, n)
    return nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n  # DDP averages: times n


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        models = {"stage1": DistributedDataParallel(_mlp()), "stage2": DistributedDataParallel(_mlp()),
                  "plain": DistributedDataParallel(_mlp()), "torch": TorchDDP(_mlp())}
        opts = {"stage1": ZeroRedundancyOptimizer(models["stage1"].parameters(), cls, **kw),
                "stage2": ZeroRedundancyOptimizer(models["stage2"].parameters(), cls, stage=2, **kw),
                "plain": cls(models["plain"].parameters(), **kw),
                "torch": TorchZero(models["torch"].parameters(), cls, **kw)}
        single = _mlp()
        single_opt = cls(single.parameters(), **kw)
        steps = []
        for X, y in _batches():
            for key, model in models.items():
                opts[key].zero_grad()
                if key == "stage2":
                    with model.no_sync():
                        _shard_loss(model, X, y, rank, n).backward()
                else:
                    _shard_loss(model, X, y, rank, n).backward()
                opts[key].step()
            single_opt.zero_grad()
            (nn.functional.cross_entropy(single(X), y, reduction="sum") / len(X)).backward()
            single_opt.step()
            steps.append({key: _flat(m.module) for key, m in models.items()} | {"single": _flat(single)})
        out[name] = {"steps": steps, "state": {k: _state_bytes(opts[k]) for k in ("stage1", "stage2", "plain")}}
    return out


def _state_bytes(opt):
    inner = getattr(opt, "optimizer", opt)
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=180.0)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_equals_torch_zero_ddp_and_one_process_after_every_step(n, name):
    results = [r[name] for r in _results(n)]
    for step in range(STEPS):
        for r in range(n):
            got = results[r]["steps"][step]
            for stage in ("stage1", "stage2"):
                torch.testing.assert_close(got[stage], got["torch"], rtol=0, atol=1e-10, msg=f"{stage} vs torch's ZeRO")
                torch.testing.assert_close(got[stage], got["plain"], rtol=0, atol=1e-10, msg=f"{stage} vs plain DDP")
                torch.testing.assert_close(got[stage], got["single"], rtol=0, atol=1e-10, msg=f"{stage} vs one process")
                assert torch.equal(got[stage], results[0]["steps"][step][stage]), "ranks differ after the all-gather"
    assert not torch.equal(results[0]["steps"][0]["stage1"], _flat(_mlp())), "training did not move the parameters"


@pytest.mark.parametrize("n", [2, 3])
def test_adam_state_per_rank_is_about_one_nth(n):
    results = [r["adam"]["state"] for r in _results(n)]
    total = sum(p.numel() for p in _mlp().parameters())
    for r in range(n):
        assert results[r]["plain"] == 2 * 8 * total
        for stage in ("stage1", "stage2"):
            assert abs(results[r][stage] - 2 * 8 * total / n) <= 2 * 8
    assert sum(r["stage1"] for r in results) == 2 * 8 * total


def _train_spmd_job():
    from torch.utils.data import DataLoader, TensorDataset

    from manualdp import train_spmd
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(60, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (60,), generator=g))
    out = {}
    for zero in (None, 1, 2):
        net = _mlp()
        train_spmd(net, DataLoader(data, batch_size=13), DataLoader(data, batch_size=30), 2, 1e-2,
                   optimizer=torch.optim.Adam, zero=zero, progress=False, log=None)
        out[zero] = _flat(net)
    try:
        train_spmd(_mlp(), DataLoader(data, batch_size=13), DataLoader(data), 1, 1e-2, zero=2, nonfinite="raise", log=None)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_train_spmd_with_zero_equals_train_spmd_without():
    results = launch(_train_spmd_job, 2, timeout=180.0)
    for r in range(2):
        for zero in (1, 2):
            torch.testing.assert_close(results[r][zero], results[r][None], rtol=0, atol=1e-10)
            assert torch.equal(results[r][zero], results[0][zero])
        assert "nonfinite" in results[r]["refused"]
    assert not torch.equal(results[0][None], _flat(_mlp()))
