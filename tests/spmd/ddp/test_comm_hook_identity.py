"""What the ranks compare of a comm hook (`hook_identity`) and of a registered hook with its state (`described`).

- the same code defined in two modules (a script run as `__main__` on one rank, imported on the other) is equal
  (was: its module's name made it differ, a false alarm where torch's DDP trains right); other code under the
  same name differs;
- a closure's cell values, a callable object's and a bound method's object's plain attributes, and the `state`
  argument are part of it (was: a per-rank scale there trained silently with rank-weighted gradients);
- what may differ per rank by design is not: an RNG or a lock (by type), PowerSGD's error feedback and RNG
  (torch's and ours compared by their settings only).
"""
import threading
import types

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from manualdp.spmd.comm_hooks import PowerSGDState
from manualdp.spmd.ddp.comm_hook import CommHook, described, hook_identity

_SOURCE = '''
def avg_hook(state, bucket):
    t = bucket.buffer() / {world}
    return t.sum() * {scale}
'''


def _module(name, world=2, scale=1.0):
    """A module named `name` that defines `avg_hook` from `_SOURCE`."""
    module = types.ModuleType(name)
    exec(compile(_SOURCE.format(world=world, scale=scale), f"<{name}>", "exec"), module.__dict__)
    return module


def _with_state(state, hook=None):
    return described(CommHook(state, hook or _module("m").avg_hook, None))


def test_the_same_code_in_two_modules_is_the_same_hook():
    assert hook_identity(_module("__main__").avg_hook) == hook_identity(_module("helpers_copy").avg_hook)


def test_other_code_under_the_same_name_differs_and_is_named():
    one, other = hook_identity(_module("a").avg_hook), hook_identity(_module("a", world=3).avg_hook)
    assert one != other and one.startswith("avg_hook [code ") and other.startswith("avg_hook [code ")
    assert hook_identity(_module("a", scale=2.0).avg_hook) != one


def _closure(scale):
    return lambda state, bucket: bucket * scale


class _Scaled:
    def __init__(self, scale):
        self.scale, self.lock, self.rng = scale, threading.Lock(), np.random.RandomState(int(scale * 7))

    def __call__(self, state, bucket):
        return bucket * self.scale

    def method(self, state, bucket):
        return bucket * self.scale


def test_a_closure_over_another_value_differs():
    assert hook_identity(_closure(1.0)) != hook_identity(_closure(2.0)) and "over (scale=2.0)" in hook_identity(
        _closure(2.0))
    assert hook_identity(_closure(torch.tensor([1.0, 2.0]))) != hook_identity(_closure(torch.tensor([1.0, 3.0])))
    assert hook_identity(_closure(1.0)) == hook_identity(_closure(1.0))


def test_a_callable_object_and_a_bound_method_differ_by_their_plain_attributes_only():
    one, two = _Scaled(1.0), _Scaled(2.0)
    assert hook_identity(one) != hook_identity(two) and "scale=2.0" in hook_identity(two)
    assert hook_identity(one.method) != hook_identity(two.method) and "scale=2.0" in hook_identity(two.method)
    other = _Scaled(1.0)  # another lock, another RNG state: compared by type
    other.rng.rand(3)
    assert hook_identity(one) == hook_identity(other)
    assert hook_identity(one.method) == hook_identity(other.method)
    assert " at 0x" not in hook_identity(one) + hook_identity(one.method)


def test_the_state_is_compared_by_its_plain_values():
    assert _with_state({"scale": 1.0}) != _with_state({"scale": 2.0})
    assert "with state {'scale': 2.0}" in _with_state({"scale": 2.0})
    locked = [_with_state({"scale": 1.0, "lock": threading.Lock()}) for _ in range(2)]
    assert locked[0] == locked[1] and "'lock': lock" in locked[0]
    assert _with_state(None) == hook_identity(_module("m").avg_hook)


def test_powersgd_states_are_compared_by_their_settings_not_their_memory():
    ours, mine = PowerSGDState(), PowerSGDState()
    mine.errors[0] = torch.randn(4)  # error feedback differs per rank by design
    mine.qs[(0, 0)] = torch.randn(4, 1)
    assert _with_state(ours) == _with_state(mine)
    assert _with_state(PowerSGDState(matrix_approximation_rank=2)) != _with_state(ours)
    theirs = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    other = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                         random_seed=1)
    other.error_dict[0] = torch.randn(4)
    other.iter = 5
    hook = torch_powersgd.powerSGD_hook
    assert _with_state(theirs, hook) == _with_state(other, hook)
    wider = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    assert _with_state(wider, hook) != _with_state(theirs, hook) and "matrix_approximation_rank=2" in \
        _with_state(wider, hook)


def test_a_long_state_is_shown_by_its_head_and_a_digest():
    long, other = _with_state({"table": list(range(10_000))}), _with_state({"table": list(range(9_999)) + [0]})
    assert len(long) < 1000 and long != other and "(sha1 " in long


def _logging_on_rank(rank, scale=1.0):
    return lambda state, bucket: bucket * scale if rank else bucket * scale + 0.0


class _Logs:
    def __init__(self, rank):
        self.rank, self.scale = rank, 1.0

    def __call__(self, state, bucket):
        return bucket * self.scale


def test_which_rank_this_is_is_not_compared():
    assert hook_identity(_logging_on_rank(0)) == hook_identity(_logging_on_rank(1))
    assert hook_identity(_logging_on_rank(0)) != hook_identity(_logging_on_rank(0, scale=2.0))
    assert hook_identity(_Logs(0)) == hook_identity(_Logs(1))
    assert _with_state({"rank": 0, "scale": 1.0}) == _with_state({"rank": 1, "scale": 1.0})
    assert _with_state({"rank": 0, "scale": 1.0}) != _with_state({"rank": 0, "scale": 2.0})
