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


def test_a_wrapper_bucket_writes_its_flags_once_sealed_and_its_views_are_its_buffer():
    import torch
    from torch import nn

    from manualdp.spmd.ddp.bucket import FlaggedBucket

    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(1))]
    bucket = FlaggedBucket(params)
    for i, p in enumerate(params):  # each view is its parameter's slice of the one buffer, shaped like it
        assert bucket.view(i).shape == p.shape
        assert bucket.view(i).data_ptr() == bucket.flat[bucket.offsets[i]:].data_ptr()
    assert bucket.mark_ready(0, torch.full((2, 3), 2.0)) is False
    assert bucket.mark_ready(2, None) is False  # the hook fired without a gradient: ready, not used
    assert bucket.flags.tolist() == [0.0] * 6  # flags are written when the bucket is sealed, not per gradient
    assert bucket.mark_ready(1, torch.arange(4.0)) is True
    bucket.seal()
    assert bucket.flags.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # used, then ready
    assert bucket.grads.tolist() == [2.0] * 6 + [0.0, 1.0, 2.0, 3.0] + [0.0]
    bucket.reset()
    assert bucket.flags.tolist() == [0.0] * 6 and bucket.pending == 3
    bucket.mark_ready(1, torch.ones(4))
    bucket.fill_missing(used_earlier={id(params[0])})  # params[0] was used in a no_sync step: it counts as used
    bucket.seal()
    assert bucket.flags.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
