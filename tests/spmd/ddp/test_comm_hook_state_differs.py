"""Comm hooks whose code is the same but defined elsewhere, or whose carried values differ per rank, at 2 ranks.

- the same hook function defined in two modules (one per rank, as a script run as `__main__` on one rank and
  imported on the other): trains as one process (was: refused, its module's name differed; torch's trains it);
- a lambda closing over a per-rank scale, a callable object and a bound method whose attribute differs per rank,
  a `state` dict whose scale differs per rank: every rank raises one line naming the hooks (was: trained silently
  with rank-weighted gradients);
- no false alarm: torch's PowerSGD (per-rank memory, compared by settings), torch's allreduce hook with a process
  group as state, a hook whose state dict changes every step;
- the no-op hook on rank 0 only: rank 1's line names the hooks too (was: a bare "allreduce called differently").
One launch runs every case; the assertions run here, in the parent.
"""
import functools
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


class _Scale:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, state, bucket):
        return _scaled(state, bucket, self.scale)

    def method(self, state, bucket):
        return _scaled(state, bucket, self.scale)


def _state_hook(state, bucket):
    return _scaled(state, bucket, state["scale"])


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
    scale = 1.0 + rank
    return {
        "two modules": train(_hook_from_module("__main__" if rank == 0 else "helpers_copy")),
        "closure": train(lambda state, bucket: _scaled(state, bucket, scale)),
        "callable object": train(_Scale(scale)),
        "bound method": train(_Scale(scale).method),
        "state": train(_state_hook, state={"scale": scale}),
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


def test_hooks_carrying_a_per_rank_value_are_named_on_every_rank():
    refused(_results(), "closure", "<lambda> [code ", "over (scale=1.0)", "over (scale=2.0)")
    refused(_results(), "callable object", "_Scale(scale=1.0)", "_Scale(scale=2.0)")
    refused(_results(), "bound method", "_Scale.method [code ", "of _Scale(scale=2.0)")
    refused(_results(), "state", "with state {'scale': 1.0}", "with state {'scale': 2.0}")


def test_hooks_whose_state_differs_only_by_design_train():
    _trains("powersgd", exact=False)  # PowerSGD compresses: the replicas agree, the average is approximate
    _trains("torch allreduce")
    _trains("changing state")


def test_the_noop_hook_on_one_rank_is_named_on_every_rank():
    refused(_results(), "noop on rank 0", "noop_hook", "before step 0, none (manualdp's allreduce))")
