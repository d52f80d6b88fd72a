"""Split a global batch into one shard per device."""
from __future__ import annotations

import torch

from .devices import check_devices

__all__ = ["shard_sizes", "split_batch"]


def shard_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Near-equal shard sizes: the first `batch_size % num_devices` shards get one more."""
    base, extra = divmod(batch_size, num_devices)
    return [base + (1 if i < extra else 0) for i in range(num_devices)]


def split_batch(X: torch.Tensor, y: torch.Tensor, devices) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split `X` and `y` across `devices`: shard `i` goes to `devices[i]`."""
    devices = check_devices(devices)
    for name, t in (("X", X), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
    if len(X) != len(y):
        raise ValueError(f"X and y must have the same length, got len(X)={len(X)} and len(y)={len(y)}")
    if len(X) < len(devices):
        raise ValueError(
            f"batch of {len(X)} is smaller than the {len(devices)} devices: every device needs at least one example"
        )
    sizes = shard_sizes(len(X), len(devices))
    # .to() returns the same tensor when it is already on the device; clone so a shard is
    # never a view that a caller's in-place edit of X would change behind our back.
    X_shards = [x.to(d, copy=True) for x, d in zip(torch.split(X, sizes), devices)]
    y_shards = [t.to(d, copy=True) for t, d in zip(torch.split(y, sizes), devices)]
    return X_shards, y_shards
