"""What a fault-tolerant step of `FaultTolerantDDP` costs, in counts (never times): the work each bucket and each
average does beyond the drop-in's, held to what it must be (issue 44: `bench/ft.py`'s 0.33x at the mlp)."""
import math

import pytest
import torch

from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager
from manualdp.spmd.ft.bucketed import finite
from tests.spmd.ft.test_ft_ddp_buckets import loss_of, make, two_members


@pytest.fixture
def coordinator():
    with Coordinator(0) as c:
        yield c


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_is_isfinite_all_also_where_the_squares_overflow(dtype):
    big = torch.finfo(dtype).max / 2  # finite, but its square is not: the norm overflows, the exact test decides
    cases = [torch.zeros(0, dtype=dtype), torch.ones(5, dtype=dtype), torch.full((7,), big, dtype=dtype)]
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(9, dtype=dtype)
        t[4] = bad
        cases.append(t)
    for t in cases:
        assert finite(t) == bool(torch.isfinite(t).all()), t


def test_a_finite_buckets_average_is_judged_without_a_boolean_tensor_of_its_size(coordinator, monkeypatch):
    """Before: `isfinite(grads).all()` on every bucket's average, a boolean tensor as large as the bucket (about 16x
    the CPU time of its norm: 400 us of an mlp's step). Now one norm says so; `isfinite` runs only where it is not."""
    sizes, real = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: sizes.append(t.numel()) or real(t))
    net = make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        ft.start_step()
        loss_of(ft, 0).backward()
        assert ft.step()
    buckets = [n for _, n in calls][:-1]  # the last average is the guard's norms
    assert buckets == [2, 8, 4, 12] and not set(sizes) & set(buckets), sizes
