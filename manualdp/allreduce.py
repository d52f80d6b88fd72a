"""Allreduce across a list of per-device tensors, in one process (the single controller)."""
from __future__ import annotations

from collections import Counter

import torch

from .cost import check_schedule
from .schedule import ALGORITHMS, Schedule, chunk_bounds, get_schedule
from .validate import check_summable, check_tensors, one_of

__all__ = ["allreduce", "run_schedule"]


def allreduce(tensors: list[torch.Tensor], algorithm: str = "naive") -> None:
    """Sum `tensors` (one per device) in place, so that every device holds the sum.

    `naive` is the textbook's: add every tensor into device 0, then copy the sum back.
    The other algorithms run their schedule from `manualdp.schedule`.
    """
    check_tensors(tensors)
    one_of("algorithm", algorithm, ALGORITHMS)
    with torch.no_grad():
        if algorithm == "naive":
            for i in range(1, len(tensors)):
                tensors[0].add_(tensors[i].to(tensors[0].device))
            for i in range(1, len(tensors)):
                tensors[i].copy_(tensors[0])  # in place: `tensors[i] = ...` would only rebind the name
        else:
            execute(get_schedule(algorithm, len(tensors)), tensors)


def run_schedule(schedule: Schedule, tensors: list[torch.Tensor]) -> None:
    """Execute any `schedule` on `tensors`, in place, after checking both.

    The schedule must pass `manualdp.cost.check_schedule`: a round that overwrites a chunk it
    also sends, or writes a chunk twice, would give a result that depends on the order of its
    transfers, which are meant to happen at once.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a manualdp.schedule.Schedule, got {type(schedule).__name__}")
    check_tensors(tensors)
    if len(tensors) != schedule.num_devices:
        raise ValueError(f"schedule is for {schedule.num_devices} devices, got {len(tensors)} tensors")
    try:
        check_schedule(schedule)
    except ValueError as e:
        raise ValueError(f"schedule {schedule.algorithm!r} cannot run: {e}") from None
    execute(schedule, tensors)


def execute(schedule: Schedule, tensors: list[torch.Tensor]) -> None:
    """Run `schedule` on checked `tensors`: every transfer is one slice copied, or added, between devices.

    The checks that stay here are cheap enough for every call: one tensor per device of the schedule,
    all of one size, and no bool tensor where it adds (True + True is True to torch, so five Trues
    would sum to True).
    """
    if len(tensors) != schedule.num_devices:
        raise ValueError(f"schedule {schedule.algorithm!r} is for {schedule.num_devices} devices, "
                         f"got {len(tensors)} tensors")
    sums = any(t.reduce for rnd in schedule.rounds for t in rnd)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if sums and t.dtype == torch.bool:
            check_summable(t, f"tensors[{i}]")  # refuses it, as allreduce does
        if t.numel() != tensors[0].numel():  # before anything is changed
            raise ValueError(f"tensors[{i}] has {t.numel()} elements and tensors[0] {tensors[0].numel()}: every "
                             "device's tensor must be of the same size")
    flats = [t.view(-1) if t.is_contiguous() else t.reshape(-1).clone() for t in tensors]
    bounds = chunk_bounds(flats[0].numel(), schedule.num_chunks)
    # Slice once per device and chunk: slicing in every transfer costs as much as adding a small chunk.
    chunks = [[flat[lo:hi] for lo, hi in bounds] for flat in flats]
    for rnd in schedule.rounds:
        # A round's transfers are simultaneous: every device sends what it held when the round began.
        # Partners that swap a chunk and both add (recursive doubling) hold the same sum after, as IEEE
        # addition is commutative: the first transfer adds, the second copies the sum back.
        swaps, added = _swaps(rnd), set()
        # Any other chunk that a device both sends and receives in the round (check_schedule allows it for
        # additions only) is copied before anything is written. Then applying the transfers in order is safe.
        sent = {(src, chunk): chunks[src][chunk].clone()
                for src, chunk in _sent_and_written(rnd) - {(src, chunk) for src, _, chunk in swaps}}
        for src, dst, chunk, reduce in rnd:
            if bounds[chunk][0] == bounds[chunk][1]:
                continue
            incoming = sent.get((src, chunk), chunks[src][chunk]).to(flats[dst].device)
            if (src, dst, chunk) in swaps and (dst, src, chunk) in added:
                chunks[dst][chunk].copy_(incoming)  # the partner holds the sum already
            elif reduce:
                chunks[dst][chunk].add_(incoming)
                added.add((src, dst, chunk))
            else:
                chunks[dst][chunk].copy_(incoming)
    for t, flat in zip(tensors, flats):
        if not t.is_contiguous():
            t.copy_(flat.view_as(t))


def _swaps(rnd) -> set:
    """The (src, dst, chunk) of round `rnd` whose partner adds the same chunk back, each device's only use of it."""
    uses = Counter((t.src, t.chunk) for t in rnd) + Counter((t.dst, t.chunk) for t in rnd)
    adds = {(t.src, t.dst, t.chunk) for t in rnd if t.reduce}
    return {(s, d, c) for s, d, c in adds if (d, s, c) in adds and uses[(s, c)] == uses[(d, c)] == 2}


def _sent_and_written(rnd) -> set:
    """The (device, chunk) pairs that the device both sends and receives in round `rnd`."""
    return {(t.src, t.chunk) for t in rnd} & {(t.dst, t.chunk) for t in rnd}
