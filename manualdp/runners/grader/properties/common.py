"""What every property of the grader shares: `Mismatch`, the call of the function under test (`called`), the hints
for the slips a student makes most (`hint_for`), and how values are shown (`show`, `apart`).

The properties themselves are beside this file, one per exercise; `__init__.py` gathers them.
"""
from __future__ import annotations

import os
import traceback

import torch

__all__ = ["FLOATS", "Mismatch", "called", "hint_for", "show", "seconds", "apart", "n_devices", "sum_within",
           "rank_error"]

FLOATS = [torch.float32, torch.float64]
TORCH = os.path.dirname(torch.__file__)


class Mismatch(AssertionError):
    """A property does not hold: the message says for which input, what was expected and what came back.

    `hint`, a function, adds to the message what costs time to find (which slip the answer made): called when the
    message is read, once, not for every failing input hypothesis tries while it shrinks."""

    def __init__(self, message: str = "", hint=None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        if self.hint is not None:
            self.args, self.hint = (self.args[0] + self.hint(),), None
        return super().__str__()


def called(call: str, fn, *args, job: str | None = None) -> tuple:
    """`fn(*args)` as `(before, after, out)`: the arguments as the caller held them before the call (lists copied,
    so that a rebound slot shows), as they are after it, and what it returned. `fn` may be a `sandbox.Child`: the
    call runs there, and what comes back is the child's. An exception becomes a Mismatch that names the call.

    With `job` (a name of `jobs.JOBS`), the grader's job runs instead, given `fn`'s functions (a Child's,
    or a tuple of functions) and `args`."""
    from .. import jobs
    from ..sandbox import Child, Raised, Stopped

    if isinstance(fn, Child):
        try:
            return fn.job(job, *args) if job else fn.call(*args)
        except Raised as e:
            raise Mismatch(f"{call} raised {e.kind}" + (f": {e.message}" if e.message else "")
                           + (f" (at {e.at})" if e.at else "")
                           + hint_for(e.kind, e.message)) from None
        except Stopped as e:
            raise Stopped(f"{call} {e}") from None
    before = tuple(list(a) if isinstance(a, list) else a for a in args)
    try:
        return before, args, (getattr(jobs, jobs.JOBS[job])(*fn, *args) if job else fn(*args))
    except Exception as e:  # noqa: BLE001 (a student's code may raise anything)
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not f.filename.startswith(TORCH)), frames[-1])  # the caller's line
        raise Mismatch(f"{call} raised {type(e).__name__}: {e} (at {frame.filename}, line {frame.lineno})"
                       + hint_for(type(e).__name__, str(e))) from e


def hint_for(kind: str, message: str) -> str:
    """What to write instead, for the slips a student makes most."""
    if kind == "IndexError" and "0-dim" in message:
        return (". A 0-dim tensor (shape ()) has no rows to slice, so d2l's `data[0][:] += ...` fails on it: write "
                "in place with `tensors[0].add_(...)` and `tensors[i].copy_(tensors[0])`, which work for every shape")
    if kind == "SystemExit":
        return ". The grader calls your function: it must return, not exit"
    if kind == "KeyboardInterrupt":
        return ". The grader calls your function: it must return, not raise KeyboardInterrupt"
    if kind == "RecursionError":
        return ". Does your function call itself without end?"
    if kind == "OSError" and "File too large" in message:
        return ". The grader lets your code print or write 64 MiB into one file"
    if kind == "MemoryError" or "can't allocate memory" in message:
        return ". The grader caps the memory your code may take (--memory)"
    return ""


def show(t, digits: int | None = None) -> str:
    """A tensor's values when they are few, rounded (to 4 decimals, or to `digits` significant digits); else its
    repr, cut short."""
    if isinstance(t, torch.Tensor) and t.numel() <= 12:
        values = t.tolist()
        return repr(_rounded(values, digits))
    return repr(t)[:200]


def _rounded(values, digits: int | None = None):
    if isinstance(values, list):
        return [_rounded(v, digits) for v in values]
    if not isinstance(values, float):
        return values
    return round(values, 4) if digits is None else float(f"{values:.{digits}g}")


def seconds(x: float, digits: int = 6) -> str:
    """A number to `digits` significant digits (6 unless `apart` asks for more)."""
    return f"{x:.{digits}g}"


def apart(want, got, show=show) -> tuple[str, str]:
    """`show(want)` and `show(got)`, given more significant digits (`show(x, digits)`, up to float64's 17) while they
    read alike, so that values that differ never read as equal (a float32 rounding, a sum in another order)."""
    a, b = show(want), show(got)
    for digits in range(5, 18):
        if a != b:
            break
        a, b = show(want, digits), show(got, digits)
    return a, b


def n_devices(n: int) -> str:
    return f"{n} device{'s' * (n != 1)}"


def sum_within(got: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per element, whether floating `got` is the sum of `tensors` as some order of summation in their dtype may
    round it: |got - exact| <= (n - 1) * eps * sum_i |x_i|.

    Each of the n - 1 additions of any order rounds by at most eps / 2 of a partial sum, itself at most sum_i |x_i|;
    `exact`, taken in float64, rounds as much again for float64 tensors (nothing that counts for narrower ones), so
    eps, not eps / 2, covers both. A bias of a few eps on every element (a scaled sum) fails."""
    wide = torch.stack([t.to(torch.float64) for t in tensors])
    bound = (len(tensors) - 1) * torch.finfo(tensors[0].dtype).eps * wide.abs().sum(0)
    return (got.to(torch.float64) - wide.sum(0)).abs() <= bound


def rank_error(e: BaseException, path: str, writable: list[str]) -> str:
    """What a rank tells of the error the file at `path` raised: the path outside `writable` (its folders) where a wall
    of the kernel refused one (`tried.outside`), else the error and the file's line."""
    import torch.distributed as dist

    from ..tried import outside

    rank = dist.get_rank()
    tried = outside(e, [*writable, "/dev/shm"])
    if tried:
        return (f"rank {rank}: it tried to {tried[0]} {tried[1]}, outside its own folder: an answer may write only in "
                "its own folder and read only what it imports (refused by the grader's walls)")
    frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), None)
    where = f" (at {path}, line {frame.lineno}: {frame.line})" if frame else ""
    return f"rank {rank}: {type(e).__name__}: {e}{where}"
