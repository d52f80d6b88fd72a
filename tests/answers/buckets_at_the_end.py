"""Buckets within the cap, averaged right, but every one sent after backward returned: no overlap."""
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module, self.cap = module, bucket_cap_mb * 2 ** 20
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        with_grad = [p for p in reversed(list(self.module.parameters())) if p.grad is not None]
        groups, size = [[]], 0
        for p in with_grad:
            if groups[-1] and size + p.grad.nbytes > self.cap:
                groups, size = groups + [[]], 0
            groups[-1].append(p)
            size += p.grad.nbytes
        sent = []
        for group in groups:
            flat = torch.cat([p.grad.flatten() for p in group])
            sent.append((group, flat, dist.all_reduce(flat, async_op=True)))
        for group, flat, work in sent:
            work.wait()
            for p, g in zip(group, flat.div_(dist.get_world_size()).split([p.numel() for p in group])):
                p.grad.copy_(g.view_as(p))
