"""The step every wrapper of this room ends with: flatten, average over the quorum, vote, and unflatten if committed.

`LocalSGD` averages the parameters so and `DiLoCo` their change (`local_sgd.py`); `FaultTolerantDDP`
(`ddp.py`), whose buckets went during backward, only what rides along, the guard judging its buckets'
norms. `manualdp train --fault-tolerant` (`runners/ft_train.py`) hands its step's loss totals
along (`also`), so that they are averaged with the step and counted only if it is applied. First
the manager's guard (`manager.guard`, `guard.py`; None: none) compares the members' norms: a
contribution that is non-finite or far out of line discards the step on every member; an average that
still comes back NaN or Inf (finite shares that sum past the dtype even divided first, one corrupted on
the way) discards it too, named in one line: with the guard on, no NaN or Inf is ever applied.
"""
from __future__ import annotations

import logging

import torch

from ...buckets import by_dtype, flatten, unflatten_
from .bucketed import average_fitting, finite
from .manager import Manager

_log = logging.getLogger("manualdp.spmd.ft")  # the guard's: one line a discarded step

__all__ = ["average_and_vote"]


def average_and_vote(manager: Manager, tensors: list[torch.Tensor], also: tuple[torch.Tensor, ...] = (), *,
                     judged: list[torch.Tensor] | None = None, ok: bool = True) -> bool:
    """Average `tensors` over `manager`'s quorum and vote; True, and the averages written back, if every member commits.

    `tensors` go as one flat buffer per dtype (rung 2 of the ladder), each tensor of `also` as a
    buffer of its own, first. On False (a member failed, or the guard found a contribution out of
    line: then no buffer is sent) every tensor is left as it was. `judged`: what the guard judges
    in place of `tensors` (`FaultTolerantDDP`'s bucket norms: its buckets were averaged during backward).
    `ok`: False votes discard, after the guard (every member judges alike, and counts the same offences).
    """
    groups = [[t] for t in also] + by_dtype(tensors)
    flats = [flatten(group) for group in groups]
    guard = getattr(manager, "guard", None)
    judged = flats[len(also):] if judged is None else judged
    passed = guard is None or guard.passes(manager, judged, flats[:len(also)])  # the same answer on all
    # a list: every buffer goes, as on the others; one whose sum overflowed goes again, divided first
    ok = ok and passed and all([average_fitting(manager, flat, lambda f, g=group: f.copy_(flatten(g)))
                                for flat, group in zip(flats, groups)])
    if ok and guard is not None:  # finite contributions whose average is not (one corrupted on the way): never applied
        ok = _finite_averages(manager, flats, len(also))
    if not manager.should_commit(ok):
        return False
    for flat, group in zip(flats, groups):
        unflatten_(flat, group)
    return True


def _finite_averages(manager: Manager, flats: list[torch.Tensor], totals: int) -> bool:
    """Whether every average in `flats` is finite; else one line naming the first that is not (alike on all)."""
    for i, flat in enumerate(flats):
        if not finite(flat):
            what = f"also[{i}]" if i < totals else f"the {flat.dtype} buffer of {flat.numel()} values"
            _log.warning(f"replica {manager.id}: step {manager.step} discarded: the average of {what} came back "
                         f"non-finite (NaN or Inf) though every contribution passed the guard; the same on every "
                         f"member")
            return False
    return True
