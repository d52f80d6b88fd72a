"""Who is alive: each replica moves its counter in the store every `interval`; a counter that stops: gone.

A counter, not a time stamp: the replicas' clocks need not agree. The value is "NONCE COUNTER":
the nonce is new in each process, so that a value copied back in time (a stranger replaying an
old, signed one) does not move, and a replica started again counts from 0 under a new nonce. Each observer notes, on its
own clock, when it last saw a counter move (`Liveness`); one that has not moved for `timeout`
seconds belongs to a replica that died (SIGKILL), stopped (SIGSTOP: its heartbeat thread
stops with it) or lost the network. A replica that leaves on purpose (`Heartbeat.stop(leave=True)`)
writes -1, and is gone at once. A value that is not "NONCE COUNTER" is ignored (logged), never fatal.

Keys (`keys.py`): `replicas` (every id that registered, one a line) and `heartbeat/ID` (the counter).
"""
from __future__ import annotations

import secrets
import threading
import time

import torch.distributed as dist

from . import keys
from .signed_store import ignore

__all__ = ["Heartbeat", "Liveness", "register", "registered", "nonce_of"]


def register(store: dist.Store, replica_id: str) -> None:
    """Add `replica_id` to the replicas the others wait for, with a counter that starts at 0 and no agreed state."""
    store.set(keys.held(replica_id), "")  # a new process holds no state of the run yet (quorum.py)
    store.set(keys.heartbeat(replica_id), f"{secrets.token_hex(8)} 0")
    store.append(keys.REPLICAS, replica_id + "\n")


def registered(store: dist.Store) -> list[str]:
    """Every replica id that has ever registered, once each, in the order they first did."""
    if not store.check([keys.REPLICAS]):
        return []
    ids = store.get(keys.REPLICAS).decode(errors="replace").split()
    bad = [r for r in ids if "/" in r or not r.isprintable()]
    if bad:
        ignore(store, keys.REPLICAS, f"{len(bad)} id(s) that no replica can take, such as {bad[0][:40]!r}")
    return [r for r in dict.fromkeys(ids) if r not in bad]


def nonce_of(store: dist.Store, replica_id: str) -> str | None:
    """The nonce of the process now beating as `replica_id`, or None if it has no heartbeat (or a malformed one)."""
    key = keys.heartbeat(replica_id)
    beat = _beat(store.get(key)) if store.check([key]) else None
    return beat[0] if beat is not None else None


def _own_nonce(store: dist.Store, key: str) -> str:
    """The nonce `register` just wrote under `key` in this process, or a new one."""
    beat = _beat(store.get(key)) if store.check([key]) else None
    return beat[0] if beat is not None else secrets.token_hex(8)


class Heartbeat:
    """A daemon thread that counts `heartbeat/ID` up every `interval` seconds, on a connection of its own.

    Its own connection: a wait of the main thread holds the main connection, and a heartbeat
    stuck behind it would make this replica look dead.
    """

    def __init__(self, store: dist.Store, replica_id: str, interval: float) -> None:
        self._store = store.clone()
        self._key = keys.heartbeat(replica_id)
        self._interval = interval
        self._nonce = _own_nonce(self._store, self._key)  # the one `register` wrote: one nonce per process
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"manualdp-heartbeat-{replica_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        store, count = self._store, 0
        while not self._stopped.wait(self._interval):
            count += 1
            try:
                store.set(self._key, f"{self._nonce} {count}")
            except Exception:  # noqa: S110 - the coordinator is gone: the main thread's next wait says so
                pass

    def stop(self, leave: bool = False) -> None:
        """Stop beating; with `leave`, mark this replica gone (-1) so that nobody waits for it."""
        self._stopped.set()
        # No timeout: a beat still in flight would land after it, under this process's old nonce, over the
        # same id started again in this process (a new nonce) or over the -1 below; the store's own timeout ends it.
        self._thread.join()
        if leave:
            try:
                self._store.set(self._key, f"{self._nonce} -1")
            except Exception:  # noqa: S110 - nobody is left to tell
                pass
        self._store = None  # close the connection: a store shutting down waits for its open ones


class Liveness:
    """One observer's view of which replicas are alive: those whose counter moved within `timeout` s of its clock.

    A counter moves when it goes above the highest this observer saw under the same nonce: a
    value written again, or copied back from earlier, does not. -1 (left) counts only under the
    nonce that moved last: an old incarnation's -1, replayed, ejects nobody.
    """

    def __init__(self, store: dist.Store, timeout: float) -> None:
        self._store = store
        self._timeout = timeout
        self._counts: dict[tuple[str, str], int] = {}  # (id, nonce) -> the highest count seen under it
        self._moved: dict[str, tuple[str, float]] = {}  # id -> (the nonce that moved last, when it moved)
        self.left: set[str] = set()  # the ids whose replica left on purpose (-1), as of the last look
        self._looked: float | None = None  # when this observer last looked

    @property
    def seen(self) -> list[str]:
        """The ids whose counter this observer has seen move: the heartbeats a look may read ahead (`look.prefetch`)."""
        return list(self._moved)

    def nonce(self, replica_id: str) -> str | None:
        """The nonce whose counter moved last for `replica_id`, as far as this observer saw (None: never seen)."""
        return self._moved.get(replica_id, (None,))[0]

    def live(self, ids: list[str], store: dist.Store | None = None) -> set[str]:
        """The ids among `ids` whose replica is alive now, as far as this observer can tell.

        A counter seen for the first time counts as moving now: a replica is given `timeout`
        seconds before it is called dead. So does every counter after this observer itself did
        not look for `timeout` s (it was stopped, or swapped out): its own silence says nothing
        of the others, who may have been stopped with it.
        """
        now, store = time.monotonic(), store if store is not None else self._store  # a look's, or this observer's
        if self._looked is not None and now - self._looked > self._timeout:
            self._moved = {r: (nonce, now) for r, (nonce, _) in self._moved.items()}
        self._looked = now
        known = [r for r in ids if r in self._moved or store.check([keys.heartbeat(r)])]
        if len(known) < len(ids):  # `register` writes the heartbeat before the id: an id without one is forged
            missing = sorted(set(ids) - set(known))[:3]
            ignore(store, keys.REPLICAS, f"ids without a heartbeat (or one that verifies): {missing}")
        ids = known
        if not ids:
            return set()
        for replica, value in zip(ids, store.multi_get([keys.heartbeat(r) for r in ids])):
            beat = _beat(value)
            if beat is None:
                ignore(store, keys.heartbeat(replica), f"{(value or b'')[:40]!r} is not 'NONCE COUNTER'")
            else:
                self._note(replica, *beat, now)
        return {r for r in ids if r in self._moved and r not in self.left and now - self._moved[r][1] < self._timeout}

    def _note(self, replica: str, nonce: str, count: int, now: float) -> None:
        if count == -1:
            if self._moved.get(replica, (nonce,))[0] == nonce:
                self.left.add(replica)
            return
        if count > self._counts.get((replica, nonce), -1):
            self._counts[replica, nonce] = count
            self._moved[replica] = (nonce, now)
            self.left.discard(replica)


def _beat(value: bytes | None) -> tuple[str, int] | None:
    """("NONCE", COUNT) from a heartbeat's value, or None if it is not one."""
    parts = value.split() if value is not None else []
    if len(parts) != 2 or not parts[0].isalnum() or not parts[1].lstrip(b"-").isdigit():
        return None
    return parts[0].decode(), int(parts[1])
