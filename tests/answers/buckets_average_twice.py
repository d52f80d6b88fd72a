"""Each rank's gradient divided by the world size as it enters its bucket, and the bucket's sum divided again:
the average over the ranks, divided by the world size once more."""
import torch
import torch.distributed as dist
from torch import nn


class Bucket:
    def __init__(self, params):
        self.params = params                                   # in the order they fill the buffer
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        self.waiting = len(params)                             # gradients still to come this step
        self.work = None                                       # the all_reduce's handle once sent

    def slot(self, p):
        start = 0
        for q in self.params:
            if q is p:
                return self.flat[start:start + p.numel()]
            start += q.numel()


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module, self.n = module, dist.get_world_size()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        trainable, limit = [p for p in module.parameters() if p.requires_grad][::-1], bucket_cap_mb * 2 ** 20
        cut = [0]
        for i in range(1, len(trainable) + 1):
            if sum(p.numel() * p.element_size() for p in trainable[cut[-1]:i]) > limit and i - 1 > cut[-1]:
                cut.append(i - 1)
        self.buckets = [Bucket(trainable[a:b]) for a, b in zip(cut, cut[1:] + [len(trainable)])]
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self.arrived(bucket, p))

    def arrived(self, bucket, p):
        bucket.slot(p).copy_(p.grad.flatten() / self.n)  # the first division
        bucket.waiting -= 1
        if bucket.waiting == 0:
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.work = dist.all_reduce(bucket.flat, async_op=True)
            bucket.work.wait()
            bucket.flat /= self.n  # the second
            for p in bucket.params:
                if p.grad is not None:
                    p.grad.copy_(bucket.slot(p).view_as(p))
            bucket.flat.zero_()
            bucket.waiting, bucket.work = len(bucket.params), None
