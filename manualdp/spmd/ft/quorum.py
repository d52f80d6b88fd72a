"""The quorum: once per step, the live replicas agree on who is in, at which step, on which process group.

Each attempt at a step is a numbered round. A replica asks to be in round `r` by appending
what it is to `round/r/asks`: its id, the steps it has committed, whether its state is the
agreed one, the process group it holds, and its `min_replicas`. Then it watches the round:

1. someone has written `round/r/quorum`: that is the round's quorum. A replica in it goes
   on; one left out (it asked too late) asks in round `r + 1`;
2. else it decides (`decide`, a pure function): the askers that are alive, once they are at
   least `min_replicas` (the largest any asker asked for), and once every live replica has
   asked, or this one has waited `quorum_timeout` for those that have not (the deadline: a
   replica that misses it is out). It writes its proposal with `compare_set`, which keeps
   the first one written: whoever wrote first, every replica reads the same quorum.

Below `min_replicas` it keeps waiting while enough replicas are alive (one may be finishing a
failed step: an allreduce and a vote, each bounded by `timeout`), up to `PATIENCE` timeouts in
all; it raises once fewer than `min_replicas` have been alive for `timeout` seconds.

The quorum also names the process group (`group_for`): the one its members already share, if
they all hold the same one and nobody else is in; else a new one, numbered by the round. So
the group is re-formed only when the membership changes or a step failed.

Whose state is the run's (`agreed`). A member at the highest step is the source of a joiner's
state (`recovery.plan_recovery`), as in torchft. Max step wins is sound only if no replica can
train ahead without the others: a replica left alone (a joiner with `min_replicas` 1 beside
members in a long step) would otherwise count steps of its own, get ahead, and then overwrite
the members' committed steps. So each replica that holds the agreed state publishes its mark,
(committed step, round of the last quorum it stepped in), under `held/ID`; the members of the
newest decided quorum hold (its step, its round) even before they publish it. The rule:

    a quorum is agreed, and its members' steps the run's, only if no live replica outside it
    holds a mark above every member's; else it is provisional.

A replica that sees a live holder ahead of it waits for it like any live replica that has not
asked (up to `quorum_timeout`); if it goes on without it, its quorum is provisional: its
members train, but their state stays not agreed (no mark), and at their first quorum with a
holder they receive the holder's state, whatever steps they counted. A provisional replica's
state becomes agreed only once no live replica holds a mark (they died or left). So a quorum
never makes a replica at a lower committed step of the run the source for replicas that had
committed more under an earlier quorum, and two quorums never both train on from one state.
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch.distributed as dist

from . import keys
from .admission import Misfit, admissible, fit, left_out, run_digest, split
from .bar import barred
from .guard import Removed
from .heartbeat import Liveness, nonce_of, registered
from .look import POLL, glance, look, peek, prefetch
from .signed_store import ignore
from .trust import checked_claims, committed_record, count_value, json_lines, majority_need, mark_value, well_formed

__all__ = ["Member", "Quorum", "decide", "agreed", "group_for", "wait_for_quorum", "publish_mark", "POLL", "PATIENCE"]

PATIENCE = 3  # timeouts a replica waits for a quorum in all: a live one may spend one in a failed allreduce, one voting


@dataclasses.dataclass(frozen=True)
class Member:
    """What a replica says of itself when it asks for a quorum."""
    id: str                            # its name, unique among the replicas
    step: int                          # steps it has committed
    synced: bool                       # its state is the agreed one (it recovered, or was the first quorum's source)
    group: tuple[int, int] | None      # the process group it holds and that group's size; None: none
    min_replicas: int                  # the fewest replicas it will train with
    since: int = 0                     # the round of the last quorum it stepped in holding the agreed state
    settings: str = ""                 # the digest of its settings (admission.py); "": not compared
    capacity: int = 0                  # the most members it can train with (its smallest global batch); 0: any

    @property
    def mark(self) -> tuple[int, int] | None:
        """(step, since) if it holds the agreed state, else None: the higher mark holds more of the run."""
        return (self.step, self.since) if self.synced else None

    def fields(self) -> dict:
        """Its fields by name, in order: what `dataclasses.asdict` gave, without its deep copies (an ask's CPU)."""
        return {name: getattr(self, name) for name in _FIELDS}


@dataclasses.dataclass(frozen=True)
class Quorum:
    """A round's members (sorted by id: a member's index is its rank in the group), their group, and whether agreed.

    `agreed` False: a provisional quorum, formed while a live replica outside it held more of the
    run (module docstring): its members' state does not become the agreed one.
    """
    round: int
    members: tuple[Member, ...]
    group: int
    agreed: bool = True

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    @property
    def step(self) -> int:
        """The step every member takes next, after recovery: the highest among the holders of the agreed state.

        Without a holder among the members, the highest step among them.
        """
        return max((m.step for m in self.members if m.synced), default=max(m.step for m in self.members))

    def rank(self, replica_id: str) -> int:
        return self.ids.index(replica_id)

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "members": [m.fields() for m in self.members], "group": self.group,
                           "agreed": self.agreed})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Quorum":
        raw = json.loads(text)
        members = tuple(_member(m) for m in raw["members"])
        return cls(raw["round"], members, raw["group"], raw.get("agreed", True))


_FIELDS = tuple(f.name for f in dataclasses.fields(Member))


def _member(raw: dict) -> Member:
    group = tuple(raw["group"]) if raw["group"] is not None else None
    return Member(raw["id"], raw["step"], raw["synced"], group, raw["min_replicas"], raw.get("since", 0),
                  raw.get("settings", ""), raw.get("capacity", 0))


def decide(asks: dict[str, Member], live: set[str], waited_enough: bool, run: str | None = None) -> list[Member] | None:
    """The members of a round from its askers, or None while it must wait.

    `live`: the registered replicas that are alive; `waited_enough`: this replica has waited
    its `quorum_timeout` for live replicas that have not asked; `run`: the run's settings digest
    (only askers with it are in) and the batch's room (`admission.py`).
    """
    members = fit(admissible([m for _, m in sorted(asks.items()) if m.id in live], run))
    need = max((m.min_replicas for m in members), default=1)
    if len(members) < need:
        return None
    if live <= set(asks) or waited_enough:
        return members
    return None


def agreed(members: list[Member], held: dict[str, tuple[int, int]]) -> bool:
    """Whether `members` may train on as the run: no replica outside them holds a mark above every member's.

    `held`: the marks of the live replicas that hold the agreed state (members' included or not).
    """
    ours = [m.mark for m in members if m.synced]
    theirs = [mark for rid, mark in held.items() if rid not in {m.id for m in members}]
    return not theirs or (bool(ours) and max(ours) >= max(theirs))


def publish_mark(store: dist.Store, replica_id: str, mark: tuple[int, int] | None) -> None:
    """Say which agreed state this replica holds (None: none; it is new, or was provisional)."""
    store.set(keys.held(replica_id), "" if mark is None else f"{mark[0]} {mark[1]}")


def _held(store: dist.Store, live: set[str], round_: int) -> dict[str, tuple[int, int]]:
    """The marks of the `live` replicas that hold the agreed state, as published, or as the newest quorum implies."""
    if not live:  # nobody outside the members: no mark to read (a steady step)
        return {}
    ids = [r for r in sorted(live) if store.check([keys.held(r)])]
    held, committed = {}, committed_record(store)
    for rid, value in zip(ids, store.multi_get([keys.held(r) for r in ids]) if ids else []):
        mark = mark_value(store, keys.held(rid), value)
        if mark is not None and (committed is None or mark[0] <= committed):  # a claim the history bears out
            held[rid] = mark
    newest = _decided(store, round_ - 1) if round_ > 1 else None
    if newest is not None and newest.agreed:  # its holders at its step may not have published their new mark yet
        for m in newest.members:
            if m.id in live and m.synced and m.step == newest.step:
                held[m.id] = max(held.get(m.id, (-1, -1)), (newest.step, newest.round))
    return held


def group_for(members: list[Member], round_: int) -> int:
    """The members' process group: the one they all hold if nobody else is in it, else a new one (`round_`)."""
    held = {m.group for m in members}
    if len(held) == 1:
        group = held.pop()
        if group is not None and group[1] == len(members):
            return group[0]
    return round_


def _asks(store: dist.Store, round_: int, liveness: Liveness) -> dict[str, Member]:
    asks = {}
    for raw in json_lines(store, keys.asks(round_)):
        now = liveness.nonce(raw["id"]) if isinstance(raw.get("id"), str) else None
        if raw.get("nonce") not in (None, now) and now is not None:  # an earlier process of that id asked
            continue
        try:
            member = _member(raw)
        except (KeyError, TypeError, ValueError):
            member = None
        if member is None or not well_formed(member):
            ignore(store, keys.asks(round_), f"an ask that is not a replica's: {str(raw)[:60]}")
            continue
        asks[member.id] = member  # a replica's last ask counts
    return asks


def _decided(store: dist.Store, round_: int) -> Quorum | None:
    key = keys.quorum(round_)
    value = peek(store, key)
    if value is None:
        return None
    try:
        quorum = Quorum.from_json(value)
        if all(well_formed(m) for m in quorum.members) and quorum.members:
            return quorum
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    ignore(store, key, "it is not a quorum")
    return None


def _first_open_round(store: dist.Store, after: int) -> int:
    """The first round after `after` (and after the newest one known to be decided) that has no quorum yet."""
    round_, store = after + 1, look(store)  # one read of each round's quorum
    if after == 0 or peek(store, keys.quorum(round_)) is not None:  # a member in step finds its next round open
        latest = peek(store, keys.LATEST)
        round_ = max(after, (count_value(store, keys.LATEST, latest) or 0) if latest is not None else 0) + 1
    while peek(store, keys.quorum(round_)) is not None:
        round_ += 1
    return round_


def wait_for_quorum(store: dist.Store, me: Member, liveness: Liveness, after: int, quorum_timeout: float,
                    timeout: float, started: float, floor=None) -> Quorum:
    """Ask in the first open round after `after` until a quorum with `me` in it is decided; return it.

    TimeoutError, saying who asked and who is alive, once fewer than the replicas needed have
    been alive for `timeout` s, or `PATIENCE * timeout` s after `started` (time.monotonic()).
    `floor` (`durable.Floor`): no quorum below the run's committed step; RunFinished once it ended.
    """
    whole, round_ = store, _first_open_round(store, after)
    # the ask names this process (its heartbeat's nonce): a process of the same id started after it asked is not it
    ask = json.dumps({**me.fields(), "nonce": liveness.nonce(me.id) or nonce_of(store, me.id)}) + "\n"
    store.append(keys.asks(round_), ask)
    asked, short_since = time.monotonic(), None
    while True:
        store = look(whole)  # each pass decides from one read of each key
        quorum = _decided(store, round_)
        if quorum is None:  # what a decision reads that exists in a steady step: in two round trips
            prefetch(store, [keys.asks(round_), keys.COMMITTED, keys.REPLICAS, keys.SETTINGS]
                     + ([keys.quorum(round_ - 1)] if round_ > 1 else []) + [keys.heartbeat(r) for r in liveness.seen])
        if quorum is not None:
            if me.id in quorum.ids:
                return quorum
            left_out(store, me, quorum)  # a misfit is refused here; one merely late asks again
            round_ = _first_open_round(store, round_)  # left out: ask in the next round
            store.append(keys.asks(round_), ask)
            asked = time.monotonic()
            continue
        live = liveness.live(registered(store), store) | {me.id}
        asks = checked_claims(store, _asks(store, round_, liveness), committed_record(store))
        out = barred(store, live)  # removed members whose process did not exit (bar.py)
        if me.id in out:
            raise Removed(f"replica {me.id!r} was removed from the run ({out[me.id]}): its asks are refused; its "
                          f"process must exit (started again, it is let in as a new replica)")
        if out:
            ignore(store, keys.asks(round_), f"the asks of {sorted(out)}: removed from the run, barred")
            live, asks = live - set(out), {rid: m for rid, m in asks.items() if rid not in out}
        if me.id not in asks:  # this replica's ask was overwritten (a stranger?): ask again
            store.append(keys.asks(round_), ask)
            asks[me.id] = me
        run = run_digest(store, [m for m in asks.values() if m.id in live])
        members = decide(asks, live, time.monotonic() - asked >= quorum_timeout, run)
        previous = _decided(store, round_ - 1) if round_ > 1 else None
        guard = majority_need([m.min_replicas for m in asks.values()],
                              previous.ids if previous is not None and previous.agreed else None, liveness.left)
        if members is not None and len(members) < guard:
            members = None  # the split-brain guard (trust.py): not more than half of the last agreed quorum
        top = Quorum(round_, tuple(members), 0).step if members is not None else None
        if members is not None and floor is not None and not floor.allows(top, [m.id for m in members], store):
            members = None  # every holder of the committed steps is away: wait for one (durable.py)
        elif members is None and floor is not None:
            floor.allows(me.step, None, store)  # the run may have ended while this replica waited
        if members is not None:
            outside = live - {m.id for m in members}  # `agreed` weighs only the marks of those outside
            proposal = Quorum(round_, tuple(members), group_for(members, round_),
                              agreed(members, _held(store, outside, round_)))
            text = proposal.to_json()
            written = store.compare_set(keys.quorum(round_), "", text)
            if written != text.encode() and _decided(store, round_) is None:  # a malformed value in place: replace it
                written = store.compare_set(keys.quorum(round_), written, text)
            if written == text.encode():
                store.set(keys.LATEST, str(round_))  # a hint for those that join later: rounds up to here are decided
                if me.id in proposal.ids:
                    return proposal  # the store holds it: every replica reads this one
            continue
        now, need = time.monotonic(), max(1, guard, *(m.min_replicas for m in asks.values()))
        short_since = (short_since or now) if len(live) < need else None
        if (short_since is not None and now - short_since > timeout) or now - started > PATIENCE * timeout:
            differ = split(store, list(asks.values()))  # every asker: the other may have raised and left first
            if differ:  # more replicas would not help: the askers must agree first
                raise Misfit(f"replica {me.id!r}: no quorum of at least {need} replicas within {timeout:g} s: {differ}")
            raise TimeoutError(
                f"replica {me.id!r}: no quorum of at least {need} replicas within {timeout:g} s "
                f"(round {round_}: asked {sorted(asks)}, alive {sorted(live)}): start more replicas, "
                f"or lower min_replicas")
        glance(lambda: peek(whole, keys.quorum(round_)) is not None)  # another asker may decide it meanwhile
