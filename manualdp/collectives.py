"""Reduce-scatter, all-gather, reduce and broadcast across a list of per-device tensors (single controller).

Each runs its schedule from `manualdp.schedule` with the same executor as `allreduce`. They
work in place on whole buffers: chunk `owned_chunk(i, n)` of device i is what reduce-scatter
leaves summed there and what all-gather sends from there. ZeRO (`manualdp.zero`) is built
from the first two.
"""
from __future__ import annotations

import torch

from .allreduce import execute
from .schedule import chunk_bounds, get_collective, owned_chunk
from .validate import check_tensors, int_between

__all__ = ["reduce_scatter", "all_gather", "reduce", "broadcast", "chunk"]


def chunk(flat: torch.Tensor, device: int, n: int) -> torch.Tensor:
    """The slice of a buffer that `device` owns among `n` devices (a view when the buffer is contiguous)."""
    lo, hi = chunk_bounds(flat.numel(), n)[owned_chunk(device, n)]
    return flat.reshape(-1)[lo:hi]


def reduce_scatter(tensors: list[torch.Tensor], algorithm: str = "ring") -> list[torch.Tensor]:
    """Sum `tensors` so that device i holds the sum of its own chunk; returns those chunks (views).

    The rest of each buffer holds partial sums afterwards: only the returned chunks are meaningful.
    """
    check_tensors(tensors)
    with torch.no_grad():
        execute(get_collective("reduce_scatter", algorithm, len(tensors)), tensors)
    return [chunk(t, i, len(tensors)) for i, t in enumerate(tensors)]


def all_gather(tensors: list[torch.Tensor], algorithm: str = "ring") -> None:
    """Give every device every device's own chunk, in place: afterwards all buffers are equal."""
    check_tensors(tensors, sums=False)
    with torch.no_grad():
        execute(get_collective("all_gather", algorithm, len(tensors)), tensors)


def reduce(tensors: list[torch.Tensor], root: int = 0, algorithm: str = "tree") -> None:
    """Sum `tensors` into `tensors[root]`; the others are left holding partial sums."""
    check_tensors(tensors)
    int_between("root", root, 0, len(tensors) - 1)
    with torch.no_grad():
        execute(get_collective("reduce", algorithm, len(tensors), root), tensors)


def broadcast(tensors: list[torch.Tensor], root: int = 0, algorithm: str = "tree") -> None:
    """Copy `tensors[root]` into every other tensor, in place."""
    check_tensors(tensors, sums=False)
    int_between("root", root, 0, len(tensors) - 1)
    with torch.no_grad():
        execute(get_collective("broadcast", algorithm, len(tensors), root), tensors)
