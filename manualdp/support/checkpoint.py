"""Checkpoints that survive a kill: atomic writes, the newest readable one wins on resume."""
from __future__ import annotations

import copy
import glob
import os
import random
import re
import time
import warnings
from dataclasses import asdict

import numpy as np
import torch

from ..validate import non_negative_int, positive_int
from .files import atomic_write

__all__ = ["TrainingState", "check_checkpoint_dir", "check_layout", "save_checkpoint", "load_latest", "checkpoint_path", "rng_state", "set_rng_state", "loader_generator"]

_NAME = re.compile(r"ckpt-(\d{8})(-epoch)?\.pt$")


def checkpoint_path(directory: str, step: int, end_of_epoch: bool = False) -> str:
    """The file of the checkpoint taken after global step `step`, mid-epoch or at the end of an epoch.

    Both can exist for one step (the step that ends an epoch, when it is also a multiple of
    `checkpoint_every`); they differ (the end-of-epoch one has been evaluated and starts the
    next epoch), so they get different names and the end-of-epoch one counts as newer.
    """
    return os.path.join(directory, f"ckpt-{step:08d}{'-epoch' if end_of_epoch else ''}.pt")


def _order(path: str) -> tuple[int, bool]:
    m = _NAME.search(path)
    return int(m.group(1)), m.group(2) is not None


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 2, end_of_epoch: bool = False) -> str:
    """Write `state` atomically (temporary file, flush, fsync, rename) and keep the newest `keep` files."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    non_negative_int("step", step)
    positive_int("keep", keep)
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, step, end_of_epoch)
    with atomic_write(path) as f:
        torch.save(state, f)
    _fsync_dir(directory)
    # Only checkpoints older than the one just written go: never delete what we just saved.
    older = [p for p in _checkpoints(directory) if _order(p) < (step, end_of_epoch)]
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


def check_layout(directory, per_rank: bool) -> None:
    """Refuse to resume one mode from the other's checkpoints: torchrun keeps them in rank<r>/ folders."""
    if not os.path.isdir(directory):
        return
    ranks = glob.glob(os.path.join(directory, "rank[0-9]*"))
    if per_rank and _checkpoints(directory):
        raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} holds single-process checkpoints; "
                         "a torchrun run keeps its own in rank<r>/ folders: use another folder")
    if not per_rank and ranks:
        raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} holds torchrun checkpoints (rank<r>/ folders); "
                         "resume them under torchrun with the same number of ranks, or use another folder")


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
    return sorted(paths, key=_order, reverse=True)


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


class TrainingState:
    """Where a training loop is (epoch, step, the epoch's running sums, RNG), and how to save and restore it.

    `train` and `train_spmd` share it; a resumed run replays the interrupted epoch's shuffle
    from the saved RNG states and skips the batches already trained, so it ends bitwise equal
    to an uninterrupted run.
    """

    def __init__(self, train_iter, checkpoint_dir):
        self.train_iter = train_iter
        self.checkpoint_dir = checkpoint_dir  # None: no checkpoints
        self.generator = loader_generator(train_iter)  # the loader's shuffling RNG, if it has its own
        self.epoch = 0            # current epoch
        self.step_in_epoch = 0    # batches of this epoch already trained
        self.global_step = 0      # batches trained since the start
        self.loss_sum = self.correct = self.seen = 0
        self.seconds = 0.0        # training time of this epoch before a resume
        self.epoch_rng = None     # RNG states at the start of this epoch: they decide its batches
        self.skip = 0             # batches to skip after a resume
        self._start = time.perf_counter()

    def batches(self, epoch):
        if self.skip:  # resuming mid-epoch: replay the epoch's shuffling, then the RNG as it was
            self._set_epoch_rng(self.epoch_rng)
            it = iter(self.train_iter)
            for _ in range(self.skip):
                next(it)
            set_rng_state(self.resume_rng)
            self.skip = 0
        else:
            self.epoch = epoch
            self.epoch_rng = self._epoch_rng()
            it = iter(self.train_iter)
        self._start = time.perf_counter()
        yield from it

    def record(self, result, n):
        self.loss_sum += result.loss
        self.correct += result.correct
        self.seen += n
        self.step_in_epoch += 1
        self.global_step += 1

    def end_epoch(self):
        self.epoch += 1
        self.step_in_epoch = 0
        self.loss_sum = self.correct = self.seen = 0
        self.seconds = 0.0

    def _epoch_rng(self):
        return {"rng": rng_state(), "loader": self.generator.get_state() if self.generator is not None else None}

    def _set_epoch_rng(self, state):
        set_rng_state(state["rng"])
        if self.generator is not None and state["loader"] is not None:
            self.generator.set_state(state["loader"])

    def save(self, replicas, optimizers, history, **extra):
        state = {
            "model": replicas[0].state_dict(), "optimizer": optimizers[0].state_dict(),
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "sums": (self.loss_sum, self.correct, self.seen),
            "seconds": self.seconds + (time.perf_counter() - self._start if self.step_in_epoch else 0.0),
            "epoch_rng": self.epoch_rng, "rng": rng_state(),
            "loader_rng": self.generator.get_state() if self.generator is not None else None,
            "history": asdict(history), **extra,
        }
        save_checkpoint(self.checkpoint_dir, self.global_step, state, end_of_epoch=self.step_in_epoch == 0)

    def resume(self, replicas, optimizers, history):
        state = load_latest(self.checkpoint_dir)
        if state is not None:
            self.restore(state, replicas, optimizers, history)
        return state

    def restore(self, state, replicas, optimizers, history):
        """Continue from `state`, a checkpoint `save` wrote."""
        for r, opt in zip(replicas, optimizers):
            r.load_state_dict(state["model"])
            # deepcopy: load_state_dict keeps the very tensors it is given (momentum buffers) when
            # device and dtype match, and replicas must never share storage.
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        for key, value in state["history"].items():
            setattr(history, key, value)
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        self.loss_sum, self.correct, self.seen = state["sums"]
        self.seconds = state["seconds"]
        if self.step_in_epoch:
            self.epoch_rng, self.resume_rng, self.skip = state["epoch_rng"], state["rng"], self.step_in_epoch
        else:  # saved at an epoch boundary: the RNG is exactly where the next epoch starts from
            set_rng_state(state["rng"])
            if self.generator is not None and state["loader_rng"] is not None:
                self.generator.set_state(state["loader_rng"])
