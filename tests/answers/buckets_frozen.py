"""Buckets over every parameter, the frozen layer's too: its bucket fills only at the end, and the frozen
parameters (and the never-called ones) are given a .grad of the bucket's zeros."""
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        flat = torch.nn.utils.parameters_to_vector(module.parameters())
        dist.broadcast(flat, src=0)
        torch.nn.utils.vector_to_parameters(flat, module.parameters())
        everything, self.buckets = list(module.parameters())[::-1], []
        start = 0
        while start < len(everything):
            end, nbytes = start + 1, everything[start].nbytes
            while end < len(everything) and nbytes + everything[end].nbytes <= bucket_cap_mb * 2 ** 20:
                nbytes += everything[end].nbytes
                end += 1
            self.buckets.append({"params": everything[start:end], "left": end - start, "work": None})
            start = end
        for b in self.buckets:
            for p in b["params"]:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p, b=b: self.ready(b))

    def send(self, b):
        b["flat"] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in b["params"]])
        b["work"] = dist.all_reduce(b["flat"], async_op=True)

    def ready(self, b):
        b["left"] -= 1
        if b["left"] == 0:
            self.send(b)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self):
        for b in self.buckets:
            if b["work"] is None:
                self.send(b)
            b["work"].wait()
            for p, g in zip(b["params"], (b["flat"] / dist.get_world_size()).split([p.numel() for p in b["params"]])):
                p.grad = g.view_as(p).clone()
            b["left"], b["work"] = len(b["params"]), None
