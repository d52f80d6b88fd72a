"""`split_batch(X, y, devices)` (chapter 1): every shard holds its near-equal slice of the batch, in memory of its
own, on its device; and what hypothesis draws for it (`DRAWN`)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from ....devices import cpu_devices
from ....split import shard_sizes
from .common import FLOATS, Mismatch, called, n_devices, show

__all__ = ["split_property", "split_devices_property", "split_sizes_property", "DRAWN", "SIZES"]


def split_property(split_batch, n: int, extra: int, features: int, dtype: torch.dtype) -> None:
    """Shard i holds the i-th near-equal slice of X and y (the first `batch % n` shards one row more), on
    devices[i], in memory of its own: writing into a shard leaves the caller's batch as it was."""
    batch = n + extra
    X = torch.arange(batch * features, dtype=dtype).reshape(batch, features)
    y = torch.arange(batch)
    X_kept, y_kept = X.clone(), y.clone()
    devices = cpu_devices(n)
    call = f"split_batch(X, y, devices) with X of shape {tuple(X.shape)}, y = torch.arange({batch}) and {n_devices(n)}"
    _, (X, y, _), out = called(call, split_batch, X, y, devices)  # X and y as the caller holds them after the call
    if not (torch.equal(X, X_kept) and torch.equal(y, y_kept)):
        raise Mismatch(f"{call}: the call changed the caller's X or y: split_batch must leave the batch as it was "
                       "(copy the rows into the shards; write nothing into X or y)")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise Mismatch(f"{call}: expected a pair (X_shards, y_shards), got {show(out)}")
    X_shards, y_shards = out
    for name, shards in (("X_shards", X_shards), ("y_shards", y_shards)):
        if not isinstance(shards, (tuple, list)) or not all(isinstance(s, torch.Tensor) for s in shards):
            raise Mismatch(f"{call}: expected {name} to be a list of tensors, got {show(shards)}")
        if len(shards) != n:
            raise Mismatch(f"{call}: expected {n} shards in {name}, one per device; got {len(shards)}")
    for name, shards, want in (("X_shards", X_shards, X_kept.dtype), ("y_shards", y_shards, y_kept.dtype)):
        for i, s in enumerate(shards):
            if s.dtype != want:
                raise Mismatch(f"{call}: expected {name}[{i}] to keep the batch's dtype, {str(want)[6:]}; got "
                               f"{str(s.dtype)[6:]}. Move the rows without converting them (`.to(device)` keeps the "
                               "dtype)")
    sizes = shard_sizes(batch, n)
    expected = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(n)]
    got = [s.tolist() for s in y_shards]
    if got != expected:
        raise Mismatch(f"{call}: expected the shards of y to be {_rows(expected)} (sizes {sizes}: near-equal, the "
                       f"first batch % n shards one longer); got {_rows(got)}")
    for i, (s, rows) in enumerate(zip(X_shards, expected)):
        if s.shape != X_kept[rows].shape or not torch.equal(s.cpu(), X_kept[rows]):
            raise Mismatch(f"{call}: expected X_shards[{i}] to be rows {_rows([rows])[1:-1]} of X, "
                           f"{show(X_kept[rows])}; "
                           f"got {show(s)}")
    for name, shards in (("X_shards", X_shards), ("y_shards", y_shards)):
        for i, s in enumerate(shards):
            s.fill_(-1)
            if not (torch.equal(X, X_kept) and torch.equal(y, y_kept)):
                raise Mismatch(f"{call}: writing into {name}[{i}] changed the caller's batch: "
                               "the shard is a view of it. "
                               "Copy each shard (`.to(device, copy=True)`): on simulated devices, all of them `cpu`, "
                               "`.to(device)` returns the very same memory")


def _rows(shards: list[list[int]]) -> str:
    """Shards of row numbers as read: each listed when short, else as its first..last row and its length."""
    return "[" + ", ".join(str(r) if len(r) <= 12 else f"[{r[0]}, ..., {r[-1]}] ({len(r)} rows)" for r in shards) + "]"


def split_devices_property(split_batch, n: int, extra: int, features: int, dtype: torch.dtype) -> None:
    """Shard i lives on devices[i]: told apart, on a machine with one CPU, by alternating cpu and meta (the grader's
    check; manualdp's own split_batch refuses meta, and tests/ holds it on real devices)."""
    if n == 1:
        return
    X = torch.arange((n + extra) * features, dtype=dtype).reshape(n + extra, features)
    y = torch.arange(n + extra)
    devices = [torch.device("cpu" if i % 2 == 0 else "meta") for i in range(n)]
    call = (f"split_batch(X, y, devices) with X of shape {tuple(X.shape)}, y = torch.arange({len(y)}) and "
            f"devices = [{', '.join(d.type for d in devices)}] (meta: a device that holds shapes but no values, so "
            "that the shards' devices differ)")
    _, _, out = called(call, split_batch, X, y, devices)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(s, (tuple, list)) and len(s) == n and all(isinstance(t, torch.Tensor) for t in s)
                    for s in out)):
        raise Mismatch(f"{call}: expected a pair (X_shards, y_shards) of {n} tensors each, got {show(out)}")
    for i, (a, b, d) in enumerate(zip(*out, devices)):
        if a.device != d or b.device != d:
            raise Mismatch(f"{call}: expected shard {i} on devices[{i}] = {d}; X's is on {a.device}, y's on "
                           f"{b.device}. Move shard i with `.to(devices[i], ...)`")


DRAWN = dict(n=st.integers(1, 8), extra=st.integers(0, 40), features=st.integers(1, 4), dtype=st.sampled_from(FLOATS))
SIZES = [dict(n=3, extra=10**6 - 2, features=1, dtype=torch.float32),
         dict(n=16, extra=5, features=2, dtype=torch.float64)]
"""Checked once by `split_sizes_property` (a million rows once, not for every example hypothesis draws)."""


def split_sizes_property(split_batch) -> None:
    """The sizes checked once, beside what hypothesis draws: a million rows on 3 devices, and 16 devices (the
    shards' slices and memory; where they lie is told by `split_devices_property`, whatever the size)."""
    for case in SIZES:
        split_property(split_batch, **case)
