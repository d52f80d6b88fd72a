"""Allreduce algorithms as data.

A schedule is a list of rounds; a round is a list of transfers `(src, dst, chunk, reduce)`:
device `src` sends chunk `chunk` of its flat buffer to `dst`, which adds it (`reduce=True`)
or overwrites its own copy with it. Transfers in one round happen at the same time, so a
device never sends a chunk that it receives in the same round (`check_schedule`).

From a schedule alone `manualdp.cost` counts bytes per device and estimates time with the
alpha-beta-gamma model; the executors (`manualdp.allreduce`, `manualdp.spmd.p2p`) only run it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .validate import one_of, positive_int

__all__ = [
    "Transfer", "Schedule", "naive", "ring", "tree", "get_schedule", "ALGORITHMS", "chunk_sizes", "chunk_bounds",
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
