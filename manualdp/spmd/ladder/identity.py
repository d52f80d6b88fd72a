"""A wrapper's identity across ranks: its number among the wrappers built on its group, carried in its step check.

Two wrappers over two same-shaped modules, called `a(b(x))` on one rank and `b(a(x))` on another,
send calls of equal sizes at equal steps: compared by size and step alone, one rank's `a` pairs with
another's `b` and each averages the other's gradients, silently. So each wrapper takes a number when
it is built (`take_number`: the count of wrappers built on its group so far, the same on every rank,
since every rank builds its wrappers together, comparing them as it goes), and its step check
compares the number with the step (`stamped`: both in the check's one "step" field). When the ranks
differ, `naming_wrappers` rewrites the check's error to name both numbers and both steps.
"""
from __future__ import annotations

import contextlib
import re

from ..transport.call_check import differs
from ..transport.group import GroupState

__all__ = ["take_number", "stamped", "naming_wrappers"]

_STRIDE = 2 ** 40  # a wrapper's steps stay below this; its number above (at most 2**22, the check's step < 2**62)
_STEP = re.compile(r"step [^;(]*\(per rank: ([^)]*)\)")


def take_number(state: GroupState) -> int:
    """The next wrapper number on the group of `state`: 1 for the first wrapper built on it, then 2, ..."""
    number = getattr(state, "wrappers_built", 0) + 1
    state.wrappers_built = number  # kept with the group: a number means nothing on another group
    return number


def stamped(number: int, steps: int) -> int:
    """The value a wrapper's step check compares: its number and its step count, in one integer.

    The first wrapper's is its step count alone: where it meets a call of the user's own, the call
    check's error shows the step as it is."""
    return (number - 1) * _STRIDE + steps


@contextlib.contextmanager
def naming_wrappers():
    """Rewrite a refused step check's "step" field as the wrappers' numbers and steps (the error keeps its type)."""
    try:
        yield
    except ValueError as error:
        message = str(error.args[0]) if error.args else ""
        match = _STEP.search(message)
        if match is not None:
            error.args = (message[:match.start()] + _named(match.group(1)) + message[match.end():], *error.args[1:])
        raise


def _named(per_rank: str) -> str:
    """`per_rank` (each rank's stamped step, or "none") as which wrapper, and which of its steps, each rank was at."""
    values = [v.strip() for v in per_rank.split(",")]
    numbers = [f"#{int(v) // _STRIDE + 1}" if v.isdigit() else "none" for v in values]
    steps = [str(int(v) % _STRIDE) if v.isdigit() else "none" for v in values]
    if "none" in values:  # a wrapper's check met a call of the user's own
        return differs("step", [s if s == "none" else f"{s} of wrapper {n}" for n, s in zip(numbers, steps)])
    parts = []
    if len(set(numbers)) > 1:
        parts.append(differs("wrapper", numbers) + " (wrappers numbered in the order each rank built them: the "
                     "ranks called different wrappers here, as a(b(x)) on one rank and b(a(x)) on another does)")
    if len(set(steps)) > 1 or not parts:
        parts.append(differs("step", steps))
    return "; ".join(parts)
