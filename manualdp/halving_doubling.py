"""Recursive halving then doubling (Rabenseifner's allreduce), as a schedule.

The ring needs n-1 rounds each way; halving/doubling needs log2(p) rounds, exchanging with a
partner at distance p/2, p/4, ..., 1 and back. It is registered as `halving_doubling` in
`manualdp.schedule.ALGORITHMS`.
"""
from __future__ import annotations

from .transfers import Schedule, Transfer
from .validate import positive_int

__all__ = ["halving_doubling"]


def halving_doubling(n: int) -> Schedule:
    """Recursive halving then doubling (Rabenseifner), with p = the largest power of two <= n.

    Chunks: p. When n is not a power of two, the r = n - p extra devices first add their
    whole buffer into devices 0..r-1 and get the result back at the end.
    Bytes sent per device, for a power of two: 2(p-1)/p * S in 2*log2(p) rounds, as the
    ring but in logarithmic rounds. Otherwise device i < r sends 2(p-1)/p * S + S,
    an extra device sends S and receives S, and the rest send 2(p-1)/p * S.
    """
    positive_int("n (number of devices)", n)
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
    return Schedule("halving_doubling", n, p, tuple(rounds), tuple(phases))
