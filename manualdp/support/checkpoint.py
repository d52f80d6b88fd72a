"""Checkpoints that survive a kill and know whose they are.

Every file is written atomically and carries a SHA-256 of its contents, and the state holds
the run's identity (its configuration and a run id made at the first start). On resume the
newest checkpoint that is intact and fits the model wins; a damaged one is skipped with a
warning. A lock file, flock'd while a run lives, keeps a second run out of a folder in use.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import glob
import hashlib
import io
import json
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
import warnings
from dataclasses import asdict

import numpy as np
import torch

from ..validate import non_negative_int, positive_int
from .files import atomic_write

__all__ = ["TrainingState", "check_checkpoint_dir", "check_layout", "save_checkpoint", "load_latest", "read_checkpoint",
           "checkpoint_path", "rng_state", "set_rng_state", "loader_generator", "CheckpointError", "ConfigChanged",
           "lock_checkpoint_dir", "check_same_config", "new_run_id", "remove_orphans", "ALLOWED_CHANGES", "lock_path"]

_NAME = re.compile(r"ckpt-(\d{8})(-epoch)?\.pt$")
_FORMAT = "manualdp-checkpoint-2"  # a container {format, sha256, payload}; older files are the bare state
# Options a resumed run may change: they cannot make it differ from an uninterrupted run.
ALLOWED_CHANGES = frozenset({"num_epochs"})


class CheckpointError(ValueError):
    """A checkpoint that is damaged (checksum) or does not fit this run."""


class ConfigChanged(ValueError):
    """A resume with options other than the saved run's: never a reason to fall back to an older file."""


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


@contextlib.contextmanager
def _ctrl_c_after():
    """Ctrl-C inside the block raised as it ends: a checkpoint is written whole, never cut inside torch's zip writer
    (whose own error then replaced the KeyboardInterrupt: a traceback instead of `--resume`'s line)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # a handler of the user's own, or a thread: left as it is
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 2, end_of_epoch: bool = False) -> str:
    """Write `state` atomically (temporary file, flush, fsync, rename) and keep the newest `keep` files."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    non_negative_int("step", step)
    positive_int("keep", keep)
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, step, end_of_epoch)
    with _ctrl_c_after():
        # Serialise in memory first: a full disk is then a plain write error, not torch's "unexpected pos".
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        container = {"format": _FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}
        try:
            with atomic_write(path) as f:
                torch.save(container, f)
        except OSError as e:
            raise OSError(e.errno, f"cannot write checkpoint {path}: {e.strerror or e}") from e
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


def read_checkpoint(path: str, fits=None) -> dict:
    """The state in checkpoint file `path`, its checksum verified; `fits(state)` may raise CheckpointError too."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and state.get("format") == _FORMAT:
        payload = state["payload"]
        if hashlib.sha256(payload).hexdigest() != state["sha256"]:
            raise CheckpointError(f"checksum mismatch in {path}: the file was damaged after it was written")
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint (a {type(state).__name__})")
    state["path"] = path
    if fits is not None:
        fits(state)
    return state


def load_latest(directory: str, fits=None) -> dict | None:
    """The newest checkpoint in `directory` that is intact (and `fits`); damaged ones are skipped with a warning."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    for path in _checkpoints(directory):
        try:
            return read_checkpoint(path, fits)
        except ConfigChanged:
            raise
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {path}: {e}; falling back to the one before")
        except Exception as e:  # truncated or corrupt: fall back to the one before
            warnings.warn(f"skipping unreadable checkpoint {path}: {e}")
    return None


def remove_orphans(directory: str) -> list[str]:
    """Delete the temporary files that killed checkpoint writes left in `directory`; return their paths."""
    orphans = glob.glob(os.path.join(directory, "ckpt-*.pt.*.tmp"))
    for p in orphans:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)
    return orphans


def new_run_id() -> str:
    """A fresh run id, made once at a run's first start and kept in all its checkpoints."""
    return uuid.uuid4().hex[:16]


def check_same_config(saved: dict, now: dict, where: str, allowed=ALLOWED_CHANGES) -> None:
    """Refuse to resume when an option outside `allowed` differs from the saved run's; name every one."""
    changed = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now), key=str)
               if k not in allowed and saved.get(k) != now.get(k)]
    if changed:
        raise ConfigChanged(f"cannot resume from {where}: the configuration changed ({'; '.join(changed)}); "
                         f"only {', '.join(sorted(allowed))} may change on resume: "
                         "restore the options or use another folder")


def lock_path(directory: str) -> str:
    """Where `directory`'s lock lives: beside it (`ckpt.lock`), so the folder holds checkpoints only.

    The path is resolved first (symlinks, `..`, the working folder), so every name of one folder
    gives the same lock.
    """
    return os.path.realpath(directory) + ".lock"


def lock_checkpoint_dir(directory: str):
    """Take `directory`'s lock file, or raise if a live run holds it; return a function that releases it.

    The lock is an `flock` held on the file for as long as the run lives: taking it is one atomic
    call of the kernel, of several processes exactly one gets it, and the kernel lets go of it when
    its process dies, however it dies. The file names its process, for the message. A file with no
    `flock` on it is a killed run's (same host, pid not running, or a zombie): it is taken over with a
    warning, so a killed run never blocks its own resume. (One that names a live process, written by
    hand or by an older manualdp, is left alone.)
    """
    os.makedirs(directory, exist_ok=True)
    lock = lock_path(directory)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "token": uuid.uuid4().hex}
    for _ in range(10):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = _read_lock(lock)  # (it may still name the stale run that the holder is taking over from)
            who = f"process {owner.get('pid')} on {owner.get('host')}" if owner and _alive(owner) else "another run"
            raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} is in use by {who}; wait for it, "
                             f"or delete {lock} if that run is gone") from None
        try:
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(lock)  # its holder let go of it and removed it while we opened it
        except FileNotFoundError:
            os.close(fd)
            continue
        owner = _read_lock(lock)
        if owner is not None and _alive(owner):  # no flock, but a live process's name: not ours to take
            os.close(fd)
            raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} is in use by process {owner.get('pid')} "
                             f"on {owner.get('host')}; wait for it, or delete {lock} if that run is gone")
        if os.fstat(fd).st_size:
            warnings.warn(f"taking over the stale lock {lock} of a run that is gone ({owner})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)

        held = [fd]

        def release():
            if held:  # once: a second call does nothing
                fd = held.pop()
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                        os.remove(lock)  # before letting go: whoever takes the file after us finds it gone
                os.close(fd)
        return release
    raise ValueError(f"could not take the lock {lock}: another run keeps taking it")


def _read_lock(lock: str) -> dict | None:
    try:
        with open(lock) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # unreadable or damaged


def _alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # another machine's process: we cannot tell, so we never take its lock
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent has not collected it yet
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


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

    def __init__(self, train_iter, checkpoint_dir, config: dict | None = None):
        self.train_iter = train_iter
        self.checkpoint_dir = checkpoint_dir  # None: no checkpoints
        self.config = dict(config or {})  # the options that make this run this run
        self.run_id = new_run_id()        # replaced by the saved one on resume
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
            # a ZeRO optimizer's own shard (each rank saves its file); its state_dict() is the consolidated one only
            "model": replicas[0].state_dict(), "optimizer": getattr(optimizers[0], "shard_state_dict",
                                                                    optimizers[0].state_dict)(),
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "sums": (self.loss_sum, self.correct, self.seen),
            "seconds": self.seconds + (time.perf_counter() - self._start if self.step_in_epoch else 0.0),
            "epoch_rng": self.epoch_rng, "rng": rng_state(),
            "loader_rng": self.generator.get_state() if self.generator is not None else None,
            "history": asdict(history), "identity": {"config": self.config, "run_id": self.run_id}, **extra,
        }
        save_checkpoint(self.checkpoint_dir, self.global_step, state, end_of_epoch=self.step_in_epoch == 0)

    def resume(self, replicas, optimizers, history):
        remove_orphans(self.checkpoint_dir)
        state = load_latest(self.checkpoint_dir, self.fits(replicas[0]))
        if state is not None:
            self.check_identity(state)
            self.restore(state, replicas, optimizers, history)
        return state

    def fits(self, model):
        """A check that a loaded state is a whole checkpoint of `model` (same parameter names and shapes)."""
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

        def check(state):
            self.check_identity(state)  # a changed configuration is refused, not skipped
            missing = [k for k in ("model", "optimizer", "epoch", "step_in_epoch", "global_step", "sums", "rng",
                                   "epoch_rng", "history") if k not in state]
            if missing:  # without any of them the run would go on other than it would have, unseen
                raise CheckpointError(f"it lacks {', '.join(missing)}, which an exact resume needs")
            saved = {k: tuple(v.shape) for k, v in state["model"].items()} if isinstance(state["model"], dict) else {}
            if saved != shapes:
                diff = sorted(set(saved) ^ set(shapes)) or [k for k in shapes if saved[k] != shapes[k]]
                raise CheckpointError(f"its model does not fit this one (differs in {', '.join(diff[:3])}"
                                      f"{', ...' if len(diff) > 3 else ''})")
        return check

    def check_identity(self, state) -> None:
        """Refuse `state` if it was written with another configuration (see `ALLOWED_CHANGES`)."""
        identity = state.get("identity")
        if identity is not None:
            check_same_config(identity["config"], self.config, os.path.dirname(state["path"]))

    def restore(self, state, replicas, optimizers, history):
        """Continue from `state`, a checkpoint `save` wrote."""
        if state.get("identity") is not None:
            self.run_id = state["identity"]["run_id"]
        for r in replicas:
            r.load_state_dict(state["model"])
        for opt in optimizers:  # one per replica, or one that holds every device's shard (ZeRO)
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
