"""The sanity guard on every contribution: a member whose buffers are non-finite or far out of line discards the step.

Before the average, the members all-gather one number each, the norm of what they contribute
(one float64 per member: each writes its own slot of a vector of zeros, and the vector is
averaged: one more allreduce per step, of 8 bytes a member), so every member judges the same
numbers and decides alike (`offenders`):
- a non-finite contribution (NaN or Inf anywhere, the loss totals included) is out of line;
- with 3 or more members, a norm above `FACTOR` times the median of the other members' norms, or
  below 1/`FACTOR` of it while that median is not zero and such members are fewer than half (a
  member that sends zeros, or its gradients scaled down, drags the average toward nothing as
  surely as one scaled up drags it away);
- with 2 members there is no majority to tell which one is wrong by a little: only a norm above
  `PAIR_FACTOR` times the other's is out of line (the larger one), or a norm of exactly zero while
  the other's is not (an honest shard's gradient is not zero while the other's is not; one far
  smaller but not zero cannot be told from the other far larger: the larger is named).
Then nobody sends the buffers: every member votes "discard", the step is taken again, and each
logs the member and its norm. A member out of line `STRIKES` steps in a row is removed: it is
told in one line (`Removed`, after its vote) and leaves, and the others' next quorum is without it.
Counts start again on a replica that joins: it has not seen the offences before it. A member
that does not leave when told (not this code) keeps every step it is in discarded: its
offences are logged, step after step.

Honest members' norms differ by a few times (their shards of one global batch: at most 4.4 times
the median of the others' over 10 epochs of `manualdp train --model mlp --batch-size 32` on 3
replicas, 2.1 between 2); a poisoned one (its contribution times 1000, a bit flip in an
exponent) by far more. But shards of one or two examples differ by thousands of times honestly
(one example misclassified, the other fitted), and a discarded step is taken again on the same
batch, so an honest member would be removed: the norms are compared only while every member
trains on at least `MIN_EXAMPLES` examples of a global batch (`Manager.capacity`: its smallest;
0, unknown, compares always); below, only a non-finite contribution is out of line.
"""
from __future__ import annotations

import logging
import math
import statistics
import sys

import torch

from .admission import Misfit
from .bar import bar

__all__ = ["FACTOR", "PAIR_FACTOR", "STRIKES", "MIN_EXAMPLES", "HUGE", "Removed", "offenders", "norm_of",
           "ContributionGuard", "guard_settings"]

FACTOR = 100.0       # 3+ members: out of line above this many times the median of the others' norms
PAIR_FACTOR = 100.0  # 2 members: out of line above this many times the other's norm
STRIKES = 3          # offences in a row that remove a member from the quorum
MIN_EXAMPLES = 8     # the fewest examples per member at which the norms are compared
# A finite contribution's norm past float64 stands at this: its slot is divided by the members' count and
# multiplied back, which must stay finite; comparisons with it stay sane (`factor * HUGE` is inf, not an offence)
HUGE = sys.float_info.max / 2

_log = logging.getLogger("manualdp.spmd.ft")


class Removed(Misfit):
    """This replica's contributions were out of line `STRIKES` steps in a row: the run goes on without it."""


def offenders(norms: list[float], factor: float = FACTOR, pair_factor: float = PAIR_FACTOR) -> dict[int, str]:
    """The members (by index) whose norm is out of line, each with why, in a few words."""
    bad = {i: "non-finite (NaN or Inf)" for i, x in enumerate(norms) if not math.isfinite(x)}
    finite = [(i, x) for i, x in enumerate(norms) if math.isfinite(x)]
    if len(norms) >= 3:
        low = {}
        for i, x in finite:
            median = statistics.median([y for j, y in finite if j != i] or [math.inf])
            if 0 < median < math.inf and x > factor * median:
                bad[i] = f"norm {x:.3g}, over {factor:g} times the median of the others' ({median:.3g})"
            elif 0 < median < math.inf and x * factor < median:
                low[i] = f"norm {x:.3g}, under 1/{factor:g} of the median of the others' ({median:.3g})"
        if 2 * len(low) < len(norms):  # a majority that sends (almost) nothing is the run's scale, not an offence
            bad.update(low)
    elif len(finite) == 2:
        (i, x), (j, y) = finite if finite[0][1] >= finite[1][1] else finite[::-1]
        if x > pair_factor * y > 0:
            bad[i] = f"norm {x:.3g}, over {pair_factor:g} times the other member's ({y:.3g})"
        elif math.isfinite(pair_factor) and x > 0 == y:
            bad[j] = f"norm 0, under 1/{pair_factor:g} of the other member's ({x:.3g})"
    return dict(sorted(bad.items()))


def norm_of(t: torch.Tensor) -> float:
    """The float64 norm of `t`: NaN if an element is NaN or Inf; at most `HUGE`, also where the squares overflow."""
    if not t.is_floating_point():
        t = t.double()  # integers are always finite, and torch's norm refuses them
    norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    if math.isfinite(norm):
        return min(norm, HUGE)
    if not bool(torch.isfinite(t).all()):
        return math.nan
    # finite elements whose squares overflowed (float64 past 1e154): the norm of t scaled by its largest element
    big = float(t.abs().max())
    return min(big * float(torch.linalg.vector_norm(t.double() / big)), HUGE)


def guard_settings(guard: "ContributionGuard | None") -> str:
    """What a joiner must share of the guard: "off", or its thresholds (a guard judges the norms all-gathered)."""
    if guard is None:
        return "off"
    if not isinstance(guard, ContributionGuard):
        raise TypeError(f"guard must be a ContributionGuard or None, got {type(guard).__name__}")
    return (f"factor {guard.factor:g}, pair_factor {guard.pair_factor:g}, strikes {guard.strikes}, "
            f"min_examples {guard.min_examples}")


class ContributionGuard:
    """One per manager: judges each step's contributions, and counts each member's offences in a row.

    Args:
        factor, pair_factor, strikes, min_examples: `FACTOR`, `PAIR_FACTOR`, `STRIKES` and
            `MIN_EXAMPLES` (module docstring).
    """

    def __init__(self, factor: float = FACTOR, pair_factor: float = PAIR_FACTOR, strikes: int = STRIKES,
                 min_examples: int = MIN_EXAMPLES) -> None:
        self.factor, self.pair_factor, self.strikes, self.min_examples = factor, pair_factor, strikes, min_examples
        self.offences: dict[str, int] = {}  # member id -> its offences in a row, as far as this replica saw

    def passes(self, manager, contribution: list[torch.Tensor], also: list[torch.Tensor] = ()) -> bool:
        """Gather each member's norm of `contribution`; False (nobody averages, all vote discard) if one is out of line.

        Raises `Removed` on the member out of line `strikes` times in a row, after its vote.
        """
        quorum = manager.quorum
        ids = quorum.ids
        norms = torch.zeros(len(ids), dtype=torch.float64)
        # NaN where any element is NaN or Inf (`norm_of`: one pass over finite buffers, where isfinite() and a norm
        # took two); finite values whose norm is past float64 are not non-finite: their norm stands at HUGE
        parts = [norm_of(t) for t in contribution]
        finite = all(map(math.isfinite, parts)) and all(bool(torch.isfinite(t).all()) for t in also)
        norms[quorum.rank(manager.id)] = min(math.hypot(*parts), HUGE) if finite else math.nan
        if not manager.average(norms):
            return False  # a member failed: the step cannot commit anyway
        batch = getattr(manager, "capacity", 0)
        compare = not batch or batch // len(ids) >= self.min_examples  # else honest shards differ too much
        bad = offenders((norms * len(ids)).tolist(), *((self.factor, self.pair_factor) if compare else (math.inf,) * 2))
        for i, rid in enumerate(ids):
            self.offences[rid] = self.offences.get(rid, 0) + 1 if i in bad else 0
        if not bad:
            return True
        removed = [ids[i] for i in bad if self.offences[ids[i]] >= self.strikes]
        for i, why in bad.items():
            _log.warning(f"replica {manager.id}: step {manager.step} discarded: replica {ids[i]}'s contribution is "
                         f"out of line: {why}" + (f"; removed after {self.strikes} in a row" if ids[i] in removed
                                                  else f" ({self.offences[ids[i]]} in a row)"))
        for rid in removed:  # a removed member that does not leave is refused at its next ask (bar.py)
            bar(manager.store, rid, f"its contribution was out of line {self.strikes} steps in a row")
        if manager.id in removed:
            manager.should_commit(False)
            raise Removed(f"replica {manager.id!r} removed from the run: its contribution was out of line "
                          f"{self.strikes} steps in a row ({bad[ids.index(manager.id)]})")
        return False
