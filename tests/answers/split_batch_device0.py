"""Right shards, each a copy, but every one on devices[0]."""
import torch


def split_batch(X, y, devices):
    base, extra = divmod(len(X), len(devices))
    sizes = [base + (i < extra) for i in range(len(devices))]
    return ([x.to(devices[0], copy=True) for x in torch.split(X, sizes)],
            [t.to(devices[0], copy=True) for t in torch.split(y, sizes)])
