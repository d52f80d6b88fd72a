"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile

__all__ = ["atomic_write", "write_json_atomic"]


@contextlib.contextmanager
def atomic_write(path, mode: str = "wb"):
    """Open a temporary file next to `path`; when the block succeeds, flush, fsync and rename it over `path`."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    folder, name = os.path.split(os.fspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _permissions(path))  # mkstemp makes 0600 files; give the usual mode instead
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
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


def write_json_atomic(path, obj) -> None:
    """Write `obj` as indented JSON to `path`, atomically."""
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2)
