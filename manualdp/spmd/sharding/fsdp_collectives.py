"""The bytes of a `fully_shard` unit: its all-gather and its reduce-scatter, the book's schedules, and the tails check.

Both lay a unit's parameters of one dtype out in one flat buffer of W equal segments, one per rank,
each parameter padded to ceil(rows / W) rows in every segment:
- all-gather: every rank copies its shards into its own segment (copy-in), the all-gather fills the
  other segments, and each full parameter is copied out of them, in rank order (copy-out);
- reduce-scatter: every rank copies each full gradient's rows into the segments of the ranks that own
  them, and the reduce-scatter leaves it the sum over ranks of its own segment, divided by the number
  of ranks (or the factor of `set_gradient_divide_factor`): the shards' gradients.

Every segment carries a short tail: the unit's number, how many all-gathers (or reduce-scatters) it has
run and whether for backward. Ranks that run other units, or one more, see each other's tails and raise,
naming the unit, instead of mixing two units' numbers; a reduce-scatter's tail also holds the rank's divide
factor, and ranks that divide by different ones raise, naming both. A reduce-scatter's tail also counts, per
parameter, the ranks that produced a gradient: a parameter no rank used in this step gets no gradient
(the optimizer skips it, as with torch's FSDP2). (One used on some ranks only makes those ranks send the
unit's gradients earlier than the others: the collectives' call check then raises on every rank.)

These run on the group's worker thread, in order (`in_line`); the unit that starts them is `fsdp_unit.py`.
"""
from __future__ import annotations

import torch

from ..collectives import all_gather, reduce_scatter
from ..transport.peers import is_refused_alike, refused_alike
from .fsdp_hsdp import across_replicas
from .fsdp_ext import HALF, RAISED, UNPADDED
from .fsdp_param import Param

__all__ = ["all_gather_params", "reduce_scatter_grads", "in_line", "segment", "UnitMismatch", "GATHER_TAIL"]

# each rank's segment of an all-gather ends with (unit number, all-gathers so far, trainable code, extension code)
GATHER_TAIL = 4


class UnitMismatch(RuntimeError):
    """Ranks ran different units (or a different number of them) in the same collective."""


def in_line(unit, job, *args):  # on the worker thread
    """Run `job(unit, *args)` unless a collective of this tree failed before: the ranks are out of step since, and
    the job would wait for peers in vain; it raises that failure instead, at once (and records its own)."""
    step = unit.step
    if step.failure is not None:
        raise step.failure
    try:
        return job(unit, *args)
    except ValueError as e:  # the collectives' call check: the ranks called differently
        step.failure = UnitMismatch(
            f"rank {unit.rank}: fully_shard's {'all-gather' if job is all_gather_params else 'reduce-scatter'} "
            f"of unit {_label(unit)} met another collective on other ranks: every rank must run the same units, "
            f"and use the same parameters in each, in the same order ({e})")
        if is_refused_alike(e):  # nothing in flight: the group's worker serves the next model's calls
            refused_alike(step.failure)
        raise step.failure from e
    except Exception as e:
        step.failure = e
        raise


@torch.no_grad()
def all_gather_params(unit, jobs, count: int, why: str, then=None) -> None:  # on the worker thread
    """Fill each (dtype, params, their local rows, their full forms) of `jobs`: copy-in, all-gather, copy-out; a
    parameter with torch's all-gather extensions has None for both (its slot stays zero), and `then()` moves the
    extensions' inputs (`fsdp_ext.gather_inputs`) once every rank's tail is checked."""
    W = unit.world_size
    with unit.span(f"all_gather {unit.name} ({why})", "comm", "comm"):
        for dtype, members, locals_, fulls in jobs:
            S = sum(p.padded for p in members) + GATHER_TAIL
            flat = torch.zeros(W * S, dtype=dtype, device=members[0].sharded.device)
            own = flat.view(W, S)[segment(unit.rank, W)]
            at = 0
            for p, local in zip(members, locals_):  # copy-in: this rank's rows, padded
                if local is not None:
                    own[at:at + local.numel()].copy_(local.reshape(-1))
                at += p.padded
            own[S - 4:] = torch.tensor([unit.number, count, unit.trainable_code, unit.extension_code])
            all_gather(flat, group=unit.group, timeout=unit.timeout)
            segments = flat.view(W, S)
            tails = segments[:, S - 4:].tolist()
            tails = [tails[segment(r, W)] for r in range(W)]
            _check_tails(unit, [t[:2] for t in tails], "all-gather", count)
            _check_extension(unit, [int(t[3]) for t in tails])
            _check_trainable(unit, [int(t[2]) for t in tails])
            at = 0
            for p, full in zip(members, fulls):  # copy-out, through .data: no version bump
                if full is not None:
                    _copy_out(segments[:, at:at + p.padded], full.data, p)
                at += p.padded
        if then is not None:
            then()


@torch.no_grad()
def reduce_scatter_grads(unit, jobs, count: int, across: int | None = 0) -> list[tuple[Param, torch.Tensor]]:
    """Sum each (dtype, params, their gradients or None) of `jobs` over the ranks: (param, this rank's rows) for
    every parameter some rank produced a gradient for. HSDP: then over the replicas, in the unit's all-reduce number
    `across` (None: nothing returned, the sums are kept for the next all-reduce, `fsdp_hsdp.py`). On the worker
    thread."""
    W, out = unit.world_size, []
    with unit.span(f"reduce_scatter {unit.name}", "comm", "comm"):
        for dtype, members, grads in jobs:
            data = sum(p.padded for p in members)
            S = data + 3 * W + len(members)  # the tails: (unit, count, factor) per rank, then a flag per parameter
            device = next((g.device for g in grads if g is not None), members[0].sharded.device)
            flat = torch.zeros(W * S, dtype=dtype, device=device)
            segments = flat.view(W, S)
            at = 0
            for p, grad in zip(members, grads):  # copy-in: each rank's rows into its segment, padded
                if grad is not None:
                    _copy_in(segments[:, at:at + p.padded], grad, p)
                at += p.padded
            factor = unit.divide_factor if unit.divide_factor is not None else W * unit.replicas
            segments[:, data + 3 * unit.rank:data + 3 * unit.rank + 3] = torch.tensor(
                [unit.number, count, factor], dtype=torch.float64)
            segments[:, data + 3 * W:] = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
            pre, post = _divide_split(factor, dtype, W == 1 and unit.divide_factor is not None)
            segments[:, :data].div_(pre)
            mine = reduce_scatter(flat, group=unit.group, timeout=unit.timeout)
            tails = mine[data:data + 3 * W].view(W, 3).tolist()
            _check_tails(unit, [t[:2] for t in tails], "reduce-scatter", count)
            _check_factor(unit, [t[2] for t in tails])
            if unit.replicate is not None:  # HSDP: the same rows of every replica, flags and all
                rows = torch.cat([mine[:data], mine[data + 3 * W:]])
                summed = across_replicas(unit, dtype, rows, across, factor)
                if summed is None:
                    continue
                mine = torch.cat([summed[:data], mine[data:data + 3 * W], summed[data:]])
            used = mine[data + 3 * W:].tolist()
            at = 0
            for p, users in zip(members, used):
                if users > 0:  # no rank produced a gradient: none, as torch's FSDP2 leaves it
                    grad = p.from_rows(mine[at:at + p.local_rows * p.row_numel])
                    out.append((p, (grad / post).to(p.dtype)))
                at += p.padded
    return out


def _divide_split(factor: float, dtype: torch.dtype, first: bool = False) -> tuple[float, float]:
    """Divide before and after the sum, as torch's FSDP2: in float16 (little range) by about sqrt(factor) each,
    so the sum neither overflows nor underflows; in float32 and bfloat16 all of it after, or all of it before where
    `first` (a factor set on a unit of one shard per replica: torch's divides its copy, then sums the replicas)."""
    if dtype in (torch.float32, torch.bfloat16):
        return (factor, 1.0) if first else (1.0, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


def _check_tails(unit, tails: list[list[float]], what: str, count: int) -> None:
    mine = [float(unit.number), float(count)]
    if any(t != mine for t in tails):
        per_rank = "; ".join(f"rank {r}: unit {int(t[0])}, {what} {int(t[1]) // 2}"
                             + (" (backward)" if int(t[1]) % 2 else "") for r, t in enumerate(tails))
        # every rank saw every tail, and the collective is complete: all raise alike, nothing in flight
        raise refused_alike(UnitMismatch(
            f"rank {unit.rank}: fully_shard's {what} of unit {_label(unit)} met other units "
            f"or counts on other ranks ({per_rank} mod 64): every rank must run the same units in "
            "the same order, the same number of times"))


def _check_factor(unit, factors: list[float]) -> None:
    """Raise on every rank unless every rank divides the summed gradients by the same factor (as the reduce dtype
    holds it): else each rank's rows would be divided by its own, a gradient mixed silently."""
    if any(f != factors[0] for f in factors):
        per_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(factors))
        raise refused_alike(UnitMismatch(
            f"rank {unit.rank}: fully_shard's reduce-scatter of unit {_label(unit)} divides by another gradient divide "
            f"factor on other ranks ({per_rank}): call set_gradient_divide_factor alike on every rank"))


def _check_extension(unit, codes: list[int]) -> None:
    """Raise on every rank, before any copy-out, unless every rank's unit holds torch's all-gather extension hooks
    on the same parameters, each both of the pair, and every pre-hook ran as torch's requires (`fsdp_ext.py`)."""
    if all(c == codes[0] for c in codes) and codes[0] not in (HALF, RAISED, UNPADDED):
        return
    where = unit.extension if unit.extension is not None else f"unit {_label(unit)}"

    def ranks(code=None) -> str:
        return ", ".join(str(r) for r, c in enumerate(codes) if (c == code if code is not None else c))

    if HALF in codes:
        raise refused_alike(UnitMismatch(f"{where}: fsdp_pre_all_gather and fsdp_post_all_gather must be defined "
                                         f"together (one of them only, on rank(s) {ranks(HALF)}), as torch's asserts"))
    if RAISED in codes:
        err = unit.extension_error
        said = (str(err).strip().splitlines() or [""])[0] if err is not None else None
        raise refused_alike(UnitMismatch(f"{where}: fsdp_pre_all_gather failed on rank(s) {ranks(RAISED)}"
                                         + (f" ({type(err).__name__}: {said})" if err is not None else ""))) from err
    if UNPADDED in codes:
        raise refused_alike(UnitMismatch(
            f"{where}: fsdp_pre_all_gather returned inputs of its shard's size on rank(s) {ranks(UNPADDED)}, whose "
            "shard of an unevenly sharded parameter has fewer rows than ceil(rows / world size): return them padded "
            "to that many rows, as torch's requires"))
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes))
    raise refused_alike(UnitMismatch(
        f"{where}: fsdp_pre_all_gather/fsdp_post_all_gather (torch's all-gather extensions, set on rank(s) "
        f"{ranks()}) are set on other parameters on other ranks (coded {per_rank}): set them alike on every rank"))


def _check_trainable(unit, codes: list[int]) -> None:
    """Raise on every rank unless every rank trains the same parameters of the unit (`requires_grad_` after
    fully_shard on some ranks only): their gradients' reduce-scatter would not pair up."""
    if any(c != codes[0] for c in codes):
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes))
        raise refused_alike(UnitMismatch(
            f"rank {unit.rank}: fully_shard's unit {_label(unit)} trains other parameters on other ranks (their "
            f"requires_grad, coded {per_rank}): freeze and unfreeze parameters alike on every rank"))


def _label(unit) -> str:
    """'3 (Block layers.2)': the unit's number, its module's class and its path from the outermost unit."""
    return f"{unit.number} ({type(unit.module).__name__}{' ' + unit.name if unit.name else ''})"


def segment(rank: int, world_size: int) -> int:
    """Which segment of a flat buffer is `rank`'s own: the chunk the ring schedules leave it (`owned_chunk`)."""
    return (rank + 1) % world_size


def _by_rank(segments: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """`segments` (W, padded) as blocks of consecutive ranks: (first rank, its rows). Rank r's is segment r + 1."""
    W = segments.shape[0]
    return [(0, segments[1:]), (W - 1, segments[:1])] if W > 1 else [(0, segments)]


def _row_blocks(p: Param, segments: torch.Tensor):
    """Pairs (rows of the full parameter, the matching part of `segments`) that cover the parameter once."""
    if p.chunk_rows == 0 or p.row_numel == 0:
        return
    for first, block in _by_rank(segments):
        start = first * p.chunk_rows
        whole = max(0, min(block.shape[0], (p.rows - start) // p.chunk_rows))  # ranks with all rows real
        if whole:
            yield (start, start + whole * p.chunk_rows), block[:whole]
        rest = p.rows - start - whole * p.chunk_rows
        if whole < block.shape[0] and rest > 0:
            yield (start + whole * p.chunk_rows, p.rows), block[whole, :rest * p.row_numel]


def _copy_out(segments: torch.Tensor, full: torch.Tensor, p: Param) -> None:
    """Each rank's rows from its segment of `segments` (W, padded) into `full`, in rank order."""
    if p.dim:  # Shard(dim > 0): the rows are slices of `full` along dim, not contiguous
        dest = p.as_rows(full)
        for (lo, hi), part in _row_blocks(p, segments):
            dest[lo:hi].copy_(part.reshape(dest[lo:hi].shape))
        return
    dest = full.view(p.rows, p.row_numel) if p.row_numel else None
    for (lo, hi), part in _row_blocks(p, segments):
        dest[lo:hi].view(part.shape).copy_(part)


def _copy_in(segments: torch.Tensor, grad: torch.Tensor, p: Param) -> None:
    """`grad`'s rows into each rank's segment of `segments` (W, padded): the inverse of `_copy_out`."""
    src = p.as_rows(grad).reshape(p.rows, p.row_numel) if p.row_numel else None
    for (lo, hi), part in _row_blocks(p, segments):
        part.copy_(src[lo:hi].reshape(part.shape))
