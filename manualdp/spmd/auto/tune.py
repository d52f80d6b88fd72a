"""`algorithm="auto"`: the constants of the link, measured, agreed by every rank and cached.

The pick itself is arithmetic (`manualdp.spmd.auto.pick`). It needs this transport's constants,
fitted by a short calibration between two ranks that sends as the executor sends
(`calibrate`): ping-pongs of one element give alpha (per message), a large transfer beta (per
byte), a local addition gamma (per byte added). `duplex`, what sending and receiving at once
costs (0 free, 1 in turns, more if they get in each other's way), is read from the ring of two
ranks timed against the naive schedule; on a busy machine the readings scatter, so it comes
with its spread, and `choose` takes the algorithm that loses least anywhere within it.
`parallel` is counted, not measured (`host_parallel`): 4 processes on 2 cores share them.
Every rank must choose alike, so rank 0 decides the constants (`MANUALDP_LINK`, its cache in
`manualdp.spmd.auto.link_cache`, or a calibration) and broadcasts them; they are kept in the
group's state (`GroupState.link`).

Constants go stale: a cache older than `MAX_CACHE_AGE` is measured again, and so is a link
whose measured allreduce times drift from the predictions (`note`, `drifted`, `recalibrate`:
one "auto" call in `DRIFT_EVERY` carries the drift in its call check, and the ranks measure
again together only when a rank saw it at `DRIFT_LOOKS` looks in a row, `drift_flag`).
"""
from __future__ import annotations

import collections
import functools
import math
import statistics
import time
from dataclasses import astuple, fields, replace

import torch
import torch.distributed as dist

from ...cost import MAX_DUPLEX
from ...schedule import ALGORITHMS, Schedule, Transfer, get_schedule
from ..transport.group import GroupState, group_state
from .link_cache import CALIBRATION, ENV, MAX_CACHE_AGE, cache_path, host_parallel, known_link, save
from ..transport.p2p import run_schedule
from ..transport.peers import talking_to, wait
from .pick import Link, choose, predict
from ..transport.plan import DEFAULT_SEGMENT_BYTES

# Link, predict and choose (`pick`), and the cache's names, are used here and kept importable from here too.
__all__ = ["ENGINE_ALGORITHMS", "DRIFT_EVERY", "drift_flag", "resolve", "link_for", "agreed", "recalibrate",
           "measure_again", "calibrate",
           "fit_duplex", "duplex_of", "note", "drifted", "moved", "Link", "predict", "choose", "host_parallel",
           "known_link", "cache_path", "CALIBRATION", "MAX_CACHE_AGE", "DEFAULT_SEGMENT_BYTES"]

ENGINE_ALGORITHMS = (*ALGORITHMS, "auto")  # what the SPMD engine accepts; the book keeps its explicit names


def resolve(algorithm: str, numel: int, element_size: int, group=None, timeout: float | None = None,
            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> str:
    """`algorithm` itself, or for "auto" the choice for a buffer of `numel` elements in `group`."""
    if algorithm != "auto":
        return algorithm
    state = group_state(group)
    return choose(len(state.peers), numel * element_size, agreed(state, timeout), element_size, segment_bytes)


# ---------------------------------------------------------------- the agreed constants of a group

def link_for(group=None, timeout: float | None = None) -> Link:
    """The constants every rank of `group` agrees on; collective the first time for a group."""
    return agreed(group_state(group), timeout)


def agreed(state: GroupState, timeout: float | None) -> Link:
    """`link_for` the group whose state is `state`."""
    if state.link is None:
        state.link = _agree(state, timeout)
    return state.link[0]


def recalibrate(group=None, timeout: float | None = None) -> Link:
    """Measure the link of `group` again (collective): every rank must call it, as after `drifted`.

    Constants given by `MANUALDP_LINK` are kept. Rank 0 caches the new ones.
    """
    return measure_again(group_state(group), timeout)


def measure_again(state: GroupState, timeout: float | None) -> Link:
    """`recalibrate` the group whose state is `state`; its drift records start afresh."""
    state.link = _agree(state, timeout, again=True)
    state.times.clear()
    state.confirmed.clear()
    state.drifted = False
    state.drift_looks = 0
    state.remeasures += 1
    return state.link[0]


def _agree(state: GroupState, timeout: float | None, again: bool = False) -> tuple[Link, str]:
    """Rank 0's constants on every rank: its override or cache, else (or `again`) a calibration with rank 1.

    Returns them and where from: "given" (by `MANUALDP_LINK`), "cached" or "measured".
    """
    group, rank, peers = state.pg(), state.rank, state.peers
    if len(peers) == 1:
        return Link(0.0, 0.0, 0.0), "given"  # nothing is ever sent
    device = _device(group)
    known = refused = None
    given = False
    if rank == 0:
        try:
            known, source = known_link(dist.get_backend(group), len(peers))
            given = source == f"${ENV}"
            known = known if given or not again else None
        except ValueError as e:  # a bad MANUALDP_LINK: every rank stops, none waits for rank 0
            refused = e
    # First: rank 0 refuses (-1), ranks 0 and 1 must measure (0), rank 0 knows them (1) or was given them (2)
    flag = -1.0 if refused else 0.0 if known is None else 2.0 if given else 1.0
    message = torch.tensor([flag, *(astuple(known) if known else [0.0] * len(fields(Link)))],
                           dtype=torch.float64, device=device)
    _broadcast(message, state, timeout)
    if message[0] < 0:
        raise refused or ValueError(f"rank {peers[0]} refused its {ENV} (its error names it); nothing was measured")
    source = ("measured", "cached", "given")[round(message[0].item())]
    if source == "measured":
        measured = calibrate(group, timeout) if rank in (0, 1) else None
        if rank == 0:
            save(dist.get_backend(group), len(peers), measured)
            measured = replace(measured, parallel=host_parallel(dist.get_backend(group), len(peers)))
            message = torch.tensor([1.0, *astuple(measured)], dtype=torch.float64, device=device)
        _broadcast(message, state, timeout)
    values = dict(zip((f.name for f in fields(Link)), message[1:].tolist()))
    return Link(**{k: int(v) if k == "parallel" else float(v) for k, v in values.items()}), source



def _broadcast(t: torch.Tensor, state: GroupState, timeout: float | None) -> None:
    peer = state.peers[0] if state.rank != 0 else None
    with talking_to(peer, timeout):
        work = dist.broadcast(t, src=state.peers[0], group=state.pg(), async_op=True)
    wait(work, peer, timeout)


def _device(group) -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
            else torch.device("cpu"))


# ---------------------------------------------------------------- measuring

SMALL_REPEATS = 20
LARGE_BYTES = 16 << 20
LARGE_REPEATS = 9    # large transfers per batch; batches go on while the duplex is uncertain
MAX_READINGS = 36    # duplex readings at most (4 batches)
SPREAD_GOAL = 0.1    # a duplex known to within this needs no more readings
WARMUP = 2


def calibrate(group=None, timeout: float | None = None) -> Link:
    """Measure alpha and beta by ping-pong between the group's ranks 0 and 1, gamma by an add, duplex from
    the ring of two against the naive schedule.

    Only those two ranks call it. The bytes move as an allreduce moves them: through the
    executor (`manualdp.spmd.transport.p2p.run_schedule`), in its segments, receives posted ahead where
    it posts them. A single 4 MiB `isend` answered by an `irecv` posted only then measured 2 to
    3 times the time per byte that the executor takes (2 ranks on one 2-core host), and the
    predictions for large buffers came out that much too slow. Medians, after `WARMUP`
    untimed runs of each: the first transfers of a fresh process are the slowest.
    """
    state = group_state(group)
    rank = state.rank
    if rank not in (0, 1):
        raise ValueError(f"calibrate runs on the group's ranks 0 and 1, not on rank {rank}")
    device = _device(group)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    large = torch.zeros(LARGE_BYTES // 4, dtype=torch.float32, device=device)
    alpha, = map(statistics.median, _timed([(small, _PING_PONG)], SMALL_REPEATS, state, timeout))
    add_times = []
    for _ in range(LARGE_REPEATS + WARMUP):
        start = time.perf_counter()
        large.add_(large)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        add_times.append(time.perf_counter() - start)
    gamma = statistics.median(add_times[WARMUP:]) / LARGE_BYTES
    # The duplex is what the ring costs at two ranks, both ranks sending, receiving and adding at once:
    # the ring of two and the naive schedule (which never sends and receives at once) are timed in turns,
    # so that the machine's noise hits both, and each pair gives the duplex at which the model's ring
    # takes that many times naive's time. (A bare exchange against a one-way transfer read 0.6 where the
    # ring then measured 1.2x slower than naive.) On a busy host the readings scatter: batches go on
    # until the duplex is known to SPREAD_GOAL (or MAX_READINGS), rank 0 deciding for both.
    one_way, naive, ring = [], [], []
    while True:
        batch = _timed([(large, _PING_PONG), (large, _NAIVE), (large, _RING)], LARGE_REPEATS, state, timeout,
                       warmup=0 if one_way else WARMUP)
        one_way, naive, ring = one_way + batch[0], naive + batch[1], ring + batch[2]
        link = Link(alpha, max(statistics.median(one_way) - alpha, 0.0) / LARGE_BYTES, gamma)
        duplex, spread = duplex_of([fit_duplex(link, LARGE_BYTES, r / n) for n, r in zip(naive, ring) if n > 0])
        if not _tell_rank_one(measure_on(spread, len(one_way)), device, state, timeout):
            break
    return replace(link, duplex=duplex, duplex_spread=spread)


def fit_duplex(link: Link, nbytes: int, ratio: float, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> float:
    """The duplex at which the model gives the ring of two `ratio` times the naive schedule's time on `nbytes`.

    Naive's time does not depend on it (no rank sends and receives at once), ring's grows with
    it: 0 for a ratio below ring's best, `MAX_DUPLEX` above its worst, else by bisection.
    """
    low, high = 0.0, MAX_DUPLEX
    naive = predict("naive", 2, nbytes, link, 4, segment_bytes)
    if naive <= 0:
        return 0.0
    for _ in range(30):
        middle = (low + high) / 2
        if predict("ring", 2, nbytes, replace(link, duplex=middle), 4, segment_bytes) < ratio * naive:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def duplex_of(readings: list[float]) -> tuple[float, float]:
    """The duplex and its spread from readings of it: their median, and how far that median may be off.

    Readings are taken within 0 and `MAX_DUPLEX`. On a quiet host they agree and the spread is
    near 0; on a busy one they scatter, and the spread narrows as readings are added.
    """
    readings = sorted(min(max(r, 0.0), MAX_DUPLEX) for r in readings)
    if len(readings) < 2:
        return (readings or [0.0])[0], MAX_DUPLEX  # no idea how far off one reading is
    low, _, high = statistics.quantiles(readings, n=4)
    # The median of n readings scattered like a normal's with interquartile range `high - low`
    # has a standard error of about 0.93 (high - low) / sqrt(n): two of them, rounded.
    return statistics.median(readings), min(2 * (high - low) / math.sqrt(len(readings)), MAX_DUPLEX)


def measure_on(spread: float, readings: int) -> bool:
    """Whether the calibration takes another batch of duplex readings: the duplex is still uncertain."""
    return spread > SPREAD_GOAL and readings < MAX_READINGS


_TELL = (1, ((Transfer(0, 1, 0, False),),))  # rank 0 tells rank 1 one number


def _tell_rank_one(decision: bool, device, state: GroupState, timeout: float | None) -> bool:
    """Rank 0's `decision`, on ranks 0 and 1 (the calibration's)."""
    flag = torch.tensor([float(decision)], device=device)
    run_schedule(flag, Schedule("calibration", len(state.peers), *_TELL, ("",)), state, DEFAULT_SEGMENT_BYTES, timeout)
    return bool(flag.item())


# Two-rank schedules for the calibration, as (chunks, rounds): there and back, and the naive and ring
# allreduces of two ranks. The group's other ranks take no part.
_PING_PONG = (1, ((Transfer(0, 1, 0, False),), (Transfer(1, 0, 0, False),)))
_NAIVE = (1, get_schedule("naive", 2).rounds)  # 1 sends to 0, which adds, and back
_RING = (2, get_schedule("ring", 2).rounds)    # each sends one half and adds the other's, then sends back its sum


def _timed(jobs: list[tuple[torch.Tensor, tuple]], repeats: int, state: GroupState, timeout: float | None,
           warmup: int = WARMUP) -> list[list[float]]:
    """Per (buffer, schedule shape) of `jobs`, run in turns: the seconds of one round of it, per repeat.

    Ranks 0 and 1 of the group run each shape with the executor; both shapes have two rounds.
    """
    schedules = [Schedule("calibration", len(state.peers), chunks, rounds, ("",) * len(rounds))
                 for _, (chunks, rounds) in jobs]
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(repeats + warmup):
        for (buf, _), schedule, out in zip(jobs, schedules, times):
            start = time.perf_counter()
            run_schedule(buf, schedule, state, DEFAULT_SEGMENT_BYTES, timeout)
            if buf.device.type == "cuda":
                torch.cuda.synchronize(buf.device)
            out.append((time.perf_counter() - start) / len(schedule.rounds))
    return [t[warmup:] for t in times]


# ---------------------------------------------------------------- drift: measured times against the predictions

DRIFT_CALLS = 16     # per size: the first calls after the constants are agreed, then the latest, compared
DRIFT_FACTOR = 2.0   # measured/predicted moving this many times (either way) means the link has changed
MAX_SIZES = 64       # sizes followed per group; others are not

def note(state: GroupState, algorithm: str, nbytes: int, element_size: int, segment_bytes: int,
         seconds: float) -> None:
    """Record one "auto" allreduce on the group of `state` that took `seconds`
    (this rank's clock, after the call check)."""
    link, source = state.link or (None, "given")
    if source == "given":
        return
    predicted = _predicted(algorithm, len(state.peers), nbytes, link, element_size, segment_bytes)
    sizes = state.times
    if predicted <= 0 or (nbytes not in sizes and len(sizes) >= MAX_SIZES):
        return
    first, latest = sizes.setdefault(nbytes, ([], collections.deque(maxlen=DRIFT_CALLS)))
    (first if len(first) < DRIFT_CALLS else latest).append(seconds / predicted)  # judged at the next look only


@functools.lru_cache(maxsize=1024)
def _predicted(*args) -> float:
    return predict(*args)


DRIFT_EVERY = 64  # "auto" looks at its drift on one checked call in this many (the same call on every rank)
DRIFT_LOOKS = 2   # looks in a row that must each have seen a drift before the ranks measure again


def drift_flag(state: GroupState) -> bool:
    """At a look (one call in `DRIFT_EVERY`): whether this rank asks to measure again.

    Only when its latest times have moved (`moved`) at this look and at the `DRIFT_LOOKS - 1`
    looks before it: a host busy for a moment moves one window of times, not several in a row.
    And only against a first window that a later one confirmed (`_confirm`): a first window taken
    while the host was busy for a moment would make every later look see a drift.
    `note` only records the times (judging them at every call cost each call a sort).
    """
    _confirm(state)
    state.drift_looks = state.drift_looks + 1 if _has_drifted(state) else 0
    state.drifted = False
    return state.drift_looks >= DRIFT_LOOKS


def _confirm(state: GroupState) -> None:
    """At a look: each size's first window that the latest agrees with is confirmed; one it does not is replaced by
    the latest, itself to be confirmed at a later look (a busy moment lasts one window, not two apart)."""
    for nbytes, (first, latest) in state.times.items():
        if nbytes in state.confirmed or len(first) < DRIFT_CALLS or len(latest) < DRIFT_CALLS:
            continue
        if moved(first, latest):
            first[:] = latest
            latest.clear()
        else:
            state.confirmed.add(nbytes)


def _has_drifted(state: GroupState) -> bool:
    """Whether the latest times of any size moved from its confirmed first (`moved`), or a drift was reported
    (`GroupState.drifted`)."""
    return state.drifted or any(moved(first, latest) for nbytes, (first, latest) in state.times.items()
                                if nbytes in state.confirmed)


def drifted(group=None) -> bool:
    """Whether this rank's "auto" allreduces say that the agreed constants no longer hold (`moved`).

    Never for constants that `MANUALDP_LINK` gives. Only this rank's view: `allreduce` sends
    it with its call check, and all ranks measure again together when any one says so.
    """
    return _has_drifted(group_state(group))


def moved(first: list[float], latest, factor: float | None = None) -> bool:
    """Whether ratios of measured to predicted time say the link has changed.

    `first`: the ratios of the first `DRIFT_CALLS` calls of one size after the constants were
    agreed; `latest`: the last `DRIFT_CALLS` since. The model is off by its own amount at each
    size (a small call's Python costs more than its messages), so what counts is a change in
    what the link can do: the second fastest calls of the two `factor` (default `DRIFT_FACTOR`)
    times apart, either way. Calls that wait for a late peer, or for a core (a busy 2-core host
    stalls one small call in three or so for ten times its usual time, and a window of them
    may hold a dozen), move neither; medians did, when the share of stalled calls crossed a
    half, and the ranks measured again every few dozen calls, for a second each.
    """
    factor = DRIFT_FACTOR if factor is None else factor
    if len(first) < DRIFT_CALLS or len(latest) < DRIFT_CALLS:
        return False
    before, now = _second_fastest(first), _second_fastest(latest)
    if not (0 < before < math.inf and 0 <= now < math.inf):  # no time to compare (NaN fails both)
        return False
    return not 1 / factor <= now / before <= factor


def _second_fastest(ratios) -> float:
    ordered = sorted(ratios)
    return ordered[min(1, len(ordered) - 1)]  # not the fastest: one reading off the clock should not decide
