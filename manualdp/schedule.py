"""Allreduce algorithms as data.

A schedule is a list of rounds; a round is a list of transfers `(src, dst, chunk, reduce)`:
device `src` sends chunk `chunk` of its flat buffer to `dst`, which adds it (`reduce=True`)
or overwrites its own copy with it. Transfers in one round happen at the same time, so a
device never sends a chunk that it receives in the same round (`check_schedule`).

From a schedule alone we count bytes per device and estimate time with the alpha-beta-gamma
model; the executors (`manualdp.allreduce`, `manualdp.distributed.allreduce`) only run it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .validate import non_negative_int, non_negative_number, one_of, positive_int

__all__ = [
    "Transfer", "Schedule", "naive", "ring", "tree", "get_schedule", "ALGORITHMS",
    "chunk_sizes", "chunk_bounds", "check_schedule", "traffic", "cost",
]


class Transfer(NamedTuple):
    src: int      # device that sends
    dst: int      # device that receives
    chunk: int    # which slice of the flat buffer
    reduce: bool  # True: dst adds the chunk to its own; False: dst overwrites its own


@dataclass(frozen=True)
class Schedule:
    algorithm: str
    num_devices: int
    num_chunks: int
    rounds: tuple[tuple[Transfer, ...], ...]
    phases: tuple[str, ...]  # one label per round, e.g. "reduce-scatter"

    def __str__(self) -> str:
        return f"{self.algorithm}({self.num_devices}): {len(self.rounds)} rounds, {self.num_chunks} chunks"


def chunk_sizes(numel: int, num_chunks: int) -> list[int]:
    """Near-equal chunk sizes; the first `numel % num_chunks` chunks get one more element."""
    base, extra = divmod(numel, num_chunks)
    return [base + (i < extra) for i in range(num_chunks)]


def chunk_bounds(numel: int, num_chunks: int) -> list[tuple[int, int]]:
    """`(start, stop)` of every chunk; chunks may be empty when `numel < num_chunks`."""
    bounds, start = [], 0
    for size in chunk_sizes(numel, num_chunks):
        bounds.append((start, start + size))
        start += size
    return bounds


def _check_n(n) -> int:
    return positive_int("n (number of devices)", n)


def naive(n: int) -> Schedule:
    """The textbook: every device sends to device 0, which sums; device 0 sends the sum back.

    Device 0 receives and sends (n-1)*S bytes; every other device sends and receives S.
    """
    _check_n(n)
    if n == 1:
        return Schedule("naive", 1, 1, (), ())
    gather = tuple(Transfer(i, 0, 0, True) for i in range(1, n))
    scatter = tuple(Transfer(0, i, 0, False) for i in range(1, n))
    return Schedule("naive", n, 1, (gather, scatter), ("reduce", "broadcast"))


def ring(n: int) -> Schedule:
    """Ring: n chunks, n-1 rounds of reduce-scatter then n-1 rounds of all-gather.

    Every device sends and receives 2(n-1)/n * S bytes (up to chunk rounding).
    """
    _check_n(n)
    rounds, phases = [], []
    # Reduce-scatter: in step s device i adds chunk (i-s) into its right neighbour;
    # after n-1 steps device i holds the full sum of chunk (i+1) % n.
    for s in range(n - 1):
        rounds.append(tuple(Transfer(i, (i + 1) % n, (i - s) % n, True) for i in range(n)))
        phases.append("reduce-scatter")
    # All-gather: pass the finished chunks around the ring, overwriting.
    for s in range(n - 1):
        rounds.append(tuple(Transfer(i, (i + 1) % n, (i + 1 - s) % n, False) for i in range(n)))
        phases.append("all-gather")
    return Schedule("ring", n, n, tuple(rounds), tuple(phases))


def tree(n: int) -> Schedule:
    """Recursive halving then doubling (Rabenseifner), with p = the largest power of two <= n.

    Chunks: p. When n is not a power of two, the r = n - p extra devices first add their
    whole buffer into devices 0..r-1 and get the result back at the end.
    Bytes sent per device, for a power of two: 2(p-1)/p * S in 2*log2(p) rounds, as the
    ring but in logarithmic rounds. Otherwise device i < r sends 2(p-1)/p * S + S,
    an extra device sends S and receives S, and the rest send 2(p-1)/p * S.
    """
    _check_n(n)
    p = 1 << (n.bit_length() - 1)
    r = n - p
    everything = range(p)
    rounds, phases = [], []
    if r:
        rounds.append(tuple(Transfer(p + i, i, c, True) for i in range(r) for c in everything))
        phases.append("fold-in")
    # Reduce-scatter by recursive halving: exchange half of the owned chunks with the
    # partner at distance d; the device with bit d clear keeps the lower half.
    owned = {i: (0, p) for i in range(p)}
    d = p // 2
    while d >= 1:
        rnd = []
        for i in range(p):
            lo, hi = owned[i]
            mid = (lo + hi) // 2
            give = range(mid, hi) if not i & d else range(lo, mid)
            rnd.extend(Transfer(i, i ^ d, c, True) for c in give)
        for i in range(p):
            lo, hi = owned[i]
            mid = (lo + hi) // 2
            owned[i] = (lo, mid) if not i & d else (mid, hi)
        rounds.append(tuple(rnd))
        phases.append("reduce-scatter")
        d //= 2
    # All-gather by recursive doubling: send what you own to the partner, ranges merge.
    d = 1
    while d < p:
        rnd = [Transfer(i, i ^ d, c, False) for i in range(p) for c in range(*owned[i])]
        for i in range(p):
            lo, hi = owned[i]
            plo, phi = owned[i ^ d]
            owned[i] = (min(lo, plo), max(hi, phi))
        rounds.append(tuple(rnd))
        phases.append("all-gather")
        d *= 2
    if r:
        rounds.append(tuple(Transfer(i, p + i, c, False) for i in range(r) for c in everything))
        phases.append("fold-out")
    return Schedule("tree", n, p, tuple(rounds), tuple(phases))


ALGORITHMS = {"naive": naive, "ring": ring, "tree": tree}


def get_schedule(algorithm: str, n: int) -> Schedule:
    """The schedule of `algorithm` (one of `ALGORITHMS`) for `n` devices."""
    one_of("algorithm", algorithm, ALGORITHMS)
    return _cached(algorithm, _check_n(n))


_CACHE: dict[tuple[str, int], Schedule] = {}


def _cached(algorithm: str, n: int) -> Schedule:
    key = (algorithm, n)
    if key not in _CACHE:
        _CACHE[key] = ALGORITHMS[algorithm](n)
    return _CACHE[key]


def check_schedule(schedule: Schedule) -> None:
    """Raise `ValueError` unless transfers are in range, no device sends a chunk it receives in the same round,
    and a chunk that is overwritten in a round is written only once in it (so applying them in order is safe).
    """
    n, k = schedule.num_devices, schedule.num_chunks
    for r, rnd in enumerate(schedule.rounds):
        written, read, overwritten = set(), set(), set()
        for t in rnd:
            if not (0 <= t.src < n and 0 <= t.dst < n and t.src != t.dst and 0 <= t.chunk < k):
                raise ValueError(f"round {r}: bad transfer {t} for {n} devices and {k} chunks")
            # Several adds into one chunk commute; an overwrite next to any other write does not.
            if (t.dst, t.chunk) in overwritten or (not t.reduce and (t.dst, t.chunk) in written):
                raise ValueError(f"round {r}: chunk {t.chunk} of device {t.dst} is overwritten and written again")
            if not t.reduce:
                overwritten.add((t.dst, t.chunk))
            written.add((t.dst, t.chunk))
            read.add((t.src, t.chunk))
        if written & read:
            raise ValueError(f"round {r}: devices send chunks they receive in the same round: {sorted(written & read)}")


def traffic(schedule: Schedule, nbytes: int, element_size: int = 1) -> dict[str, list[int]]:
    """Bytes each device sends, receives and reduces, for a buffer of `nbytes` bytes.

    Chunks are cut in whole elements of `element_size` bytes, as the executors cut them.
    """
    non_negative_int("nbytes", nbytes)
    positive_int("element_size", element_size)
    if nbytes % element_size:
        raise ValueError(f"nbytes={nbytes} is not a multiple of element_size={element_size}")
    sizes = [s * element_size for s in chunk_sizes(nbytes // element_size, schedule.num_chunks)]
    n = schedule.num_devices
    out = {"sent": [0] * n, "received": [0] * n, "reduced": [0] * n, "messages": [0] * n}
    for rnd in schedule.rounds:
        for t in rnd:
            out["sent"][t.src] += sizes[t.chunk]
            out["received"][t.dst] += sizes[t.chunk]
            if t.reduce:
                out["reduced"][t.dst] += sizes[t.chunk]
        for src, dst in {(t.src, t.dst) for t in rnd}:  # all chunks to one peer in a round: one message
            out["messages"][src] += 1
    return out


def cost(schedule: Schedule, nbytes: int, alpha: float, beta: float, gamma: float, element_size: int = 1) -> float:
    """Alpha-beta-gamma time estimate in seconds.

    Each round lasts as long as its busiest device: alpha per message it sends or receives,
    beta per byte it sends or receives (whichever is more), gamma per byte it adds.
    """
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        non_negative_number(name, v)
    total = 0.0
    for rnd in schedule.rounds:
        one = Schedule(schedule.algorithm, schedule.num_devices, schedule.num_chunks, (rnd,), ("",))
        t = traffic(one, nbytes, element_size)
        msgs_in = [0] * schedule.num_devices
        for _src, dst in {(x.src, x.dst) for x in rnd}:
            msgs_in[dst] += 1
        total += max(
            alpha * max(m, mi) + beta * max(s, r) + gamma * red
            for m, mi, s, r, red in zip(t["messages"], msgs_in, t["sent"], t["received"], t["reduced"])
        )
    return total
