"""HSDP's second collective: this rank's reduce-scattered rows, all-reduced across the replicas (mesh dim 0).

On a 2-D mesh (replicate, shard), as torch's HSDP: each replica is a group of ranks that shards the
model among themselves (dim 1); a unit's gradients are reduce-scattered within the replica
(`fsdp_collectives.py`), then rank i of each replica all-reduces its rows with rank i of the others,
and the sum is divided by shards x replicas (or the unit's `set_gradient_divide_factor`). The sum over
the shard group comes first and then the replicas', as torch's order. Each sum runs on the book's ring: bitwise
torch's where its order of the terms is gloo's (two replicas; a reduce-scatter over 2 shards, or 3 whose chunks fall on
the ranks' rows), to float32 rounding elsewhere: gloo's ring adds each chunk downwards from the rank below its owner,
in 2 chunks per rank, ours upwards. Adding in gloo's order by all-gathering the rows instead would double the bytes
of the reduce-scatter at 4 shards, and hold for small messages only (gloo cuts large ones into more chunks).

With `set_requires_all_reduce(False)` the reduce-scatter's sums are kept per dtype (`unit.partial`) and
added to the next one that all-reduces (gradient accumulation across replicas at the last micro-batch
only); the shards get no gradient until then, as torch's.

Each replica writes a short tail into its own slot of the message (the unit's number, its count of
all-reduces across the replicas, its divide factor, whether it was asked to all-reduce, and its all-reduces of the
unit since an optimizer last stepped it): replicas that run other units, or one all-reduce more, or divide otherwise,
or all-reduce at every micro-batch where others do at the last only, raise naming the unit on every rank. The replicas
pair by what they all-reduce, not by how many backward passes led to it: one replica may accumulate 2 micro-batches
and another 3 (as torch's HSDP allows), each reduce-scattering every micro-batch within its shard group, and
all-reducing once, on its last.

A replica that forgets `set_requires_all_reduce(True)` on its last micro-batch leaves the others waiting in that
all-reduce (torch's waits out its timeout, or hangs). Its optimizer step is the moment it knows: the optimizer steps
shards whose unit still keeps sums never all-reduced. So that step (a hook on every optimizer's step) joins the
others' all-reduce with the first sums it kept, in the order the others all-reduce them, its tail saying "not asked":
every rank of the mesh raises one line, at once, naming the replicas that did not all-reduce. One that set it back on
some units only all-reduces another unit than the others: the call check refuses that on every replica, and the
replicas then tell each other the first unit each kept in this backward, to name the one that kept it.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..collectives import allreduce
from ..transport.peers import group_ranks, is_refused_alike, refused_alike
from .fsdp_param import SLOTS, owner_of

__all__ = ["across_replicas", "watch_unreduced"]

# each replica's slot of the message: (unit number, all-reduces so far, divide factor, asked to all-reduce, all-reduces
# of these sums since the last optimizer step over the unit)
TAIL = 5


@torch.no_grad()
def across_replicas(unit, dtype: torch.dtype, summed: torch.Tensor, count: int | None,
                    factor: float):  # on the worker thread
    """`summed` (this rank's rows and used-flags, summed over its shard group) plus what was kept, summed over the
    replicas in the unit's all-reduce number `count` (mod 64); None while `count` is None (then kept for the next)."""
    kept = unit.partial.pop(dtype, None)
    if kept is not None:
        summed = summed + kept
    unit.step.kept.pop((unit, dtype), None)
    if count is None:
        unit.partial[dtype] = summed.clone()
        unit.step.kept[(unit, dtype)] = unit.step.backwards  # last: the order the replicas that all-reduce send them in
        return None
    since = unit.step.since[(unit, dtype)] = unit.step.since.get((unit, dtype), 0) + 1
    return _exchange(unit, summed, count, factor, asked=True, since=since)


def _exchange(unit, summed: torch.Tensor, count: int, factor: float, asked: bool, since: int = 0) -> torch.Tensor:
    """All-reduce `summed` across the replicas with each replica's tail; raise on every rank unless the tails agree
    and every replica was asked to all-reduce."""
    replica, peers = group_ranks(unit.replicate)
    R, n = len(peers), summed.numel()
    flat = torch.zeros(n + TAIL * R, dtype=summed.dtype, device=summed.device)
    flat[:n] = summed
    flat[n + TAIL * replica:n + TAIL * (replica + 1)] = torch.tensor(
        [unit.number, count, factor, float(asked), since % 64], dtype=torch.float64)
    try:
        allreduce(flat, "ring", group=unit.replicate, timeout=unit.timeout)
    except ValueError as e:  # the call check: another replica's all-reduce was of another size (another unit's)
        if is_refused_alike(e):  # every replica raised it, nothing in flight: they can tell each other why
            _name_keepers(unit, replica, R, e)
        raise
    tails = flat[n:].view(R, TAIL).tolist()
    unasked = [r for r, t in enumerate(tails) if t[3] == 0]
    if unasked:
        raise refused_alike(RuntimeError(_not_all_reduced(
            unit, replica, unasked, R, f"before {_its(unasked)} optimizer step (unit {_label(unit)}: its last "
            "micro-batch ran with set_requires_all_reduce(False))")))
    if any(t[:3] != tails[replica][:3] for t in tails):
        per_replica = "; ".join(f"replica {r}: unit {int(a)}, all-reduce {int(c)}, divide factor {f}"
                                for r, (a, c, f, _, _) in enumerate(tails))
        raise refused_alike(RuntimeError(
            f"rank {dist.get_rank()} (replica {replica}): fully_shard's all-reduce across replicas of unit "
            f"{_label(unit)} met other units, counts or divide factors on other replicas ({per_replica}; counts mod "
            "64): every replica must run the same units, all-reduce them the same number of "
            "times (set_requires_all_reduce(True) on every replica's last micro-batch), and call "
            "set_gradient_divide_factor alike"))
    if any(t[4] != tails[replica][4] for t in tails):
        per_replica = ", ".join(f"replica {r}: {int(t[4])}" for r, t in enumerate(tails))
        raise refused_alike(RuntimeError(
            f"rank {dist.get_rank()} (replica {replica}): fully_shard's HSDP replicas all-reduced unit "
            f"{_label(unit)}'s gradients a different number of times since their last optimizer step ({per_replica}; "
            "mod 64): every replica must all-reduce once per step (set_requires_all_reduce(False) before each "
            "micro-batch's backward but the last, True before the last) or at every micro-batch alike"))
    return flat[:n]


def _name_keepers(unit, replica: int, R: int, error: ValueError) -> None:
    """After the call check refused an all-reduce on every replica: raise one line naming the replicas that kept, in
    this backward, sums of a unit that others all-reduce (`set_requires_all_reduce(False)` left on it), if any."""
    step = unit.step
    numbers = torch.zeros(R, dtype=torch.int64)  # per replica: the first unit it kept in this backward, from 1
    numbers[replica] = next((u.number for (u, _), b in step.kept.items() if b == step.backwards), 0)
    allreduce(numbers, "ring", group=unit.replicate, timeout=unit.timeout)
    keepers = [r for r, k in enumerate(numbers.tolist()) if k]
    if keepers:
        kept = step.root.tree()[int(numbers[keepers[0]]) - 1]
        raise refused_alike(RuntimeError(_not_all_reduced(
            unit, replica, keepers, R, f"in this backward (unit {_label(kept)}: set_requires_all_reduce(False) left "
            f"on it, while {_its(keepers)} all-reduce of another unit met the others')"))) from error


def _not_all_reduced(unit, replica: int, who: list[int], R: int, when: str) -> str:
    """The line every rank raises when the replicas `who` did not all-reduce gradients that others did."""
    named = f"replica {who[0]}" if len(who) == 1 else f"replicas {', '.join(str(r) for r in who[:-1])} and {who[-1]}"
    return (f"rank {dist.get_rank()} (replica {replica}): fully_shard's HSDP {named} did not all-reduce "
            f"{_its(who)} gradients across the replicas {when}, "
            f"{'while the other replicas did' if len(who) < R else 'nor did any other'}: call "
            "set_requires_all_reduce(True) before the last micro-batch's backward on every replica, for every unit")


def _its(who: list[int]) -> str:
    return "its" if len(who) == 1 else "their"


def _label(unit) -> str:
    return f"{unit.number} ({type(unit.module).__name__}{' ' + unit.name if unit.name else ''})"


@functools.cache
def watch_unreduced() -> None:
    """Once: an optimizer step over HSDP shards whose unit keeps sums never all-reduced names it on every rank."""
    register_optimizer_step_pre_hook(_at_optimizer_step)


def _at_optimizer_step(optimizer, args, kwargs) -> None:
    """(An optimizer step pre-hook) if a unit it steps keeps sums, join the other replicas' all-reduce as a replica not
    asked to, and raise; else the units' all-reduces since the last optimizer step count from 0 again."""
    units = {u for u in (_unit_of(p) for group in optimizer.param_groups for p in group["params"]) if u is not None}
    waiting = next((u for u in units if u.partial), None)
    if waiting is not None:
        _own_up(waiting.step)
    for step in {u.step for u in units}:
        step.since = {key: k for key, k in step.since.items() if key[0] not in units}


def _unit_of(p: torch.Tensor):
    """The unit whose shard `p` is, or None."""
    param = owner_of(p)
    if param is None or param.sharded is not p:
        return None
    sub, attr = param.slots[0]
    return sub.__dict__.get(SLOTS, {}).get(attr)


def _own_up(step) -> None:
    """Send the first sums the tree kept into the all-reduce its peers wait in, tail "not asked": every rank raises."""
    if step.failure is not None:
        raise step.failure
    unit, dtype = next(iter(step.kept))
    factor = unit.divide_factor if unit.divide_factor is not None else unit.world_size * unit.replicas
    try:
        step.root.worker.submit(_exchange, unit, unit.partial[dtype], (unit.all_reduces + 1) % 64, factor,
                                False).result()
    except Exception as e:
        step.failure = e  # the replicas are out of step: the tree's later collectives raise it at once
        step.abandon()
        raise
