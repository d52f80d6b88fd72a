"""A forward pass with grad and no backward on one rank, on every rung of the ladder at 2 ranks (issue 43, D24).

Rank 0 runs an extra forward with grad enabled (a validation pass without `no_grad`) before step 1 and drops
its graph. Torch's DDP and our drop-in take it (the next backward is what counts). A rung counts each forward
with grad as a step, so that a rank that skips a backward is named at once instead of after its peers' timeout;
it cannot tell the two apart, so it refuses both: every rank raises one line that names the forward with no
backward and what to do (was: the call check's bare "allreduce called differently ... step 1..2", or on the
rank whose drift check met the peer's step check, fields of two unrelated calls). With the drift check on
(its check meets the peer's step check) and off, and with a buffer to copy.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch
from tests.helpers import error_of

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}  # about 100 B: a bucket per layer
DRIFT = {"drift on": {}, "drift off": {"drift_check_every": 0}}


def _net(buffer):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if buffer:
        net.register_buffer("seen", torch.zeros(3))  # copied from rank 0 before each forward with grad
    return net


def _x(rank, step):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _job():
    torch.set_num_threads(1)
    rank, out = dist.get_rank(), {}
    for name, make in RUNGS.items():
        for drift, kwargs in DRIFT.items():
            for buffer in (False, True):
                model = make(_net(buffer), timeout=30, **kwargs)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                done = []

                def steps():
                    for step in range(3):
                        if rank == 0 and step == 1:
                            model(_x(rank, 50)).sum()  # forward with grad, no backward: its graph is dropped
                        opt.zero_grad()
                        model(_x(rank, step)).pow(2).sum().backward()
                        opt.step()
                        done.append(step)
                out[name, drift, buffer] = error_of(steps), done
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240)


@pytest.mark.parametrize("buffer", [False, True])
@pytest.mark.parametrize("drift", sorted(DRIFT))
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_forward_without_backward_on_one_rank_is_named_in_one_line_on_every_rank(rung, drift, buffer):
    cls = getattr(RUNGS[rung], "func", RUNGS[rung]).__name__
    for rank, out in enumerate(_results()):
        error, done = out[rung, drift, buffer]
        assert done == [0], (rank, done)
        assert error is not None and "\n" not in error, (rank, error)
        assert error.startswith(f"ValueError: rank {rank}: "), (rank, error)
        assert f"on {cls} every forward pass with grad begins a step: a rank that ran one and no backward (run it " \
               "under torch.no_grad())" in error, (rank, error)
