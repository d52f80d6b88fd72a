"""Comm hooks whose code is the same but defined elsewhere, or whose carried values differ per rank, at 2 ranks.

- the same hook function defined in two modules (one per rank, as a script run as `__main__` on one rank and
  imported on the other): trains as one process (was: refused, its module's name differed; torch's trains it);
- hooks that compute the same on every rank but carry values that differ per rank by design (a closure over a
  dict keyed by id(p), an object with a rank-0 logging flag, a timestamp and a pid, a `state` keyed by id):
  train as one process, as torch's (an adversary's nine such hooks were refused while carried values were
  compared by value);
- no false alarm: torch's PowerSGD (per-rank memory, compared by settings), torch's allreduce hook with a process
  group as state, a hook whose state dict changes every step;
- the no-op hook on rank 0 only: rank 1's line names the hooks too (was: a bare "allreduce called differently").
One launch runs every case; the assertions run here, in the parent.
"""
import functools
import os
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from manualdp.spmd import launch
from manualdp.spmd.comm_hooks import noop_hook
from tests.spmd.ddp.test_comm_hook_ranks_differ import _reference, _scaled, refused, train

_SOURCE = '''
import torch.distributed as dist
def avg_hook(state, bucket):
    t = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])
'''


class _Logging:
    """A hook that logs on rank 0 only, stamped with its start and its process: equal in what it computes."""

    def __init__(self, rank):
        self.verbose, self.t0, self.pid = rank == 0, time.time(), os.getpid()

    def __call__(self, state, bucket):
        return _scaled(state, bucket, 1.0)

    def method(self, state, bucket):
        return _scaled(state, bucket, 1.0)


def _keyed_state_hook(state, bucket):
    state[id(bucket)] = 0  # per-parameter memory keyed by an address: differs per process by design
    return _scaled(state, bucket, 1.0)


def _counting_hook(state, bucket):
    state["calls"] += 1  # the state changes while training: compared at registration only
    return _scaled(state, bucket, 1.0)


def _hook_from_module(name):
    module = types.ModuleType(name)
    exec(compile(_SOURCE, f"<{name}>", "exec"), module.__dict__)
    return module.avg_hook


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    memory = {id(object()): rank}  # an address and the rank: both differ per process
    return {
        "two modules": train(_hook_from_module("__main__" if rank == 0 else "helpers_copy")),
        "closure": train(lambda state, bucket: _scaled(state, bucket, 1.0 + 0 * len(memory))),
        "callable object": train(_Logging(rank)),
        "bound method": train(_Logging(rank).method),
        "state": train(_keyed_state_hook, state=dict(memory)),
        "powersgd": train(powerSGD_hook.powerSGD_hook, state=powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=rank)),
        "torch allreduce": train(default_hooks.allreduce_hook, state=dist.group.WORLD),
        "changing state": train(_counting_hook, state={"calls": 0}),
        "noop on rank 0": train(noop_hook, ranks=(0,)),
    }


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240)


def _trains(case, exact=True):
    outs = _results()
    for rank, out in enumerate(outs):
        assert out[case][0] is None, (rank, out[case][0])
    for got, other in zip(outs[0][case][1], outs[1][case][1]):
        torch.testing.assert_close(got, other, rtol=0, atol=0)  # the replicas agree
    if exact:
        for got, want in zip(outs[0][case][1], _reference()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_same_hook_defined_in_two_modules_trains_as_one_process():
    _trains("two modules")


def test_hooks_that_compute_alike_but_carry_per_rank_values_train_as_one_process():
    for case in ("closure", "callable object", "bound method", "state"):
        _trains(case)


def test_hooks_whose_state_differs_only_by_design_train():
    _trains("powersgd", exact=False)  # PowerSGD compresses: the replicas agree, the average is approximate
    _trains("torch allreduce")
    _trains("changing state")


def test_the_noop_hook_on_one_rank_is_named_on_every_rank():
    refused(_results(), "noop on rank 0", "noop_hook", "before step 0, none (manualdp's allreduce))")
