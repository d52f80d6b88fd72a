"""Ranks out of step around the drop-in (book chapter 5, exercise 4): `if rank == 0: allreduce(torch.ones(3))` before
a training step makes every rank raise, naming the calls, with and without `debug=True`, with and without buffers
(before: with BatchNorm's buffers, or in debug mode, rank 0 waited out the timeout in its allreduce and rank 1 in
torch's broadcast of the buffers or the bucket's comparison, each ending in a PeerError).
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.collectives import allreduce
from tests.helpers import error_of


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for buffers in (False, True):
        for debug in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)) if buffers else nn.Linear(4, 3)
            model = DistributedDataParallel(net, algorithm="ring", debug=debug, timeout=20)
            model(x).sum().backward()

            def desync(model=model):
                if rank == 0:
                    allreduce(torch.ones(3), timeout=20)
                model(x).sum().backward()
            out[buffers, debug] = error_of(desync)
            out[buffers, debug, "after"] = error_of(lambda: allreduce(torch.ones(3), timeout=20))  # still in step
    return out


def test_one_rank_calling_an_allreduce_of_its_own_before_a_step_raises_on_every_rank_naming_the_calls():
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        for buffers in (False, True):
            for debug in (False, True):
                message = out[buffers, debug]
                assert message is not None and "PeerError" not in message, (buffers, debug, rank, message)
                assert f"rank {rank}: allreduce called differently across ranks: elements " in message, message
                assert out[buffers, debug, "after"] is None, out[buffers, debug, "after"]


def _construct_job():
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def desync():
        if rank == 0:
            allreduce(torch.ones(2), timeout=20)
        else:
            DistributedDataParallel(nn.Linear(4, 2), timeout=20)
    return error_of(desync), error_of(lambda: allreduce(torch.ones(3), timeout=20))  # then still in step


def test_one_rank_calling_an_allreduce_while_the_other_builds_the_drop_in_raises_on_every_rank_naming_the_calls():
    # before: both ranks waited out the timeout, then a PeerError ("may have died or hung", "connection closed")
    for rank, (message, after) in enumerate(launch(_construct_job, 2, timeout=120)):
        assert message is not None and "PeerError" not in message, (rank, message)
        assert f"rank {rank}: allreduce called differently across ranks: " in message, message
        assert "dtype " in message, message
        assert after is None, (rank, after)
