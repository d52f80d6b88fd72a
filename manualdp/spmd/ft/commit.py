"""Commit or discard: after its allreduce, a step is applied on every member or on none.

Each member writes its vote for the round, `round/r/vote/ID`: "1" if its allreduce went
through, "0" if it failed (a `PeerError`, a gloo error: a member died or hung). Then any
member may propose the round's outcome (`outcome_of`, a pure function):
- "discard" as soon as one vote is "0", or a member whose vote is missing has stopped
  heartbeating, or the votes have not all come within `timeout`;
- "commit" once every member's vote is "1".
The proposal goes in with `compare_set`, which keeps the first one written, and every member
applies what the store holds, not what it proposed: the members decide from the same data.
No vote once counted changes, and "commit" needs all of them, so a member that saw its own
step fail can never find it committed.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from . import keys
from .heartbeat import Liveness
from .look import glance, look, peek
from .quorum import Quorum
from .signed_store import ignore

__all__ = ["outcome_of", "commit_or_discard"]


def outcome_of(votes: dict[str, bool | None], alive: set[str], timed_out: bool) -> str | None:
    """The outcome a member proposes from the votes it sees (None: not cast yet), or None while it must wait."""
    if any(v is False for v in votes.values()):
        return "discard"
    if all(v is True for v in votes.values()):
        return "commit"
    missing = {m for m, v in votes.items() if v is None}
    if timed_out or not missing <= alive:
        return "discard"
    return None


def commit_or_discard(store: dist.Store, quorum: Quorum, replica_id: str, ok: bool, liveness: Liveness,
                      timeout: float) -> bool:
    """Vote `ok` for `quorum`'s step, then return whether every member commits it (the same answer on all)."""
    round_, decided, whole = quorum.round, keys.outcome(quorum.round), store
    store.set(keys.vote(round_, replica_id), "1" if ok else "0")
    deadline, first = time.monotonic() + timeout, True
    while True:
        store = look(whole)  # each pass decides from one read of each key
        # the first pass proposes without reading the outcome: compare_set answers with the one written, if any
        outcome = b"" if first else peek(store, decided) or b""
        if outcome in (b"commit", b"discard"):
            return outcome == b"commit"
        if outcome:
            ignore(store, decided, f"{outcome[:40]!r} is neither 'commit' nor 'discard'")
        votes = {m: (ok if m == replica_id else _vote(store, keys.vote(round_, m))) for m in quorum.ids}
        # the heartbeats are read only while a vote is missing, and not on the first pass: the last voter is a moment
        # away (its vote and outcome end the glance), and one dead is named a glance later; a complete count needs none
        alive = liveness.live(quorum.ids) if None in votes.values() and not first else set(quorum.ids)
        first = False
        proposal = outcome_of(votes, alive, time.monotonic() > deadline)
        if proposal is not None:
            written = store.compare_set(decided, outcome, proposal)  # the first proposal written is the outcome
            if written in (b"commit", b"discard"):                   # (or a malformed one in place, replaced)
                return written == b"commit"
            continue
        glance(lambda: peek(whole, decided) is not None)  # the last voter writes it: a moment away


def _vote(store: dist.Store, key: str) -> bool | None:
    """A member's vote: True ("1"), False ("0"), or None while not cast; a malformed one is ignored (logged)."""
    value = peek(store, key)
    if value is not None and value not in (b"1", b"0"):
        ignore(store, key, f"{value[:40]!r} is not a vote")
        value = None
    return None if value is None else value == b"1"
