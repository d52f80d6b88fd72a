"""A wrapper's identity across ranks: its number among the wrappers built on its group, the `identity=` of its calls.

Two wrappers over two same-shaped modules, called `a(b(x))` on one rank and `b(a(x))` on another,
send calls of equal sizes at equal steps: compared by size and step alone, one rank's `a` pairs with
another's `b` and each averages the other's gradients, silently. So each wrapper takes a number when
it is built (`take_number`: the count of wrappers built on its group so far, the same on every rank,
since every rank builds its wrappers together, comparing them as it goes), and its step checks pass
it as the call check's `identity` (its "wrapper" field, beside the "step" field, which is the step).
When the ranks differ, `naming_wrappers` rewrites the check's error to name both wrappers.

A wrapper's parameters have an identity too (`BuiltWith`): a rank whose module no longer holds one it
was built with sends `replaced_mark` (a negative identity, never a wrapper's) in its next check, which
refuses its peers' calls, and every rank raises `replaced_line` naming the parameter and the rank.
A parameter whose `.data` was given another shape (`resized_mark`: its new shape is left in the default
store for the peers to read) or whose `requires_grad` was flipped after wrapping is named the same way.
"""
from __future__ import annotations

import contextlib
import datetime
import re

import torch
import torch.distributed as dist

from ..transport.call_check import differs
from ..transport.group import GroupState

__all__ = ["take_number", "naming_wrappers", "replaced_mark", "resized_mark", "flipped_mark", "frozen_alike",
           "replaced_line",
           "BuiltWith"]

_WRAPPER = re.compile(r"wrapper [^;(]*\(per rank: ([^)]*)\)")
_KIND = 1 << 24  # a mark's kind (replaced, resized, requires_grad flipped) times this, plus the parameter's index
_REPLACED, _RESIZED, _FLIPPED = 0, 1, 2


def take_number(state: GroupState) -> int:
    """The next wrapper number on the group of `state`: 1 for the first wrapper built on it, then 2, ..."""
    number = getattr(state, "wrappers_built", 0) + 1
    state.wrappers_built = number  # kept with the group: a number means nothing on another group
    return number


def replaced_mark(index: int) -> int:
    """The identity a rank sends in place of its wrapper's when parameter `index` (in the order the wrapper was
    built with; past its end: one added) is no longer the one it was built with: negative, never a wrapper's."""
    return -1 - index


def resized_mark(index: int) -> int:
    """The identity a rank sends when parameter `index`'s `.data` now has another shape than the wrapper's."""
    return -1 - (_RESIZED * _KIND + index)


def flipped_mark(index: int) -> int:
    """The identity a rank sends when parameter `index` no longer requires grad (frozen after wrapping)."""
    return -1 - (_FLIPPED * _KIND + index)


def frozen_alike(mark: int) -> bool:
    """Whether `mark`, sent by every rank alike (the check passed), is a parameter frozen on every rank: no rank then
    waits for it, and training goes on as torch's does (the parameter unused, with `find_unused_parameters`)."""
    return divmod(-1 - mark, _KIND)[0] == _FLIPPED


def replaced_line(rank: int, who: str, marks: dict[int, int], names: list[str]) -> str:
    """The one line every rank raises when `marks` (group rank -> a mark) says which ranks replaced, resized or
    froze which parameter after wrapping; `names`: the parameters the wrapper was built with, in order."""
    ranks: dict[int, list[int]] = {}  # mark -> the ranks that sent it: ranks that replaced the same one, said once
    for r, m in sorted(marks.items()):
        ranks.setdefault(m, []).append(r)
    said = {_REPLACED: [], _RESIZED: [], _FLIPPED: []}
    for m, rs in ranks.items():
        kind, index = divmod(-1 - m, _KIND)
        if kind == _RESIZED:
            said[kind] += [f"parameter {names[index]} on rank {r} has shape {_published(r, names[index])}" for r in rs]
        else:
            said[kind].append(f"{_parameter(index, names)} on {_ranks(rs)}")
    line = []
    if said[_REPLACED]:
        line.append(f"{'; '.join(said[_REPLACED])} is not the one the wrapper was built with (replaced or resized "
                    "after wrapping, e.g. module.weight = nn.Parameter(...)): it would never be averaged; replace "
                    "parameters before wrapping, or assign to .data to keep the parameter itself")
    if said[_RESIZED]:
        line.append(f"{'; '.join(said[_RESIZED])} (its .data set to a tensor of another shape after wrapping): its "
                    "gradient no longer fits the others'; resize parameters before wrapping, on every rank")
    if said[_FLIPPED]:
        line.append(f"{'; '.join(said[_FLIPPED])} no longer requires grad (requires_grad flipped after wrapping): "
                    "it would not be averaged there while the other ranks wait for it; freeze or unfreeze "
                    "parameters on every rank before wrapping")
    return f"rank {rank}: {who}: " + "; ".join(line)


def _key(rank: int, name: str) -> str:
    """Where a rank leaves a resized parameter's new shape in the default store, for its peers' lines."""
    return f"manualdp/resized/{rank}/{name}"


def _publish(rank: int, name: str, shape: tuple, built: tuple) -> None:
    """Leave this rank's new shape of parameter `name` where the peers' `replaced_line` reads it (before the mark)."""
    if dist.is_initialized():
        dist.distributed_c10d._get_default_store().set(_key(rank, name),
                                                       f"{shape}, where the wrapper was built with {built}")


def _published(rank: int, name: str) -> str:
    """Group rank `rank`'s new shape of parameter `name`, as it left it in the store before sending its mark."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.wait([_key(rank, name)], datetime.timedelta(seconds=5))
        return store.get(_key(rank, name)).decode()
    except Exception:  # noqa: BLE001 - the line still names the parameter and the rank
        return "another than the wrapper was built with"


def _parameter(index: int, names: list[str]) -> str:
    """Parameter `index` of the wrapper as built, or, past the end, one added after."""
    return f"parameter {names[index]}" if index < len(names) else "a parameter added after wrapping"


def _ranks(ranks: list[int]) -> str:
    """`rank 2`, `ranks 0 and 1`, `ranks 0, 1 and 2`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


@contextlib.contextmanager
def naming_wrappers(names: list[str] | None = None, who: str = "DistributedDataParallel"):
    """Rewrite a refused check's "wrapper" field (each rank's `identity`) as the wrappers' numbers (the error keeps
    its type).

    `names` (the wrapper's parameter names, in the order it was built with): a rank that sent
    `replaced_mark` (or `resized_mark`, `flipped_mark`) makes the whole error `replaced_line`, on every rank."""
    try:
        yield
    except ValueError as error:
        message = str(error.args[0]) if error.args else ""
        match = _WRAPPER.search(message)
        values = [v.strip() for v in match.group(1).split(",")] if match else []
        if not values or not all(v.lstrip("-").isdigit() for v in values):  # not a call check's identities
            raise
        values = [int(v) for v in values]
        marks = {r: v for r, v in enumerate(values) if v < 0}
        if marks and names is not None:
            error.args = (replaced_line(dist.get_rank(), who, marks, names), *error.args[1:])
        else:
            error.args = (message[:match.start()] + _named(values) + message[match.end():], *error.args[1:])
        raise


def _named(values: list[int]) -> str:
    """Each rank's identity as which wrapper it called ("none": a call of the user's own)."""
    named = differs("wrapper", [f"#{v}" if v > 0 else "none" if v == 0 else "a replaced parameter" for v in values])
    if any(v <= 0 for v in values):
        return named
    return named + (" (wrappers numbered in the order each rank built them: the ranks called different wrappers "
                    "here, as a(b(x)) on one rank and b(a(x)) on another does)")


class BuiltWith:
    """The parameters a wrapper averages, as it was built, to tell a rank whose module now holds others.

    `mark` is None while every one is still there (by identity: a replaced or resized parameter is
    a new object); else the `replaced_mark` the rank sends in its next call check, so that its peers'
    calls are refused and every rank raises `replaced_line`, instead of the peers waiting for
    gradients that never come (or averaging without it, silently)."""

    def __init__(self, named: list, everything: list) -> None:
        self.names = [n for n, _ in named]  # the averaged parameters' names, in order
        self.params = [p for _, p in named]
        self.shapes = [tuple(p.shape) for _, p in named]  # as built: a `.data` of another shape is named
        self.known = {n for n, _ in everything}  # every parameter's name at wrapping, frozen ones too

    def mark(self, named_now, rank: int = 0) -> int | None:
        """The mark of the first averaged parameter that `named_now` no longer holds (or a new one), holds resized
        (its new shape left in the store for the peers, as group rank `rank`'s), or holds frozen."""
        now = dict(named_now)
        for k, (name, p) in enumerate(zip(self.names, self.params)):
            held = now.get(name)
            if type(held) is torch.Tensor:  # a plain tensor in a parameter's place: torch.func.functional_call's
                continue  # stateless call, for this forward only (nn.Module refuses one assigned by hand)
            if held is not p:
                return replaced_mark(k)
            if tuple(p.shape) != self.shapes[k]:
                _publish(rank, name, tuple(p.shape), self.shapes[k])
                return resized_mark(k)
            if not p.requires_grad:
                return flipped_mark(k)
        if any(name not in self.known for name in now):
            return replaced_mark(len(self.names))
        return None
