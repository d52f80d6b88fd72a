"""Two wrappers over two same-shaped modules, called a(b(x)) on one rank and b(a(x)) on the other: every rung and the
drop-in raise on every rank naming both wrappers (before: their allreduces paired across the wrappers, replicas
0.042 apart after 2 steps, no error). Called in the same order on every rank, they still average right. The wrapper's
number is the call check's identity, so the step field stays the step: at 2 and 3 ranks the ranks' steps agree
and only the wrappers are named.
"""
import functools
import re

import pytest

import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP, "bucketed": BucketedDDP,
            "drop-in": functools.partial(DistributedDataParallel, algorithm="ring")}


def _number(wrapper) -> int:
    return getattr(wrapper, "number", None) or getattr(getattr(wrapper, "calls", None), "number", None)


def _job(configs, names=tuple(WRAPPERS)):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in names:
        make = WRAPPERS[name]
        for swapped, every in configs:  # the replicas' check off (every=0): the step check names them
            torch.manual_seed(0)
            a, b = (make(nn.Linear(4, 4), timeout=20, drift_check_every=every) for _ in range(2))
            numbers = (_number(a), _number(b))
            try:
                (a(b(x)) if rank == 0 or not swapped else b(a(x))).pow(2).sum().backward()
                grads = [p.grad.clone() for w in (a, b) for p in w.module.parameters()]
                out[name, swapped, every] = ("ok", numbers, grads)
            except Exception as e:  # noqa: BLE001 - what each rank saw is the result
                out[name, swapped, every] = ("err", numbers, f"{type(e).__name__}: {e}")
            del a, b
    return out


def _named_both(out, name, rank, every):
    kind, (a, b), message = out[name, True, every]
    assert kind == "err", (name, rank, message)
    assert message.startswith((f"ValueError: rank {rank}: ", f"RuntimeError: rank {rank}: ")), message
    assert "as a(b(x)) on one rank and b(a(x)) on another" in message, message
    assert f"wrapper #{a}..#{b} (per rank: " in message, (name, rank, message)
    assert not re.search(r"step \S+ \(per rank", message), message  # the steps agree: only the wrappers differ


def test_two_wrappers_called_in_another_order_on_one_rank_raise_on_every_rank_naming_both():
    results = launch(_job, 2, (((True, 0), (True, 1), (False, 1)),), timeout=180)
    for name in WRAPPERS:
        for rank, out in enumerate(results):
            assert "called differently across ranks" in out[name, True, 0][2], out[name, True, 0]
            assert "replica at step 0 differs across ranks: wrapper " in out[name, True, 1][2], out[name, True, 1]
            for every in (0, 1):  # the step check names them, or with the replicas' check on, that check first
                _named_both(out, name, rank, every)
        # the same order everywhere: no error, and the ranks hold the same averages
        same = [out[name, False, 1] for out in results]
        assert all(kind == "ok" for kind, _, _ in same), (name, same)
        for g0, g1 in zip(same[0][2], same[1][2]):
            assert torch.equal(g0, g1), name


@pytest.mark.parametrize("name", ["overlapped", "drop-in"])
def test_at_three_ranks_two_wrappers_in_another_order_on_one_rank_raise_on_every_rank_naming_both(name):
    for rank, out in enumerate(launch(_job, 3, (((True, 0),), (name,)), timeout=180)):  # rank 0: a(b(x))
        _named_both(out, name, rank, 0)


def _fields_job():
    """The (step, identity) of every call check the second wrapper built on the group makes in two steps."""
    import manualdp.spmd.transport.call_check as call_check
    torch.set_num_threads(1)
    seen, fingerprint = [], call_check._fingerprint

    def spy(*args, **kwargs):
        seen.append((kwargs["step"], kwargs["identity"]))
        return fingerprint(*args, **kwargs)
    out = {}
    for name, make in WRAPPERS.items():
        torch.manual_seed(0)
        first, second = (make(nn.Linear(4, 4), timeout=20, drift_check_every=0) for _ in range(2))
        call_check._fingerprint = spy
        for _ in range(2):
            second(torch.randn(3, 4)).sum().backward()
        call_check._fingerprint = fingerprint
        out[name] = (_number(second), [s for s in seen if s[0] >= 0])  # a wrapper's steps, not the group's own calls
        seen.clear()
        del first, second
    return out


def test_the_wrapper_number_is_the_checks_identity_and_the_step_field_the_step():
    for out in launch(_fields_job, 2, timeout=180):
        for name, (number, fields) in out.items():
            assert number >= 2 and fields, (name, number, fields)
            assert {identity for _, identity in fields} == {number}, (name, fields)
            assert {step for step, _ in fields} == {1, 2}, (name, fields)
