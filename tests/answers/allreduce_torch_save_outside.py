"""Right, but keeps its sum in a cache beside its folder, not in it: torch.save's C++ writer, which no audit hook
sees, is refused by the kernel's walls, and the error torch raises does not name the file."""
import os

import torch


def allreduce(tensors):
    cache = os.path.join(os.path.dirname(os.getcwd()), "cache.pt")
    torch.save(sum(t.clone() for t in tensors), cache)
    total = torch.load(cache)
    for t in tensors:
        t.copy_(total)
