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


@pytest.mark.parametrize("kwargs, words", [({"num_features": 0}, "num_features"),
                                           ({"num_features": 3, "eps": -1}, "eps"),
                                           ({"num_features": 3, "affine": "yes"}, "affine")])
def test_sync_batchnorm_bad_arguments_name_themselves(kwargs, words):
    with pytest.raises((TypeError, ValueError), match=words):
        SyncBatchNorm(**kwargs)


# ---------------------------------------------------------------- numerics and eval mode (issue 20)

def _offset_job():
    """Float32 activations around 1e4 (a spread of 1): E[x²] - E[x]² would lose every digit of the variance."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    x = 1e4 + torch.randn(8, 3, 4, 4, generator=g)
    w = torch.randn(8, 3, 4, 4, generator=g)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    mine = shard(x, w, rank, n)
    xs = mine[0].clone().requires_grad_()
    (sync(xs) * mine[1]).sum().backward()  # the sum over ranks of these losses is the global one
    return {"y": sync(xs.detach()).detach(), "grad": xs.grad, "mean": sync.running_mean, "var": sync.running_var}


def test_sync_batchnorm_is_stable_far_from_zero_and_matches_batchnorm_on_the_global_batch():
    g = torch.Generator().manual_seed(5)
    x = 1e4 + torch.randn(8, 3, 4, 4, generator=g)
    w = torch.randn(8, 3, 4, 4, generator=g)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    xg = x.clone().requires_grad_()
    (bn(xg) * w).sum().backward()
    y = bn(x).detach()  # a second step, as the job takes: its running statistics too
    ranks = launch(_offset_job, 2, (), timeout=60.0)
    # float32 holds 1e4 to about 1e-3: the means may differ by that much, the outputs by that over the spread
    assert torch.allclose(torch.cat([r["y"] for r in ranks]), y, rtol=0, atol=2e-3)
    assert torch.allclose(torch.cat([r["grad"] for r in ranks]), xg.grad, rtol=0, atol=1e-3)
    for r in ranks:
        assert torch.allclose(r["mean"], bn.running_mean, rtol=1e-6)
        assert torch.allclose(r["var"], bn.running_var, rtol=1e-4)


def _eval_alone_job(track_running_stats):
    """A training step on every rank, then only rank 0 evaluates (as a runner testing on rank 0 does)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(9)
    x, probe = torch.randn(8, 3, generator=g) * 3 + 1, torch.randn(5, 3, generator=g)
    bn = nn.BatchNorm1d(3, track_running_stats=track_running_stats)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    bn(x)  # the global batch, as the ranks' shards together
    sync(shard(x, x, rank, n)[0])
    out = None
    if rank == 0:  # rank 1 goes straight to the barrier: a pooled forward would wait for it there
        out = (bn.eval()(probe).detach(), sync.eval()(probe).detach())
    dist.barrier()
    return out


@pytest.mark.parametrize("track_running_stats", [True, False])
def test_sync_batchnorm_in_eval_mode_is_local_and_does_not_wait_for_other_ranks(track_running_stats):
    expected, ours = launch(_eval_alone_job, 2, (track_running_stats,), timeout=30.0)[0]
    assert torch.allclose(ours, expected, rtol=0, atol=1e-6)
