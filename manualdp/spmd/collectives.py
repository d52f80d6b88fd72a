"""Reduce-scatter, all-gather, reduce and broadcast across processes, by the p2p executor.

The schedules are the book's (`manualdp.schedule`); each rank runs its share of them with
`manualdp.spmd.p2p.run_schedule`. As in the single controller they work in place on the
whole buffer: rank i's own chunk is `manualdp.collectives.shard(tensor, i, world_size)`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import shard
from ..schedule import get_collective
from ..validate import check_summable, int_between, positive_int, timeout_seconds
from .p2p import DEFAULT_SEGMENT_BYTES, run_schedule
from .peers import group_ranks
from .peers import group_timeout

__all__ = ["reduce_scatter", "all_gather", "reduce", "broadcast"]


def _run(collective: str, tensor, algorithm: str, group, root: int, segment_bytes: int, timeout, sums: bool) -> int:
    """Check, then run `collective` on this rank; returns this rank's index in `group`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if sums:
        check_summable(tensor)
    positive_int("segment_bytes", segment_bytes)
    timeout = timeout_seconds("timeout", timeout)
    rank, peers = group_ranks(group)
    int_between("root", root, 0, len(peers) - 1)
    schedule = get_collective(collective, algorithm, len(peers), root)
    if len(peers) > 1 and tensor.numel():
        timeout = timeout if timeout is not None else group_timeout(group)
        run_schedule(tensor, schedule, group, rank, peers, segment_bytes, dist.get_backend(group) == "gloo", timeout)
    return rank


def reduce_scatter(tensor: torch.Tensor, algorithm: str = "ring", group=None, *,
                   segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks so that this rank holds the sum of its own chunk; returns that chunk (a view)."""
    rank = _run("reduce_scatter", tensor, algorithm, group, 0, segment_bytes, timeout, sums=True)
    return shard(tensor, rank, dist.get_world_size(group))


def all_gather(tensor: torch.Tensor, algorithm: str = "ring", group=None, *,
               segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
    """Fill `tensor` with every rank's own chunk, in place: afterwards it is equal on all ranks."""
    _run("all_gather", tensor, algorithm, group, 0, segment_bytes, timeout, sums=False)


def reduce(tensor: torch.Tensor, dst: int = 0, algorithm: str = "tree", group=None, *,
           segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
    """Sum `tensor` over the ranks into group rank `dst`'s copy; the others hold partial sums afterwards."""
    _run("reduce", tensor, algorithm, group, dst, segment_bytes, timeout, sums=True)


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "tree", group=None, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
    """Copy group rank `src`'s `tensor` into every other rank's, in place."""
    _run("broadcast", tensor, algorithm, group, src, segment_bytes, timeout, sums=False)
