"""What a schedule costs, computed from the schedule alone: bytes per device, and time.

`traffic` counts what each device sends, receives and adds (`bytes_per_step`: DDP, local SGD, DiLoCo);
`cost` turns that into the alpha-beta-gamma estimate (alpha per message, beta per byte moved,
gamma per byte added) that the tests hold to the textbook formulas and `explain` prints.

A round's time depends only on its loads (what each device sends, receives and adds):
`round_loads` lists them, `loads_cost` prices them. `manualdp.loads` writes down the loads
of the standard allreduces without building their schedules.
"""
from __future__ import annotations

from collections import Counter

from .schedule import Schedule, chunk_sizes, get_collective
from .validate import fraction, non_negative_int, non_negative_number, one_of, positive_int

__all__ = ["check_schedule", "traffic", "round_loads", "merged", "cost", "loads_cost", "shared_cores", "MAX_DUPLEX",
           "traffic_of", "bytes_per_step", "SYNC_METHODS"]
SYNC_METHODS = ("ddp", "local_sgd", "diloco")  # how replicas combine their work (`bytes_per_step`)


def check_schedule(schedule: Schedule) -> None:
    """Raise `ValueError` unless transfers are in range, no device sends a chunk it overwrites in the same round,
    and a chunk that is overwritten in a round is written only once in it.

    A round's transfers happen at once: every device sends what it held when the round began.
    A chunk that a device adds into may also go out in that round (the executors add once the
    round's sends have read it); one it overwrites may not (the executors write it in place as
    it arrives). Messages count rounds from 1, as `manualdp explain` and the pictures do (`round 1`
    is `schedule.rounds[0]`: the pictures' 'start' is the state before any round).
    """
    n, k = schedule.num_devices, schedule.num_chunks
    for r, rnd in enumerate(schedule.rounds, start=1):
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
        if overwritten & read:
            raise ValueError(f"round {r}: a device sends a chunk that it overwrites in the same round: "
                             + ", ".join(f"device {d}'s chunk {c}" for d, c in sorted(overwritten & read)))


def traffic(schedule: Schedule, nbytes: int, element_size: int = 1) -> dict[str, list[int]]:
    """Bytes each device sends, receives and reduces, for a buffer of `nbytes` bytes; chunks are cut in whole
    elements of `element_size` bytes, as the executors cut them."""
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


def round_loads(schedule: Schedule, nbytes: int, element_size: int = 1) -> list[tuple[Counter, int]]:
    """What `cost` needs of a schedule: per round, how many devices carry each load, a load being
    (messages sent, messages received, bytes sent, bytes received, bytes added); idle devices left
    out, and equal rounds in a row given once with how many there are: `[(loads, rounds), ...]`.
    """
    rounds = []
    for rnd in schedule.rounds:
        one = Schedule(schedule.algorithm, schedule.num_devices, schedule.num_chunks, (rnd,), ("",))
        t = traffic(one, nbytes, element_size)
        msgs_in = [0] * schedule.num_devices
        for _src, dst in {(x.src, x.dst) for x in rnd}:
            msgs_in[dst] += 1
        loads = zip(t["messages"], msgs_in, t["sent"], t["received"], t["reduced"])
        rounds.append((Counter(load for load in loads if any(load)), 1))
    return merged(rounds)


def merged(rounds: list[tuple[Counter, int]]) -> list[tuple[Counter, int]]:
    out: list[tuple[Counter, int]] = []
    for loads, repeats in rounds:
        if out and out[-1][0] == loads:
            out[-1] = (loads, out[-1][1] + repeats)
        else:
            out.append((loads, repeats))
    return out


MAX_DUPLEX = 2.0  # sending and receiving at once cost at most three times the larger of the two


def cost(schedule: Schedule, nbytes: int, alpha: float, beta: float, gamma: float, element_size: int = 1,
         duplex: float = 0.0, parallel: int = 0, segment_bytes: int | None = None) -> float:
    """Alpha-beta-gamma time estimate in seconds.

    Each round lasts as long as its busiest device: alpha per message it sends or receives,
    beta per byte it sends or receives, gamma per byte it adds. Sending and receiving at once
    costs the larger of the two plus `duplex` times the smaller: 0 for a full-duplex link
    (the textbook's), 1 where both directions take turns on one resource, up to `MAX_DUPLEX`
    where they also get in each other's way, as two processes on 2 cores that send, receive
    and add at once do (`manualdp.spmd.auto.tune` measures it).

    `parallel`: how many devices can work at once; 0 (the textbook's) for all of them. With
    fewer (4 processes on 2 cores), the busy devices of a round share the cores equally, as
    the operating system shares them (`shared_cores`): a round where every device is busy
    (ring, halving-doubling) lasts all their work over `parallel`, and one device with most
    of the work (naive's root) is slowed while the others share its core, then finishes alone.

    `segment_bytes`: messages cut into segments of this size, a receiver adding one segment
    while the next is in flight (as `manualdp.spmd.transport.p2p` does). Within a round, additions then
    overlap transfers: a device with k segments to receive spends the larger of its transfer
    and addition times plus 1/k of the smaller. None (the textbook's): one after the other.
    """
    return loads_cost(round_loads(schedule, nbytes, element_size), alpha, beta, gamma, duplex, parallel, segment_bytes)


def loads_cost(rounds: list[tuple[Counter, int]], alpha: float, beta: float, gamma: float, duplex: float = 0.0,
               parallel: int = 0, segment_bytes: int | None = None) -> float:
    """`cost` of the rounds that `round_loads` or `allreduce_loads` describe."""
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        non_negative_number(name, v)
    fraction("duplex", duplex, MAX_DUPLEX)
    non_negative_int("parallel", parallel)
    if segment_bytes is not None:
        positive_int("segment_bytes", segment_bytes)

    def busy(m, mi, s, r, red):  # one device's time in one round
        move, add = beta * both(s, r), gamma * red
        k = -(-r // segment_bytes) if segment_bytes and r else 1  # segments received: the pipeline's depth
        return alpha * both(m, mi) + max(move, add) + min(move, add) / k

    both = lambda a, b: max(a, b) + duplex * min(a, b)  # noqa: E731
    total = 0.0
    for loads, repeats in rounds:
        work: Counter = Counter()
        for load, devices in loads.items():
            work[busy(*load)] += devices
        total += repeats * _shared(work, parallel)
    return total


def shared_cores(work: list[float], parallel: int = 0) -> float:
    """How long devices with these amounts of `work` (seconds on a core of their own) take on
    `parallel` cores shared equally among the busy ones; 0 for a core each (the longest work).

    Processor sharing: while m > `parallel` devices are busy, each runs at `parallel`/m of a core;
    as each finishes, the others speed up. Equal work takes sum(work)/`parallel`; a device with
    more than the rest takes longer than its own work, which is what a schedule that makes one
    device do most of a round (naive's root) costs when there are fewer cores than devices.
    """
    non_negative_int("parallel", parallel)
    for i, w in enumerate(work):
        non_negative_number(f"work[{i}]", w)
    return _shared(Counter(work), parallel)


def _shared(work: Counter, parallel: int) -> float:
    """`shared_cores` of `work` given as {seconds: how many devices have that much}."""
    busy = sorted((w, devices) for w, devices in work.items() if w > 0)
    m = sum(devices for _, devices in busy)
    if not busy or parallel == 0 or parallel >= m:
        return busy[-1][0] if busy else 0.0
    elapsed = done = 0.0
    for w, devices in busy:  # m devices are busy until the next ones finish
        elapsed += (w - done) * max(1.0, m / parallel)
        done, m = w, m - devices
    return elapsed


def traffic_of(collectives, num_devices: int, algorithm: str = "ring") -> dict[str, list[int]]:
    """Bytes each device sends and receives in `collectives` (ZeRO-3's `manualdp.units.Collective`s: a kind,
    a number of elements and their size each), from their schedules (`traffic`)."""
    total = {"sent": [0] * num_devices, "received": [0] * num_devices}
    for c in collectives:
        t = traffic(get_collective(c.kind, algorithm, num_devices), c.numel * c.element_size, c.element_size)
        total = {k: [a + b for a, b in zip(v, t[k])] for k, v in total.items()}
    return total


def bytes_per_step(method: str, nbytes: int, num_devices: int, sync_every: int = 1, algorithm: str = "ring",
                   element_size: int = 4) -> list[float]:
    """Bytes each device sends per step of DDP, local SGD or DiLoCo (`method`) for a model of `nbytes`: DDP
    allreduces the gradients every step, local SGD the parameters and DiLoCo their change once every
    `sync_every` (H) steps, so 1/H of DDP's bytes per step (ring: 2(n-1)/n * nbytes / H)."""
    one_of("method", method, SYNC_METHODS)
    if positive_int("sync_every", sync_every) != 1 and method == "ddp":
        raise ValueError(f"sync_every must be 1 for ddp (it allreduces every step), got {sync_every}")
    schedule = get_collective("allreduce", algorithm, positive_int("num_devices", num_devices))
    return [s / sync_every for s in traffic(schedule, nbytes, element_size)["sent"]]
