"""Resuming under torchrun: the ranks agree on one checkpoint that every one of them can read.

Every rank writes its own `checkpoint_dir/rank{r}/`; a kill can leave a rank one checkpoint
behind the others. The ranks exchange the position of their newest readable checkpoint and
all load the oldest of those, so they restart from one state, or all raise the same error.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..spmd.collectives import allreduce
from ..spmd.transport.agree import agree
from ..support.checkpoint import checkpoint_path, load_latest, read_checkpoint

__all__ = ["agree_on_checkpoint", "agree_on_run_id", "agree_all_succeed", "agree_all_saved",
           "agree_on_settings"]


def _exchange(value: int, device, algorithm: str, timeout: float | None) -> list[int]:
    """Every rank's `value` (ints >= -1), on every rank."""
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    everyone[dist.get_rank()] = value + 1
    allreduce(everyone, algorithm, timeout=timeout)
    return [v - 1 for v in everyone.tolist()]


def _position(state: dict) -> int:
    """Where a checkpoint sits in the run: after step s mid-epoch is 2s, after step s at the end of an epoch 2s + 1."""
    return 2 * state["global_step"] + (state["step_in_epoch"] == 0)


def _load_step(directory: str, position: int, fits) -> dict | None:
    step, end_of_epoch = divmod(position, 2)
    try:
        return read_checkpoint(checkpoint_path(directory, step, bool(end_of_epoch)), fits)
    except Exception:  # missing, damaged or not fitting: the caller tells every rank
        return None


def agree_all_succeed(error: Exception | None, device, algorithm: str, timeout: float | None) -> None:
    """Raise on every rank if `error` happened on any: a rank that raised alone would leave its peers waiting."""
    failed = _exchange(int(error is not None), device, algorithm, timeout)
    if error is not None:
        raise error
    if any(failed):
        raise ValueError(f"rank(s) {[r for r, f in enumerate(failed) if f]} could not start (see their error)")


def agree_all_saved(error: OSError | None, directory: str, device, algorithm: str, timeout: float | None) -> None:
    """Raise on every rank if any rank could not write its checkpoint into its `directory` (`.../rank<r>`).

    A full disk on one rank is then named on every rank, with that rank's folder and the reason,
    instead of the others losing a peer at their next step.
    """
    codes = _exchange(-1 if error is None else error.errno or 0, device, algorithm, timeout)
    if error is not None:
        raise error
    failed = [r for r, code in enumerate(codes) if code >= 0]
    if failed:
        r, code = failed[0], codes[failed[0]]
        folder = os.path.join(os.path.dirname(directory), f"rank{r}")
        raise OSError(code, f"rank {r} could not write its checkpoint in {folder}: "
                            f"{os.strerror(code) if code else 'an OS error'} (see its own error)")


def agree_on_settings(settings: dict, timeout: float | None) -> None:
    """Raise on every rank unless every rank trains with the same `settings` (learning rate, optimizer, ...)."""
    agree("the training setup", settings, timeout=timeout, check=True,
          hint="every rank must be given the same settings")


def agree_on_run_id(run_id: str, device, algorithm: str, timeout: float | None) -> str:
    """Rank 0's `run_id` (hex), on every rank."""
    words = [int(run_id[i:i + 8], 16) if dist.get_rank() == 0 else -1 for i in range(0, 16, 8)]
    return "".join(f"{max(_exchange(w, device, algorithm, timeout)):08x}" for w in words)


def agree_on_checkpoint(directory: str, device, algorithm: str, timeout: float | None, fits=None,
                        log=None, present: bool = True) -> dict | None:
    """The newest checkpoint that every rank holds intact, loaded on every rank; None if there is none.

    Every rank sees the same exchanged positions, so all of them return, or all raise the same
    error. A rank whose newest file is damaged or does not fit (`fits`) falls back to its one
    before, and so do the others. `present=False` says this rank's folder did not exist before
    the run started: then it was deleted, or written by another number of ranks, and we refuse.
    """
    state = load_latest(directory, fits)  # warns about, and skips, damaged files
    # Positions, not steps: a rank killed while rank 0 evaluates holds step s mid-epoch, its
    # peers may already hold step s at the end of the epoch, and those two states differ.
    newest = _exchange(-1 if state is None else _position(state), device, algorithm, timeout)
    parent = os.path.dirname(directory)
    if max(newest) < 0:
        return None
    sizes = _exchange(-1 if state is None else int(state.get("world_size") or 0), device, algorithm, timeout)
    written = {s for s in sizes if s >= 0}
    if written - {dist.get_world_size()}:
        raise ValueError(f"cannot resume from {parent}: its checkpoints were written by {sorted(written)} "
                         f"ranks, this run has {dist.get_world_size()}")
    folders = _exchange(int(present), device, algorithm, timeout)
    if min(newest) < 0 and min(folders) == 0:
        missing = [r for r, f in enumerate(folders) if f == 0]
        raise ValueError(f"cannot resume from {parent}: rank(s) {missing} have no readable checkpoint in "
                         f"their rank<r>/ folder (it is missing) while others do; were they written with another "
                         f"number of ranks, or was the folder deleted? Move {parent} aside to start afresh")
    if min(newest) < 0:
        # A rank killed before its first checkpoint (rank 0 during the first evaluation): no step
        # was saved by every rank, so the last complete state is the start.
        missing = [r for r, s in enumerate(newest) if s < 0]
        if log and dist.get_rank() == 0:
            log(f"rank(s) {missing} saved no checkpoint in {parent} before the run stopped: "
                "no step is complete on every rank, starting from the beginning")
        return None
    position = min(newest)
    if _position(state) != position:
        state = _load_step(directory, position, fits)
    loaded = _exchange(position if state is not None else -1, device, algorithm, timeout)
    if min(loaded) < 0:
        step = position // 2
        raise ValueError(f"cannot resume from {parent}: step {step} is the newest that every rank saved, but rank(s) "
                         f"{[r for r, s in enumerate(loaded) if s < 0]} cannot read it intact; "
                         f"move {parent} aside and start afresh")
    return state

