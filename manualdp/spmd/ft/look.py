"""One look at the store: what a replica reads to take one decision, each key read at most once.

A quorum's look reads the run's committed step three times (the claims, the marks, the floor),
the previous quorum twice, and checks each key before it gets it: two round trips where one
would do. A `Look` answers every read of a key after the first from what the first found, and
a `check` and the `get` after it in one round trip (`SignedStore.peek`); the keys a decision
reads that exist in a steady step are read together (`prefetch`: one `check`, one `multi_get`). torch's
`multi_get` waits for a missing key up to the client's timeout, so a key deleted between the two (a
stranger can) would stall the decision that long: the `multi_get` waits at most `VANISH` s, then each
key is read alone, and the vanished key is logged once.
A decision taken from one look is taken from one set of values, as if they were read at one
moment; the next look reads everything again. Writes go through at once, and the next read of a key written reads it
again.

Between two looks a replica waits for the one key a peer writes next (a round's quorum, its
outcome), peeking at it after a fifth of a millisecond, then at doubling intervals of at most `MOST`,
for up to `POLL` (`glance`): in a step where the members arrive together, that key is a moment away
(the peer's few round trips, 1-3 ms on a loaded 2-core host), and a pause that doubled past it (1.6 ms)
left the step waiting for the glance, not for the peer.
"""
from __future__ import annotations

import datetime
import time
from typing import Callable

import torch.distributed as dist

from .signed_store import SignedStore

__all__ = ["Look", "look", "peek", "prefetch", "glance", "POLL", "MOST"]

POLL = 0.005  # seconds between two looks at the store while waiting
FIRST = 0.0002  # seconds before the first glance at the key a peer writes next
MOST = 0.0008  # the longest pause between two glances: what a glance can add to the wait for that key
# seconds a prefetch's multi_get waits: its keys existed at its check, so only a deleted one waits that long, or a
# store stalled by a loaded host (0.5 s was passed by a store stopped for 1 s: a false line, and torch's C++ lines)
VANISH = 2.0


def look(store):
    """A `Look` at `store` (a `SignedStore`; any other store is read as it is)."""
    return Look(store) if isinstance(store, SignedStore) else store


def peek(store, key: str) -> bytes | None:
    """`key`'s value, or None if it holds none: one round trip on a `SignedStore`."""
    if isinstance(store, SignedStore):
        return store.peek(key)
    return store.get(key) if store.check([key]) else None


def prefetch(store, keys: list[str]) -> None:
    """Read `keys` into a `Look` in two round trips if they all hold a value (else nothing: each is read alone)."""
    if isinstance(store, Look):
        store.prefetch(keys)


def glance(ready: Callable[[], bool], seconds: float = POLL) -> None:
    """Wait up to `seconds`, asking `ready()` (one peek) after `FIRST` s, then at doubling intervals up to `MOST`;
    stop once True."""
    pause, end = FIRST, time.monotonic() + seconds
    while True:
        time.sleep(min(pause, max(0.0, end - time.monotonic())))
        if time.monotonic() >= end or ready():
            return
        pause = min(2 * pause, MOST)


class Look(SignedStore):
    """`store` for the length of one decision: each key read at most once; writes go through."""

    def __init__(self, store: SignedStore) -> None:
        super().__init__(store._client, store._secret, store._prefix)
        self._ignored = store._ignored  # a bad value is logged once per key, over all looks
        self._seen: dict[str, bytes | None] = {}

    def peek(self, key: str) -> bytes | None:
        if key not in self._seen:
            self._seen[key] = super().peek(key)
        return self._seen[key]

    def prefetch(self, keys: list[str]) -> None:
        """One `check` of the unread `keys` and, if they all exist, one `multi_get`: two round trips where n would do.

        Worth it only for keys that exist in a steady step: one missing costs the check and changes nothing.
        """
        unread = [k for k in dict.fromkeys(keys) if k not in self._seen]
        names = [self._name(k) for k in unread]
        if len(unread) < 2 or not self._client.check(names):
            return
        whole = self._client.timeout
        self._client.set_timeout(datetime.timedelta(seconds=VANISH))  # this client's own setting: no round trip
        try:
            raws = self._client.multi_get(names)
        except dist.DistStoreError:  # a key deleted since the check (a stranger can): read each alone
            # logged once per connection (the keys name each round, so a line per key set would repeat each round)
            self.ignore("prefetch", f"one of {', '.join(unread)} was deleted between its check and its read (a "
                                    f"stranger can delete keys), or the store took over {VANISH:g} s to answer: "
                                    f"each is read alone")
            return
        finally:
            self._client.set_timeout(whole)
        for key, raw in zip(unread, raws):
            self._seen[key] = self._open(key, raw)

    def check(self, keys: list[str]) -> bool:
        return all(self.peek(k) is not None for k in keys)

    def get(self, key: str) -> bytes:
        value = self.peek(key)
        return value if value is not None else super().get(key)  # waits, as the store's get does

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        unread = [k for k in dict.fromkeys(keys) if self._seen.get(k) is None]
        for key, value in zip(unread, super().multi_get(unread) if unread else []):
            self._seen[key] = value
        return [self._seen[k] for k in keys]

    def set(self, key: str, value) -> None:
        self._seen.pop(key, None)
        super().set(key, value)

    def append(self, key: str, value) -> None:
        self._seen.pop(key, None)
        super().append(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self._seen.pop(key, None)
        return super().compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._seen.pop(key, None)
        return super().delete_key(key)
