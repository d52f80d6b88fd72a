"""Bucket assignment (`manualdp.buckets.assign_buckets`): properties over random parameter lists."""
import torch
from hypothesis import given, settings, strategies as st

from manualdp.buckets import assign_buckets

MIB = 2**20


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(1, 400_000), min_size=1, max_size=12))
    params = [torch.empty(n, dtype=torch.float32, device="meta") for n in sizes]  # no memory: only sizes count
    order = draw(st.permutations(range(len(params))))
    cap = draw(st.sampled_from([0.5, 1.0, 2.0]))
    first = draw(st.sampled_from([None, 0.25, 1.0]))
    return params, list(order), cap, first


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_buckets_follow_the_order_and_respect_their_caps(case):
    params, order, cap, first = case
    buckets = assign_buckets(params, cap if first is None else [first, cap], order=order)
    assert [i for b in buckets for i in b] == order  # every parameter once, in the given order
    for k, bucket in enumerate(buckets):
        limit = (first if k == 0 and first is not None else cap) * MIB
        nbytes = sum(params[i].numel() * 4 for i in bucket)
        assert nbytes <= limit or len(bucket) == 1  # over the cap only a parameter alone
        if k + 1 < len(buckets):  # a bucket is closed only when the next parameter would not fit
            nxt = params[buckets[k + 1][0]].numel() * 4
            assert nbytes + nxt > limit


def test_default_order_is_reverse_and_first_bucket_is_small():
    params = [torch.empty(200_000, device="meta") for _ in range(5)]  # 0.76 MiB each
    assert assign_buckets(params, 25.0) == [[4, 3, 2, 1, 0]]
    assert assign_buckets(params, [1.0, 25.0]) == [[4], [3, 2, 1, 0]]
