"""A replica's history on disk, `DIR/ID/steps.jsonl`: one JSON line per durable step, never a step twice.

A step is logged once it is durable (`durable.py`). A replica that goes on from an older state
than its history's last step (its newest checkpoint was damaged, and it resumed from the one
before, or received an older state) takes those steps again: `append_step` then cuts the
history back to the step before the one it logs, so that the file says what the run's state
holds, each step once. `logged_steps` tells a folder that has a history from one that has none:
with a history but no intact checkpoint, the run cannot go on, and must not start again from 0.

`lock_folder` keeps a replica's folder its own for the process's life (a POSIX lock on
`DIR/ID/.lock`, let go by the kernel when the process ends, however it ends): a second run given
the same `--checkpoint-dir`, or the same replica started twice, is refused in one line before it
writes anything, instead of the two overwriting each other's checkpoints mid-run.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os

from ...support.files import atomic_write

__all__ = ["append_step", "logged_steps", "logged_lines", "lock_folder", "NAME"]

NAME = "steps.jsonl"
_HELD: dict[str, int] = {}  # folder -> the open lock file: a POSIX lock is the process's, kept until it ends


def _steps(path: str) -> list[tuple[int, str]]:
    """(step, line) for each well-formed line of the history at `path`; [] if there is none."""
    found = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue  # a line cut by a kill: not a step
                if type(step) is int:
                    found.append((step, line if line.endswith("\n") else line + "\n"))
    except FileNotFoundError:
        return []
    return found


def append_step(folder: str, record: dict, last: int | None) -> int:
    """Log `record` (a dict with an int "step") in `folder/steps.jsonl`; the last step logged, for the next call.

    `last`: what the previous call returned (None: the first call of this process). A record at
    or below it, or the first, cuts the history back to the steps before it first (written
    atomically: a line cut short by a kill goes too), so that no step is in the file twice.
    """
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        raise ValueError(f"record must be a dict with an int 'step', got {record!r}")
    path = os.path.join(folder, NAME)
    step = record["step"]
    line = json.dumps(record) + "\n"
    if last is None or step <= last:  # first in this process: rewrite, so a line a kill cut short goes too
        kept = "".join(text for s, text in _steps(path) if s < step)
        with atomic_write(path, "w") as f:
            f.write(kept + line)
    else:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
    return step


def logged_steps(directory: str) -> tuple[int, str] | None:
    """The most steps any replica's history below `directory` logged, and that file; None if none logged any."""
    best = None
    for path in sorted(glob.glob(os.path.join(directory, "*", NAME))):
        steps = [s for s, _ in _steps(path)]
        if steps and (best is None or max(steps) + 1 > best[0]):
            best = (max(steps) + 1, path)
    return best


def logged_lines(directory: str) -> set[str]:
    """Every line of every replica's history below `directory` (each ends with a newline)."""
    return {text for path in glob.glob(os.path.join(directory, "*", NAME)) for _, text in _steps(path)}


def lock_folder(folder: str) -> None:
    """Make `folder` (created if need be) this process's for its life; ValueError in one line if another holds it."""
    if not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder):
        raise ValueError(f"folder must be a path, got {folder!r}")
    folder = os.path.realpath(folder)
    if folder in _HELD:
        return  # this process holds it already (a Manager made again in one process)
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"checkpoint folder {folder!r} is in use by another live process (a second run given the "
                         f"same --checkpoint-dir, or this replica started twice): give this run its own "
                         f"--checkpoint-dir, or stop the other first") from None
    _HELD[folder] = fd
