"""Exercise 2.2 as asked: halving-doubling for n a power of two, with no fold for other sizes."""
from manualdp.transfers import Transfer


def schedule(n):
    owned = [(0, n) for _ in range(n)]  # the chunks device i still reduces: [lo, hi)
    rounds, distances = [], []
    d = n // 2
    while d >= 1:  # reduce-scatter by recursive halving: keep one half, send the other to i ^ d, which adds it
        rnd = []
        for i in range(n):
            lo, hi = owned[i]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if i & d == 0 else ((mid, hi), (lo, mid))
            rnd += [Transfer(i, i ^ d, c, True) for c in range(*give)]
            owned[i] = keep
        rounds.append(rnd)
        distances.append(d)
        d //= 2
    for d in reversed(distances):  # all-gather by recursive doubling: send what you hold, the range doubles
        rounds.append([Transfer(i, i ^ d, c, False) for i in range(n) for c in range(*owned[i])])
        owned = [(min(owned[i][0], owned[i ^ d][0]), max(owned[i][1], owned[i ^ d][1])) for i in range(n)]
    return rounds
