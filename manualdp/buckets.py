"""Gradient buckets: fuse many small gradients into a few flat buffers, and back."""
from __future__ import annotations

import torch

from .validate import positive_number

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_CAP_MB", "assign_buckets", "by_dtype", "flatten", "unflatten_"]

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default
FIRST_BUCKET_CAP_MB = 1.0  # DDP's first bucket, when bucket_cap_mb is its default


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float | list[float] | None, *,
                   order: list[int] | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most `bucket_cap_mb` MiB, in reverse order.

    Reverse order, as DDP: backward produces the last layers' gradients first, so the first
    bucket fills first. A parameter larger than the cap gets a bucket of its own; a change
    of dtype or device starts a new bucket (a flat buffer has one of each).
    `bucket_cap_mb=None` gives one bucket per parameter (the textbook's loop). A list gives
    bucket k a cap of its own, the last one for every later bucket (torch's `bucket_cap_mb_list`;
    DDP's default is `[1, 25]`: a small first bucket, so the first allreduce starts early).
    `order` replaces the reverse order by the one the gradients were seen to become ready in.
    """
    caps = list(bucket_cap_mb) if isinstance(bucket_cap_mb, (list, tuple)) and bucket_cap_mb else [bucket_cap_mb]
    for cap in caps:
        positive_number("bucket_cap_mb", cap, none_ok=not isinstance(bucket_cap_mb, (list, tuple)))
    if order is None:
        order = list(range(len(params)))[::-1]
    elif sorted(order) != list(range(len(params))):
        raise ValueError(f"order must hold each index 0..{len(params) - 1} once, got {order!r}")
    if bucket_cap_mb is None:
        return [[i] for i in order]
    buckets: list[list[int]] = []
    size = 0
    for i in order:
        p = params[i]
        nbytes = p.numel() * p.element_size()
        first = params[buckets[-1][0]] if buckets else None
        cap = caps[min(len(buckets), len(caps)) - 1] * 2**20  # the cap of the bucket being filled
        if first is None or size + nbytes > cap or p.dtype != first.dtype or p.device != first.device:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` split by dtype, in order: a flat buffer holds one dtype."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate `tensors` into one new flat tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`, in place."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat has {flat.numel()} elements, tensors hold {total}")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
