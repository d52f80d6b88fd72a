"""Rung 4 of the ladder: the book's buckets, each sent when full, overlapped with backward.

Rung 3 overlaps, but pays one latency per parameter; rung 2 pays one, but overlaps nothing.
Buckets take both: the gradients are grouped, in the reverse order of `module.parameters()`
(roughly the order backward produces them), into buffers of about `bucket_cap_mb` MiB
(`manualdp.buckets.assign_buckets`; `bucket.py`). A hook copies each finished gradient into its bucket;
when a bucket's last gradient arrives, the bucket is allreduced on the background thread
while backward goes on. Buckets are started in their order only, the same on every rank,
even if one fills before the one ahead of it. At the end of backward the averages are
copied back into `.grad`. This is torch's DDP without its features (rung 5).

The last bucket also carries one flag per parameter, whether this rank's backward reached it,
summed with the gradients: it starts after every other bucket, when this rank's flags are final,
and no message is added for them. A parameter no rank reached keeps its `.grad` (`rules.py`).
"""
from __future__ import annotations

import concurrent.futures

import torch

from ...buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets
from ...validate import positive_number
from .bucket import Bucket
from .overlapped import OverlappedDDP, wait_all

__all__ = ["BucketedDDP"]


class BucketedDDP(OverlappedDDP):
    """`OverlappedDDP` that sends buckets of gradients of about `bucket_cap_mb` MiB instead of single ones."""

    def __init__(self, module, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **kwargs):
        self.bucket_cap_mb = positive_number("bucket_cap_mb", bucket_cap_mb)  # compared at construction (`settings`)
        super().__init__(module, **kwargs)
        self.build_buckets()
        self.next = 0  # the next bucket to start: they start in order

    def rebuild_kwargs(self) -> dict:
        return super().rebuild_kwargs() | {"bucket_cap_mb": self.bucket_cap_mb}

    def build_buckets(self) -> None:
        """The buckets, of the parameters' dtypes and devices as they are now."""
        layout = assign_buckets(self.params, self.bucket_cap_mb)
        self.buckets = [Bucket([self.params[i] for i in b], extra=len(self.params) if k == len(layout) - 1 else 0)
                        for k, b in enumerate(layout)]
        last = self.buckets[-1]
        self.flags = last.flat[last.offsets[-1]:]  # after the last bucket's gradients: the ranks' "used" flags
        self.where = {id(p): (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)}

    def settings(self) -> dict:
        return super().settings() | {"bucket_cap_mb": self.bucket_cap_mb}

    def forward(self, *args, **kwargs):
        # model.double() (or .to(device)) after wrapping: buckets anew, or the gradients would be rounded to float32;
        # a rank that alone cast its model sends another dtype, which the step check names on every rank
        if torch.is_grad_enabled() and any((p.dtype, p.device) != (b.flat.dtype, b.flat.device)
                                           for b in self.buckets for p in b.params):
            self.build_buckets()
        return super().forward(*args, **kwargs)

    def grad_ready(self, p: torch.Tensor) -> None:
        k, i = self.where[id(p)]
        self.buckets[k].mark_ready(i, p.grad)
        while self.next < len(self.buckets) and self.buckets[self.next].pending == 0:
            self.start_bucket(self.buckets[self.next])
            self.next += 1

    def start_bucket(self, bucket: Bucket) -> None:
        if bucket is self.buckets[-1]:  # every other bucket has started: this rank's flags are final
            self.flags.copy_(torch.tensor(self.reached))
        bucket.future = self.submit(bucket.flat)

    def forget_backward(self) -> None:
        super().forget_backward()
        concurrent.futures.wait([bucket.future for bucket in self.buckets if bucket.future is not None])
        for bucket in self.buckets:
            bucket.reset()

    def sync_gradients(self) -> None:
        for bucket in self.buckets[self.next:]:  # a parameter unused in this step sends its .grad, or zeros
            bucket.fill_missing()
            self.start_bucket(bucket)
        self.next, self.checked = 0, None
        self.take_reached()
        try:
            wait_all(bucket.future for bucket in self.buckets)
        except Exception:
            for bucket in self.buckets:
                bucket.reset()
            raise
        used = (self.flags > 0).tolist()  # how many ranks used each parameter
        for bucket in self.buckets:
            bucket.flat.div_(self.world_size)
            for p, view in zip(bucket.params, bucket.views):
                if not used[self.position[id(p)]]:  # no rank used it: its .grad stays as it was
                    continue
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
            bucket.reset()
