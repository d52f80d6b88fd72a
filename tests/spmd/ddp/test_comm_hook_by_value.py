"""Comm hooks compared by what they compute, at 2 ranks on the drop-in (adversary 87's cases).

- a `functools.partial` whose bound argument differs per rank as a numpy scalar, a numpy array or a list nested six
  deep: every rank raises naming the hook (was: compared by type only, it trained rank-weighted gradients, silently);
- the same code under two names (`hook_a` on rank 0, `hook_b` on rank 1): trains as one process, as torch's DDP
  does (was: refused);
- a per-rank value frozen as a default argument (`verbose=(rank == 0)`, a keyword-only `pid=os.getpid()`): still
  refused, but the line says which default differs, its value on each rank, and what to do (was: two code digests
  and "call register_comm_hook with the same hook").
One launch runs every case (soak: it starts replica processes); the assertions run here, in the parent.
"""
import functools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from manualdp.spmd import launch
from manualdp.spmd.ddp.comm_hook import CommHook, _what_differs, described
from manualdp.spmd.ddp.hook_identity import defaults_of, hook_identity
from tests.spmd.ddp.test_comm_hook_ranks_differ import _reference, _scaled, refused, train

_DEFAULTS_SAY = "DistributedDataParallel's comm hook differs across ranks: its default argument"


def _first(state, bucket, w):
    """`_scaled` by the first number of `w` (a list nested however deep, or a numpy array)."""
    while isinstance(w, list):
        w = w[0]
    return _scaled(state, bucket, float(np.asarray(w).reshape(-1)[0]))


def _named_hooks(rank):
    """The same code under another name on each rank."""
    if rank == 0:
        def hook_a(state, bucket):
            return _scaled(state, bucket)
        return hook_a

    def hook_b(state, bucket):
        return _scaled(state, bucket)
    return hook_b


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def flag_hook(state, bucket, verbose=(rank == 0)):
        return _scaled(state, bucket)

    def pid_hook(state, bucket, *, pid=os.getpid()):
        return _scaled(state, bucket)

    return {
        "np float32": train(functools.partial(_scaled, scale=np.float32(rank + 1))),
        "np array": train(functools.partial(_first, w=np.ones(2) * (rank + 1))),
        "deep list": train(functools.partial(_first, w=[[[[[[float(rank + 1)]]]]]])),
        "np same": train(functools.partial(_first, w=np.ones(2))),
        "name only": train(_named_hooks(rank)),
        "default flag": train(flag_hook),
        "default pid": train(pid_hook),
        "pids": os.getpid(),
    }


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240)


@pytest.mark.soak
def test_bound_numpy_values_and_deep_lists_that_differ_per_rank_are_named_on_every_rank():
    results = _results()
    refused(results, "np float32", "_scaled [code ", "numpy(<f4, [], 1.0, sha1 ", "numpy(<f4, [], 2.0, sha1 ")
    refused(results, "np array", "_first [code ", "numpy(<f8, [2], [1.0, 1.0], sha1 ",
            "numpy(<f8, [2], [2.0, 2.0], sha1 ")
    refused(results, "deep list", "_first [code ", "list(list(list(list(list(list(1.0))))))",
            "list(list(list(list(list(list(2.0))))))")


@pytest.mark.soak
def test_the_same_bound_numpy_value_and_the_same_code_under_two_names_train_as_one_process():
    for out in _results():
        for case in ("np same", "name only"):
            error, params = out[case]
            assert error is None, (case, error)
            for mine, theirs in zip(params, _reference()):
                assert torch.allclose(mine, theirs, rtol=0, atol=1e-6), (case, (mine - theirs).abs().max())


@pytest.mark.soak
def test_a_per_rank_default_argument_is_refused_naming_the_argument_and_each_ranks_value():
    results = _results()
    for rank, out in enumerate(results):
        error = out["default flag"][0]
        assert error is not None and "\n" not in error, error
        assert error.startswith(f"ValueError: rank {rank}: {_DEFAULTS_SAY} verbose: True on rank 0, False on rank 1 "
                                "(its code is the same on every rank: "), error
        assert "a closure's variable or the hook's state" in error, error
        pid = out["default pid"][0]
        assert pid is not None and "\n" not in pid, pid
        assert (f"{_DEFAULTS_SAY} pid: {results[0]['pids']} on rank 0, {results[1]['pids']} on rank 1 "
                in pid), pid


def _deep(value, depth):
    for _ in range(depth):
        value = [value]
    return value


def test_identity_reads_numpy_values_deep_and_long_lists_by_value():
    def bound(w):
        return hook_identity(functools.partial(_first, w=w))
    assert bound(np.float32(1)) == bound(np.float32(1)) != bound(np.float32(2))
    assert bound(np.float32(1)) != bound(np.float64(1))  # the dtype too
    assert bound(np.ones(2)) != bound(np.ones(3)) and bound(np.ones((2, 1))) != bound(np.ones((1, 2)))
    assert bound(np.array([{"a": 1}], dtype=object)) == bound(np.array([{"a": 1}], dtype=object))
    assert bound(np.array([{"a": 1}], dtype=object)) != bound(np.array([{"a": 2}], dtype=object))
    assert bound(_deep(1.0, 50)) == bound(_deep(1.0, 50)) != bound(_deep(2.0, 50))
    long = list(range(20000))  # past the budget of values read one by one: by a digest of its pickle
    assert bound(long) == bound(list(long)) != bound(long[:-1] + [-1])
    cycle = [1.0]
    cycle.append(cycle)
    assert "list sha1 " in bound(cycle)  # a cycle ends at the budget


def test_identity_without_names_is_equal_for_the_same_code_under_two_names():
    a, b = _named_hooks(0), _named_hooks(1)
    assert hook_identity(a) != hook_identity(b)  # the text a user reads names each
    assert hook_identity(a, named=False) == hook_identity(b, named=False)


def _record(hook):
    """What `publish` writes of `hook` registered before step 0."""
    registered = CommHook(None, hook, None)
    return {"compared": described(registered, named=False), "named": described(registered),
            "code": described(registered, bare=True), "defaults": defaults_of(hook)}


def _flag_hook(rank):
    def hook(state, bucket, verbose=(rank == 0), *, path=f"/tmp/log{rank}", n=3):
        return _scaled(state, bucket)
    return hook


def test_a_default_that_differs_is_named_with_each_ranks_value_and_other_code_as_the_hooks():
    records = [_record(_flag_hook(rank)) for rank in range(2)]
    assert records[0]["code"] == records[1]["code"] and records[0]["compared"] != records[1]["compared"]
    line = _what_differs(records)
    assert line.startswith("its default arguments verbose: True on rank 0, False on rank 1; path: '/tmp/log0' on "
                           "rank 0, '/tmp/log1' on rank 1 (its code is the same on every rank: "), line
    assert " n: " not in line  # the same on every rank
    other = _what_differs([records[0], _record(_first)])
    assert other.startswith("comm hook ") and "call register_comm_hook with the same hook" in other, other
