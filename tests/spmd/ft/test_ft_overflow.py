"""Huge finite values in the fault-tolerant average and in its guard: shares whose sum overflows, norms past float64.

In this process, on a quorum of one whose `average` stands for two members that send the same
shares (so the average must be the share itself); with replica processes (soak, the end of this
file), two `FaultTolerantDDP` replicas whose float16 gradients of 40000 sum past float16.
"""
import json
import logging
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager
from manualdp.spmd.ft.average import average_and_vote
from manualdp.spmd.ft.bucketed import average_fitting, finite
from manualdp.spmd.ft.guard import HUGE, norm_of, offenders
from manualdp.spmd.ft.share import average_shares
from tests.spmd.ft.harness import ROOT

# dtype: a share whose average (itself) fits the dtype, but whose sum with the same share does not
HUGE_SHARES = {torch.float16: 40000.0, torch.bfloat16: 2e38, torch.float32: 2e38, torch.float64: 1e200}


class Pair(nn.Module):
    """Two parameters whose gradients are the input's two rows exactly, and an empty one."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.p0, self.p1 = nn.Parameter(torch.zeros(3, dtype=dtype)), nn.Parameter(torch.zeros(3, dtype=dtype))
        self.e = nn.Parameter(torch.zeros(0, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.p0 * x[0]).sum() + (self.p1 * x[1]).sum() + self.e.sum()


def same_share_twice(manager) -> list[bool]:
    """Make `manager.average` stand for two members sending the same shares; each call's `divide_first` is listed."""
    calls, real = [], manager.average

    def average(t: torch.Tensor, divide_first: bool = False) -> bool:
        calls.append(divide_first)
        if not real(t):  # the quorum of one's own
            return False
        if divide_first:
            t.div_(2)
        t.add_(t)  # this member's share and the other's: the same
        if not divide_first:
            t.div_(2)
        return True

    manager.average = average
    return calls


@pytest.mark.parametrize("dtype", list(HUGE_SHARES), ids=str)
def test_shares_whose_sum_overflows_but_whose_average_fits_commit_the_average_at_once(coordinator, dtype):
    g = HUGE_SHARES[dtype]
    net = Pair(dtype)
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=1.0), manager, bucket_cap_mb=None)
        calls = same_share_twice(manager)
        ft.start_step()
        ft(torch.tensor([[g] * 3, [1.0] * 3], dtype=dtype)).backward()
        assert ft.step() and manager.step == 1  # was: discarded, and the same batch again forever
    # the average of two equal shares is the share: SGD at lr 1 moves each parameter by it
    assert torch.equal(net.p0.detach(), torch.full((3,), -g, dtype=dtype))
    assert torch.equal(net.p1.detach(), torch.full((3,), -1.0, dtype=dtype))
    # float16 to float32: p0's bucket went again, divided first; float64's sum fits, only its norm did not
    assert calls.count(True) == (dtype != torch.float64)


def test_shares_that_fit_keep_sum_then_divide_bitwise(coordinator):
    net = Pair(torch.float32)
    x = torch.tensor([[0.1, 3.0, 7.0], [1.0 / 3, 5.0, 1e-3]])
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=1.0), manager, bucket_cap_mb=None)
        calls = same_share_twice(manager)
        ft.start_step()
        ft(x).backward()
        assert ft.step()
    assert True not in calls  # never divided first
    assert torch.equal(net.p0.detach(), -(x[0] + x[0]) / 2) and torch.equal(net.p1.detach(), -(x[1] + x[1]) / 2)


class SameShares:
    """A manager's `average` and `should_commit` without a guard, as if one more member sent the same buffers."""

    def __init__(self) -> None:
        self.calls = []

    def average(self, flat: torch.Tensor, divide_first: bool = False) -> bool:
        self.calls.append(divide_first)
        flat.copy_(flat / 2 + flat / 2 if divide_first else (flat + flat) / 2)
        return True

    def should_commit(self, ok: bool) -> bool:
        return ok


def test_average_and_vote_of_shares_whose_sum_overflows_writes_back_the_finite_average():
    params = [torch.full((2,), 2e38), torch.tensor([1.5])]
    totals = torch.tensor([3.0], dtype=torch.float64)
    manager = SameShares()
    assert average_and_vote(manager, params, also=(totals,))
    assert torch.equal(params[0], torch.full((2,), 2e38))  # was: inf, committed
    assert params[1].tolist() == [1.5] and totals.tolist() == [3.0]
    assert manager.calls == [False, False, True]  # the totals, the float32 buffer, the float32 buffer again


def test_a_nan_share_is_averaged_again_and_stays_nan():
    t = torch.tensor([math.nan, 1.0])
    manager, refills = SameShares(), []
    assert average_fitting(manager, t, lambda f: (refills.append(1), f.copy_(torch.tensor([math.nan, 1.0]))))
    assert manager.calls == [False, True] and refills == [1] and not finite(t)


def test_norm_of_tells_a_norm_past_float64_from_a_non_finite_value():
    assert norm_of(torch.tensor([1e200, 1e200], dtype=torch.float64)) == pytest.approx(math.sqrt(2) * 1e200)
    assert norm_of(torch.full((4,), 1e308, dtype=torch.float64)) == HUGE  # finite values; the norm is past float64
    assert math.isnan(norm_of(torch.tensor([1.0, math.inf]))) and math.isnan(norm_of(torch.tensor([math.nan])))
    assert norm_of(torch.tensor([3.0, 4.0])) == 5.0 and norm_of(torch.tensor([3, 4])) == 5.0
    assert norm_of(torch.zeros(0)) == 0.0


def test_offenders_among_huge_norms_compare_sanely():
    assert offenders([HUGE, HUGE]) == {} and offenders([HUGE, HUGE / 3, HUGE / 7]) == {}
    assert list(offenders([HUGE, 1e300, 1e300])) == [0] and list(offenders([HUGE, 1e300])) == [0]
    assert list(offenders([HUGE / 3, HUGE, math.nan])) == [2]


def test_finite_says_integers_and_booleans_are_finite():
    assert finite(torch.tensor([1, 2], dtype=torch.int64)) and finite(torch.tensor([True, False]))
    assert finite(torch.zeros(2, dtype=torch.uint8)) and finite(torch.tensor([1.0, 2.0]))
    assert not finite(torch.tensor([1.0, math.inf])) and not finite(torch.tensor([math.nan], dtype=torch.float16))


def members_sending_the_same(members: int):
    """A sum over `members` that all send the same shares, in the buffer's own dtype: the share added members times."""
    def sum_(t: torch.Tensor) -> None:
        share = t.clone()
        for _ in range(members - 1):
            t.add_(share)
    return sum_


@pytest.mark.parametrize("dtype, members", [(torch.float16, 3), (torch.bfloat16, 10)], ids=str)
def test_divide_first_sums_half_precision_shares_in_float32(dtype, members):
    """Three float16 65504s divide to 21840 (rounded), whose sum rounds to Inf: was the average, though 65504 fits."""
    big = torch.finfo(dtype).max
    t = torch.tensor([big, 1.0, -big, 3.0], dtype=dtype)
    average_shares(t, members, members_sending_the_same(members), divide_first=True)
    # the average of equal shares is the share: float32 holds each part and their sum within the half's step
    assert t.dtype == dtype and torch.equal(t, torch.tensor([big, 1.0, -big, 3.0], dtype=dtype))
    old = torch.tensor([big], dtype=dtype).div_(members)  # what the divide-first pass did before: all in the dtype
    members_sending_the_same(members)(old)
    assert not finite(old)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_average_shares_keeps_the_bits_of_the_normal_path(dtype):
    """Sum then divide in the dtype (every reference's bits); float32 and float64 divide first in their own dtype."""
    x = torch.tensor([0.1, 1.0 / 3, 7.0, -2.5e-3, 1e4], dtype=dtype)
    for members in (2, 3):
        t = x.clone()
        average_shares(t, members, members_sending_the_same(members))
        reference = x.clone()
        members_sending_the_same(members)(reference)
        assert torch.equal(t, reference / members)
    if dtype not in (torch.float16, torch.bfloat16):
        t = x.clone()
        average_shares(t, 3, members_sending_the_same(3), divide_first=True)
        reference = x / 3
        members_sending_the_same(3)(reference)
        assert torch.equal(t, reference)


class Corrupting(SameShares):
    """`SameShares` with a guard that passes every contribution, and an average corrupted on the way (Inf)."""

    id, step = "one", 4
    guard = SimpleNamespace(passes=lambda manager, judged, totals: True)

    def average(self, flat: torch.Tensor, divide_first: bool = False) -> bool:
        super().average(flat, divide_first)
        flat[-1] = math.inf
        return True


def test_average_and_vote_with_the_guard_never_commits_a_non_finite_average(caplog):
    params = [torch.full((2,), 3.0, dtype=torch.float16), torch.tensor([1.5, 2.0])]
    before = [p.clone() for p in params]
    with caplog.at_level(logging.WARNING, logger="manualdp.spmd.ft"):
        assert not average_and_vote(Corrupting(), params)  # was: True, and Inf written into every replica's model
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # left as it was
    lines = [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()]
    assert len(lines) == 1 and "step 4" in lines[0] and "non-finite" in lines[0] and "float16" in lines[0], lines


def test_average_and_vote_without_a_guard_leaves_the_average_to_the_user():
    params = [torch.tensor([1.5, 2.0])]
    manager = Corrupting()
    manager.guard = None
    assert average_and_vote(manager, params) and params[0][-1].item() == math.inf  # guard=None: nothing judged


# ---------------------------------------------------------------- replica processes (soak)

def replicas(tmp_path, worker: str, ids: str, dtype: str, value: float, min_replicas: int) -> list[dict]:
    """Run `worker` (ID PORT DTYPE VALUE OUT MIN_REPLICAS) once per id of `ids`; each one's exit 0 and what it wrote."""
    with Coordinator(0) as c:
        procs = [subprocess.Popen([sys.executable, "-m", f"tests.spmd.ft.{worker}", rid, str(c.port), dtype, str(value),
                                   str(tmp_path / f"{rid}.json"), str(min_replicas)], cwd=ROOT) for rid in ids]
        try:
            assert [p.wait(timeout=240) for p in procs] == [0] * len(ids)
        finally:
            for p in procs:
                p.kill()
    return [json.loads((tmp_path / f"{rid}.json").read_text()) for rid in ids]


@pytest.mark.soak
@pytest.mark.parametrize("dtype, g, ids", [("float16", 40000.0, "ab"), ("float64", 1e200, "ab"),
                                           ("float16", 65504.0, "abc")])
def test_replicas_whose_shares_sum_past_the_dtype_commit_at_once(tmp_path, dtype, g, ids):
    """65504 at three: divided first in float16, the shares summed to Inf again (discarded forever, no member named)."""
    for out in replicas(tmp_path, "overflow_worker", ids, dtype, g, len(ids)):
        assert out["committed"] == [True] and out["step"] == 1  # the first attempt: was discarded forever
        assert out["gloo_threads"] == 0  # the Manager closed let go of its group: nothing of gloo's left for the exit
        assert out["p0"] == [-g] * 3 and out["p1"] == [-1.0] * 3


@pytest.mark.soak
def test_three_float16_local_sgd_replicas_at_the_dtypes_largest_average_it_not_inf(tmp_path):
    """Divided first in float16, three 65504s summed to Inf, and LocalSGD committed Inf on every replica, guard on."""
    v = torch.finfo(torch.float16).max
    for out in replicas(tmp_path, "local_overflow_worker", "abc", "float16", v, 3):
        assert out["committed"] == [True] and out["weight"] == [v] * 4  # the average of equal parameters: them
        assert out["gloo_threads"] == 0
