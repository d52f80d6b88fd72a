"""torch's C++ store client logs, kept off a replica's stderr: the coordinator's loss is one line, not thirty.

When the coordinator dies, every client of its store (the main thread's, the heartbeat thread's,
the leave written as the replica closes) logs the failed send in C++ (`[W... TCPStore.cpp:106]
[c10d] sendBytes failed ...`, then `Exception raised from ...` and twenty `frame #` lines)
before Python sees the error, and the replica's own line drowns. `TORCH_CPP_LOG_LEVEL` is read
once, as torch is imported, so it cannot be set here: `store_logs_dropped` instead passes fd 2
through a pipe for the duration and drops those lines (a store's log line and its trace), and
nothing else.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

__all__ = ["store_logs_dropped", "is_store_log"]

_HEAD = re.compile(rb"^\[[WEI]\d{4} [\d:.]+ (TCPStore|TCPStoreBackend|TCPStoreLibUvBackend|socket)\.cpp:\d+\]")
_TRACE = (b"Exception raised from ", b"frame #", b"<omitting python frames>")  # and the blank line that ends it


def is_store_log(line: bytes, in_trace: bool) -> bool:
    """Whether `line` is a C++ store log line, or (`in_trace`: right after one) a line of its trace."""
    if not isinstance(line, bytes):
        raise TypeError(f"line must be bytes, got {type(line).__name__}")
    return bool(_HEAD.match(line)) or (in_trace and (not line.strip() or line.lstrip().startswith(_TRACE)))


def _forward(read_fd: int, out_fd: int) -> None:
    in_trace = False
    with os.fdopen(read_fd, "rb") as pipe:
        for line in pipe:
            in_trace = is_store_log(line, in_trace)
            if not in_trace:
                os.write(out_fd, line)


@contextlib.contextmanager
def store_logs_dropped():
    """Drop the C++ store client's log lines from this process's stderr (fd 2) while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    thread = threading.Thread(target=_forward, args=(read_fd, saved), name="manualdp-stderr", daemon=True)
    thread.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the thread forwards what is left, then ends
        thread.join(timeout=5)
        os.close(saved)
