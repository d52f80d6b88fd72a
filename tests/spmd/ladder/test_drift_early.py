"""Replicas that part in a run shorter than `drift_check_every` are named too (issue 43): with the default interval
(100), a 10-step run at 2 ranks in which rank 1 alone loads other weights after step 2 raises on every rank at the
next check of the schedule 0, 1, 2, 4, 8, ... (was: checked at step 0 only, the run ended with two models).
A 1-D `fully_shard` has no drift check (its ranks hold different shards; HSDP's replicas are checked:
tests/spmd/sharding/test_fsdp_hsdp_drift.py); ZeRO heals a drift into one mixed model at its
next all-gather, so only a load right before a checked step is seen there.
"""
import torch
import torch.distributed as dist

from manualdp.distributed import ZeroRedundancyOptimizer
from manualdp.spmd import launch
from manualdp.spmd.ladder.drift import DRIFT_CHECK_EVERY, due
from tests.helpers import error_of

from .test_drift import WRAPPERS, _net, _raised, _train

STEPS = 10


def _checked(every, steps):
    """The steps the schedule checks: the expectation, computed from its definition, not from a run."""
    return [s for s in range(steps) if s == 0 or (s < every and (s & (s - 1)) == 0) or s % every == 0]


def test_the_schedule_checks_powers_of_two_below_the_interval_then_its_multiples():
    for every in (1, 2, 3, 7, 64, 100):
        assert [s for s in range(5 * every) if due(s, every)] == _checked(every, 5 * every), every
    assert not any(due(s, 0) for s in range(50))
    # in a long run the extra checks at the start are a few: the cost per step stays about 1 / every
    long = 1000 * DRIFT_CHECK_EVERY
    assert sum(due(s, DRIFT_CHECK_EVERY) for s in range(long)) <= long // DRIFT_CHECK_EVERY + 8


def _loads_after(after, rank, model):
    """Before step `after` (0-based: after `after` steps), rank 1 alone loads other weights into `model`."""
    def between(step):
        if step == after and rank == 1:
            model.load_state_dict(_net(seed=7).state_dict())
    return between


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, make in WRAPPERS.items():  # the default interval, as a user runs it
        model = make(_net(), timeout=20)
        out[name, 2] = _train(model, x, STEPS, _loads_after(2, rank, model.module))
    model = WRAPPERS["DistributedDataParallel"](_net(), timeout=20)
    out["DistributedDataParallel", 5] = _train(model, x, STEPS, _loads_after(5, rank, model.module))
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, timeout=20)
    load = _loads_after(2, rank, net)

    def zero_run():
        for step in range(STEPS):
            load(step)
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    out["ZeroRedundancyOptimizer", 2] = error_of(zero_run)
    return out


def test_a_rank_that_loads_other_weights_after_step_2_of_10_is_named_on_every_rank():
    assert DRIFT_CHECK_EVERY > STEPS  # the case: a run shorter than the interval
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        for who in WRAPPERS:
            _raised(out[who, 2], rank, who, 2, "0.weight")
        _raised(out["DistributedDataParallel", 5], rank, "DistributedDataParallel", 8, "0.weight")
        _raised(out["ZeroRedundancyOptimizer", 2], rank, "ZeroRedundancyOptimizer", 2, "0")
