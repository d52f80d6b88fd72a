"""The executor: the schedules of `manualdp.schedule` across processes, one rank's share at a time.

Every rank runs the same schedule and keeps the transfers where it is `src` or `dst`:
1. `plan` (`manualdp.spmd.transport.plan`) merges them into messages and cuts those into segments;
2. an executor posts them as non-blocking sends and receives of `torch.distributed` and adds
   what arrives: on gloo the process group's own `send`/`recv` (what `dist.isend`/`dist.irecv`
   call, without their per-message checks), on NCCL `dist.batch_isend_irecv`.

The collectives users call (`allreduce` with its "auto" and its call check, reduce-scatter,
all-gather, ...) are in `manualdp.spmd.collectives`, on top of this executor. What the
executor keeps between calls (scratch space, finished works, bytes sent) is the process
group's, in its `manualdp.spmd.transport.group.GroupState`, which the caller hands in.

Every wait has a deadline (`timeout`, default: the process group's): a peer that dies or
hangs ends in a `manualdp.spmd.transport.peers.PeerError` naming it, never in a hang.
"""
from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from ...schedule import ALGORITHMS, Schedule
from .group import GroupState, Traffic, group_state
from .peers import PeerError, peer_error, talking_to, wait
from .plan import DEFAULT_SEGMENT_BYTES, Message, Round, plan

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "run_allreduce", "run_schedule", "schedule_of",
           "exchange", "Traffic", "traffic"]


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


def _targets(flat: torch.Tensor, rnd: Round, scratch: torch.Tensor, held: bool = False) -> list[torch.Tensor]:
    """Where each receive of `rnd` lands: scratch space for reductions (on flat's device), flat itself
    for overwrites; with `held`, overwrites land in scratch too, copied in once the call check has passed."""
    out, at = [], 0
    for m in rnd.recvs:
        if m.reduce or held:
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


def _add(flat: torch.Tensor, m: Message, buf: torch.Tensor, held: bool = False) -> None:
    if m.reduce:  # in schedule order, so the sum is the single controller's, bit for bit
        flat[m.lo:m.hi].add_(buf)
    elif held:  # an overwrite held in scratch space until the call check passed
        flat[m.lo:m.hi].copy_(buf)


# ---------------------------------------------------------------- gloo: receives posted a round early

def _run_early(flat: torch.Tensor, rounds: tuple[Round, ...], state: GroupState, scratch, timeout: float | None,
               tag: int = 0, check=None) -> None:
    """Gloo: post each round's receives while the previous round runs.

    Gloo sends a message at once only to a receiver that has already said it is ready;
    otherwise the two sides exchange notifications first, a round trip through both
    processes' network threads. Receives posted one round ahead avoid that wait.

    Messages go straight to the process group's `send` and `recv` (with group ranks, as
    `m.peer` is), and errors are caught once for the whole call: `dist.isend`'s checks and a
    `talking_to` around every message cost 30 to 50 us per message on a 2-core machine,
    which is what a small allreduce costs in all.

    `check` (a call check of `manualdp.spmd.transport.call_check`, or None) starts once the first
    round's receives are posted, and is called once its sends are; before anything of the first
    round is used or the next round is posted, `check.landed()` says whether the calls agreed
    (`_checked_first_round`; a `TagCheck` after the round's first message has come). Meanwhile
    that round's receives all land in scratch space, overwrites too (an all-gather's, a
    broadcast's), so a refused call leaves the tensor unchanged.
    """
    pg, peers = state.pg(), state.peers
    deadline = None if timeout is None else datetime.timedelta(seconds=timeout)
    peer = None  # the global rank of the message under way, for the error
    checked = None  # the first round's work the check waited for already: a gloo work is waited for once

    def wait_for(work) -> None:
        if work is checked:
            return
        if deadline is None:
            work.wait()  # the process group's own timeout applies
        else:
            work.wait(deadline)

    def post(i: int) -> list:
        nonlocal peer
        bufs = _targets(flat, rounds[i], scratch[i % 2], held=i == 0 and check is not None)
        out = []
        for m, b in zip(rounds[i].recvs, bufs):
            peer = peers[m.peer]
            out.append((m, b, pg.recv([b], m.peer, tag)))
        return out

    spent = []
    try:
        pending = post(0) if rounds else []
        if check is not None:
            check.start()
        for i, rnd in enumerate(rounds):
            sends = []
            for m in rnd.sends:
                peer = peers[m.peer]
                sends.append((peer, pg.send([flat[m.lo:m.hi]], m.peer, tag)))
            if i == 0 and check is not None:
                checked = _checked_first_round(check, [w for *_, w in pending] + [w for _, w in sends], wait_for)
            ahead = i + 1 < len(rounds) and rounds[i + 1].early
            following = post(i + 1) if ahead else None
            gone = 0  # sends waited for: a gloo work is waited for once (a second wait waits for another message)
            for k, (m, buf, work) in enumerate(pending):
                while rnd.sends_before and gone < rnd.sends_before[k]:  # partners swap: what this rank adds
                    peer = sends[gone][0]                                # into must have gone out first
                    wait_for(sends[gone][1])
                    gone += 1
                peer = peers[m.peer]
                wait_for(work)
                _add(flat, m, buf, held=i == 0 and check is not None)
            for peer, work in sends[gone:]:
                wait_for(work)
            spent += [w for *_, w in pending] + [w for _, w in sends]
            pending = following if ahead else (post(i + 1) if i + 1 < len(rounds) else [])
    except (PeerError, ValueError):
        raise
    except RuntimeError as e:  # gloo raises plain RuntimeErrors; torch's DistError types derive from it
        raise peer_error(e, peer, timeout) from e
    _keep_until_next_call(state, spent)


def _checked_first_round(check, works: list, wait_for):
    """Let `check` say whether the ranks called alike before anything of the first round (`works`) is used;
    returns the work it waited for, if any.

    A `HeaderCheck` compares the headers (`check()`). For a `TagCheck` the first message of the
    round that completes tells (on another call's tag it completes only when the ranks, having
    compared through the store, settle it), and the rest of the round then pipelines as
    unchecked data does. On a refusal every message of the round is completed before raising,
    so nothing stays queued to meet a later call.
    """
    first = works[0] if works and check.waits_first else None
    try:
        check()
        if first is not None:
            try:
                wait_for(first)
            except BaseException:
                check.abandon()
                raise
        check.landed()
    except ValueError:
        for work in works[1:] if first is not None else works:
            wait_for(work)
        raise
    return first


def exchange(flat: torch.Tensor, rounds: tuple[Round, ...], state: GroupState, timeout: float | None,
             tag: int = 0, check=None) -> None:
    """Run `rounds` of overwrites (no reductions) on `flat`, on `tag`: the call check's headers (not counted as
    traffic).

    `check` (gloo): a `call_check.TagCheck` that the first round carries; it lands in scratch space until then.
    """
    if check is not None:
        space = flat.new_empty(flat.numel())
        _run_early(flat, rounds, state, (space, space), timeout, tag, check)
    else:
        (_run_early if state.early else _run_grouped)(flat, rounds, state, (flat[:0], flat[:0]), timeout, tag)


# ---------------------------------------------------------------- NCCL and others: one group per round

def _run_grouped(flat: torch.Tensor, rounds: tuple[Round, ...], state: GroupState, scratch,
                 timeout: float | None, tag: int = 0) -> None:
    """NCCL and others: each round's sends and receives as one group, so that two ranks exchanging never deadlock.

    `tag` goes with every message (NCCL ignores tags: there the call check runs alone, first).
    """
    group, peers = state.pg(), state.peers
    spent = []
    for i, rnd in enumerate(rounds):
        bufs = _targets(flat, rnd, scratch[i % 2])
        ops = [dist.P2POp(dist.isend, flat[m.lo:m.hi], peers[m.peer], group, tag) for m in rnd.sends]
        ops += [dist.P2POp(dist.irecv, b, peers[m.peer], group, tag) for m, b in zip(rnd.recvs, bufs)]
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


def run_allreduce(tensor: torch.Tensor, algorithm: str, state: GroupState, segment_bytes: int,
                  timeout: float | None = None, *, early: bool | None = None, check=None) -> None:
    """`algorithm` (a name, not "auto") run by this rank on `tensor`; the arguments are already checked.

    `check`: a `manualdp.spmd.transport.call_check.HeaderCheck` for this call, run beside its first round.
    """
    run_schedule(tensor, schedule_of(algorithm, len(state.peers)), state, segment_bytes, timeout, early=early,
                 check=check)


@functools.lru_cache(maxsize=64)
def schedule_of(algorithm: str, n: int) -> Schedule:
    """The allreduce schedule `algorithm` on `n` ranks: `get_schedule` without its checks, for names already checked."""
    return ALGORITHMS[algorithm](n)


def traffic(group=None) -> Traffic:
    """This process's counter of what `run_schedule` sent on `group` (default: all ranks)."""
    return group_state(group).traffic


def run_schedule(tensor: torch.Tensor, schedule: Schedule, state: GroupState, segment_bytes: int,
                 timeout: float | None, *, early: bool | None = None, check=None) -> None:
    """Run this rank's share of any `schedule` on `tensor`, in place; the arguments are already checked.

    `early` (default: on gloo) posts each round's receives while the previous round runs.
    `check` (a `manualdp.spmd.transport.call_check.HeaderCheck` made for this schedule, or None): it runs
    beside the first round, which goes on its tag (gloo only).
    """
    rounds = plan(schedule, state.rank, tensor.numel(), max(1, segment_bytes // tensor.element_size()))
    early = state.early if early is None else early
    if check is not None and not (early and rounds):
        raise RuntimeError("a call check carried with the data needs gloo's early receives and a round to carry it; "
                           "run it alone first")
    state.traffic.add(tensor.dtype, sum(m.hi - m.lo for r in rounds for m in r.sends) * tensor.element_size())
    width = max((r.scratch for r in rounds), default=0)
    if check is not None:  # the first round's receives all wait in scratch space for the check
        width = max(width, sum(m.hi - m.lo for m in rounds[0].recvs))
    space = _scratch(state, 2 * width, tensor)
    scratch = (space[:width], space[width:])  # rounds alternate halves: a round's receives may be posted early
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        if early:
            _run_early(flat, rounds, state, scratch, timeout, 0 if check is None else check.tag, check)
        else:
            _run_grouped(flat, rounds, state, scratch, timeout)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
