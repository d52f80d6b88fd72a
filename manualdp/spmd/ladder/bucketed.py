"""Rung 4 of the ladder: the book's buckets, each sent when full, overlapped with backward.

Rung 3 overlaps, but pays one latency per parameter; rung 2 pays one, but overlaps nothing.
Buckets take both: the gradients are grouped, in the reverse order of `module.parameters()`
(roughly the order backward produces them), into buffers of about `bucket_cap_mb` MiB
(`manualdp.buckets.assign_buckets`). A hook copies each finished gradient into its bucket;
when a bucket's last gradient arrives, the bucket is allreduced on the background thread
while backward goes on. Buckets are started in their order only, the same on every rank,
even if one fills before the one ahead of it. At the end of backward the averages are
copied back into `.grad`. This is torch's DDP without its features (rung 5).
"""
from __future__ import annotations

import torch

from ...buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets
from ...validate import positive_number
from .overlapped import OverlappedDDP
from ..collectives import allreduce

__all__ = ["BucketedDDP"]


class BucketedDDP(OverlappedDDP):
    """`OverlappedDDP` that sends buckets of gradients of about `bucket_cap_mb` MiB instead of single ones."""

    def __init__(self, module, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **kwargs):
        super().__init__(module, **kwargs)
        positive_number("bucket_cap_mb", bucket_cap_mb)
        self.buckets = [[self.params[i] for i in b] for b in assign_buckets(self.params, bucket_cap_mb)]
        self.flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                      for b in self.buckets]
        self.where = {}  # id(parameter) -> (bucket, its gradient's slice of the bucket's buffer)
        for k, (bucket, flat) in enumerate(zip(self.buckets, self.flats)):
            at = 0
            for p in bucket:
                self.where[id(p)] = (k, flat[at:at + p.numel()].view_as(p))
                at += p.numel()
        self._reset()

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.arrived: set[int] = set()
        self.next = 0  # the next bucket to start: they start in order

    def grad_ready(self, p: torch.Tensor) -> None:
        k, view = self.where[id(p)]
        view.copy_(p.grad)
        self.arrived.add(id(p))
        self.missing[k] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self.start_bucket(self.next)
            self.next += 1

    def start_bucket(self, k: int) -> None:
        self.running.append((self.flats[k], self.worker.submit(allreduce, self.flats[k], self.algorithm, self.group,
                                                              timeout=self.timeout, check=False)))

    def sync_gradients(self, params=None) -> None:
        for p in self.params:  # a parameter unused in this step sends what its .grad holds, or zeros
            if id(p) not in self.arrived:
                k, view = self.where[id(p)]
                view.copy_(p.grad) if p.grad is not None else view.zero_()
        for k in range(self.next, len(self.buckets)):
            self.start_bucket(k)
        running, self.running = self.running, []
        for _, future in running:
            future.result()
        for bucket, flat in zip(self.buckets, self.flats):
            flat.div_(self.world_size)
            for p in bucket:
                view = self.where[id(p)][1]
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        self._reset()
