"""Resuming under torchrun: the ranks agree on one checkpoint that every one of them can read.

Every rank writes its own `checkpoint_dir/rank{r}/`; a kill can leave a rank one checkpoint
behind the others. The ranks exchange the position of their newest readable checkpoint and
all load the oldest of those, so they restart from one state, or all raise the same error.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..spmd.p2p import allreduce
from ..support.checkpoint import checkpoint_path, load_latest

__all__ = ["agree_on_checkpoint"]


def _exchange(value: int, device, algorithm: str, timeout: float | None) -> list[int]:
    """Every rank's `value` (ints >= -1), on every rank."""
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    everyone[dist.get_rank()] = value + 1
    allreduce(everyone, algorithm, timeout=timeout)
    return [v - 1 for v in everyone.tolist()]


def _position(state: dict) -> int:
    """Where a checkpoint sits in the run: after step s mid-epoch is 2s, after step s at the end of an epoch 2s + 1."""
    return 2 * state["global_step"] + (state["step_in_epoch"] == 0)


def _load_step(directory: str, position: int) -> dict | None:
    step, end_of_epoch = divmod(position, 2)
    path = checkpoint_path(directory, step, bool(end_of_epoch))
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # missing, truncated or corrupt: the caller tells every rank
        return None
    state["path"] = path
    return state


def agree_on_checkpoint(directory: str, device, algorithm: str, timeout: float | None) -> dict | None:
    """The newest checkpoint step that every rank can read, loaded on every rank; None if no rank has any.

    Every rank sees the same exchanged steps, so all of them return, or all raise the same error.
    """
    state = load_latest(directory)  # warns about, and skips, files a kill left unreadable
    # Positions, not steps: a rank killed while rank 0 evaluates holds step s mid-epoch, its
    # peers may already hold step s at the end of the epoch, and those two states differ.
    newest = _exchange(-1 if state is None else _position(state), device, algorithm, timeout)
    parent = os.path.dirname(directory)
    if max(newest) < 0:
        return None
    if min(newest) < 0:
        missing = [r for r, s in enumerate(newest) if s < 0]
        raise ValueError(f"cannot resume from {parent}: rank(s) {missing} have no readable checkpoint in "
                         f"their rank<r>/ folder while others do (newest steps per rank: {[max(s, -1) // 2 if s >= 0 else None for s in newest]}); "
                         "were they written with another number of ranks?")
    position = min(newest)
    if _position(state) != position:
        state = _load_step(directory, position)
    loaded = _exchange(position if state is not None else -1, device, algorithm, timeout)
    if min(loaded) < 0:
        step = position // 2
        raise ValueError(f"cannot resume from {parent}: step {step} is the newest that every rank saved, but rank(s) "
                         f"{[r for r, s in enumerate(loaded) if s < 0]} cannot read it")
    if state.get("world_size") != dist.get_world_size():
        raise ValueError(f"cannot resume from {parent}: its checkpoints were written by {state.get('world_size')} "
                         f"ranks, this run has {dist.get_world_size()}")
    return state

