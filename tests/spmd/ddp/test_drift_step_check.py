"""The drop-in's drift check at 3 ranks, where call checks are headers (issue 44): no lone step check before a due
drift check, and a rank out of step still named by its step there.

- three steps, all due (0, 1, 2): each bucket carries the step's call check, and nothing compares the step's calls
  alone (was: one `check_same_call` of the whole step before each due check after the first);
- rank 1 runs one backward more at step 1: at step 2 its extra buckets meet its peers' drift check, whose own call
  check carries the step about to begin, so every rank raises one line naming the step (2 against 3).
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.ladder.drift import due
from tests.helpers import error_of

STEPS = 3


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _steps(model, x, extra_on=None):
    for step in range(STEPS):
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=step == 1)
        if step == 1 and dist.get_rank() == extra_on:
            loss.backward()  # one backward more on one rank: its buckets carry step 2 while its peers begin step 3


def _job():
    from manualdp.spmd.ddp import step_check
    torch.set_num_threads(1)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    alone, check = [], step_check.check_same_call
    step_check.check_same_call = lambda *a, **k: (alone.append(k.get("step")), check(*a, **k))[1]
    try:
        _steps(DistributedDataParallel(_net(), algorithm="ring", timeout=20), x)
    finally:
        step_check.check_same_call = check
    out = error_of(lambda: _steps(DistributedDataParallel(_net(), algorithm="ring", timeout=20), x, extra_on=1))
    return alone, out


def test_at_three_ranks_no_step_check_goes_alone_and_a_rank_out_of_step_is_named_by_its_step_at_a_drift_check():
    assert all(due(s, 100) for s in range(STEPS))  # the case: every step has a drift check
    for rank, (alone, message) in enumerate(launch(_job, 3, timeout=120)):
        assert alone == [], alone
        assert message is not None and message.startswith(f"ValueError: rank {rank}: "), message
        assert "step 2..3 (per rank: 3, 2, 3)" in message and "\n" not in message, message
