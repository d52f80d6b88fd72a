"""A replica group's lanes: rank i of every member group in one gloo group, and the state that travels along it.

Lane i of quorum group N meets in the coordinator's store under `group/N/lane/i` (`keys.lane`),
as `quorum_group.py`'s groups do, and holds one member per replica group, ranked by the group's
index in the quorum. It is a `ProcessGroupGloo` built by hand, not the process's default group:
that one is the replica group's own (torchrun's world), which its ranks keep using inside. Its
allreduce is therefore gloo's (our collectives find a group's ranks through torch's registry,
which a hand-built group is not in). A lane is formed again whenever the quorum's group number
changes (members changed, or a step failed), so a failed lane is never reused.

A lane's state (model shard and optimizer shard of rank i) goes through the store as
`recovery.py`'s states do, under the source name `GROUP/lane/i`, checked by its SHA-256.

Gloo aborts the process when the members of an allreduce pass tensors of other sizes, so a
lane's sum first sums a header of fixed size (each member's element count and dtype, in its
own row) and raises a ValueError on every member when the rows differ, as the call check does
for `Manager.average`.

Gloo's rendezvous waits its whole timeout for a member that never comes. So the members first
answer a roll call in the lane's meeting place, and a member group whose heartbeat stops before it
answered ends the wait at once (`LaneLost`), as a recovery's lost sender does (`recovery.receive_state`'s
`gone`): the step is discarded and asked again within about one heartbeat timeout. A member lost after it
answered leaves gloo connecting to a process that is gone for longer than gloo's own timeout, while this group's
other ranks wait for this one inside the group: so the rendezvous runs on a thread of its own, waited for only
while every member group's heartbeat goes on (`LaneLost` at once when one stops), at most `timeout`.
"""
from __future__ import annotations

import datetime
import re
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import keys
from .counted_store import CountedStore
from .heartbeat import Liveness
from .look import POLL
from .quorum_group import meeting
from .recovery import check_loadable, forget_state, receive_state, send_state
from .share import may_not_sum

__all__ = ["Lane", "LaneLost", "lane_source", "gloo_words"]

# every dtype torch has, each its own number in the header (a dtype's name travels as its index)
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


class LaneLost(RuntimeError):
    """A member group of the lane was lost (its heartbeat stopped) or did not come before the lane formed."""


def lane_source(group_id: str, index: int) -> str:
    """The name lane `index` of replica group `group_id` sends its state under (a replica id holds no '/')."""
    return f"{group_id}/lane/{index}"


class Lane:
    """This rank's lane: its gloo group with rank `index` of the other member groups, and the state it sent."""

    def __init__(self, store: dist.Store, group_id: str, index: int, timeout: float,
                 heartbeat_timeout: float | None = None, connect: Callable[[], dist.Store] | None = None) -> None:
        self.store, self.index, self.timeout = store, index, timeout
        # a new connection to the store for each rendezvous: a client's wait holds its connection, and a rendezvous
        # given up still waits in it (None: `store`'s)
        self._connect = connect
        # a sender's group whose heartbeat stops is lost: its state never comes (None: wait `timeout`)
        self._liveness = Liveness(store, heartbeat_timeout) if heartbeat_timeout is not None else None
        self.name = lane_source(group_id, index)
        self.number: int | None = None            # the quorum group this lane was formed for; None: none held
        self.size = 0                             # how many replica groups it joins
        self._rank = 0                            # this group's place among them (its row in the sum's header)
        self._pg: dist.ProcessGroup | None = None  # the hand-built gloo group
        self._sent: int | None = None             # the round whose state this lane wrote to the store

    def form(self, number: int, rank: int, size: int, members: list[str] | None = None) -> None:
        """Join lane `index` of quorum group `number` as `rank` of `size` (a group of one needs no peer).

        `members`: the member groups' ids in lane order; with them (and a heartbeat timeout) a member
        lost before it came ends the wait at once, `LaneLost` naming it.
        """
        self.drop()
        store = meeting(self.store, keys.lane(number, self.index))
        if members is not None and self._liveness is not None:
            self._roll_call(store, number, rank, members)
            own = meeting(self._connect(), keys.lane(number, self.index)) if self._connect is not None else store
            self._pg = self._rendezvous(own, number, rank, size, members)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=self.timeout))
        self.number, self.size, self._rank = number, size, rank

    def _roll_call(self, store: dist.Store, number: int, rank: int, members: list[str]) -> None:
        """Say this member came, and wait until every member did; LaneLost if one's group is gone or late."""
        names = [f"manualdp-came/{r}" for r in range(len(members))]  # beside gloo's keys, never one of them
        store.set(names[rank], "1")
        deadline = time.monotonic() + self.timeout
        while not store.check(names):
            missing = [members[r] for r, name in enumerate(names) if not store.check([name])]
            self._raise_if_lost(number, missing, deadline, "gone before the lane formed", "did not come")
            time.sleep(POLL)

    def _rendezvous(self, store: dist.Store, number: int, rank: int, size: int,
                    members: list[str]) -> dist.ProcessGroup:
        """gloo's rendezvous, on a thread of its own, given up (LaneLost) once a member group's heartbeat stops.

        A member lost after the roll call leaves gloo trying to connect to it for longer than its timeout (a
        minute and more), while this group's other ranks wait for this one inside the group: so this rank waits
        only while every member group lives, at most `timeout`; the thread, left behind, ends with gloo's error.
        """
        done, box = threading.Event(), {}

        def build() -> None:
            try:
                box["pg"] = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=self.timeout))
            except BaseException as e:  # noqa: BLE001 - raised again below, on the rank's own thread
                box["error"] = e
            done.set()
        threading.Thread(target=build, name=f"rendezvous of lane {self.name}", daemon=True).start()
        others, deadline = [m for r, m in enumerate(members) if r != rank], time.monotonic() + self.timeout
        while not done.wait(POLL):
            self._raise_if_lost(number, others, deadline, "lost during the lane's rendezvous", "did not connect")
        if "error" in box:
            raise box["error"]
        return box["pg"]

    def _raise_if_lost(self, number: int, waited: list[str], deadline: float, lost_words: str, late_words: str) -> None:
        """LaneLost if a group of `waited` is gone (its heartbeat stopped) or `deadline` (time.monotonic()) passed."""
        lost = sorted(set(waited) - self._liveness.live(waited))
        if lost:
            raise LaneLost(f"lane {self.name!r} of quorum group {number}: replica group(s) {', '.join(lost)} "
                           f"{lost_words} (heartbeat stopped); the step is asked again")
        if time.monotonic() > deadline:
            raise LaneLost(f"lane {self.name!r} of quorum group {number}: replica group(s) {', '.join(waited)} "
                           f"{late_words} within {self.timeout:g} s; the step is asked again")

    def drop(self) -> None:
        """Leave the lane held, if any (its peers are not told: their next collective on it fails)."""
        self._pg, self.number, self.size = None, None, 0

    def sum(self, tensor: torch.Tensor, names: list[str] | None = None,
            keep: Callable[[torch.Tensor], None] | None = None) -> None:
        """Sum `tensor` in place over the lane; RuntimeError if a peer failed or the lane is not held.

        ValueError on every member if the members' tensors differ in size or dtype; `names`: the
        member groups' ids in lane order, for that message. `keep(tensor)` runs before the sum on every
        member alike when any member's share might not sum finite (`share.may_not_sum`, told in the header).
        """
        if self._pg is None:
            raise RuntimeError(f"lane {self.name!r} is not held (its last step failed)")
        large = keep is not None and may_not_sum(tensor, self.size)
        if self._check_alike(tensor, names or [f"member {i}" for i in range(self.size)], large) and keep is not None:
            keep(tensor)
        self._pg.allreduce([tensor]).wait()

    def _check_alike(self, tensor: torch.Tensor, names: list[str], large: bool = False) -> bool:
        """Sum every member's (elements, dtype, large) row; ValueError on every member, naming each row, if the
        (elements, dtype) differ; whether any member's share is `large`."""
        code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        table = torch.zeros(self.size, 3, dtype=torch.int64)
        table[self._rank] = torch.tensor([tensor.numel(), code, int(large)])
        self._pg.allreduce([table]).wait()
        rows = [tuple(row[:2]) for row in table.tolist()]
        if len(set(rows)) > 1:
            named = "; ".join(f"{names[i]!r}: {n} elements of {_dtype_name(d)}" for i, (n, d) in enumerate(rows))
            raise ValueError(f"lane {self.name!r}: the groups average tensors of other sizes or dtypes ({named}); "
                             "each group's rank must pass the same tensor (the same model and arguments)")
        return any(row[2] for row in table.tolist())

    def send(self, round_: int, state: dict) -> str:
        """Write this lane's `state` for the receivers of `round_`; return its SHA-256."""
        check_loadable(state, self.name)
        digest = send_state(self.store, round_, self.name, state)
        self._sent = round_
        return digest

    def forget(self) -> None:
        """Remove the state this lane sent last (its receivers have read it, or given up)."""
        if self._sent is not None:
            forget_state(self.store, self._sent, self.name)
            self._sent = None

    def receive(self, round_: int, source_group: str, load: Callable[[dict], object]) -> dict:
        """Receive lane `index`'s state from `source_group` for `round_`, check it, load it; the record of it."""
        source = lane_source(source_group, self.index)
        live = self._liveness
        gone = None if live is None else lambda: source_group not in live.live([source_group])
        counted = CountedStore(self.store)  # the bytes that came: the state's blob and its SHA-256
        state, digest = receive_state(counted, round_, source, self.timeout, gone,
                                      f"replica group {source_group!r} (rank {self.index})")
        load(state)
        return {"round": round_, "source": source, "sha256": digest, "bytes": counted.received}


def gloo_words(error: BaseException, most: int = 80) -> str:
    """gloo's message in a few words on one line: its first sentence, without its source path, at most `most` chars."""
    # gloo's messages run to several lines (advice, a C++ trace): the first line that says something
    text = " ".join(next((line for line in str(error).splitlines() if line.strip()), "").split())
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", text).split(". ")[0].rstrip(".") or type(error).__name__
    return text if len(text) <= most else text[:most - 3] + "..."


def _dtype_name(code: int) -> str:
    """The dtype a header's `code` stands for."""
    return str(_DTYPES[code]) if code < len(_DTYPES) else "an unknown dtype"
