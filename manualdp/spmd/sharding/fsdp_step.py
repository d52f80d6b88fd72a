"""The step under way, for a whole tree of `fully_shard` units: one `Step`, held by the outermost unit.

A unit's own state (gathered or not, its gradients in or not) is the unit's (`fsdp_unit.py`); what
spans the tree lives here, once:
- how deep the forwards under way are, so that the outermost one's end is seen (and a forward under
  `no_grad` ends the step there);
- the order in which the units' forwards began, this step and the last: the forward hooks prefetch
  the unit that came next last step, the backward hook the one before in this step (`fsdp_hooks.py`);
- whether backward is under way: its end is one autograd callback, queued by the first hook of the
  backward pass, at which every unit that has not sent its gradients sends them (zeros where it has
  none), so that the ranks' collectives pair up even where a unit ran on some ranks only;
- the first failure of a collective: the ranks are out of step after it, so every later one raises it
  at once instead of waiting for peers in vain;
- HSDP: which units keep sums not all-reduced across the replicas, in the order kept, and in which backward: an
  optimizer step that finds some, or an all-reduce that meets another unit's, names the replica that forgot
  `set_requires_all_reduce(True)` (`fsdp_hsdp.py`).
"""
from __future__ import annotations

import torch

from ..ladder.drift import DRIFT_CHECK_EVERY, DriftCheck
from .fsdp_hsdp import watch_unreduced

__all__ = ["Step", "inside_backward"]


class Step:
    """What the forward and backward under way have done, for the tree of units under `root` (the outermost)."""

    def __init__(self, root) -> None:
        self.root = root
        self.depth = 0          # forwards of any unit under way
        self.order: list = []       # units in the order their forward began, this step
        self.last_order: list = []  # the same, last step (forward prefetch follows it)
        self.in_backward = False
        self.failure: Exception | None = None  # a collective of the tree that raised: the later ones raise it too
        self.tied_apart: str | None = None  # a unit of the tree left out a weight tied apart: every forward raises
        self.drift = DriftCheck(DRIFT_CHECK_EVERY)  # HSDP: the replicas' shards compared at due steps (`fsdp_drift`)
        # HSDP's drift check counts steps that all-reduced across the replicas, not backward passes: replicas that
        # accumulate 2 and 3 micro-batches meet in the same check (`fsdp_drift`)
        self.all_reduced = False  # a unit of this backward all-reduced across the replicas
        self.steps = 0  # backward passes of the tree that ended having all-reduced across the replicas
        # HSDP: (unit, dtype) whose sums are kept, not all-reduced, in the order kept: the order that replicas which
        # all-reduce send them in, which an optimizer step that finds them kept joins (`fsdp_hsdp._own_up`)
        self.kept: dict = {}  # (unit, dtype) -> the backward pass that kept it
        self.backwards = 0  # backward passes of the tree begun
        self.since: dict = {}  # HSDP: (unit, dtype) -> its all-reduces across replicas since an optimizer stepped it
        if root.replicate is not None:
            watch_unreduced()

    def backward_begins(self) -> None:
        """Queue `end_backward` for the end of this backward pass, once."""
        if not self.in_backward:
            self.in_backward = True
            self.backwards += 1
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """The units that have not sent their gradients send them; every shard gets its `.grad`.

        Every unit of the tree sends once per backward (zeros where it has none) unless its gradient
        sync is off: the ranks' collectives pair up even where a step ran a unit on one rank only.
        """
        units = self.root.tree()
        try:
            for u in reversed(units):  # the same order on every rank
                if not u.reduced and u.requires_gradient_sync and u.reduce_groups:
                    u.reduce_scatter()
                elif not u.requires_gradient_sync:
                    u.keep_gradients()
            for u in units:
                u.take_gradients()
        except BaseException:
            self.in_backward = False
            self.abandon()  # raise what went wrong first, not what the collectives queued behind it run into
            raise
        self.in_backward = False
        self.steps += self.all_reduced
        self.all_reduced = False
        self.end(after_backward=True)

    def abandon(self) -> None:
        """Forget a step that raised, without waiting for the collectives queued behind the failed one:
        after a refused call the ranks are out of step, and those would wait for a peer in vain.
        A unit whose all-gather is still queued keeps its full memory until that all-gather ends (the next
        forward waits for it: it writes there)."""
        self.all_reduced = False
        for u in self.root.tree():
            if u.gathering is None:
                u.free()
            u.accumulating = False
            u.partial.clear()  # HSDP's sums kept without all-reduce: gradients of the step that raised
            u.forget_step(keep_gradients=False)
        self.kept.clear()
        self.since.clear()
        self._next_order()

    def end(self, after_backward: bool = False) -> None:
        """Every unit lets go of its full parameters (after backward, those that reshard after it); the next forward
        follows this order."""
        for u in self.root.tree():
            if u.reshard_after_backward or not after_backward:
                u.free()
            u.forget_step(keep_gradients=u.accumulating)  # else left by a backward that raised
        self._next_order()

    def _next_order(self) -> None:
        if self.order:
            self.last_order, self.order = self.order, []


def inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (torch has no public way to ask)."""
    return torch._C._current_graph_task_id() != -1
