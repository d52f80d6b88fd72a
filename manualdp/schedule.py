"""Collectives as data: allreduce (naive, ring, halving_doubling, tree, recursive_doubling), reduce-scatter, all-gather,
reduce, broadcast.

A schedule is a list of rounds; a round is a list of transfers `(src, dst, chunk, reduce)`:
device `src` sends chunk `chunk` of its flat buffer to `dst`, which adds it (`reduce=True`)
or overwrites its own copy with it. Transfers in one round happen at the same time: every
device sends what it held when the round began. So a device never sends a chunk that it
overwrites in the same round; one it adds into may go out (recursive doubling's partners swap
their buffers), as the executors add only once the round's sends have read it (`check_schedule`).

The types are in `manualdp.transfers`; halving/doubling, the longest schedule, has its own
file. From a schedule alone `manualdp.cost` counts bytes per device and estimates time with the
alpha-beta-gamma model; the executors (`manualdp.allreduce`, `manualdp.spmd.transport.p2p`) only run it.
"""
from __future__ import annotations

import functools

from .halving_doubling import halving_doubling
from .transfers import Schedule, Transfer, then
from .validate import int_between, one_of, positive_int

__all__ = [
    "Transfer", "Schedule", "naive", "ring", "halving_doubling", "tree", "recursive_doubling", "get_schedule",
    "ALGORITHMS", "ring_reduce_scatter", "ring_all_gather", "tree_reduce", "tree_broadcast", "owned_chunk", "then",
    "COLLECTIVES", "get_collective",
    "chunk_sizes", "chunk_bounds",
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


def recursive_doubling(n: int) -> Schedule:
    """Recursive doubling: partners at distance 1, 2, 4, ... swap their whole buffers and both add.

    log2(p) rounds with p the largest power of two <= n (two more when n is not one), each of
    one message each way, moving the whole buffer: half the tree's rounds, and no device
    handles more than one message a round, as naive's device 0 handles n-1. MPICH's allreduce
    for short messages (Thakur, Rabenseifner and Gropp, 2005). At two devices it is one round
    where naive and tree need two. Partners add the same two numbers in opposite order, and
    IEEE addition is commutative: they hold the same bits.
    When n is not a power of two, the r = n - p extra devices first add their buffer into
    devices 0..r-1 and get the result back at the end, as in halving_doubling.
    Bytes sent per device: S per round, S log2(p) in all (the ring: 2(n-1)/n S).
    """
    _check_n(n)
    p = 1 << (n.bit_length() - 1)
    r = n - p
    rounds, phases = [], []
    if r:
        rounds.append(tuple(Transfer(p + i, i, 0, True) for i in range(r)))
        phases.append("fold-in")
    d = 1
    while d < p:
        rounds.append(tuple(Transfer(i, i ^ d, 0, True) for i in range(p)))
        phases.append("swap and add")
        d *= 2
    if r:
        rounds.append(tuple(Transfer(i, p + i, 0, False) for i in range(r)))
        phases.append("fold-out")
    return Schedule("recursive_doubling", n, 1, tuple(rounds), tuple(phases))


ALGORITHMS = {"naive": naive, "ring": ring, "halving_doubling": halving_doubling, "tree": tree,
              "recursive_doubling": recursive_doubling}

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
