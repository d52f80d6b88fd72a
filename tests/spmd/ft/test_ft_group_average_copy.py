"""`GroupManager.average` copies a share only when a second average may need it: when some member's share might not
sum finite (`share.may_not_sum`, told in the lane's header); the bits of the average are the same either way."""
import math

import pytest
import torch

from manualdp.spmd.ft.group import GroupManager
from manualdp.spmd.ft.share import may_not_sum
from tests.spmd.ft.test_ft_group_guard import one_rank_group  # noqa: F401 (a fixture)
from tests.spmd.ft.test_ft_lane_check import _sum_on_two_lanes

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_may_not_sum_flags_non_finite_and_huge_shares_only():
    assert not may_not_sum(torch.tensor([1.0, -2.0, 0.0]), 2)
    assert may_not_sum(torch.tensor([1.0, math.nan]), 2) and may_not_sum(torch.tensor([-math.inf, 1.0]), 2)
    assert may_not_sum(torch.tensor([2e38, 1.0]), 2) and may_not_sum(torch.tensor([1.0, -2e38]), 2)
    assert not may_not_sum(torch.tensor([2e38], dtype=torch.float64), 2)  # float64 holds it many times over
    assert not may_not_sum(torch.tensor([2**62, -(2**62)]), 2) and not may_not_sum(torch.tensor([True]), 2)
    assert not may_not_sum(torch.zeros(0), 3)
    assert may_not_sum(torch.tensor([1 + 1j]), 2)  # complex: always kept (no order to bound it by)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("members", [2, 3, 4, 7])
def test_shares_that_no_member_flags_sum_finite_in_any_order(dtype, members):
    # the largest values may_not_sum lets through, of one sign, summed one by one in the dtype itself
    bound = torch.finfo(dtype).max / (4 * members)
    share = torch.tensor([bound, -bound], dtype=torch.float64).to(dtype)
    share = torch.where(share.double().abs() > bound, torch.nextafter(share, torch.zeros_like(share)), share)
    assert not may_not_sum(share, members)
    total = share.clone()
    for _ in range(members - 1):
        total = total + share
    assert torch.isfinite(total.div(members)).all(), (dtype, members, total)


def _clones_of(monkeypatch, watched: torch.Tensor) -> list:
    """The calls of `clone` on `watched` from now on (the share's copy)."""
    seen, clone = [], torch.Tensor.clone
    def spy(self, *args, **kwargs):
        if self is watched:
            seen.append(1)
        return clone(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "clone", spy)
    return seen


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_share_that_sums_finite_is_averaged_without_a_copy_and_keeps_its_bits(one_rank_group, monkeypatch, dtype):
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5)
    try:
        manager.start_step()
        share = torch.tensor([1.5, -3.25, 0.1], dtype=dtype)
        grad = share.clone()
        copies = _clones_of(monkeypatch, grad)
        assert manager.average(grad) and manager.should_commit(True)
        assert copies == [], "the share was copied where no second average can follow"  # before: copied each call
        assert torch.equal(grad, share)  # one group: the average is its share, bitwise
    finally:
        manager.close()


def test_a_share_that_might_not_sum_finite_is_kept_before_the_sum(one_rank_group, monkeypatch):
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5)
    try:
        manager.start_step()
        grad = torch.tensor([3e38, 1.0])  # past float32's largest / 4: kept, though alone it sums finite
        copies = _clones_of(monkeypatch, grad)
        assert manager.average(grad) and manager.should_commit(True)
        assert copies == [1] and torch.equal(grad, torch.tensor([3e38, 1.0]))
    finally:
        manager.close()


@pytest.mark.parametrize("b_share, kept", [(2.0, False), (3e38, True), (math.nan, True)])
def test_the_members_of_a_lane_keep_their_shares_alike_as_the_header_tells(store, b_share, kept):
    # A's share is small; whether A keeps it follows B's, told in the lane's header before the sum
    shares = [torch.tensor([1.0, 2.0]), torch.tensor([b_share, 0.5])]
    copies: list[list] = [[], []]
    keeps = [lambda t, i=i: copies[i].append(t.clone()) for i in range(2)]
    expected = [s.clone() for s in shares]
    assert _sum_on_two_lanes(store, shares, keeps) == [None, None]
    assert [len(c) for c in copies] == ([1, 1] if kept else [0, 0])
    assert all(torch.equal(c[0].nan_to_num(7.0), e.nan_to_num(7.0)) for c, e in zip(copies, expected) if c)  # pre-sum
