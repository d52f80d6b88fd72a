"""One rank's share of a schedule, as messages: a pure function of the schedule, tested without processes.

Every rank runs the same schedule and keeps the transfers where it is `src` or `dst`; `plan`
merges them into messages and cuts those into segments. Both sides derive their lists from
the same transfers in the same order, so every send meets its receive. The executor
(`manualdp.spmd.transport.p2p`) posts them.
"""
from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

from ...schedule import Schedule, chunk_bounds
from ...validate import int_between, non_negative_int, positive_int

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "merge_into_messages", "cut_into_segments",
           "may_post_early", "sends_before", "overlaps"]

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
    sends_before: tuple[int, ...] = ()  # per receive, how many of its sends (in posting order) must have gone
                                        # before it is added: partners swap; empty when no receive overlaps a send


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
        rounds.append(Round(sends, recvs, may_post_early(recvs, previous), scratch,
                            sends_before(messages, sends, recvs)))
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


def sends_before(messages: list[Message], sends: tuple[Message, ...], recvs: tuple[Message, ...]) -> tuple[int, ...]:
    """Per receive of a round, how many of the round's sends (in posting order) must have gone before it is added.

    Only a round where a device sends what it also receives has any (recursive doubling's
    partners swap; `check_schedule` allows it for additions only): the addition must not
    change what is still going out. Else `()`. Found on the merged messages first, a few per
    round, not on every pair of segments. Sends of one message go in increasing order: a
    receive waits for those up to the last that overlaps it, and adds while the rest go; in
    any other order, for all of them.
    """
    if not any(m.lo < x.hi and x.lo < m.hi for m in messages if not m.send for x in messages if x.send):
        return ()
    if not all(a.hi <= b.lo for a, b in zip(sends, sends[1:])):
        return (len(sends),) * len(recvs)
    starts = [x.lo for x in sends]
    out = []
    for m in recvs:
        k = bisect.bisect_left(starts, m.hi)  # sends[:k] begin before m ends
        out.append(k if k and sends[k - 1].hi > m.lo else 0)
    return tuple(out)


def may_post_early(recvs: tuple[Message, ...], previous: list[Message]) -> bool:
    """Whether a round's receives may be posted while the previous round still runs.

    Reductions land in scratch space, so only overwrites can collide with the previous
    round; a range sent to the very peer that will overwrite it is safe: that peer sends
    only after it has received everything of the previous round.
    """
    return all(m.reduce or x.hi <= m.lo or m.hi <= x.lo or (x.send and x.peer == m.peer)
               for m in recvs for x in previous)


def overlaps(rounds: tuple[Round, ...]) -> bool:
    """Whether a plan's first round may go out before the call check agrees: its receives all land in scratch space.

    So a refused call's tensor is unchanged (`manualdp.spmd.transport.call_check`). True of every allreduce schedule.
    """
    return bool(rounds) and all(m.reduce for m in rounds[0].recvs)
