"""The executor: the schedules of `manualdp.schedule` across processes, one rank's share at a time.

Every rank runs the same schedule and keeps the transfers where it is `src` or `dst`:
1. `plan` merges them into messages and cuts those into segments (a pure function, tested
   without processes);
2. an executor posts them as non-blocking sends and receives of `torch.distributed` and adds
   what arrives: on gloo the process group's own `send`/`recv` (what `dist.isend`/`dist.irecv`
   call, without their per-message checks), on NCCL `dist.batch_isend_irecv`.

The collectives users call (`allreduce` with its "auto" and its call check, reduce-scatter,
all-gather, ...) are in `manualdp.spmd.collectives`, on top of this executor.

Every wait has a deadline (`timeout`, default: the process group's): a peer that dies or
hangs ends in a `manualdp.spmd.peers.PeerError` naming it, never in a hang.
"""
from __future__ import annotations

import datetime
import functools
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..schedule import ALGORITHMS, Schedule, Transfer, chunk_bounds, get_schedule
from ..validate import int_between, non_negative_int, positive_int
from .peers import PeerError, group_ranks, peer_error, talking_to, wait

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "merge_into_messages", "cut_into_segments",
           "may_post_early", "run_allreduce", "run_schedule", "check_same_call", "everyone_hears_everyone",
           "Traffic", "traffic"]

DEFAULT_SEGMENT_BYTES = 1 << 20  # messages are cut into segments of 1 MiB: the receiver adds one while the next arrives


class Message(NamedTuple):
    peer: int     # group rank of the other side
    lo: int       # first element of the slice of the flat buffer
    hi: int       # one past its last element
    send: bool    # True: send flat[lo:hi] to peer; False: receive flat[lo:hi] from peer
    reduce: bool  # for a receive: add into flat[lo:hi] (True) or overwrite it (False)


class Round(NamedTuple):
    sends: tuple[Message, ...]  # segments this rank sends, in posting order
    recvs: tuple[Message, ...]  # segments it receives, in posting order, which is also the order of the additions
    early: bool                 # its receives may be posted while the previous round runs (they cannot clobber it)
    scratch: int                # elements of scratch space its reducing receives land in


@functools.lru_cache(maxsize=256)  # training calls it with the same few bucket sizes every step
def plan(schedule: Schedule, rank: int, numel: int, segment_numel: int) -> tuple[Round, ...]:
    """Rank `rank`'s share of `schedule`: per round, the segments it sends and receives.

    Both sides derive their lists from the same transfers in the same order, so every send
    meets its receive, in order. Empty chunks send nothing, on both sides.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    int_between("rank", rank, 0, schedule.num_devices - 1)
    non_negative_int("numel", numel)
    positive_int("segment_numel", segment_numel)
    bounds = chunk_bounds(numel, schedule.num_chunks)
    rounds: list[Round] = []
    previous: list[Message] = []
    for rnd in schedule.rounds:
        messages = merge_into_messages(rnd, rank, bounds)
        sends, recvs = cut_into_segments(messages, segment_numel)
        scratch = sum(m.hi - m.lo for m in recvs if m.reduce)
        rounds.append(Round(sends, recvs, may_post_early(recvs, previous), scratch))
        previous = messages
    return tuple(rounds)


def merge_into_messages(rnd, rank: int, bounds: list[tuple[int, int]]) -> list[Message]:
    """This rank's transfers of one round; consecutive chunks to or from one peer become one message."""
    messages: list[Message] = []
    last: dict[tuple[int, bool, bool], int] = {}  # (peer, send, reduce) -> index of its latest message
    for t in rnd:
        if rank not in (t.src, t.dst):
            continue
        lo, hi = bounds[t.chunk]
        if lo == hi:
            continue
        send = t.src == rank
        key = (t.dst if send else t.src, send, t.reduce)
        j = last.get(key)
        if j is not None and messages[j].hi == lo:
            messages[j] = messages[j]._replace(hi=hi)
        else:
            last[key] = len(messages)
            messages.append(Message(key[0], lo, hi, send, t.reduce))
    return messages


def cut_into_segments(messages: list[Message], segment_numel: int) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """Sends and receives cut into segments of at most `segment_numel` elements.

    Ordered segment 0 of every message, then segment 1, ..., so that the receiver adds one
    segment while the next is in flight.
    """
    segments = sorted(
        ((k, i, m._replace(lo=start, hi=min(start + segment_numel, m.hi)))
         for i, m in enumerate(messages) for k, start in enumerate(range(m.lo, m.hi, segment_numel))),
        key=lambda x: x[:2])
    return tuple(m for _, _, m in segments if m.send), tuple(m for _, _, m in segments if not m.send)


def may_post_early(recvs: tuple[Message, ...], previous: list[Message]) -> bool:
    """Whether a round's receives may be posted while the previous round still runs.

    Reductions land in scratch space, so only overwrites can collide with the previous
    round; a range sent to the very peer that will overwrite it is safe: that peer sends
    only after it has received everything of the previous round.
    """
    return all(m.reduce or x.hi <= m.lo or m.hi <= x.lo or (x.send and x.peer == m.peer)
               for m in recvs for x in previous)


_SCRATCH = threading.local()  # per thread: DDP's allreduce thread and the main thread must not share it


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """`numel` elements of reusable space on `like`'s device and dtype.

    Kept between calls: a fresh multi-MiB buffer every round costs page faults (the CPU
    allocator gives large blocks back to the system), more than the additions themselves.
    """
    cache = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (like.device, like.dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = like.new_empty(numel)
    return buf[:numel]


def _targets(flat: torch.Tensor, rnd: Round, scratch: torch.Tensor) -> list[torch.Tensor]:
    """Where each receive of `rnd` lands: scratch space for reductions (on flat's device), flat itself for overwrites."""
    out, at = [], 0
    for m in rnd.recvs:
        if m.reduce:
            out.append(scratch[at:at + m.hi - m.lo])
            at += m.hi - m.lo
        else:
            out.append(flat[m.lo:m.hi])
    return out


_SPENT = threading.local()  # per thread: the previous call's finished sends and receives


def _keep_until_next_call(works: list) -> None:
    """Hold this call's finished works until the same thread's next call has finished too.

    Freeing a gloo send or receive right after its wait, before the next message is posted,
    cost about 2 ms per message on a 2-core machine (torch 2.13: a ping-pong of 4 KiB took
    4 ms with each work freed at once, 0.2-0.3 ms with it freed one exchange later). Held
    until the next call, they are freed when nothing waits on them. The price: the tensors
    of the last call stay referenced a little longer.
    """
    _SPENT.works = works


def _add(flat: torch.Tensor, m: Message, buf: torch.Tensor) -> None:
    if m.reduce:  # in schedule order, so the sum is the single controller's, bit for bit
        flat[m.lo:m.hi].add_(buf)


# ---------------------------------------------------------------- gloo: receives posted a round early

def _run_early(flat: torch.Tensor, rounds: tuple[Round, ...], peers: list[int], group, scratch,
               timeout: float | None) -> None:
    """Gloo: post each round's receives while the previous round runs.

    Gloo sends a message at once only to a receiver that has already said it is ready;
    otherwise the two sides exchange notifications first, a round trip through both
    processes' network threads. Receives posted one round ahead avoid that wait.

    Messages go straight to the process group's `send` and `recv` (with group ranks, as
    `m.peer` is), and errors are caught once for the whole call: `dist.isend`'s checks and a
    `talking_to` around every message cost 30 to 50 us per message on a 2-core machine,
    which is what a small allreduce costs in all.
    """
    pg = group if group is not None else dist.group.WORLD
    deadline = None if timeout is None else datetime.timedelta(seconds=timeout)
    peer = None  # the global rank of the message under way, for the error

    def wait_for(work) -> None:
        if deadline is None:
            work.wait()  # the process group's own timeout applies
        else:
            work.wait(deadline)

    def post(i: int) -> list:
        nonlocal peer
        bufs = _targets(flat, rounds[i], scratch[i % 2])
        out = []
        for m, b in zip(rounds[i].recvs, bufs):
            peer = peers[m.peer]
            out.append((m, b, pg.recv([b], m.peer, 0)))
        return out

    spent = []
    try:
        pending = post(0) if rounds else []
        for i, rnd in enumerate(rounds):
            sends = []
            for m in rnd.sends:
                peer = peers[m.peer]
                sends.append((peer, pg.send([flat[m.lo:m.hi]], m.peer, 0)))
            ahead = i + 1 < len(rounds) and rounds[i + 1].early
            following = post(i + 1) if ahead else None
            for m, buf, work in pending:
                peer = peers[m.peer]
                wait_for(work)
                _add(flat, m, buf)
            for peer, work in sends:
                wait_for(work)
            spent += [w for *_, w in pending] + [w for _, w in sends]
            pending = following if ahead else (post(i + 1) if i + 1 < len(rounds) else [])
    except PeerError:
        raise
    except RuntimeError as e:  # gloo raises plain RuntimeErrors; torch's DistError types derive from it
        raise peer_error(e, peer, timeout) from e
    _keep_until_next_call(spent)


# ---------------------------------------------------------------- NCCL and others: one group per round

def _run_grouped(flat: torch.Tensor, rounds: tuple[Round, ...], peers: list[int], group, scratch,
                 timeout: float | None) -> None:
    """NCCL and others: each round's sends and receives as one group, so that two ranks exchanging never deadlock."""
    spent = []
    for i, rnd in enumerate(rounds):
        bufs = _targets(flat, rnd, scratch[i % 2])
        ops = [dist.P2POp(dist.isend, flat[m.lo:m.hi], peers[m.peer], group) for m in rnd.sends]
        ops += [dist.P2POp(dist.irecv, b, peers[m.peer], group) for m, b in zip(rnd.recvs, bufs)]
        if ops:
            others = {peers[m.peer] for m in rnd.sends + rnd.recvs}
            peer = next(iter(others)) if len(others) == 1 else None  # NCCL returns one work for the whole group
            with talking_to(peer, timeout):
                works = dist.batch_isend_irecv(ops)
            for work in works:
                wait(work, peer, timeout)
            spent += works
        for m, buf in zip(rnd.recvs, bufs):
            _add(flat, m, buf)
    _keep_until_next_call(spent)


_FIELDS = ("elements", "dtype", "algorithm", "segment_bytes", "call")  # a call's fingerprint
_DTYPES = sorted((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64), key=str)
_NAMES = sorted((*ALGORITHMS, "auto"))
_CALLS: dict = {}  # process group -> checked calls made on it so far: the fingerprint's counter


@functools.lru_cache(maxsize=64)
def everyone_hears_everyone(n: int) -> Schedule:
    """Each device's own chunk sent on to every device (an all-gather) in ceil(log2 n) rounds.

    Dissemination: before a round every device holds its own chunk and the `known - 1` chunks
    below it (mod n); it passes them to the device `known` places up, which then holds twice as
    many. Every round, every device sends one message and receives one, of fixed size.
    """
    rounds, known = [], 1
    while known < n:
        new = min(known, n - known)  # chunks the receiver does not hold yet
        rounds.append(tuple(Transfer(r, (r + known) % n, (r - j) % n, False) for r in range(n) for j in reversed(range(new))))
        known += new
    return Schedule("dissemination", n, n, tuple(rounds), ("all-gather",) * len(rounds))


def check_same_call(tensor: torch.Tensor, algorithm: str, segment_bytes: int, group, timeout: float | None, *,
                    numel: int | None = None, flag: bool = False) -> bool:
    """Raise on every rank unless all called allreduce alike: same size, dtype, algorithm, segment size, call number.

    Returns whether any rank raised `flag`, a bit that rides along uncompared, so that every
    rank takes the same decision from it (`allreduce`: measure the link again).

    `numel` (default `tensor.numel()`): the size to compare, for a caller that checks a whole
    sequence of calls at once (`DistributedDataParallel`: all of a step's buckets). The call
    number counts this group's checked calls: a rank that is a call ahead, or that lost one to
    an error the others did not see, is found even when the sizes happen to agree.

    Every rank's fingerprint, one row of a small table of fixed shape, goes to every rank
    (`everyone_hears_everyone`: at two ranks, one message each way at once) before any data
    moves. Only the payload's size depends on the call, so it cannot ride in the same
    messages: a receive posted for another size than its send makes gloo abort, and a send
    that its receiver refuses stays queued and meets the next call's receive. Messages of
    fixed size pair safely whatever the calls; then every rank compares the same table and
    raises, or not, alike. It goes through the same sends and receives as the data, so a
    dead or silent peer is named as before.
    """
    rank, peers = group_ranks(group)
    key = group if group is not None else dist.group.WORLD
    _CALLS[key] = call = _CALLS.get(key, 0) + 1
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = [tensor.numel() if numel is None else numel, dtype, _NAMES.index(algorithm), segment_bytes, call, int(flag)]
    table = torch.tensor([mine if i == rank else [0] * len(mine) for i in range(len(peers))], dtype=torch.int64,
                         device=tensor.device)
    rounds = plan(everyone_hears_everyone(len(peers)), rank, table.numel(), table.numel())  # no segments, no scratch
    run = _run_early if dist.get_backend(group) == "gloo" else _run_grouped
    run(table.view(-1), rounds, peers, group, (table[:0], table[:0]), timeout)
    everyone = table.tolist()
    rows = [row[:-1] for row in everyone]  # the fingerprints; the flags are not compared
    if all(row == rows[0] for row in rows):
        return any(row[-1] for row in everyone)
    names = {"dtype": lambda v: str(_DTYPES[v]).replace("torch.", "") if v < len(_DTYPES) else "other",
             "algorithm": lambda v: _NAMES[v]}
    differ = []
    for i, field in enumerate(_FIELDS):
        values = [names.get(field, str)(row[i]) for row in rows]
        if len(set(values)) > 1:
            differ.append(f"{field} {'..'.join(sorted(set(values), key=lambda v: (len(v), v)))} "
                          f"(per rank: {', '.join(values)})")
    raise ValueError(f"rank {dist.get_rank()}: allreduce called differently across ranks: {'; '.join(differ)}; "
                     "the ranks are out of step (one ran out of batches or skipped a step) or were given other arguments")


def run_allreduce(tensor: torch.Tensor, algorithm: str, group, rank: int, peers: list[int], segment_bytes: int,
                  early: bool, timeout: float | None = None) -> None:
    """`algorithm` (a name, not "auto") run by this rank on `tensor`; the arguments are already checked."""
    run_schedule(tensor, get_schedule(algorithm, len(peers)), group, rank, peers, segment_bytes, early, timeout)


class Traffic:
    """The bytes this process has sent by `run_schedule` on one process group, per dtype (e.g. "float32").

    The data of every collective, counted from this rank's sends in its plan as each call
    starts; not counted: `check_same_call`'s fingerprints, and torch's own collectives. A
    benchmark reads `traffic(group).sent()` before and after a step, on each rank.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the group's worker thread and the main thread both send
        self._sent: dict[str, int] = {}

    def add(self, dtype: torch.dtype, nbytes: int) -> None:
        name = str(dtype).removeprefix("torch.")
        with self._lock:
            self._sent[name] = self._sent.get(name, 0) + nbytes

    def sent(self) -> dict[str, int]:
        """A copy of the counts so far: dtype name -> bytes."""
        with self._lock:
            return dict(self._sent)


_TRAFFIC: dict[int, Traffic] = {}  # id(process group) -> its counter (the id only, as `group_worker` keeps)


def traffic(group=None) -> Traffic:
    """This process's counter of what `run_schedule` sent on `group` (default: all ranks)."""
    key = id(group if group is not None else dist.group.WORLD)
    return _TRAFFIC.setdefault(key, Traffic())


def run_schedule(tensor: torch.Tensor, schedule: Schedule, group, rank: int, peers: list[int], segment_bytes: int,
                 early: bool, timeout: float | None) -> None:
    """Run this rank's share of any `schedule` on `tensor`, in place; the arguments are already checked."""
    rounds = plan(schedule, rank, tensor.numel(), max(1, segment_bytes // tensor.element_size()))
    traffic(group).add(tensor.dtype, sum(m.hi - m.lo for r in rounds for m in r.sends) * tensor.element_size())
    width = max((r.scratch for r in rounds), default=0)
    space = _scratch(2 * width, tensor)
    scratch = (space[:width], space[width:])  # rounds alternate halves: a round's receives may be posted early
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        (_run_early if early else _run_grouped)(flat, rounds, peers, group, scratch, timeout)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
