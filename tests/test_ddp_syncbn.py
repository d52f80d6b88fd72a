"""SyncBatchNorm: N ranks wrapped in manualdp's DDP equal one process on the global batch, also with BatchNorm."""
import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import SyncBatchNorm, convert_sync_batchnorm, launch, shard

JOB_TIMEOUT = 180.0
BATCH = 12  # divisible by 2 and 3


def _net():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 4)).double()


def _batches(steps=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def _state(model):
    return torch.cat([t.detach().double().reshape(-1) for t in list(model.parameters()) + list(model.buffers())])


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    single = _net()
    ours = DistributedDataParallel(convert_sync_batchnorm(copy.deepcopy(single)))
    plain = DistributedDataParallel(copy.deepcopy(single))  # BatchNorm on each rank's shard only
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (single, ours, plain)]
    rows = []
    for X, y in _batches():
        for opt in opts:
            opt.zero_grad()
        nn.functional.cross_entropy(single(X), y, reduction="sum").div(BATCH).backward()
        Xs, ys = shard(X, y, rank, n)
        for model in (ours, plain):
            nn.functional.cross_entropy(model(Xs), ys, reduction="sum").div(BATCH / n).backward()
        for opt in opts:
            opt.step()
        rows.append([_state(single), _state(ours), _state(plain)])
    kinds = sorted({type(m).__name__ for m in ours.module.modules()})
    ours.eval()
    single.eval()
    X, _ = _batches(1)[0]
    return {"rows": rows, "kinds": kinds, "eval": [single(X).detach(), ours(X).detach()]}


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, (), timeout=JOB_TIMEOUT)


@pytest.mark.parametrize("n", [2, 3])
def test_sync_batchnorm_on_n_ranks_equals_one_process(n):
    for rank, result in enumerate(_results(n)):
        assert "BatchNorm2d" not in result["kinds"] and "SyncBatchNorm" in result["kinds"]
        for step, (single, ours, plain) in enumerate(result["rows"]):
            assert torch.allclose(single, ours, rtol=0, atol=1e-10), f"rank {rank} step {step}"
            assert not torch.allclose(single, plain, rtol=0, atol=1e-6), "plain BatchNorm should differ"
        assert torch.allclose(*result["eval"], rtol=0, atol=1e-10)


def test_sync_batchnorm_in_one_process_is_batchnorm():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3).double()
    sync = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(bn))
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    a, b = bn(x), sync(x)
    assert torch.allclose(a, b, atol=1e-12) and sync.weight.dtype == torch.float64
    ga, = torch.autograd.grad((a ** 3).sum(), x)
    gb, = torch.autograd.grad((b ** 3).sum(), x)
    assert torch.allclose(ga, gb, atol=1e-10)
    assert torch.allclose(bn.running_var, sync.running_var, atol=1e-12)


@pytest.mark.parametrize("kwargs, words", [({"num_features": 0}, "num_features"), ({"num_features": 3, "eps": -1}, "eps"),
                                           ({"num_features": 3, "affine": "yes"}, "affine")])
def test_sync_batchnorm_bad_arguments_name_themselves(kwargs, words):
    with pytest.raises((TypeError, ValueError), match=words):
        SyncBatchNorm(**kwargs)
