"""Writes to what the user named: a crash leaves a regular file old or new, never half of one.

A regular file (or a path that does not exist yet) is written to a temporary file that is
renamed over it. A symlink gets its target written that way; the link stays. A FIFO, a
device (`/dev/null`) or `/dev/stdout` is written in place: renaming over it would replace
the device with a plain file, and its reader would never see a byte.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import sys
import tempfile

__all__ = ["atomic_write", "write_json_atomic", "writes_in_place", "json_safe", "output_problem"]


def writes_in_place(path) -> bool:
    """True when `path` is a FIFO, a device, a socket or a /proc or /dev file: written in place, never renamed over."""
    try:
        mode = os.stat(path).st_mode  # follows symlinks: /dev/stdout -> /proc/self/fd/1 -> a pipe or a tty
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        return False
    # /dev/stdout redirected to a regular file is still the shell's open file: replace it and
    # everything printed after goes to a deleted inode. So any link on the way through /dev or
    # /proc means in place.
    return not stat.S_ISREG(mode) or any(p.startswith(("/dev/", "/proc/")) for p in _link_chain(path))


def _own_fd(path) -> int | None:
    """The descriptor `path` stands for when it is /dev/stdout, /dev/stderr or /proc/self/fd/N, else None."""
    names = {"/dev/stdout": 1, "/dev/stderr": 2}
    for p in _link_chain(path):
        if p in names:
            return names[p]
        for prefix in ("/proc/self/fd/", "/dev/fd/", f"/proc/{os.getpid()}/fd/"):
            if p.startswith(prefix) and p[len(prefix):].isdigit():
                return int(p[len(prefix):])
    return None


def _link_chain(path) -> list[str]:
    """`path` and every path its symlinks lead through, absolute."""
    chain = [os.path.abspath(path)]
    while os.path.islink(chain[-1]) and len(chain) < 40:
        chain.append(os.path.abspath(os.path.join(os.path.dirname(chain[-1]), os.readlink(chain[-1]))))
    return chain


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """Open `path` for writing: atomically (temporary file, fsync, rename) for a regular file, in place
    for a special one."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    if os.fspath(path) == "":
        raise ValueError("path must not be empty, got ''")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{os.fspath(path)!r} is a directory")
    if writes_in_place(path):
        fd = _own_fd(path)
        if fd is not None:  # our stdout or stderr: write at its position (reopening would truncate a redirect)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            f = os.fdopen(os.dup(fd), mode)
        else:
            f = open(path, mode)
        with f:
            yield f
        return
    # A symlink (or a chain of them) names its target: write that, and keep the link.
    target = os.path.realpath(path) if os.path.islink(path) else os.fspath(path)
    folder, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _permissions(target))  # mkstemp makes 0600 files; give the usual mode instead
        os.replace(tmp, target)  # atomic on POSIX: readers see the old file or the new one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _permissions(path) -> int:
    """The mode a plain `open(path, "w")` would give: the old file's, or 0o666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def json_safe(obj):
    """`obj` with every NaN or infinite float replaced by None: standard JSON has no NaN (it is written `null`)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json_atomic(path, obj) -> None:
    """Write `obj` as indented standard JSON to `path` (NaN and inf become null), atomically where `path` allows."""
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False)  # serialise first: a failure writes nothing
    with atomic_write(path, "w") as f:
        f.write(text)


def output_problem(path, need_bytes: int = 1 << 20, folder: bool = False) -> str | None:
    """Why writing `need_bytes` to `path` (a file, or with `folder=True` a folder of files) would fail;
    None if it would not.

    Tries it: a temporary file is made and removed where the output will go, so a read-only
    file system, missing permissions (also for root) and a full disk are found before any work.
    """
    if os.fspath(path) == "":
        return "the path is empty"
    if not folder and os.path.isdir(path):
        return "is a directory"
    if not folder and writes_in_place(path):
        return None if os.access(path, os.W_OK) else "it cannot be opened for writing"
    target = os.path.realpath(path)
    if folder:
        if os.path.exists(target) and not os.path.isdir(target):
            return "it exists and is not a folder"
        where = target
        while not os.path.isdir(where):  # the first folder that exists: the run will make the rest
            where = os.path.dirname(where)
    else:
        if os.path.isdir(target):
            return "is a directory"
        where = os.path.dirname(target)
        if not os.path.isdir(where):
            return f"its folder {where} does not exist"
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        return f"cannot write in {where}: {e.strerror or e}"
    free = shutil.disk_usage(where).free
    if free < need_bytes:
        return f"only {free / 2**20:.1f} MiB free in {where}, about {need_bytes / 2**20:.1f} MiB needed"
    return None
