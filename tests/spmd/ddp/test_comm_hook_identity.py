"""What the ranks compare of a comm hook (`hook_identity`) and of a registered hook with its state (`described`).

- the same code defined in two modules (a script run as `__main__` on one rank, imported on the other) is equal
  (was: its module's name made it differ, a false alarm where torch's DDP trains right); other code under the
  same name differs;
- a `functools.partial`'s bound arguments are part of it (torch's DDP refuses a partial outright);
- what a hook carries beside its code (a closure's cells, a callable object's or bound method's attributes, the
  `state`) is compared by its class only, as torch's DDP compares nothing of it: nine hooks of an adversary's
  that differ there only by design (a dict keyed by id(p), a rank-0 logging flag, a timestamp, a pid, a per-rank
  path) were refused while they compared by value; PowerSGD's state by its settings (not its memory).
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


def test_what_a_hook_carries_is_compared_by_its_class_not_its_values():
    assert hook_identity(_closure(1.0)) == hook_identity(_closure(2.0))  # as torch's: a closure's values not seen
    assert hook_identity(_closure(torch.tensor([1.0]))) == hook_identity(_closure(torch.tensor([3.0])))
    one, two = _Scaled(1.0), _Scaled(2.0)
    assert hook_identity(one) == hook_identity(two) and "_Scaled [code " in hook_identity(one)
    assert hook_identity(one.method) == hook_identity(two.method) and " of _Scaled" in hook_identity(one.method)
    assert " at 0x" not in hook_identity(one) + hook_identity(one.method)
    assert _with_state({"scale": 1.0}) == _with_state({"scale": 2.0}) and "with state dict" in _with_state({})
    assert _with_state({"scale": 1.0}) != _with_state([1.0])  # another class of state: named
    assert _with_state(None) == hook_identity(_module("m").avg_hook)


def test_the_values_that_differ_per_rank_by_design_are_not_compared():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    keyed = [{id(p): 0 for p in params}, {id(p) + 8: 0 for p in params}]  # the keys of two processes
    assert _with_state(keyed[0]) == _with_state(keyed[1])
    assert hook_identity(_logging_on_rank(0)) == hook_identity(_logging_on_rank(1))
    assert hook_identity(_Logs(0)) == hook_identity(_Logs(1))


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


def _logging_on_rank(rank, scale=1.0):
    return lambda state, bucket: bucket * scale if rank else bucket * scale + 0.0


class _Logs:
    def __init__(self, rank):
        self.rank, self.scale = rank, 1.0

    def __call__(self, state, bucket):
        return bucket * self.scale
