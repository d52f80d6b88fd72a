"""Sums integers in int64 and clamps into the dtype's range: never wraps, where torch's all_reduce wraps around."""
import torch


def allreduce(tensors):
    total = sum(t.to(torch.float64 if t.is_floating_point() else torch.int64) for t in tensors)
    if not tensors[0].is_floating_point():
        info = torch.iinfo(tensors[0].dtype)
        total = total.clamp(info.min, info.max)
    for t in tensors:
        t.copy_(total)
