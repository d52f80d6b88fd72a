"""Members removed from the run whose process does not exit: barred by the process, their asks refused.

A member the guard removes (`guard.py`: `Removed`, out of line `STRIKES` steps in a row) is
meant to leave. One that does not (a loop that catches `Removed`, a process that hangs on) would
ask again, be let in, and have every step it is in discarded. So the members that remove it bar
it: each appends to `barred` (`keys.py`) its id, the nonce of its process (its heartbeat's:
`heartbeat.py`, new in each process) and why. A quorum leaves a barred process out and does not
wait for it (`barred`, one log line per round), and the process itself, asking, is told in one
line (`Removed`, raised by `quorum.py`). The bar is on the process, not the name: the same id
started again (a new process, a new nonce) is let in again, as any joiner is.
"""
from __future__ import annotations

import json

import torch.distributed as dist

from . import keys
from .heartbeat import nonce_of
from .look import peek
from .trust import json_lines

__all__ = ["bar", "barred"]


def bar(store: dist.Store, replica_id: str, why: str) -> None:
    """Bar the process now running as `replica_id` from the quorums of the run, for `why` (a few words)."""
    nonce = nonce_of(store, replica_id)
    if nonce is not None:
        store.append(keys.BARRED, json.dumps({"id": replica_id, "nonce": nonce, "why": why}) + "\n")


def barred(store: dist.Store, ids) -> dict[str, str]:
    """Those of `ids` whose running process is barred, each with why."""
    if peek(store, keys.BARRED) is None:  # the common case: one round trip
        return {}
    bars = {(b.get("id"), b.get("nonce")): str(b.get("why", "")) for b in json_lines(store, keys.BARRED)}
    out = {}
    for rid in {i for i, _ in bars} & set(ids):
        why = bars.get((rid, nonce_of(store, rid)))
        if why is not None:
            out[rid] = why
    return out
