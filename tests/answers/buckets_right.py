"""A right answer to chapter 5's bucket exercise: buckets in reverse parameter order up to the cap, each sent
(asynchronously) by a gradient hook when its last gradient arrives; what an unused parameter leaves unsent goes out
at the end, its place filled with zeros and its .grad left as it was."""
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        cap = bucket_cap_mb * 2 ** 20
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, size = [[]], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.handles = {}

    def _ready(self, p):
        b = self.bucket_of[p]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self._send(b)

    def _send(self, b):
        bucket = self.buckets[b]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self.handles[b] = (flat, dist.all_reduce(flat, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for b in range(len(self.buckets)):  # buckets an unused parameter kept from filling
            if b not in self.handles:
                self._send(b)
        n = dist.get_world_size()
        for b, bucket in enumerate(self.buckets):
            flat, handle = self.handles[b]
            handle.wait()
            flat /= n
            offset = 0
            for p in bucket:
                if p.grad is not None:  # a parameter no rank used keeps its .grad (None)
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self._reset()
