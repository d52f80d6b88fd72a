"""The executor: the schedules of `manualdp.schedule` across processes, one rank's share at a time.

Every rank runs the same schedule and keeps the transfers where it is `src` or `dst`:
1. `plan` (`manualdp.spmd.plan`) merges them into messages and cuts those into segments;
2. an executor posts them as non-blocking sends and receives of `torch.distributed` and adds
   what arrives: on gloo the process group's own `send`/`recv` (what `dist.isend`/`dist.irecv`
   call, without their per-message checks), on NCCL `dist.batch_isend_irecv`.

The collectives users call (`allreduce` with its "auto" and its call check, reduce-scatter,
all-gather, ...) are in `manualdp.spmd.collectives`, on top of this executor. What the
executor keeps between calls (scratch space, finished works, bytes sent) is the process
group's, in its `manualdp.spmd.group.GroupState`, which the caller hands in.

Every wait has a deadline (`timeout`, default: the process group's): a peer that dies or
hangs ends in a `manualdp.spmd.peers.PeerError` naming it, never in a hang.
"""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from ..schedule import ALGORITHMS, Schedule, Transfer
from .group import GroupState, Traffic, group_state
from .peers import PeerError, peer_error, talking_to, wait
from .plan import DEFAULT_SEGMENT_BYTES, Message, Round, plan

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "run_allreduce", "run_schedule", "check_same_call", "same_call",
           "everyone_hears_everyone", "Traffic", "traffic"]


def _scratch(state: GroupState, numel: int, like: torch.Tensor) -> torch.Tensor:
    """`numel` elements of reusable space on `like`'s device and dtype.

    Kept between calls: a fresh multi-MiB buffer every round costs page faults (the CPU
    allocator gives large blocks back to the system), more than the additions themselves.
    Per thread: DDP's worker thread and the main thread must not share it.
    """
    cache = state.local.__dict__.setdefault("buffers", {})
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


def _keep_until_next_call(state: GroupState, works: list) -> None:
    """Hold this call's finished works until the same thread's next call has finished too.

    Freeing a gloo send or receive right after its wait, before the next message is posted,
    cost about 2 ms per message on a 2-core machine (torch 2.13: a ping-pong of 4 KiB took
    4 ms with each work freed at once, 0.2-0.3 ms with it freed one exchange later). Held
    until the next call, they are freed when nothing waits on them. The price: the tensors
    of the last call stay referenced a little longer.
    """
    state.local.works = works


def _add(flat: torch.Tensor, m: Message, buf: torch.Tensor) -> None:
    if m.reduce:  # in schedule order, so the sum is the single controller's, bit for bit
        flat[m.lo:m.hi].add_(buf)


# ---------------------------------------------------------------- gloo: receives posted a round early

def _run_early(flat: torch.Tensor, rounds: tuple[Round, ...], state: GroupState, scratch, timeout: float | None) -> None:
    """Gloo: post each round's receives while the previous round runs.

    Gloo sends a message at once only to a receiver that has already said it is ready;
    otherwise the two sides exchange notifications first, a round trip through both
    processes' network threads. Receives posted one round ahead avoid that wait.

    Messages go straight to the process group's `send` and `recv` (with group ranks, as
    `m.peer` is), and errors are caught once for the whole call: `dist.isend`'s checks and a
    `talking_to` around every message cost 30 to 50 us per message on a 2-core machine,
    which is what a small allreduce costs in all.
    """
    pg, peers = state.pg(), state.peers
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
    _keep_until_next_call(state, spent)


# ---------------------------------------------------------------- NCCL and others: one group per round

def _run_grouped(flat: torch.Tensor, rounds: tuple[Round, ...], state: GroupState, scratch,
                 timeout: float | None) -> None:
    """NCCL and others: each round's sends and receives as one group, so that two ranks exchanging never deadlock."""
    group, peers = state.pg(), state.peers
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
    _keep_until_next_call(state, spent)


_FIELDS = ("elements", "dtype", "algorithm", "segment_bytes", "call")  # a call's fingerprint
_DTYPES = sorted((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64), key=str)
_NAMES = sorted((*ALGORITHMS, "auto"))


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
    return same_call(group_state(group), tensor, algorithm, segment_bytes, timeout, numel=numel, flag=flag)


def same_call(state: GroupState, tensor: torch.Tensor, algorithm: str, segment_bytes: int, timeout: float | None, *,
              numel: int | None = None, flag: bool = False) -> bool:
    """`check_same_call` on the group whose state is `state`."""
    rank, peers = state.rank, state.peers
    state.calls += 1
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = [tensor.numel() if numel is None else numel, dtype, _NAMES.index(algorithm), segment_bytes, state.calls,
            int(flag)]
    table = torch.tensor([mine if i == rank else [0] * len(mine) for i in range(len(peers))], dtype=torch.int64,
                         device=tensor.device)
    rounds = plan(everyone_hears_everyone(len(peers)), rank, table.numel(), table.numel())  # no segments, no scratch
    (_run_early if state.early else _run_grouped)(table.view(-1), rounds, state, (table[:0], table[:0]), timeout)
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


def run_allreduce(tensor: torch.Tensor, algorithm: str, state: GroupState, segment_bytes: int,
                  timeout: float | None = None, *, early: bool | None = None) -> None:
    """`algorithm` (a name, not "auto") run by this rank on `tensor`; the arguments are already checked."""
    run_schedule(tensor, _allreduce_schedule(algorithm, len(state.peers)), state, segment_bytes, timeout, early=early)


@functools.lru_cache(maxsize=64)
def _allreduce_schedule(algorithm: str, n: int) -> Schedule:
    """`get_schedule` without its checks: whoever took `algorithm` from a user checked it there."""
    return ALGORITHMS[algorithm](n)


def traffic(group=None) -> Traffic:
    """This process's counter of what `run_schedule` sent on `group` (default: all ranks)."""
    return group_state(group).traffic


def run_schedule(tensor: torch.Tensor, schedule: Schedule, state: GroupState, segment_bytes: int,
                 timeout: float | None, *, early: bool | None = None) -> None:
    """Run this rank's share of any `schedule` on `tensor`, in place; the arguments are already checked.

    `early` (default: on gloo) posts each round's receives while the previous round runs.
    """
    rounds = plan(schedule, state.rank, tensor.numel(), max(1, segment_bytes // tensor.element_size()))
    state.traffic.add(tensor.dtype, sum(m.hi - m.lo for r in rounds for m in r.sends) * tensor.element_size())
    width = max((r.scratch for r in rounds), default=0)
    space = _scratch(state, 2 * width, tensor)
    scratch = (space[:width], space[width:])  # rounds alternate halves: a round's receives may be posted early
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        run = _run_early if (state.early if early is None else early) else _run_grouped
        run(flat, rounds, state, scratch, timeout)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
