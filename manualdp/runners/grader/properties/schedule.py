"""`schedule(n)` (chapter 2): the rounds of an allreduce on n devices, every transfer valid, every device ending with
each device's contribution to every chunk exactly once; and what hypothesis draws for it (`DRAWN`)."""
from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from ....cost import check_schedule
from ....schedule import Schedule, Transfer
from ...explain import trace
from .common import Mismatch, called, show

__all__ = ["as_schedule", "schedule_property", "DRAWN"]


def as_schedule(out, n: int, call: str) -> Schedule:
    """A `Schedule`, or rounds of `Transfer`s (or `(src, dst, chunk, reduce)` tuples), as a Schedule for `n` devices."""
    if isinstance(out, Schedule):
        if out.num_devices != n:
            raise Mismatch(f"{call}: expected a schedule for {n} devices, got one for {out.num_devices}")
        return out
    try:
        rounds = tuple(tuple(Transfer(*t) for t in rnd) for rnd in out)
    except TypeError as e:
        raise Mismatch(f"{call}: expected a list of rounds, each a list of Transfer(src, dst, chunk, reduce); "
                       f"got {show(out)} ({e})") from None
    chunks = 1 + max((t.chunk for rnd in rounds for t in rnd if isinstance(t.chunk, int)), default=0)
    return Schedule("yours", n, chunks, rounds, ("",) * len(rounds))


def _holds(contributions: Counter, chunk: int, n: int) -> str:
    names = "abcdefghijklmnopqrstuvwxyz"
    return "+".join(f"{names[d] if n <= 26 else f'd{d}_'}{chunk}"
                    for d in sorted(contributions.elements())) or "nothing"


def schedule_property(schedule, n: int) -> Schedule:
    """`schedule(n)` is an allreduce: every transfer valid, and in the end every device holds, in every chunk,
    each device's contribution exactly once. Returns the schedule."""
    call = f"schedule({n})"
    sched = as_schedule(called(call, schedule, n)[2], n, call)
    for r, rnd in enumerate(sched.rounds, start=1):  # from 1, as check_schedule, explain and the pictures
        for t in rnd:
            if not all(isinstance(v, int) for v in t[:3]) or not isinstance(t.reduce, bool):
                raise Mismatch(f"{call}: round {r} holds {t}; src, dst and chunk are ints and reduce a bool")
    try:
        check_schedule(sched)
    except ValueError as e:
        raise Mismatch(f"{call}: {e}") from None
    final = trace(sched)[-1]
    everyone = Counter(range(n))
    for d in range(n):
        for c in range(sched.num_chunks):
            if final[d][c] != everyone:
                missing = sorted((everyone - final[d][c]).elements())
                twice = sorted((final[d][c] - everyone).elements())
                what = "; ".join(p for p in (
                    f"it misses device{'s' * (len(missing) > 1)} {_listed(missing)}" if missing else "",
                    f"it counts device{'s' * (len(twice) > 1)} {_listed(twice)} twice" if twice else "") if p)
                raise Mismatch(f"{call}: after its {len(sched.rounds)} rounds, "
                               f"device {d} holds {_holds(final[d][c], c, n)} "
                               f"in chunk {c}, expected the sum of every device's chunk {c}, "
                               f"{_holds(everyone, c, n)}: {what}")
    return sched


def _listed(items: list) -> str:
    return ", ".join(str(i) for i in items[:-1]) + (" and " if len(items) > 1 else "") + str(items[-1])


DRAWN = dict(n=st.integers(1, 16))
