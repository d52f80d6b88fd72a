"""Exercise 1.1, a reference solution.  Check it: manualdp check split_batch book/solutions/split_batch.py"""
import torch


def split_batch(X, y, devices):
    """Split `X` and `y` into near-equal shards, shard i on devices[i]."""
    base, extra = divmod(len(X), len(devices))
    sizes = [base + (i < extra) for i in range(len(devices))]  # the first `extra` shards get one more row
    # copy=True: on simulated devices (all `cpu`) a plain .to() hands back a view of the caller's batch.
    X_shards = [x.to(d, copy=True) for x, d in zip(torch.split(X, sizes), devices)]
    y_shards = [t.to(d, copy=True) for t, d in zip(torch.split(y, sizes), devices)]
    return X_shards, y_shards
