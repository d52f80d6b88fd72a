"""The loads of the standard allreduces, written down without building their schedules.

A round's time depends only on its loads (`manualdp.cost.round_loads`: what each device
sends, receives and adds), and the standard allreduces repeat a few loads over many devices
and rounds. `allreduce_loads` writes those down directly: at 100,000 ranks the ring's
schedule would be billions of transfers. The tuner's `predict` uses it, and the tests hold
it equal to `round_loads` of the schedule itself.
"""
from __future__ import annotations

from collections import Counter

from .cost import merged
from .schedule import ALGORITHMS
from .validate import non_negative_int, one_of, positive_int

__all__ = ["allreduce_loads"]


def allreduce_loads(algorithm: str, n: int, nbytes: int, element_size: int = 1) -> list[tuple[Counter, int]]:
    """`round_loads(get_schedule(algorithm, n), nbytes, element_size)`, written down without the schedule.

    Time and memory grow as log n at most, where the schedule of a ring holds 2n(n-1) transfers.
    """
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_int("n", n)
    non_negative_int("nbytes", nbytes)
    positive_int("element_size", element_size)
    if nbytes % element_size:
        raise ValueError(f"nbytes={nbytes} is not a multiple of element_size={element_size}")
    if n == 1:
        return []
    numel, S = nbytes // element_size, nbytes
    if algorithm == "naive":  # everyone into device 0, then device 0 to everyone
        rounds = [(Counter({(0, n - 1, 0, (n - 1) * S, (n - 1) * S): 1, (1, 0, S, 0, 0): n - 1}), 1),
                  (Counter({(n - 1, 0, (n - 1) * S, 0, 0): 1, (0, 1, 0, S, 0): n - 1}), 1)]
    elif algorithm == "tree":  # at distance 1, 2, 4, ... (reduce), then back (broadcast), m pairs pass the buffer on
        ups = [len(range(d, n, 2 * d)) for d in _powers_below(n)]
        downs = [len(range(0, n - d, 2 * d)) for d in reversed(_powers_below(n))]
        rounds = ([(Counter({(1, 0, S, 0, 0): m, (0, 1, 0, S, S): m}), 1) for m in ups] +
                  [(Counter({(1, 0, S, 0, 0): m, (0, 1, 0, S, 0): m}), 1) for m in downs])
    elif algorithm == "ring":
        # In every round device i sends chunk c = i - s and receives chunk c - 1 (mod n); the first
        # `extra` chunks hold one element more. Every round of a phase has the same loads.
        base, extra = divmod(numel, n)
        big, small = (base + 1) * element_size, base * element_size
        pairs = ({(big, small): 1, (big, big): extra - 1, (small, big): 1, (small, small): n - 1 - extra} if extra
                 else {(small, small): n})
        rounds = [(Counter({(1, 1, s, r, r): c for (s, r), c in pairs.items() if c > 0}), n - 1),  # reduce-scatter
                  (Counter({(1, 1, s, r, 0): c for (s, r), c in pairs.items() if c > 0}), n - 1)]  # all-gather
    elif algorithm == "recursive_doubling":  # the extra devices fold in, the p others swap and add, fold out
        p = 1 << (n.bit_length() - 1)
        r = n - p
        rounds = ([(Counter({(1, 0, S, 0, 0): r, (0, 1, 0, S, S): r}), 1)] if r else [])
        rounds += [(Counter({(1, 1, S, S, S): p}), p.bit_length() - 1)]
        rounds += [(Counter({(1, 0, S, 0, 0): r, (0, 1, 0, S, 0): r}), 1)] if r else []
    else:
        rounds = _halving_doubling_loads(n, numel, element_size)
    return merged(rounds)


def _powers_below(n: int) -> list[int]:
    """1, 2, 4, ... below n: the distances of a binomial tree's rounds."""
    return [1 << i for i in range((n - 1).bit_length())]


def _halving_doubling_loads(n: int, numel: int, element_size: int) -> list[tuple[Counter, int]]:
    p = 1 << (n.bit_length() - 1)
    r, S = n - p, numel * element_size
    base, extra = divmod(numel, p)

    def span(lo, hi):  # bytes in chunks lo..hi-1: the first `extra` chunks hold one element more
        return ((hi - lo) * base + min(max(extra - lo, 0), hi - lo)) * element_size

    fold = [(Counter({(1, 0, S, 0, 0): r, (0, 1, 0, S, S): r}), 1)] if r else []
    middle = []
    # At distance d, the aligned blocks of 2d chunks pair devices i and i ^ d; the d devices of a
    # block's lower half send its upper half and receive its lower one (halving, adding), then
    # send their lower half and receive the upper one (doubling). Blocks all of big chunks, the
    # one with both and those all of small chunks: at most three kinds per round.
    for d, adds in [(d, True) for d in reversed(_powers_below(p))] + [(d, False) for d in _powers_below(p)]:
        loads: Counter = Counter()
        for lo, blocks in _blocks(p, 2 * d, extra):
            low, high = span(lo, lo + d), span(lo + d, lo + 2 * d)
            loads[(1, 1, high, low, low) if adds else (1, 1, low, high, 0)] += blocks * d
            loads[(1, 1, low, high, high) if adds else (1, 1, high, low, 0)] += blocks * d
        middle.append((loads, 1))
    unfold = [(Counter({(1, 0, S, 0, 0): r, (0, 1, 0, S, 0): r}), 1)] if r else []
    return fold + middle + unfold


def _blocks(p: int, width: int, extra: int) -> list[tuple[int, int]]:
    """(first chunk of one, how many) for the blocks of `width` of `p` chunks: all big, the one with both, all small."""
    full, part = divmod(extra, width)
    groups = [(0, full), (full * width, int(part > 0)), ((full + (part > 0)) * width, p // width - full - (part > 0))]
    return [(lo, count) for lo, count in groups if count > 0]
