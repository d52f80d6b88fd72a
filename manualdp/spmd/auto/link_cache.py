"""The constants of a link known without measuring: from `MANUALDP_LINK`, else this host's cache.

Rank 0 keeps what a calibration measured in a small JSON file per (backend, world size, host)
(`cache_path`), so that the next run skips the calibration. A cache is only trusted when it
is this version's, recent and well formed: anything else is measured again. `parallel` is
never cached but counted from the host (`host_parallel`), which can change between runs.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import time
import warnings
from dataclasses import asdict

from ...cost import MAX_DUPLEX
from ...support.files import write_json_atomic
from ...validate import is_int, non_negative_number, positive_int
from .pick import MAX_SECONDS, Link

__all__ = ["ENV", "MEASURED", "CALIBRATION", "MAX_CACHE_AGE", "host_parallel", "cache_path", "known_link", "save"]

ENV = "MANUALDP_LINK"  # "alpha,beta,gamma[,duplex[,parallel]]" in s, s/byte, s/byte, 0..1, ranks: skips the calibration
MEASURED = ("alpha", "beta", "gamma", "duplex", "duplex_spread")  # what a calibration measures and the cache keeps
CALIBRATION = 4  # the cache's "calibration": bumped when the measurement changes, so older caches are measured again
MAX_CACHE_AGE = 24 * 3600.0  # seconds: a host's load changes, and with it the link; older constants are measured again
MAX_CACHE_BYTES = 4096  # a cache is a few numbers; a larger file is not one (and /dev/zero never ends)


def host_parallel(backend: str, world_size: int) -> int:
    """How many of `world_size` ranks can work at once: 0 (all) unless a host has fewer cores than ranks.

    On GPUs (NCCL) every rank has its own device: 0. On CPUs, each host runs
    `LOCAL_WORLD_SIZE` ranks (torchrun sets it; otherwise all ranks are on this host) on this
    host's cores, one core per rank at most.
    """
    positive_int("world_size", world_size)
    if backend == "nccl":
        return 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local <= 0 or cores >= local:
        return 0
    return max(1, world_size // local) * cores

def cache_path(backend: str, world_size: int, host: str | None = None) -> str:
    """Where rank 0 keeps the constants it measured for (backend, world size, host)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    host = host or socket.gethostname()
    return os.path.join(root, "manualdp", f"link-{backend}-{world_size}-{host}.json")


def known_link(backend: str, world_size: int) -> tuple[Link | None, str]:
    """The constants known without measuring, and where from: `MANUALDP_LINK`, else this host's cache.

    (None, cache path) when neither has them; a cache written by another version of manualdp,
    whose model had other constants or whose calibration measured otherwise, counts as none, and
    so does one measured more than `MAX_CACHE_AGE` seconds ago (or, by the clock, later than now). A
    cache that cannot be read as one (not a regular file, too large, not its JSON, constants out
    of range) counts as none too, with a one-line warning that names it. A bad `MANUALDP_LINK` is
    a `ValueError`. `parallel` comes from the variable when it gives one (else 0), from the host
    (`host_parallel`) with the cache.
    """
    if os.environ.get(ENV):
        return _parse_env(os.environ[ENV]), f"${ENV}"
    path = cache_path(backend, world_size)
    try:
        saved = _read_json(path)
    except FileNotFoundError:
        return None, path
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: deeply nested lists
        return _ignored(path, e)
    if not isinstance(saved, dict):
        return _ignored(path, f"a JSON {type(saved).__name__}, not an object")
    version = saved.pop("calibration", None)
    if version is None or (is_int(version) and version != CALIBRATION):
        return None, path  # another version's: measured again, silently
    if version != CALIBRATION or sorted(saved) != sorted((*MEASURED, "measured_at")):
        return _ignored(path, f"keys {sorted(saved)[:8]}, calibration {version!r:.20}; "
                              f"expected {sorted((*MEASURED, 'measured_at'))}")
    try:
        age = time.time() - non_negative_number("measured_at", saved.pop("measured_at"))
        link = Link(**saved, parallel=host_parallel(backend, world_size))
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an int no float holds
        return _ignored(path, e)
    return (link, path) if -60.0 <= age <= MAX_CACHE_AGE else (None, path)  # old: measured again, silently


def _parse_env(value: str) -> Link:
    try:
        values = value.split(",")
        if not 3 <= len(values) <= 5:
            raise ValueError(f"{len(values)} values, not 3 to 5")
        parallel = int(values.pop()) if len(values) == 5 else 0
        return Link(*(float(v) for v in values), parallel=parallel)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ENV} must be 'alpha,beta,gamma[,duplex[,parallel]]' (numbers from 0 to {MAX_SECONDS} s, "
                         f"duplex from 0 to {MAX_DUPLEX:g}, parallel a whole number of ranks), got {_short(value)} "
                         f"({_short(e)})") from e


def _short(x, limit: int = 100) -> str:
    """`x` on one line, cut to about `limit` characters: a value can be a million digits long."""
    text = repr(x) if isinstance(x, str) else " ".join(str(x).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _read_json(path: str):
    """The JSON in the regular file `path` of at most MAX_CACHE_BYTES; never reads a FIFO (it would block)
    or a device."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO without a writer: opens at once
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_CACHE_BYTES + 1)
    if len(data) > MAX_CACHE_BYTES:
        raise ValueError(f"larger than {MAX_CACHE_BYTES} bytes")
    return json.loads(data)


def _ignored(path: str, reason) -> tuple[None, str]:
    warnings.warn(f"ignoring the tuner's cache {path}: {_short(reason, 200)}; the link is measured again", stacklevel=3)
    return None, path


def save(backend: str, world_size: int, link: Link) -> None:
    """Keep `link`'s measured constants in this host's cache for (backend, world size)."""
    path = cache_path(backend, world_size)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path) and not os.path.isfile(path):  # a FIFO would block the write, a device swallow it
            os.remove(path)
        write_json_atomic(path, {**{k: v for k, v in asdict(link).items() if k in MEASURED}, "measured_at": time.time(),
                                 "calibration": CALIBRATION})
    except OSError:  # a read-only home costs a calibration per run, nothing more
        pass
