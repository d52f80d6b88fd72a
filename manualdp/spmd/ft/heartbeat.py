"""Who is alive: each replica adds 1 to its counter in the store every `interval`; a counter that stops: gone.

A counter, not a time stamp: the replicas' clocks need not agree. Each observer notes, on its
own clock, when it last saw a counter move (`Liveness`); one that has not moved for `timeout`
seconds belongs to a replica that died (SIGKILL), stopped (SIGSTOP: its heartbeat thread
stops with it) or lost the network. A replica that leaves on purpose (`Heartbeat.stop(leave=True)`)
writes -1, and is gone at once.

Keys (`keys.py`): `replicas` (every id that registered, one a line) and `heartbeat/ID` (the counter).
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from . import keys

__all__ = ["Heartbeat", "Liveness", "register", "registered"]


def register(store: dist.Store, replica_id: str) -> None:
    """Add `replica_id` to the replicas the others wait for, with a counter that starts at 0 and no agreed state."""
    store.set(keys.held(replica_id), "")  # a new process holds no state of the run yet (quorum.py)
    store.set(keys.heartbeat(replica_id), "0")
    store.append(keys.REPLICAS, replica_id + "\n")


def registered(store: dist.Store) -> list[str]:
    """Every replica id that has ever registered, once each, in the order they first did."""
    if not store.check([keys.REPLICAS]):
        return []
    return list(dict.fromkeys(store.get(keys.REPLICAS).decode().split()))


class Heartbeat:
    """A daemon thread that adds 1 to `heartbeat/ID` every `interval` seconds, on a connection of its own.

    Its own connection: a wait of the main thread holds the main connection, and a heartbeat
    stuck behind it would make this replica look dead.
    """

    def __init__(self, store: dist.Store, replica_id: str, interval: float) -> None:
        self._store = store.clone()
        self._key = keys.heartbeat(replica_id)
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"manualdp-heartbeat-{replica_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        store = self._store
        while not self._stopped.wait(self._interval):
            try:
                store.add(self._key, 1)
            except Exception:  # noqa: S110 - the coordinator is gone: the main thread's next wait says so
                pass

    def stop(self, leave: bool = False) -> None:
        """Stop beating; with `leave`, mark this replica gone (-1) so that nobody waits for it."""
        self._stopped.set()
        self._thread.join(timeout=2 * self._interval + 1)
        if leave:
            try:
                self._store.set(self._key, "-1")
            except Exception:  # noqa: S110 - nobody is left to tell
                pass
        self._store = None  # close the connection: a store shutting down waits for its open ones


class Liveness:
    """One observer's view of which replicas are alive: those whose counter moved within `timeout` s of its clock."""

    def __init__(self, store: dist.Store, timeout: float) -> None:
        self._store = store
        self._timeout = timeout
        self._seen: dict[str, tuple[bytes, float]] = {}  # id -> (last counter value seen, when it was first seen)
        self._looked: float | None = None  # when this observer last looked

    def live(self, ids: list[str]) -> set[str]:
        """The ids among `ids` whose replica is alive now, as far as this observer can tell.

        A counter seen for the first time counts as moving now: a replica is given `timeout`
        seconds before it is called dead. So does every counter after this observer itself did
        not look for `timeout` s (it was stopped, or swapped out): its own silence says nothing
        of the others, who may have been stopped with it.
        """
        if not ids:
            return set()
        now = time.monotonic()
        if self._looked is not None and now - self._looked > self._timeout:
            self._seen.clear()
        self._looked = now
        alive = set()
        for replica, value in zip(ids, self._store.multi_get([keys.heartbeat(r) for r in ids])):
            last, since = self._seen.get(replica, (None, now))
            if value != last:
                since = now
            self._seen[replica] = (value, since)
            if value != b"-1" and now - since < self._timeout:
                alive.add(replica)
        return alive
