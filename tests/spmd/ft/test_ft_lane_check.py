"""A lane's sum (`group_lanes.Lane.sum`) checks first that its members pass alike tensors: gloo aborts the process
on a size mismatch, so tensors of other sizes or dtypes raise one ValueError on every member instead.

Two lanes of two groups of one rank, in threads of this process (< 2 s).
"""
import threading

import pytest
import torch

from manualdp.spmd.ft.group_lanes import Lane


def _sum_on_two_lanes(store, tensors, keeps=(None, None)):
    """Form lane 0 of two groups 'A' and 'B' over `store`, sum `tensors` (one each, `keeps`: each one's `keep`) in
    threads: each one's error."""
    lanes = [Lane(store(), group, 0, timeout=10) for group in "AB"]
    errors = [None, None]

    def member(i):
        try:
            lanes[i].form(1, i, 2)
            lanes[i].sum(tensors[i], ["A", "B"], keeps[i])
        except Exception as e:  # noqa: BLE001 -- the test asserts which
            errors[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a lane's sum hangs"
    return errors


def test_alike_tensors_sum_over_the_lane(store):
    a, b = torch.arange(4, dtype=torch.float64), torch.full((4,), 2.0, dtype=torch.float64)
    expected = a + b
    assert _sum_on_two_lanes(store, [a, b]) == [None, None]
    assert torch.equal(a, expected) and torch.equal(b, expected)


@pytest.mark.parametrize("other, named", [(torch.ones(11, dtype=torch.float64), "'B': 11 elements of torch.float64"),
                                          (torch.ones(10, dtype=torch.float32), "'B': 10 elements of torch.float32")])
def test_tensors_of_another_size_or_dtype_raise_on_both_members_naming_both(store, other, named):
    mine = torch.ones(10, dtype=torch.float64)
    errors = _sum_on_two_lanes(store, [mine, other.clone()])
    for e in errors:
        assert isinstance(e, ValueError), e
        assert "'A': 10 elements of torch.float64" in str(e) and named in str(e)
    assert torch.equal(mine, torch.ones(10, dtype=torch.float64))  # refused: unchanged
