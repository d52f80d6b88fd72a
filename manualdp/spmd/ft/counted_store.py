"""`CountedStore`: a store seen through a counter of the bytes its reads return (what a recovery received)."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["CountedStore"]


class CountedStore:
    """`store`'s `check`, `get`, `peek` and `delete_key`, with `received`: the bytes every read returned so far
    (values, not keys)."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self.received = 0  # bytes read back: a state's blob and its SHA-256, as they came over the socket

    def check(self, names: list[str]) -> bool:
        return self._store.check(names)

    def get(self, name: str) -> bytes:
        value = self._store.get(name)
        self.received += len(value)
        return value

    def peek(self, name: str) -> bytes | None:
        value = self._store.peek(name)
        self.received += len(value or b"")
        return value

    def delete_key(self, name: str) -> bool:
        return self._store.delete_key(name)

    @property
    def signed(self) -> bool:
        return getattr(self._store, "signed", False)
