"""Checkpoints that survive a kill: atomic writes, the newest readable one wins on resume."""
from __future__ import annotations

import glob
import os
import random
import re
import warnings

import numpy as np
import torch

from .files import atomic_write

__all__ = ["check_checkpoint_dir", "save_checkpoint", "load_latest", "checkpoint_path", "rng_state", "set_rng_state", "loader_generator"]

_NAME = re.compile(r"ckpt-(\d{8})\.pt$")


def checkpoint_path(directory: str, step: int) -> str:
    """The file name of the checkpoint taken after global step `step`."""
    return os.path.join(directory, f"ckpt-{step:08d}.pt")


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 2) -> str:
    """Write `state` atomically (temporary file, flush, fsync, rename) and keep the newest `keep` files."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, step)
    with atomic_write(path) as f:
        torch.save(state, f)
    _fsync_dir(directory)
    # Only older steps than the one just written go: never delete what we just saved.
    older = [p for p in _checkpoints(directory) if int(_NAME.search(p).group(1)) < step]
    for old in older[keep - 1:]:
        os.remove(old)
    return path


def check_checkpoint_dir(directory, resume: bool) -> None:
    """Refuse a path that is a file, and, unless resuming, a folder that holds another run's checkpoints."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path, got {type(directory).__name__}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} exists and is not a folder")
    if not resume and os.path.isdir(directory) and _checkpoints(directory):
        raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} already holds checkpoints; "
                         "resume from them (resume=True, --resume) or use another folder")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoints(directory: str) -> list[str]:
    """Checkpoint files in `directory`, newest first."""
    paths = [p for p in glob.glob(os.path.join(directory, "ckpt-*.pt")) if _NAME.search(p)]
    return sorted(paths, key=lambda p: int(_NAME.search(p).group(1)), reverse=True)


def load_latest(directory: str) -> dict | None:
    """The newest checkpoint in `directory` that loads; unreadable ones (a kill mid-write) are skipped with a warning."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    for path in _checkpoints(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated or corrupt: fall back to the one before
            warnings.warn(f"skipping unreadable checkpoint {path}: {e}")
            continue
        state["path"] = path
        return state
    return None


def rng_state() -> dict:
    """Every random number generator a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def loader_generator(loader) -> torch.Generator | None:
    """The generator that decides a data loader's shuffling, if it has its own."""
    gen = getattr(loader, "generator", None)
    if gen is None:
        gen = getattr(getattr(loader, "sampler", None), "generator", None)
    return gen if isinstance(gen, torch.Generator) else None
