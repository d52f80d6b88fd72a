"""`cost(schedule, nbytes, alpha, beta, gamma)` (chapter 3): the alpha-beta-gamma time of a schedule equals
`manualdp.cost.cost`'s, and a wrong one is told which slip it made (`COST_SLIPS`); the book's every schedule
(`book_schedules`), and what hypothesis draws (`schedules`, `DRAWN`)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from ....schedule import Schedule, Transfer
from .common import Mismatch, apart, called, seconds, show

__all__ = ["COST_SLIPS", "cost_property", "book_schedules", "cost_sweep_property", "schedules", "DRAWN"]


def _describe(sched: Schedule) -> str:
    """A schedule as the grader names it: the book's by name, a random one transfer by transfer."""
    if sched.algorithm != "random":
        return f"{sched.algorithm}({sched.num_devices})"
    rounds = "; ".join(f"round {r}: " + (", ".join(f"{t.src}->{t.dst} chunk {t.chunk} {'add' if t.reduce else 'copy'}"
                                                   for t in rnd) or "nothing")
                       for r, rnd in enumerate(sched.rounds))
    chunks = f"{sched.num_chunks} chunk{'s' * (sched.num_chunks != 1)}"
    return f"a schedule of {sched.num_devices} devices and {chunks} ({rounds})"


def _slip_cost(sched: Schedule, nbytes: int, alpha: float, beta: float, gamma: float, slip: str) -> float:
    """The textbook model with one of a student's slips (`COST_SLIPS`), to name the slip an answer made."""
    from ....schedule import chunk_sizes

    sizes, n, total = chunk_sizes(nbytes, sched.num_chunks), sched.num_devices, 0.0
    for rnd in sched.rounds:
        sent, received, added = [0] * n, [0] * n, [0] * n
        out, into = [set() for _ in range(n)], [set() for _ in range(n)]
        count_out, count_in = [0] * n, [0] * n
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            received[t.dst] += sizes[t.chunk]
            added[t.dst] += sizes[t.chunk] if t.reduce or slip == "adds every chunk received" else 0
            out[t.src].add(t.dst)
            into[t.dst].add(t.src)
            count_out[t.src] += 1
            count_in[t.dst] += 1
        times = []
        for d in range(n):
            if slip == "a message per transfer":
                messages = max(count_out[d], count_in[d])
            else:
                messages = max(len(out[d]), len(into[d]))
            moved = {"bytes sent only": sent[d], "sent plus received": sent[d] + received[d]}.get(
                slip, max(sent[d], received[d]))
            times.append(alpha * messages + beta * moved + gamma * added[d])
        total += (sum(times) if slip == "every device's time added up" else max(times, default=0.0))
    return total


COST_SLIPS = {  # a slip -> what to write instead
    "bytes sent only": "a device's beta term is beta times the larger of the bytes it sends and the bytes it receives",
    "sent plus received": "the textbook's link is full duplex: a device sends and receives at once, so its beta term "
                          "is beta times the larger of the two, not their sum",
    "a message per transfer": "the chunks one device sends to one peer in a round travel as one message: count the "
                              "peers a device sends to (and receives from), not the transfers",
    "every device's time added up": "the devices work at once: a round lasts as long as its busiest device (the "
                                    "largest of their times), not all their times added up",
    "adds every chunk received": "gamma is for the bytes a device adds (transfers with reduce=True); a chunk that "
                                 "overwrites (reduce=False) is only copied",
}


def cost_property(cost_fn, sched: Schedule, nbytes: int, alpha: float, beta: float, gamma: float) -> None:
    """`cost_fn(schedule, nbytes, alpha, beta, gamma)` is `manualdp.cost.cost`'s textbook time, to 1e-9."""
    import math

    from ....cost import cost

    expected = cost(sched, nbytes, alpha, beta, gamma)
    call = (f"cost(schedule, nbytes={nbytes}, alpha={alpha:.3g}, beta={beta:.3g}, gamma={gamma:.3g}) for "
            f"{_describe(sched)}")
    _, _, out = called(call, cost_fn, sched, nbytes, alpha, beta, gamma)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise Mismatch(f"{call}: expected a number of seconds, got {show(out)}")
    if not math.isclose(out, expected, rel_tol=1e-9, abs_tol=1e-15):
        slips = [s for s in COST_SLIPS if math.isclose(out, _slip_cost(sched, nbytes, alpha, beta, gamma, s),
                                                      rel_tol=1e-9, abs_tol=1e-15)]
        want, got = apart(expected, out, seconds)
        off = abs(out - expected) / abs(expected) if expected else math.inf
        raise Mismatch(f"{call}: expected {want} s (manualdp.cost.cost), got {got} s"
                       + (f". Yours counts {slips[0]}: {COST_SLIPS[slips[0]]}" if slips else "")
                       + (f", off by {off:.2g} relatively where 1e-9 is asked: is a sum rounded to float32 "
                          "somewhere?" if not slips and off < 1e-5 else ""))


COST_SWEEP = dict(nbytes=1_000_003, alpha=1e-5, beta=1e-9, gamma=2e-10)  # every term counts; uneven chunks


def _book_schedule(collective: str, algorithm: str, n: int) -> Schedule:
    """The book's schedule of `collective` by `algorithm` on `n` devices, named as `_describe` tells it."""
    from ....schedule import get_collective

    sched = get_collective(collective, algorithm, n)
    return Schedule(f"{collective} {algorithm}" if collective != "allreduce" else algorithm, sched.num_devices,
                    sched.num_chunks, sched.rounds, sched.phases)


def book_schedules(sizes=range(1, 17)) -> list[Schedule]:
    """Every schedule of the book (each algorithm of each collective, `COLLECTIVES`) on each of `sizes` devices."""
    from ....schedule import COLLECTIVES

    return [_book_schedule(c, a, n) for n in sizes for c in sorted(COLLECTIVES) for a in sorted(COLLECTIVES[c])]


def cost_sweep_property(cost_fn) -> None:
    """`cost_property` on every schedule of the book on every n from 1 to 16 (`COST_SWEEP`'s buffer and constants):
    each size the grader's report names is called, whatever hypothesis draws."""
    for sched in book_schedules():
        cost_property(cost_fn, sched, **COST_SWEEP)


@st.composite
def schedules(draw) -> Schedule:
    """The book's schedules on 1 to 16 devices, or a random valid one: 2 to 6 devices, 1 to 6 chunks, 0 to 4 rounds
    of up to 10 transfers (some to one peer, some adding, some overwriting)."""
    from ....cost import check_schedule
    from ....schedule import COLLECTIVES

    if draw(st.booleans()):
        collective = draw(st.sampled_from(sorted(COLLECTIVES)))
        algorithm = draw(st.sampled_from(sorted(COLLECTIVES[collective])))
        return _book_schedule(collective, algorithm, draw(st.integers(1, 16)))
    n, k = draw(st.integers(2, 6)), draw(st.integers(1, 6))
    rounds = []
    for _ in range(draw(st.integers(0, 4))):
        kept: list[Transfer] = []
        for src, dst, c, add in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                                                        st.integers(0, k - 1), st.booleans()), max_size=10)):
            if src == dst:
                continue
            try:  # keep the transfers that leave the round valid (`check_schedule`)
                check_schedule(Schedule("random", n, k, ((*kept, Transfer(src, dst, c, add)),), ("",)))
            except ValueError:
                continue
            kept.append(Transfer(src, dst, c, add))
        rounds.append(tuple(kept))
    return Schedule("random", n, k, tuple(rounds), ("",) * len(rounds))


DRAWN = dict(sched=schedules(), nbytes=st.integers(0, 1 << 30) | st.integers(0, 64), alpha=st.floats(0, 1e-3),
             beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9))
