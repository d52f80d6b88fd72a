"""`algorithm="auto"`: pick the schedule with the lowest predicted time, as NCCL's tuner does.

The prediction is `manualdp.cost.cost`, the alpha-beta-gamma model, with constants fitted
to this transport by a short calibration between two ranks, sending as the executor sends
(`calibrate`): a few ping-pongs of one element give alpha (the time of a message), one large
transfer gives beta (the time per byte), and a local addition gives gamma (the time per byte
added). `duplex` says what sending and receiving at once costs: 0 if a link carries both
directions at full speed, 1 if they take turns, more if they also get in each other's way. It
is read from the ring of two ranks (two rounds of exchange) timed against the naive schedule
(one-way rounds) on a large buffer. Two processes on one 2-core machine measured the ring
slower than naive at most sizes, while a bare exchange read 0.5 to 1.3, and any reading below 1
made ring the pick from 1 MiB up, up to 1.66x slower. The readings scatter on a busy machine,
so the duplex comes with its spread (how far their median may be off): the calibration reads on
while it is wide, and `choose` takes the algorithm that loses least to the fastest anywhere
within it. `parallel` is
not measured but counted (`host_parallel`): with more ranks on a host than it has cores (4
processes on 2 cores), the busy ranks of a round share the cores (`manualdp.cost.shared_cores`),
which favours schedules that spread a round's work (tree) over one rank doing most of it
(naive's root). Every rank must choose
alike, so rank 0 decides the constants (from `MANUALDP_LINK`, its cache or a calibration)
and broadcasts them; each rank then computes the same argmin from the same numbers.

Constants go stale: a cache older than `MAX_CACHE_AGE` is measured again, and so is a link
whose measured allreduce times drift from the predictions (`note`, `drifted`, `recalibrate`:
the drift rides in allreduce's call check, so that all ranks measure again together).
"""
from __future__ import annotations

import collections
import functools
import json
import math
import os
import socket
import stat
import statistics
import time
import warnings
from dataclasses import asdict, astuple, dataclass, fields, replace

import torch
import torch.distributed as dist

from ..cost import MAX_DUPLEX, loads_cost
from ..loads import allreduce_loads
from ..schedule import ALGORITHMS, Schedule, Transfer, get_schedule
from ..support.files import write_json_atomic
from ..validate import fraction, is_int, non_negative_int, non_negative_number, positive_int
from .p2p import DEFAULT_SEGMENT_BYTES, run_schedule  # the model pipelines additions with its segments
from .peers import group_ranks, talking_to, wait

__all__ = ["Link", "ENGINE_ALGORITHMS", "predict", "choose", "calibrate", "link_for", "cache_path", "known_link",
           "resolve", "host_parallel", "DEFAULT_SEGMENT_BYTES", "CALIBRATION", "duplex_of", "fit_duplex", "recalibrate",
           "note",
           "drifted", "moved"]

ENGINE_ALGORITHMS = (*ALGORITHMS, "auto")  # what the SPMD engine accepts; the book keeps its explicit names
ENV = "MANUALDP_LINK"  # "alpha,beta,gamma[,duplex[,parallel]]" in s, s/byte, s/byte, 0..1, ranks: skips the calibration


@dataclass(frozen=True)
class Link:
    """The alpha-beta-gamma constants of one transport."""

    alpha: float  # seconds per message (latency, including the posting of it)
    beta: float   # seconds per byte sent or received
    gamma: float  # seconds per byte added
    duplex: float = 0.0  # what sending and receiving at once costs on top of the larger: 0 (free), 1 (in turn), to 2
    parallel: int = 0  # ranks that can work at once, 0 for all; counted from the host (`host_parallel`), not cached
    duplex_spread: float = 0.0  # how far the duplex may lie from `duplex`: about two standard errors of it

    def duplexes(self) -> tuple[float, ...]:
        """The duplex at the low end, the middle and the high end of its measured range (one value if exact)."""
        return tuple(sorted({max(0.0, self.duplex - self.duplex_spread), self.duplex,
                             min(MAX_DUPLEX, self.duplex + self.duplex_spread)}))

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if non_negative_number(name, getattr(self, name)) > MAX_SECONDS:
                raise ValueError(f"{name} must be at most {MAX_SECONDS} s (per message or byte), got {getattr(self, name)!r}")
        fraction("duplex", self.duplex, MAX_DUPLEX)
        fraction("duplex_spread", self.duplex_spread, MAX_DUPLEX)
        if non_negative_int("parallel", self.parallel) > MAX_PARALLEL:
            raise ValueError(f"parallel must be at most {MAX_PARALLEL} ranks, got {self.parallel!r}")


# A second per message or per byte is no link (a typo or a corrupt cache), and larger constants overflow
# the predictions to inf. Ranks receive `parallel` as a float64, exact up to 2**53.
MAX_SECONDS = 1.0
MAX_PARALLEL = 1 << 53
MEASURED = ("alpha", "beta", "gamma", "duplex", "duplex_spread")  # what a calibration measures and the cache keeps
CALIBRATION = 4  # the cache's "calibration": bumped when the measurement changes, so older caches are measured again
MAX_CACHE_AGE = 24 * 3600.0  # seconds: a host's load changes, and with it the link; older constants are measured again
MAX_CACHE_BYTES = 4096  # a cache is a few numbers; a larger file is not one (and /dev/zero never ends)


def host_parallel(backend: str, world_size: int) -> int:
    """How many of `world_size` ranks can work at once: 0 (all) unless a host has fewer cores than ranks.

    On GPUs (NCCL) every rank has its own device: 0. On CPUs, each host runs
    `LOCAL_WORLD_SIZE` ranks (torchrun sets it; otherwise all ranks are on this host) on this
    host's cores, one core per rank at most.
    """
    positive_int("world_size", world_size)
    if backend == "nccl":
        return 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local <= 0 or cores >= local:
        return 0
    return max(1, world_size // local) * cores


def predict(algorithm: str, world_size: int, nbytes: int, link: Link, element_size: int = 4,
            segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> float:
    """Predicted seconds for an allreduce of `nbytes` per rank with `algorithm`, cut into `segment_bytes`.

    `manualdp.cost.cost` of the schedule, from its loads written down without building it
    (`allreduce_loads`), so that 100,000 ranks take no longer than 8.
    """
    non_negative_int("nbytes", nbytes)
    positive_int("element_size", element_size)
    nbytes -= nbytes % element_size
    return loads_cost(allreduce_loads(algorithm, world_size, nbytes, element_size), link.alpha, link.beta, link.gamma,
                      link.duplex, link.parallel, segment_bytes)


@functools.lru_cache(maxsize=1024)  # a training run asks for the same few bucket sizes again and again
def choose(world_size: int, nbytes: int, link: Link, element_size: int = 4,
           segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> str:
    """The algorithm that loses least to the fastest wherever in its measured range the duplex lies.

    With an exact link (`duplex_spread` 0) that is the lowest prediction. A calibration on a
    busy host reads the duplex with noise, and at two ranks it alone decides between naive
    and ring: an algorithm whose lead holds only at one end of the range is not picked when
    another is never far behind at either end. Ties go to the first in `ALGORITHMS`' order.
    """
    positive_int("world_size", world_size)
    non_negative_int("nbytes", nbytes)
    times = [{a: predict(a, world_size, nbytes, replace(link, duplex=d), element_size, segment_bytes)
              for a in ALGORITHMS} for d in link.duplexes()]
    return min(ALGORITHMS, key=lambda a: max(_behind(t[a], min(t.values())) for t in times))


def _behind(time: float, fastest: float) -> float:
    """How many times the fastest's time `time` is (1 for the fastest, also when both are 0)."""
    return time / fastest if fastest > 0 else 1.0 if time == 0 else math.inf


def resolve(algorithm: str, numel: int, element_size: int, group=None, timeout: float | None = None,
            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> str:
    """`algorithm` itself, or for "auto" the choice for a buffer of `numel` elements in `group`."""
    if algorithm != "auto":
        return algorithm
    rank, peers = group_ranks(group)
    return choose(len(peers), numel * element_size, link_for(group, timeout), element_size, segment_bytes)


# ---------------------------------------------------------------- the agreed constants of a group

_LINKS: dict = {}  # process group -> (its agreed Link, where from: "given" by MANUALDP_LINK, "cached" or "measured")


def link_for(group=None, timeout: float | None = None) -> Link:
    """The constants every rank of `group` agrees on; collective the first time for a group."""
    key = group if group is not None else dist.group.WORLD
    if key not in _LINKS:
        _LINKS[key] = _agree(group, timeout)
    return _LINKS[key][0]


def recalibrate(group=None, timeout: float | None = None) -> Link:
    """Measure the link of `group` again (collective): every rank must call it, as after `drifted`.

    Constants given by `MANUALDP_LINK` are kept. Rank 0 caches the new ones.
    """
    key = group if group is not None else dist.group.WORLD
    _LINKS[key] = _agree(group, timeout, again=True)
    _TIMES.pop(key, None)
    _DRIFTED.discard(key)
    return _LINKS[key][0]


def cache_path(backend: str, world_size: int, host: str | None = None) -> str:
    """Where rank 0 keeps the constants it measured for (backend, world size, host)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    host = host or socket.gethostname()
    return os.path.join(root, "manualdp", f"link-{backend}-{world_size}-{host}.json")


def _agree(group, timeout: float | None, again: bool = False) -> tuple[Link, str]:
    """Rank 0's constants on every rank: its override or cache, else (or `again`) a calibration with rank 1.

    Returns them and where from: "given" (by `MANUALDP_LINK`), "cached" or "measured".
    """
    rank, peers = group_ranks(group)
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
    _broadcast(message, peers, rank, group, timeout)
    if message[0] < 0:
        raise refused or ValueError(f"rank {peers[0]} refused its {ENV} (its error names it); nothing was measured")
    source = ("measured", "cached", "given")[round(message[0].item())]
    if source == "measured":
        measured = calibrate(group, timeout) if rank in (0, 1) else None
        if rank == 0:
            _save(group, len(peers), measured)
            measured = replace(measured, parallel=host_parallel(dist.get_backend(group), len(peers)))
            message = torch.tensor([1.0, *astuple(measured)], dtype=torch.float64, device=device)
        _broadcast(message, peers, rank, group, timeout)
    values = dict(zip((f.name for f in fields(Link)), message[1:].tolist()))
    return Link(**{k: int(v) if k == "parallel" else float(v) for k, v in values.items()}), source


def known_link(backend: str, world_size: int) -> tuple[Link | None, str]:
    """The constants known without measuring, and where from: `MANUALDP_LINK`, else this host's cache.

    (None, cache path) when neither has them; a cache written by another version of manualdp,
    whose model had other constants or whose calibration measured otherwise, counts as none, and
    so does one measured more than `MAX_CACHE_AGE` seconds ago (or, by the clock, later than now). A
    cache that cannot be read as one (not a regular file, too large, not its JSON, constants out
    of range) counts as none too, with a one-line warning that names it. A bad `MANUALDP_LINK` is
    a `ValueError`. `parallel` comes from the variable when it gives one (else 0), from the host
    (`host_parallel`) with the cache.
    """
    if os.environ.get(ENV):
        return _parse_env(os.environ[ENV]), f"${ENV}"
    path = cache_path(backend, world_size)
    try:
        saved = _read_json(path)
    except FileNotFoundError:
        return None, path
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: deeply nested lists
        return _ignored(path, e)
    if not isinstance(saved, dict):
        return _ignored(path, f"a JSON {type(saved).__name__}, not an object")
    version = saved.pop("calibration", None)
    if version is None or (is_int(version) and version != CALIBRATION):
        return None, path  # another version's: measured again, silently
    if version != CALIBRATION or sorted(saved) != sorted((*MEASURED, "measured_at")):
        return _ignored(path, f"keys {sorted(saved)[:8]}, calibration {version!r:.20}; "
                              f"expected {sorted((*MEASURED, 'measured_at'))}")
    try:
        age = time.time() - non_negative_number("measured_at", saved.pop("measured_at"))
        link = Link(**saved, parallel=host_parallel(backend, world_size))
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an int no float holds
        return _ignored(path, e)
    return (link, path) if -60.0 <= age <= MAX_CACHE_AGE else (None, path)  # old: measured again, silently


def _parse_env(value: str) -> Link:
    try:
        values = value.split(",")
        if not 3 <= len(values) <= 5:
            raise ValueError(f"{len(values)} values, not 3 to 5")
        parallel = int(values.pop()) if len(values) == 5 else 0
        return Link(*(float(v) for v in values), parallel=parallel)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ENV} must be 'alpha,beta,gamma[,duplex[,parallel]]' (numbers from 0 to {MAX_SECONDS} s, "
                         f"duplex from 0 to {MAX_DUPLEX:g}, parallel a whole number of ranks), got {_short(value)} "
                         f"({_short(e)})") from e


def _short(x, limit: int = 100) -> str:
    """`x` on one line, cut to about `limit` characters: a value can be a million digits long."""
    text = repr(x) if isinstance(x, str) else " ".join(str(x).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _read_json(path: str):
    """The JSON in the regular file `path` of at most MAX_CACHE_BYTES; never reads a FIFO (it would block) or a device."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO without a writer: opens at once
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_CACHE_BYTES + 1)
    if len(data) > MAX_CACHE_BYTES:
        raise ValueError(f"larger than {MAX_CACHE_BYTES} bytes")
    return json.loads(data)


def _ignored(path: str, reason) -> tuple[None, str]:
    warnings.warn(f"ignoring the tuner's cache {path}: {_short(reason, 200)}; the link is measured again", stacklevel=3)
    return None, path


def _save(group, world_size: int, link: Link) -> None:
    path = cache_path(dist.get_backend(group), world_size)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path) and not os.path.isfile(path):  # a FIFO would block the write, a device swallow it
            os.remove(path)
        write_json_atomic(path, {**{k: v for k, v in asdict(link).items() if k in MEASURED}, "measured_at": time.time(),
                                 "calibration": CALIBRATION})
    except OSError:  # a read-only home costs a calibration per run, nothing more
        pass


def _broadcast(t: torch.Tensor, peers: list[int], rank: int, group, timeout: float | None) -> None:
    peer = peers[0] if rank != 0 else None
    with talking_to(peer, timeout):
        work = dist.broadcast(t, src=peers[0], group=group, async_op=True)
    wait(work, peer, timeout)


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


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
    executor (`manualdp.spmd.p2p.run_schedule`), in its segments, receives posted ahead where
    it posts them. A single 4 MiB `isend` answered by an `irecv` posted only then measured 2 to
    3 times the time per byte that the executor takes (2 ranks on one 2-core host), and the
    predictions for large buffers came out that much too slow. Medians, after `WARMUP`
    untimed runs of each: the first transfers of a fresh process are the slowest.
    """
    rank, peers = group_ranks(group)
    if rank not in (0, 1):
        raise ValueError(f"calibrate runs on the group's ranks 0 and 1, not on rank {rank}")
    device = _device(group)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    large = torch.zeros(LARGE_BYTES // 4, dtype=torch.float32, device=device)
    alpha, = map(statistics.median, _timed([(small, _PING_PONG)], SMALL_REPEATS, group, peers, timeout))
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
        batch = _timed([(large, _PING_PONG), (large, _NAIVE), (large, _RING)], LARGE_REPEATS, group, peers,
                       timeout, warmup=0 if one_way else WARMUP)
        one_way, naive, ring = one_way + batch[0], naive + batch[1], ring + batch[2]
        link = Link(alpha, max(statistics.median(one_way) - alpha, 0.0) / LARGE_BYTES, gamma)
        duplex, spread = duplex_of([fit_duplex(link, LARGE_BYTES, r / n) for n, r in zip(naive, ring) if n > 0])
        if not _tell_rank_one(measure_on(spread, len(one_way)), rank, device, group, peers, timeout):
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


def _tell_rank_one(decision: bool, rank: int, device, group, peers: list[int], timeout: float | None) -> bool:
    """Rank 0's `decision`, on ranks 0 and 1 (the calibration's)."""
    flag = torch.tensor([float(decision)], device=device)
    schedule = Schedule("calibration", len(peers), *_TELL, ("",))
    run_schedule(flag, schedule, group, rank, peers, DEFAULT_SEGMENT_BYTES, dist.get_backend(group) == "gloo", timeout)
    return bool(flag.item())


# Two-rank schedules for the calibration, as (chunks, rounds): there and back, and the naive and ring
# allreduces of two ranks. The group's other ranks take no part.
_PING_PONG = (1, ((Transfer(0, 1, 0, False),), (Transfer(1, 0, 0, False),)))
_NAIVE = (1, get_schedule("naive", 2).rounds)  # 1 sends to 0, which adds, and back
_RING = (2, get_schedule("ring", 2).rounds)    # each sends one half and adds the other's, then sends back its sum


def _timed(jobs: list[tuple[torch.Tensor, tuple]], repeats: int, group, peers: list[int],
           timeout: float | None, warmup: int = WARMUP) -> list[list[float]]:
    """Per (buffer, schedule shape) of `jobs`, run in turns: the seconds of one round of it, per repeat.

    Ranks 0 and 1 of the group run each shape with the executor; both shapes have two rounds.
    """

    rank = peers.index(dist.get_rank())
    early = dist.get_backend(group) == "gloo"
    schedules = [Schedule("calibration", len(peers), chunks, rounds, ("",) * len(rounds)) for _, (chunks, rounds) in jobs]
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(repeats + warmup):
        for (buf, _), schedule, out in zip(jobs, schedules, times):
            start = time.perf_counter()
            run_schedule(buf, schedule, group, rank, peers, DEFAULT_SEGMENT_BYTES, early, timeout)
            if buf.device.type == "cuda":
                torch.cuda.synchronize(buf.device)
            out.append((time.perf_counter() - start) / len(schedule.rounds))
    return [t[warmup:] for t in times]


# ---------------------------------------------------------------- drift: measured times against the predictions

DRIFT_CALLS = 16     # per size: the first calls after the constants are agreed, then the latest, compared
DRIFT_FACTOR = 2.0   # measured/predicted moving this many times (either way) means the link has changed
MAX_SIZES = 64       # sizes followed per group; others are not

_TIMES: dict = {}  # process group -> {bytes: (first ratios, latest ratios)} of measured to predicted time
_DRIFTED: set = set()  # process groups whose times have moved (`moved`) since their constants were agreed


def note(group, algorithm: str, nbytes: int, element_size: int, segment_bytes: int, seconds: float) -> None:
    """Record one "auto" allreduce of `group` that took `seconds` (this rank's clock, after the call check)."""
    key = group if group is not None else dist.group.WORLD
    link, source = _LINKS.get(key, (None, "given"))
    if source == "given":
        return
    predicted = _predicted(algorithm, dist.get_world_size(group), nbytes, link, element_size, segment_bytes)
    sizes = _TIMES.setdefault(key, {})
    if predicted <= 0 or (nbytes not in sizes and len(sizes) >= MAX_SIZES):
        return
    first, latest = sizes.setdefault(nbytes, ([], collections.deque(maxlen=DRIFT_CALLS)))
    (first if len(first) < DRIFT_CALLS else latest).append(seconds / predicted)
    if moved(first, latest):
        _DRIFTED.add(key)


@functools.lru_cache(maxsize=1024)
def _predicted(*args) -> float:
    return predict(*args)


def drifted(group=None) -> bool:
    """Whether this rank's "auto" allreduces say that the agreed constants no longer hold (`moved`).

    Never for constants that `MANUALDP_LINK` gives. Only this rank's view: `allreduce` sends
    it with its call check, and all ranks measure again together when any one says so.
    """
    return (group if group is not None else dist.group.WORLD) in _DRIFTED


def moved(first: list[float], latest, factor: float = DRIFT_FACTOR) -> bool:
    """Whether ratios of measured to predicted time say the link has changed.

    `first`: the ratios of the first `DRIFT_CALLS` calls of one size after the constants were
    agreed; `latest`: the last `DRIFT_CALLS` since. The model is off by its own amount at each
    size (a small call's Python costs more than its messages), so what counts is a change: the
    medians of the two `factor` times apart, either way. Medians: a call now and then that waits
    for a late peer moves neither.
    """
    if len(first) < DRIFT_CALLS or len(latest) < DRIFT_CALLS:
        return False
    return not 1 / factor <= statistics.median(latest) / statistics.median(first) <= factor
