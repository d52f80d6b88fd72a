"""HSDP's second collective: this rank's reduce-scattered rows, all-reduced across the replicas (mesh dim 0).

On a 2-D mesh (replicate, shard), as torch's HSDP: each replica is a group of ranks that shards the
model among themselves (dim 1); a unit's gradients are reduce-scattered within the replica
(`fsdp_collectives.py`), then rank i of each replica all-reduces its rows with rank i of the others,
and the sum is divided by shards x replicas (or the unit's `set_gradient_divide_factor`). The sum over
the shard group comes first and then the replicas', as torch's order: at 2 x 2 the numbers are torch's
bitwise (its averages divide by powers of two, which round nothing).

With `set_requires_all_reduce(False)` the reduce-scatter's sums are kept per dtype (`unit.partial`) and
added to the next one that all-reduces (gradient accumulation across replicas at the last micro-batch
only); the shards get no gradient until then, as torch's.

Each replica writes a short tail into its own slot of the message (the unit's number, its count of
all-reduces across the replicas, its divide factor): replicas that run other units, or one all-reduce more, or
divide otherwise, raise naming the unit on every rank. The replicas pair by what they all-reduce, not by how
many backward passes led to it: one replica may accumulate 2 micro-batches and another 3 (as torch's HSDP
allows), each reduce-scattering every micro-batch within its shard group, and all-reducing once, on its last.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import allreduce
from ..transport.peers import group_ranks, refused_alike

__all__ = ["across_replicas"]


@torch.no_grad()
def across_replicas(unit, dtype: torch.dtype, summed: torch.Tensor, count: int | None,
                    factor: float):  # on the worker thread
    """`summed` (this rank's rows and used-flags, summed over its shard group) plus what was kept, summed over the
    replicas in the unit's all-reduce number `count` (mod 64); None while `count` is None (then kept for the next)."""
    kept = unit.partial.pop(dtype, None)
    if kept is not None:
        summed = summed + kept
    if count is None:
        unit.partial[dtype] = summed.clone()
        return None
    replica, peers = group_ranks(unit.replicate)
    R, n = len(peers), summed.numel()
    flat = torch.zeros(n + 3 * R, dtype=summed.dtype, device=summed.device)
    flat[:n] = summed
    flat[n + 3 * replica:n + 3 * replica + 3] = torch.tensor([unit.number, count, factor], dtype=torch.float64)
    allreduce(flat, "ring", group=unit.replicate, timeout=unit.timeout)
    tails = flat[n:].view(R, 3).tolist()
    if any(t != tails[replica] for t in tails):
        per_replica = "; ".join(f"replica {r}: unit {int(a)}, all-reduce {int(c)}, divide factor {f}"
                                for r, (a, c, f) in enumerate(tails))
        raise refused_alike(RuntimeError(
            f"rank {dist.get_rank()} (replica {replica}): fully_shard's all-reduce across replicas of unit "
            f"{unit.number} ({type(unit.module).__name__}{' ' + unit.name if unit.name else ''}) met other units, "
            f"counts or divide factors on other replicas ({per_replica}; counts mod 64): every replica must run the "
            "same units, all-reduce them the same number of "
            "times (set_requires_all_reduce(True) on every replica's last micro-batch), and call "
            "set_gradient_divide_factor alike"))
    return flat[:n]
