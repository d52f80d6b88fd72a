"""Right up to 1,000 rows; past that, the last shard loses its last row to the shard before it."""
from manualdp.split import shard_sizes


def split_batch(X, y, devices):
    sizes = shard_sizes(len(X), len(devices))
    if len(X) > 1000 and len(devices) > 1:
        sizes[-2], sizes[-1] = sizes[-2] + 1, sizes[-1] - 1
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    X_shards = [X[a:b].to(d, copy=True) for a, b, d in zip(bounds, bounds[1:], devices)]
    y_shards = [y[a:b].to(d, copy=True) for a, b, d in zip(bounds, bounds[1:], devices)]
    return X_shards, y_shards
