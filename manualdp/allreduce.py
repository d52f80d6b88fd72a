"""Allreduce across a list of per-device tensors, in one process (the single controller)."""
from __future__ import annotations

import torch

from .schedule import ALGORITHMS, Schedule, chunk_bounds, get_schedule

__all__ = ["allreduce", "run_schedule", "check_tensors"]


def allreduce(tensors: list[torch.Tensor], algorithm: str = "naive") -> None:
    """Sum `tensors` (one per device) in place, so that every device holds the sum.

    `naive` is the textbook's: add every tensor into device 0, then copy the sum back.
    Other algorithms (`ring`, `tree`) run their schedule from `manualdp.schedule`.
    Afterwards the tensors are bitwise identical.
    """
    check_tensors(tensors)
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    with torch.no_grad():
        if algorithm == "naive":
            for i in range(1, len(tensors)):
                tensors[0].add_(tensors[i].to(tensors[0].device))
            for i in range(1, len(tensors)):
                tensors[i].copy_(tensors[0])  # in place: `tensors[i] = ...` would only rebind the name
        else:
            _execute(get_schedule(algorithm, len(tensors)), tensors)  # tensors already checked above


def run_schedule(schedule: Schedule, tensors: list[torch.Tensor]) -> None:
    """Execute `schedule` on `tensors`, in place: the executor for every algorithm."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a manualdp.schedule.Schedule, got {type(schedule).__name__}")
    check_tensors(tensors)
    if len(tensors) != schedule.num_devices:
        raise ValueError(f"schedule is for {schedule.num_devices} devices, got {len(tensors)} tensors")
    _execute(schedule, tensors)


def _execute(schedule: Schedule, tensors: list[torch.Tensor]) -> None:
    """`run_schedule` without the checks, for callers that made them."""
    flats = [t.view(-1) if t.is_contiguous() else t.reshape(-1).clone() for t in tensors]
    bounds = chunk_bounds(flats[0].numel(), schedule.num_chunks)
    # Slice once per device and chunk: slicing in every transfer costs as much as adding a small chunk.
    chunks = [[flat[lo:hi] for lo, hi in bounds] for flat in flats]
    for rnd in schedule.rounds:
        # A round's transfers are simultaneous; check_schedule guarantees no chunk is both
        # read and written on one device within a round, so applying them in order is safe.
        for src, dst, chunk, reduce in rnd:
            if bounds[chunk][0] == bounds[chunk][1]:
                continue
            incoming = chunks[src][chunk].to(flats[dst].device)
            if reduce:
                chunks[dst][chunk].add_(incoming)
            else:
                chunks[dst][chunk].copy_(incoming)
    for t, flat in zip(tensors, flats):
        if not t.is_contiguous():
            t.copy_(flat.view_as(t))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Address range of `t`'s bytes; absolute, since two storages can share memory (e.g. `torch.from_numpy`)."""
    if t.numel() == 0:
        return (0, 0)
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return (start, start + extent * t.element_size())


def check_tensors(tensors, name: str = "tensors") -> None:
    """Raise unless `tensors` is a non-empty list of same-shape, same-dtype, non-aliasing tensors.

    The overlap test compares address ranges, so two interleaved views of one buffer (the
    columns of a matrix) count as sharing memory even where no element is shared.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors (one per device), got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name} must not be empty, got {tensors!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}[{i}] has layout {t.layout}; allreduce sums dense tensors only")
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}; allreduce sums real numbers")
        if t.shape != tensors[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, but {name}[0] has {tuple(tensors[0].shape)}")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}, but {name}[0] has {tensors[0].dtype}")
        if any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride())):
            # An expanded tensor cannot be written in place; torch would fail half-way through.
            raise ValueError(f"{name}[{i}] has stride 0 (an expanded view); pass a tensor that owns its elements")
    spans = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        key = t.device
        lo, hi = _span(t)
        for j, (k, jlo, jhi) in spans:
            if k == key and lo < jhi and jlo < hi:
                raise ValueError(f"{name}[{i}] and {name}[{j}] share memory; every device needs its own copy")
        spans.append((i, (key, lo, hi)))
