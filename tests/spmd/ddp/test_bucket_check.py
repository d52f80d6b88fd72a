"""Each bucket carries the step's call check (`step_check.CallCheck.carried`), at 2 ranks (its tag) and 3 (headers).

One rank calls an allreduce of its own before a step of a model in several buckets: every rank raises
naming the calls, and the later buckets of the refused step send nothing, so the ranks stay in step for
the next call. (Training with several buckets against torch's DDP: test_wrapper.py's "equivalence".)
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.collectives import allreduce
from tests.helpers import error_of

CAP_MB = 2e-4  # about 50 float32 elements: each layer's weight in a bucket of its own


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    ours = DistributedDataParallel(_net(), bucket_cap_mb=CAP_MB, timeout=20)
    _train(ours, x)
    out = {"buckets": len(ours._buckets)}

    def desync():
        if rank == 0:
            allreduce(torch.ones(3), timeout=20)
        ours(x).sum().backward()
    out["refused"] = error_of(desync)
    out["after"] = error_of(lambda: allreduce(torch.ones(3), timeout=20))  # every rank still in step
    return out


@functools.lru_cache(maxsize=None)
def _results(n: int):
    return launch(_job, n, timeout=180)


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_out_of_step_meets_the_first_buckets_check_and_no_later_bucket_goes_out(n):
    for rank, out in enumerate(_results(n)):
        assert out["buckets"] >= 3, out["buckets"]
        message = out["refused"]
        assert message is not None and "PeerError" not in message, (rank, message)
        assert f"rank {rank}: allreduce called differently across ranks: elements " in message, message
        assert out["after"] is None, (rank, out["after"])

