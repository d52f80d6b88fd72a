"""Buckets sent when full, from gradient hooks, but each all_reduce synchronous: backward stops at every bucket
until the ranks have exchanged it, so nothing overlaps."""
import torch
import torch.distributed as dist
from torch import nn


def average_into_grads(params, n):
    """One bucket, summed over the ranks at once (async_op=False) and averaged into the gradients."""
    flat = torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    sizes = [p.numel() for p in params]
    for p, chunk in zip(params, (flat / n).split(sizes)):
        if p.grad is not None:
            p.grad.copy_(chunk.view_as(p))


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        nn.Module.__init__(self)
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        self.module = module
        self.groups, room = [], 0
        for p in [p for p in module.parameters() if p.requires_grad][::-1]:
            if not self.groups or room < p.numel() * p.element_size():
                self.groups.append([])
                room = bucket_cap_mb * 2 ** 20
            self.groups[-1].append(p)
            room -= p.numel() * p.element_size()
            p.register_post_accumulate_grad_hook(self.hook)
        self.done, self.count = set(), {}

    def hook(self, p):
        g = next(i for i, group in enumerate(self.groups) if any(q is p for q in group))
        self.count[g] = self.count.get(g, 0) + 1
        if self.count[g] == len(self.groups[g]):
            average_into_grads(self.groups[g], dist.get_world_size())
            self.done.add(g)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for g, group in enumerate(self.groups):
            if g not in self.done:
                average_into_grads(group, dist.get_world_size())
        self.done, self.count = set(), {}
