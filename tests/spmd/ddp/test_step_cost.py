"""What the drop-in's usual step leaves out (issue 44.3, from bench/ddp_profile.py): counted, never timed.

A bucket whose every gradient came writes its flags without a tensor made from a list; a gradient
copied in during a plain backward enters no `no_grad` context (one with `create_graph` still does);
a bucket's carried call check enters its naming contexts only when the ranks' calls differ.
"""
import pytest
import torch
from torch import nn

from manualdp.spmd.ddp import step_check
from manualdp.spmd.ddp.bucket import FlaggedBucket


def _bucket() -> FlaggedBucket:
    return FlaggedBucket([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))])


@pytest.mark.parametrize("arrived", [(0, 1), (0,), (1,), ()])
def test_seal_writes_the_flags_and_makes_no_tensor_from_a_list_when_every_gradient_came(monkeypatch, arrived):
    bucket = _bucket()
    for i in arrived:
        bucket.mark_ready(i, torch.full(bucket.params[i].shape, float(i + 1)))
    bucket.fill_missing()
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    bucket.seal()
    expected = [1.0 if i in arrived else 0.0 for i in range(2)] * 2  # used, then ready
    assert bucket.flags.tolist() == expected
    assert len(made) == (0 if len(arrived) == 2 else 1)


class _Counting:
    """torch.no_grad, counting how often a context is made."""

    def __init__(self, real) -> None:
        self.real, self.made = real, 0

    def __call__(self, *args, **kwargs):
        self.made += 1
        return self.real(*args, **kwargs)


def test_a_plain_backward_enters_no_context_per_gradient_and_create_graph_keeps_the_bucket_plain(monkeypatch):
    counting = _Counting(torch.no_grad)
    monkeypatch.setattr(torch, "no_grad", counting)
    bucket = _bucket()
    with torch.enable_grad():
        torch.set_grad_enabled(False)  # as autograd runs a plain backward's hooks
        try:
            bucket.mark_ready(0, torch.full((3,), 2.0))
        finally:
            torch.set_grad_enabled(True)
        assert counting.made == 0
        grad = torch.full((2, 2), 3.0, requires_grad=True) * 1  # as under backward(create_graph=True)
        assert bucket.mark_ready(1, grad)
    assert counting.made == 1
    assert not bucket.flat.requires_grad and bucket.flat.grad_fn is None
    assert bucket.grads.tolist() == [2.0] * 3 + [3.0] * 4


class _Check:
    """A call check that agrees, or refuses as a call check does."""

    def __init__(self, refuse: bool) -> None:
        self.refuse, self.calls = refuse, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.refuse:
            raise ValueError("rank 0: call check refused: wrapper differs (per rank: 1, 2); same calls everywhere")

    landed = __call__


@pytest.mark.parametrize("refuse", [False, True])
def test_a_carried_check_enters_its_naming_contexts_only_when_the_calls_differ(monkeypatch, refuse):
    entered = []

    def named(*args, **kwargs):
        entered.append(args)
        return real(*args, **kwargs)

    real = step_check.naming_wrappers
    monkeypatch.setattr(step_check, "naming_wrappers", named)
    monkeypatch.setattr(step_check, "hooks_named", lambda *a: _Passing())
    check = _Check(refuse)
    carried = step_check._Named(check, ["w"], 1, None)
    for run in (carried, carried.landed):
        if refuse:
            with pytest.raises(ValueError, match="wrappers numbered in the order each rank built them"):
                run()
        else:
            run()
    assert check.calls == 2
    assert len(entered) == (2 if refuse else 0)


class _Passing:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False
