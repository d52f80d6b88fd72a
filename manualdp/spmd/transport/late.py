"""Two ranks on gloo: what happens when a checked call's first round of data is late.

The call's fingerprint is the tag its data travels on (`call_check.TagCheck`), so ranks that
call alike pair at once and send nothing more. Ranks that call differently post on different
tags, nothing pairs, and each waits for its first round. A `LateWatch` (one thread per group)
notices a call still waiting after `LATE` seconds and only then talks to the peer, through
the group's store, never by a message that could pair with data:

1. it writes this rank's fingerprint under its key ("late");
2. it reads the peer's: a peer late in another call, which is neither this call nor the one
   this rank finished last (a stale entry), is acknowledged ("ack": the peer's fingerprint);
3. once both have acknowledged each other, each writes that it refused the other's call (a key
   of its own per refused call) and settles what the other posted toward it
   (`call_check.TagCheck.settle`): the waits end, and both raise naming what each had.

A peer that is only slow writes nothing, or finishes its first round before acknowledging: its
data then pairs and the call goes on. When the first round ends on a rank that acknowledged,
the peer's refusal key says whether the peer settled it (written before settling) or the data
paired. The caller's thread never waits on the store while the calls agree; the
next call waits, if need be, until this rank's entry says "done".
"""
from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

__all__ = ["LATE", "LateWatch", "group_store"]

LATE = 0.05   # seconds a first round may take before the ranks compare fingerprints through the store
POLL = 0.002  # seconds before the first look at the peer's entry, once late; then twice as long each time,
POLL_MOST = 0.05  # up to this: a peer only slow (still in its backward) costs a few looks, not one per POLL
IDLE = 1.0    # seconds without a call after which the thread sleeps until the next one


def group_store(pg):
    """The store the process group `pg` was made with (a prefix of the default store for a new group); None for a
    group torch did not make (then the ranks exchange headers instead)."""
    entry = getattr(dist.distributed_c10d._world, "pg_map", {}).get(pg)
    return entry[1] if entry is not None else None


class LateWatch:
    """One group of two ranks on gloo: a thread that notices a late first round and settles a refused call."""

    def __init__(self, rank: int, store) -> None:
        self.store = store
        self.rank, self.key, self.peer_key = rank, f"manualdp/late/{rank}", f"manualdp/late/{1 - rank}"
        self._cv = threading.Condition()
        self._call = None       # the armed check (`call_check.TagCheck`), until its first round ends
        self._since = 0.0       # when it was armed
        self._last_arm = 0.0
        self._landed = False    # its first round has ended on this rank (data or settled)
        self._acked = None      # the peer's fingerprint this rank acknowledged during the call
        self._slow = None       # set once the store's side of a late call has ended; None: not late
        self._refused = None    # once the first round has ended: whether the call was refused
        self._stop = False      # the call failed (a peer gone): the thread gives up on it
        self._idle = True
        self._closed = False
        self._thread = None
        self.last = None        # the fingerprint of the last call whose first round ended
        self.late_calls = 0     # calls that were late (each cost a few store round trips, off the caller's thread)
        self.looks = 0          # looks at the peer's entry during late calls

    def arm(self, check) -> None:
        """Watch `check`'s first round from now on (after its receives are posted)."""
        slow = self._slow
        if slow is not None:  # the previous late call's entry must say "done" before this call's data goes out
            slow.wait()
        with self._cv:
            self._call, self._since, self._landed, self._acked = check, time.monotonic(), False, None
            self._slow, self._refused, self._stop, self._last_arm = None, None, False, self._since
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="manualdp-late", daemon=True)
                self._thread.start()
            elif self._idle:
                self._cv.notify()

    def landed(self) -> list[int] | None:
        """The first round has ended here: None if the call agreed, else the peer's fingerprint (refused).

        A rank that acknowledged the peer's entry may have had its round completed by the peer's
        settling, which the peer does only after writing that it refused this rank's fingerprint
        (a key of its own, never overwritten): that key, read now, tells. Else the data paired.
        """
        with self._cv:
            self._landed = True
            self._cv.notify_all()
            acked, row = self._acked, self._call.compared
        verdict = acked if acked is not None and self._peer_refused(row) else None
        with self._cv:
            self._refused = verdict is not None  # the thread settles the peer's round, or says "done"
            self.last = row
            slow = self._slow
        if verdict is not None:  # the peer's round waits for this rank's settling: done before the caller raises
            slow.wait()
        return verdict

    def abandon(self) -> None:
        """The call failed before its first round ended: stop watching it."""
        with self._cv:
            self._stop = True
            self._landed = True
            self._cv.notify_all()

    def close(self) -> None:
        """The group is gone: the thread ends."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                call, since = self._call, self._since
                if call is None or self._landed or self._slow is not None:
                    self._idle = time.monotonic() - self._last_arm > IDLE
                    self._cv.wait(None if self._idle else LATE)
                    continue
                left = since + LATE - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._slow = slow = threading.Event()
                self.late_calls += 1
            try:
                self._compare(call)
            except Exception:  # noqa: S110 - a peer gone: the caller's own wait names it (`PeerError`)
                pass
            finally:
                slow.set()

    def _refusal(self, rank: int, row: list[int]) -> str:
        """The key under which group rank `rank` says it refused the call whose fingerprint is `row`."""
        return f"manualdp/refused/{rank}/{json.dumps(row)}"

    def _peer_refused(self, row: list[int]) -> bool:
        return self.store.check([self._refusal(1 - self.rank, row)])

    def _entry(self) -> dict | None:
        if not self.store.check([self.peer_key]):
            return None
        return json.loads(self.store.get(self.peer_key))

    def _compare(self, call) -> None:
        """The store's side of one late call, until the first round has ended here and, if the ranks called
        differently, the peer's round is settled."""
        me = call.compared
        self.store.set(self.key, json.dumps({"row": me, "ack": None}))
        deadline = time.monotonic() + (call.timeout or 1800.0)
        acked, pause = None, POLL
        while time.monotonic() < deadline:
            with self._cv:
                if self._stop or (self._landed and (acked is None or self._refused is False)):
                    break  # the data paired (or the call failed): not a mismatch
                last = self.last
            peer = self._entry()
            row = peer and peer["row"]
            if row is not None and acked is None and not peer.get("refused") and row not in (me, last):
                with self._cv:
                    if self._landed:
                        break
                    self._acked = acked = row
                self.store.set(self.key, json.dumps({"row": me, "ack": acked}))
            if acked is not None and ((row == acked and peer["ack"] == me) or self._peer_refused(me)):
                self.store.set(self._refusal(self.rank, acked), json.dumps(me))  # before the peer's round ends
                self.store.set(self.key, json.dumps({"row": me, "ack": acked, "refused": True}))
                call.settle(acked)
                return  # the entry stays: the peer may not have read it yet
            self.looks += 1
            with self._cv:  # woken as the first round lands: the next call waits for this entry's "done"
                waiting = not (self._landed or self._stop)
                if waiting:
                    self._cv.wait(pause)
            if not waiting:  # landed and refused: the peer's acknowledgement is a moment away
                time.sleep(POLL)
            pause = min(2 * pause, POLL_MOST)
        self.store.set(self.key, json.dumps({"row": None, "ack": None}))  # done: never read as late again
