"""Who may join the run: a replica with the run's settings, while the global batch has room for one more member.

A joiner that does not fit is refused alone, in one line, and the running replicas train on.

The settings are what every member must share (`Manager.require_same`: the method, H, the
optimizer and its hyperparameters, the seed, the model, the data, the epochs, the batch size),
written as canonical JSON. Keys (`keys.py`):
- `settings/ID`: each replica's own, written before it first asks for a quorum;
- `settings`: the run's, written by the members of its first quorum (`compare_set`: the first
  writer wins), never changed afterwards;
- `refused`: one line per refused replica ("replica c refused: lr 0.2 != 0.1"), which the
  running replicas log (`refusals`).

Three gates, so that no race lets a misfit in:
1. before it asks, a replica compares its settings with the run's (`check`): a misfit is refused;
2. its ask carries a digest of its settings (`Member.settings`), and a quorum takes only the
   askers with the run's digest (`admissible`): the run's published one, or before it is
   written, that of the asker holding the most of the run (`run_digest`);
3. a quorum holds at most as many members as the smallest `Member.capacity` among them (each
   member's smallest global batch: a member needs an example), keeping those that hold the most
   of the run (`fit`).
A replica left out by gate 2 or 3 is refused in one line (`left_out`); one merely late asks again.
Askers that wait in vain before the run's settings are published, because their own differ, are
told which fields differ between whom (`split`), not to start more replicas.
"""
from __future__ import annotations

import hashlib
import json
import logging

import torch.distributed as dist

from . import keys

_log = logging.getLogger("manualdp.spmd.ft")

__all__ = ["Misfit", "canonical", "digest", "differences", "check", "publish", "refusals", "run_digest",
           "admissible", "fit", "left_out", "split"]


class Misfit(ValueError):
    """This replica does not fit the run (other settings, no room in the batch): it is refused, the run goes on."""

    final = True  # no fault to ride out: asking again cannot help (`Manager.start_step`)


def canonical(settings: dict) -> str:
    """`settings` as JSON with sorted keys: equal strings for equal settings on every replica."""
    return json.dumps(settings, sort_keys=True, default=str)


def digest(text: str) -> str:
    """A short digest of canonical settings, carried by every ask."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(mine: dict, run: dict) -> str:
    """Every field where `mine` differs from `run`'s, as "lr 0.2 != 0.1, seed 1 != 0" (mine first).

    Between a replica group and a replica of another size or kind (`group_size`; a one-process
    replica has none): the size, then only the fields both hold in the same form.
    """
    if "group_size" in mine or "group_size" in run:
        sizes = [s.get("group_size", "(one process)") for s in (mine, run)]
        if sizes[0] != sizes[1]:
            return _other_size(mine, run, *sizes)
    missing = "(none)"
    fields = [k for k in sorted(set(mine) | set(run)) if mine.get(k, missing) != run.get(k, missing)]
    return ", ".join(f"{k} {mine.get(k, missing)} != {run.get(k, missing)}" for k in fields)


def _other_size(mine: dict, run: dict, my_size, run_size) -> str:
    """A group's settings against another size's: the size first, then the fields both hold alike and that differ."""
    # a group's runner and a one-process replica's share a few fields only (the optimizer's hyperparameters, the
    # allreduce's schedule, the guard's thresholds are one-process fields): the rest differ by the kind alone
    both = [k for k in sorted(set(mine) & set(run)) if k != "group_size" and type(mine[k]) is type(run[k])]
    return ", ".join([f"group_size {my_size} != {run_size}"] + [f"{k} {mine[k]} != {run[k]}" for k in both
                                                                 if mine[k] != run[k]])


def _settings(store: dist.Store, key: str) -> str | None:
    """The settings under `key`, or None if none are written or the value is not settings (logged, then ignored)."""
    if not store.check([key]):
        return None
    text = store.get(key).decode(errors="replace")
    try:
        if isinstance(json.loads(text), dict):
            return text
    except ValueError:
        pass
    _log.warning(f"ignored a malformed value of {key!r} in the coordinator's store: {text[:80]!r}")
    return None


def _refuse(store: dist.Store, replica_id: str, why: str, hint: str) -> Misfit:
    """Leave a note that the running replicas log, and the error that tells this replica so."""
    store.append(keys.REFUSED, f"replica {replica_id} refused: {why}\n")
    return Misfit(f"replica {replica_id!r} refused by the run: {why}: {hint}")


def _refuse_settings(store: dist.Store, replica_id: str, mine: str, run: str) -> Misfit:
    return _refuse(store, replica_id, differences(json.loads(mine), json.loads(run)),
                   "start it with the run's settings (the first value is this replica's, the second the run's)")


def check(store: dist.Store, replica_id: str, mine: str) -> None:
    """Gate 1: write this replica's settings (`canonical`); `Misfit` naming each field unless they are the run's."""
    store.set(keys.settings_of(replica_id), mine)
    run = _settings(store, keys.SETTINGS)
    if run is not None and run != mine:
        raise _refuse_settings(store, replica_id, mine, run)


def publish(store: dist.Store, replica_id: str, mine: str) -> None:
    """Write `mine` as the run's settings unless some are written (the first writer wins); `Misfit` if they differ."""
    held = store.compare_set(keys.SETTINGS, "", mine)
    run = _settings(store, keys.SETTINGS)
    if run is None:  # a malformed value: the run's first quorum writes over it
        store.compare_set(keys.SETTINGS, held, mine)
        run = _settings(store, keys.SETTINGS) or mine
    if run != mine:
        raise _refuse_settings(store, replica_id, mine, run)


def refusals(store: dist.Store, seen: int) -> tuple[list[str], int]:
    """The notes of refused replicas after the first `seen`, and how many there are in all."""
    if not store.check([keys.REFUSED]):
        return [], seen
    lines = store.get(keys.REFUSED).decode(errors="replace").splitlines()
    # only notes of our shape, cut short: what a stranger appends there is not echoed at length
    return [line[:300] for line in lines[seen:] if line.startswith("replica ") and " refused: " in line], len(lines)


def _standing(member) -> tuple:
    """How much of the run a member holds: its agreed state's mark first (`quorum.Member.mark`)."""
    return (member.synced, member.step, member.since)


def run_digest(store: dist.Store, asks: list) -> str | None:
    """The run's settings digest: the published one, else that of the asker holding the most of the run."""
    run = _settings(store, keys.SETTINGS)
    if run is not None:
        return digest(run)
    signed = [m for m in asks if m.settings]
    if not signed:
        return None
    best = max(_standing(m) for m in signed)
    return next(m.settings for m in signed if _standing(m) == best)  # the first such asker: asks are in order


def admissible(members: list, run: str | None) -> list:
    """Gate 2: the members whose settings are the run's (an ask without a digest is not compared)."""
    return [m for m in members if run is None or not m.settings or m.settings == run]


def fit(members: list) -> list:
    """Gate 3: at most as many members as the smallest capacity among them, those holding the most of the run."""
    capacities = [m.capacity for m in members if m.capacity]
    if not capacities or len(members) <= min(capacities):
        return members
    ranked = sorted(members, key=_standing, reverse=True)  # stable: the first asked first among equals
    kept = ranked[:min(capacities)]
    return sorted(kept, key=lambda m: m.id)


def left_out(store: dist.Store, me, quorum) -> None:
    """`Misfit` if `me` was left out of `quorum` by gate 2 or 3; nothing if it merely asked too late."""
    first = quorum.members[0]
    if me.settings and first.settings and me.settings != first.settings:
        run, mine = _settings(store, keys.settings_of(first.id)), _settings(store, keys.settings_of(me.id))
        if run is None or mine is None:
            raise _refuse(store, me.id, "its settings differ from the run's", "start it with the run's settings")
        raise _refuse_settings(store, me.id, mine, run)
    cap = min((m.capacity for m in quorum.members if m.capacity), default=0)
    cap = min(cap, me.capacity) if me.capacity else cap
    if cap and len(quorum.members) >= cap:
        raise _refuse(store, me.id, f"the run's quorum is full: {len(quorum.members)} members already split "
                                    f"a global batch of {cap}", "join with a larger batch, or when a member leaves")


def _own(store: dist.Store, member) -> dict | None:
    """`member`'s settings under `settings/ID`, if they match its ask's digest (a stranger may write there)."""
    text = _settings(store, keys.settings_of(member.id))
    return json.loads(text) if text is not None and digest(text) == member.settings else None


def _names(members: list) -> str:
    """`a` for one member, `[a, c]` for several."""
    return members[0].id if len(members) == 1 else "[" + ", ".join(m.id for m in members) + "]"


def split(store: dist.Store, asks: list) -> str | None:
    """Before the run's settings are published, the askers' differing settings in one line; None if they agree."""
    if _settings(store, keys.SETTINGS) is not None:
        return None
    groups: dict[str, list] = {}
    for m in sorted(asks, key=lambda m: m.id):
        if m.settings:
            groups.setdefault(m.settings, []).append(m)
    if len(groups) < 2:
        return None
    first, *others = groups.values()
    said = []
    for group in others:
        mine, theirs = _own(store, first[0]), _own(store, group[0])
        why = differences(mine, theirs) if mine is not None and theirs is not None else "their settings digests differ"
        said.append(f"replicas {_names(first)} and {_names(group)} ask with other settings: {why}")
    return "; ".join(said) + "; start them with the same settings"
