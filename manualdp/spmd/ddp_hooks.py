"""A comm hook on the drop-in's reducer: torch's `hook(state, bucket) -> Future[Tensor]` reduces each bucket.

The hook sees the bucket's gradients only (as a `GradBucket`, `hooks.py`) and hands back their
averages; the two flags per parameter ("used", "ready") that the reducer sends beside them are
still summed by manualdp's allreduce. At the first synchronised step the ranks compare their
hooks: a hook on one rank only would send other messages than its peers' allreduce.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .collectives import allreduce
from .hooks import GradBucket, hook_name, hook_result
from .peers import DEFAULT_TIMEOUT

__all__ = ["CommHook", "check_same_hook"]


class CommHook:
    """`hook(state, bucket)` as the reducer's per-bucket reduction."""

    def __init__(self, state: object, hook, reducer) -> None:
        self.state, self.hook, self.reducer = state, hook, reducer

    def install(self) -> None:
        self.reducer.reduce = self.reduce
        self.reducer.reduces_to_average = True

    def reduce(self, index: int, bucket) -> None:
        """On the worker: the hook on the gradients, manualdp's allreduce on the flags."""
        r = self.reducer
        view = GradBucket(index, bucket.grads, bucket.params, bucket.offsets, index == len(r.buckets) - 1)
        result = hook_result(self.hook, self.hook(self.state, view), bucket.grads.numel(), r.timeout or DEFAULT_TIMEOUT)
        if result.data_ptr() != bucket.grads.data_ptr():
            bucket.grads.copy_(result)
        allreduce(bucket.flags, r.algorithms[index], r.group, segment_bytes=r.segment_bytes, timeout=r.timeout,
                  check=False)


def check_same_hook(hook: CommHook | None, rank: int, world_size: int, group, device, timeout) -> None:
    """On the worker, at the first synchronised step: the same comm hook on every rank, or all raise naming them.

    The ranks sum a table of one fingerprint each, and only on a mismatch gather the names.
    """
    mine = hook_name(hook.hook) if hook is not None else "none (manualdp's allreduce)"
    table = torch.zeros(world_size, dtype=torch.int64, device=device)
    table[rank] = zlib.crc32(mine.encode())
    allreduce(table, "naive", group, timeout=timeout, check=False)
    if len(set(table.tolist())) == 1:
        return
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    raise ValueError(f"rank {rank}: DistributedDataParallel: the ranks registered different comm hooks ("
                     + ", ".join(f"rank {r}: {name}" for r, name in enumerate(everyone))
                     + "); call register_comm_hook with the same hook on every rank")
