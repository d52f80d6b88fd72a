"""What the call check cannot catch (book chapter 5, exercise 4): a call with no counterpart to meet. Rank 0 calls an
allreduce on a group that rank 1 never uses, before a step of the drop-in: nothing arrives to compare, so both ranks
wait until the deadline and end in a PeerError naming the other, never a hang past it or a wrong result."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.collectives import allreduce
from tests.helpers import error_of

DEADLINE = 3.0


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    side = dist.new_group(ranks=[0, 1])  # every rank makes it; only rank 0 calls on it
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 3), timeout=DEADLINE)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()

    def extra_call_on_a_side_group():
        if rank == 0:
            allreduce(torch.ones(3), group=side, timeout=DEADLINE)
        model(x).sum().backward()
    return error_of(extra_call_on_a_side_group)


@pytest.mark.soak
def test_a_call_on_a_group_only_one_rank_uses_ends_in_a_peer_error_on_both_ranks_at_the_deadline():
    for rank, message in enumerate(launch(_job, 2, timeout=120)):
        # the deadline ended it (no check could): the message says so
        assert message is not None and message.startswith(f"PeerError: rank {rank}: no answer from rank {1 - rank} "
                                                          f"within {DEADLINE:g} s"), (rank, message)
