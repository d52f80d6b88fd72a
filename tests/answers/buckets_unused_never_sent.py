"""Buckets sent when full, during backward, but never when one of their parameters gets no gradient: the bucket that
holds the never-called layer is never sent, and its other gradients stay each rank's own."""
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        [dist.broadcast(p.data, 0) for p in module.parameters()]
        self.module = module
        names, self.plan, used = [k for k, p in module.named_parameters() if p.requires_grad], [[]], 0
        tensors = dict(module.named_parameters())
        for k in reversed(names):
            nbytes = tensors[k].numel() * tensors[k].element_size()
            if self.plan[-1] and used + nbytes > bucket_cap_mb * 2 ** 20:
                self.plan.append([])
                used = 0
            self.plan[-1].append(k)
            used += nbytes
        self.arrived, self.sent = {}, []
        for k in names:
            tensors[k].register_post_accumulate_grad_hook(lambda p, k=k: self.on_grad(k, p))

    def on_grad(self, k, p):
        self.arrived[k] = p
        for keys in self.plan:
            if k in keys and all(key in self.arrived for key in keys):  # never true for the bucket of `unused`
                flat = torch.cat([self.arrived[key].grad.reshape(-1) for key in keys])
                self.sent.append(([self.arrived[key] for key in keys], flat, dist.all_reduce(flat, async_op=True)))

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for params, flat, work in self.sent:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.arrived, self.sent = {}, []
