"""Collectives as data: allreduce (naive, ring, halving_doubling, tree), reduce-scatter, all-gather, reduce, broadcast.

A schedule is a list of rounds; a round is a list of transfers `(src, dst, chunk, reduce)`:
device `src` sends chunk `chunk` of its flat buffer to `dst`, which adds it (`reduce=True`)
or overwrites its own copy with it. Transfers in one round happen at the same time, so a
device never sends a chunk that it receives in the same round (`check_schedule`).

The types are in `manualdp.transfers`; halving/doubling, the longest schedule, has its own
file. From a schedule alone we count bytes per device and estimate time with the
alpha-beta-gamma model; the executors (`manualdp.allreduce`, `manualdp.spmd.p2p`) only run it.
"""
from __future__ import annotations

import functools

from .halving_doubling import halving_doubling
from .transfers import Schedule, Transfer, then
from .validate import int_between, non_negative_int, non_negative_number, one_of, positive_int

__all__ = [
    "Transfer", "Schedule", "naive", "ring", "halving_doubling", "tree", "get_schedule", "ALGORITHMS",
    "ring_reduce_scatter", "ring_all_gather", "tree_reduce", "tree_broadcast", "owned_chunk", "then",
    "COLLECTIVES", "get_collective",
    "chunk_sizes", "chunk_bounds", "check_schedule", "traffic", "cost",
]


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


# ---------------------------------------------------------------- the building blocks

def ring_reduce_scatter(n: int) -> Schedule:
    """Ring reduce-scatter: n chunks, n-1 rounds; afterwards device i holds the sum of chunk `owned_chunk(i, n)`.

    Every device sends and receives (n-1)/n * S bytes (nccl-tests' busbw factor (n-1)/n).
    """
    _check_n(n)
    # In step s device i adds chunk (i-s) into its right neighbour; after n-1 steps
    # device i holds the full sum of chunk (i+1) % n.
    rounds = [tuple(Transfer(i, (i + 1) % n, (i - s) % n, True) for i in range(n)) for s in range(n - 1)]
    return Schedule("ring", n, n, tuple(rounds), ("reduce-scatter",) * (n - 1))


def ring_all_gather(n: int) -> Schedule:
    """Ring all-gather: device i starts with chunk `owned_chunk(i, n)`; n-1 rounds pass every chunk around.

    Every device sends and receives (n-1)/n * S bytes.
    """
    _check_n(n)
    rounds = [tuple(Transfer(i, (i + 1) % n, (i + 1 - s) % n, False) for i in range(n)) for s in range(n - 1)]
    return Schedule("ring", n, n, tuple(rounds), ("all-gather",) * (n - 1))


def owned_chunk(device: int, n: int) -> int:
    """The chunk that `device` holds summed after `ring_reduce_scatter(n)` (and brings to `ring_all_gather(n)`)."""
    return (device + 1) % n


def tree_reduce(n: int, root: int = 0) -> Schedule:
    """Binomial tree: in round k every device at distance 2**k (relative to `root`) adds its whole buffer
    into its parent; ceil(log2 n) rounds. Each device but the root sends S once; a parent receives S per child.
    """
    _check_n(n)
    int_between("root", root, 0, n - 1)
    rounds, d = [], 1
    while d < n:
        rounds.append(tuple(Transfer((v + root) % n, (v - d + root) % n, 0, True) for v in range(d, n, 2 * d)))
        d *= 2
    return Schedule("tree", n, 1, tuple(rounds), ("reduce",) * len(rounds))


def tree_broadcast(n: int, root: int = 0) -> Schedule:
    """Binomial tree, the reduce backwards: the devices that hold the buffer double every round; ceil(log2 n) rounds.

    Each device but the root receives S once; the root sends S in every round.
    """
    _check_n(n)
    int_between("root", root, 0, n - 1)
    rounds, d = [], (1 << (n - 1).bit_length()) // 2  # the largest power of two below n
    while d >= 1:
        rounds.append(tuple(Transfer((v + root) % n, (v + d + root) % n, 0, False) for v in range(0, n - d, 2 * d)))
        d //= 2
    return Schedule("tree", n, 1, tuple(rounds), ("broadcast",) * len(rounds))


# ---------------------------------------------------------------- allreduce = two building blocks

def ring(n: int) -> Schedule:
    """Ring allreduce = ring reduce-scatter + ring all-gather: 2(n-1) rounds.

    Every device sends and receives 2(n-1)/n * S bytes (up to chunk rounding).
    """
    return then("ring", ring_reduce_scatter(n), ring_all_gather(n))


def tree(n: int) -> Schedule:
    """Binomial-tree allreduce = tree reduce to device 0 + tree broadcast from it: 2*ceil(log2 n) rounds.

    Every device but 0 sends S up and receives S down; a device with c children also
    receives and sends c*S. Latency grows as log n, but every round moves the whole buffer.
    """
    return then("tree", tree_reduce(n), tree_broadcast(n))


ALGORITHMS = {"naive": naive, "ring": ring, "halving_doubling": halving_doubling, "tree": tree}

# Every collective by name, and its algorithms. Reduce and broadcast take a `root`.
COLLECTIVES = {
    "allreduce": ALGORITHMS,
    "reduce_scatter": {"ring": ring_reduce_scatter},
    "all_gather": {"ring": ring_all_gather},
    "reduce": {"tree": tree_reduce},
    "broadcast": {"tree": tree_broadcast},
}
ROOTED = ("reduce", "broadcast")


def get_schedule(algorithm: str, n: int) -> Schedule:
    """The allreduce schedule of `algorithm` (one of `ALGORITHMS`) for `n` devices."""
    return get_collective("allreduce", algorithm, n)


def get_collective(collective: str, algorithm: str, n: int, root: int = 0) -> Schedule:
    """The schedule of `collective` (one of `COLLECTIVES`) by `algorithm` for `n` devices."""
    one_of("collective", collective, COLLECTIVES)
    one_of("algorithm", algorithm, COLLECTIVES[collective])
    _check_n(n)
    int_between("root", root, 0, n - 1)
    return _cached(collective, algorithm, n, root if collective in ROOTED else 0)


@functools.lru_cache(maxsize=512)
def _cached(collective: str, algorithm: str, n: int, root: int) -> Schedule:
    build = COLLECTIVES[collective][algorithm]
    return build(n, root) if collective in ROOTED else build(n)


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
