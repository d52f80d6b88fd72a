"""Split a global batch into one shard per device."""
from __future__ import annotations

import torch

from .validate import check_batch, check_devices

__all__ = ["shard_sizes", "split_batch"]


def shard_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Near-equal shard sizes: the first `batch_size % num_devices` shards get one more."""
    base, extra = divmod(batch_size, num_devices)
    return [base + (1 if i < extra else 0) for i in range(num_devices)]


def split_batch(X: torch.Tensor, y: torch.Tensor, devices) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split `X` and `y` across `devices`: shard `i` goes to `devices[i]`."""
    devices = check_devices(devices)
    check_batch(X, y, len(devices))
    sizes = shard_sizes(len(X), len(devices))
    # copy=True: .to() returns the very same tensor when it is already on the device, and a
    # shard must never be a view that a caller's in-place edit of X would change.
    X_shards = [x.to(d, copy=True) for x, d in zip(torch.split(X, sizes), devices)]
    y_shards = [t.to(d, copy=True) for t, d in zip(torch.split(y, sizes), devices)]
    return X_shards, y_shards
