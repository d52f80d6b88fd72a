"""What a quorum trusts of what it reads in the store: well-formed values, a majority, claims the history bears out.

Anyone who reaches the coordinator's port may have written a value (with a secret they cannot
sign one, `signed_store.py`; without, they can), so a reader never lets a value end the run:

- a malformed value (`latest` = "x", a line of garbage among a round's asks, a mark that is not
  two numbers) is ignored and logged once per key (`ignore`), never fatal;
- the split-brain guard (`majority_need`): a quorum holds more than half of the members of the
  last agreed quorum that did not leave on purpose, so that two halves of a run cut apart by the
  network never both train on; a replica given `min_replicas` explicitly decides for itself;
- a replica's claimed step is held to the store's history (`checked_claims`): one that claims
  more steps than the run committed (`durable.py`'s `committed`) is not a source of the state.
"""
from __future__ import annotations

import dataclasses
import json

import torch.distributed as dist

from . import keys
from .signed_store import LOG, ignore

__all__ = ["well_formed", "json_lines", "count_value", "mark_value", "majority_need", "checked_claims",
           "committed_record"]


def well_formed(member) -> bool:
    """Whether a `quorum.Member` read from the store has fields of the right kinds and ranges."""
    def count(x) -> bool:
        return type(x) is int and 0 <= x < 2**62
    group = member.group
    return (isinstance(member.id, str) and bool(member.id) and member.id.isprintable() and "/" not in member.id
            and not any(c.isspace() for c in member.id) and count(member.step) and type(member.synced) is bool
            and (group is None or (len(group) == 2 and all(count(g) for g in group)))
            and count(member.min_replicas) and member.min_replicas <= 4096 and count(member.since)
            and isinstance(member.settings, str) and count(member.capacity))


def json_lines(store: dist.Store, key: str) -> list[dict]:
    """The JSON objects of `key`'s value, one a line; a line that is not one is ignored (logged)."""
    found, bad = [], 0
    for line in store.get(key).decode(errors="replace").splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            found.append(value)
        elif line.strip():
            bad += 1
    if bad:
        ignore(store, key, f"{bad} line(s) that are not a JSON object")
    return found


def count_value(store: dist.Store, key: str, value: bytes) -> int | None:
    """`value` as a count (an int >= 0), or None (logged) if it is not one."""
    text = value.decode(errors="replace").strip()
    if text.isdigit() and len(text) < 19:
        return int(text)
    ignore(store, key, f"{text[:40]!r} is not a count")
    return None


def mark_value(store: dist.Store, key: str, value: bytes | None) -> tuple[int, int] | None:
    """A published mark "STEP SINCE" as two ints; None for "" (no mark) or (logged) for a malformed one."""
    parts = (value or b"").split()
    if len(parts) == 2 and all(p.isdigit() and len(p) < 19 for p in parts):
        return int(parts[0]), int(parts[1])
    if parts:
        ignore(store, key, f"{value[:40]!r} is not 'STEP SINCE'")
    return None


def majority_need(min_replicas: list[int], previous: list[str] | None, left: set[str]) -> int:
    """The fewest members a quorum needs by the split-brain guard: more than half of `previous` that did not leave.

    0 (no guard) when any asker gave `min_replicas` explicitly (> 0), or there is no previous quorum.
    """
    if previous is None or any(n > 0 for n in min_replicas):
        return 0
    stayed = [r for r in previous if r not in left]
    return len(stayed) // 2 + 1 if stayed else 0


def committed_record(store: dist.Store) -> int | None:
    """The most steps the run committed, as the store records it (`durable.py`); None: no record (a fresh store)."""
    if not store.check([keys.COMMITTED]):
        return None
    return count_value(store, keys.COMMITTED, store.get(keys.COMMITTED))


def checked_claims(store: dist.Store, asks: dict, committed: int | None) -> dict:
    """`asks` with each holder that claims more steps than `committed` made a non-holder: never a source (logged)."""
    if committed is None:
        return asks
    checked = {}
    for rid, member in asks.items():
        if member.synced and member.step > committed:
            LOG.warning("manualdp fault tolerance: replica %r claims %d committed steps, but the run committed %d: "
                        "it will not be a source of the state", rid, member.step, committed)
            member = dataclasses.replace(member, synced=False)
        checked[rid] = member
    return checked
