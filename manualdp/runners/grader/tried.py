"""What an answer's error says it tried outside its folder, where only the kernel's walls stopped it (`walls.py`).

The audit hook names what it refuses; a write made through ctypes, a program the answer runs, or torch's C++ file
writer (`torch.save`) is refused by the mount namespace (EROFS) or Landlock (EACCES) where no hook sees it. When such
a refusal is why the answer raised, the path is in the error: an `OSError`'s filename (ctypes' code raises one from
errno), the program's complaint on its stderr ("touch: cannot touch '/x': Read-only file system"), or the path handed
to torch's writer, in its frames. `outside` finds it, so that the verdict names it as it names the hook's refusals.
"""
from __future__ import annotations

import errno
import os
import re
import subprocess

__all__ = ["outside"]

REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}  # what the kernel's walls answer
WORDS = ("Read-only file system", "Permission denied", "Operation not permitted")
# a program's or a library's complaint that names the path: 'PATH': WORDS, or PATH: WORDS
_WORDS = "(?:" + "|".join(WORDS) + ")"
SAID = re.compile(r"['\"`‘]([^'\"`’\n]+)['\"`’]:? " + _WORDS + r"|(/[^\s:'\"]+):? " + _WORDS)
TORCH_PATHS = ("name", "f", "name_or_buffer", "filename", "path")  # torch.save's frames' names for the file


def outside(error: BaseException, writable: list[str], printed: str = "") -> tuple[str, str] | None:
    """(operation, path): the path outside `writable` that `error` (or an error it was raised from) says the kernel
    refused, "write" where the refusal was a read-only mount's, else "write or read" (Landlock refuses both alike);
    `printed`: the last lines the answer's programs wrote to stderr. None where it says none."""
    seen: list[BaseException] = []
    while error is not None and error not in seen and len(seen) < 10:
        seen.append(error)
        for path in _paths(error, printed):
            full = os.path.realpath(os.path.abspath(os.fsdecode(path)))
            if not any(full == root or full.startswith(root.rstrip("/") + "/") for root in writable):
                rofs = getattr(error, "errno", None) == errno.EROFS or WORDS[0] in _said(error, printed)
                return ("write" if rofs else "write or read"), full
        error = error.__cause__ or error.__context__
    return None


def _paths(error: BaseException, printed: str) -> list:
    """The paths `error` names as refused."""
    if isinstance(error, OSError):
        return [p for p in (error.filename, error.filename2) if isinstance(p, (str, bytes))] if (
            error.errno in REFUSED) else []
    message = _said(error, printed)
    if isinstance(error, subprocess.CalledProcessError):
        return [a or b for a, b in SAID.findall(message)]
    if not any(words in message for words in WORDS):
        return []
    named = [a or b for a, b in SAID.findall(message)]
    frames = [f for f in _frames(error) if "torch" in os.path.basename(os.path.dirname(f.f_code.co_filename))]
    return named + [f.f_locals[k] for f in reversed(frames) for k in TORCH_PATHS if isinstance(f.f_locals.get(k), str)]


def _said(error: BaseException, printed: str) -> str:
    """What `error` says; a program's, what the program said too: captured, or on the answer's stderr."""
    if not isinstance(error, subprocess.CalledProcessError):
        return str(error)
    return " ".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                    for x in (error.stderr, error.output, printed) if isinstance(x, (str, bytes)))


def _frames(error: BaseException) -> list:
    tb, frames = error.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames
