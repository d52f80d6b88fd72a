"""`FaultTolerantDDP`'s buckets: the drop-in's reducer, each bucket averaged over the quorum while backward runs.

torchft's fault-tolerant DDP is torch's DDP with a comm hook that calls its manager; here it is
the drop-in's reducer (`spmd/ddp/reducer.py`: buckets in reverse parameter order, a small first
one, each sent when full, in bucket order) whose per-bucket reduction is `Manager.average`, over
the current quorum's group. Where it departs from the drop-in, and why:
- the buckets are never rebuilt in the order the gradients came: a replica that joins later must
  cut the same buckets as the members, without a broadcast that they would have to join;
- the buckets go on a thread of this reducer's own, not the group's worker: the group is formed
  again whenever the members change, and the reducer outlives every group;
- no flags travel: every parameter counts as used by every member, and one unused on a replica
  contributes zeros (as the flat buffer did);
- the quorum asked ahead (`ahead.py`) is taken as backward starts, on the main thread. If the step
  must enter it (a state to receive, a group to form), nothing is averaged during backward: a state
  loaded under autograd would break it. `average_late` averages every bucket after backward, once
  the quorum is entered; the step is voted down anyway, but a newcomer is not left waiting;
- a member gone mid-bucket makes `Manager.average` return False: the later buckets go nowhere,
  and the vote discards the step on every member;
- an average that comes back NaN or Inf is averaged again, each share divided first (`average_fitting`:
  finite shares whose sum overflows, as two float16 40000s); if it is still NaN or Inf (a member's
  NaN, or one corrupted on the way) it is noted (`nonfinite`): the guard judged the norms before
  it, so `step()` votes discard, and every member does, holding the same averages.
The guard (`guard.py`) judges every member's whole contribution, known only once every bucket is
in: each bucket's norm is taken before its average, and the guard judges them in `step()`. An
out-of-line contribution has then been averaged, but the step is discarded: it is never applied.
"""
from __future__ import annotations

import concurrent.futures
import math
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from ...buckets import assign_buckets
from ..ddp.feature import Feature
from ..ddp.reducer import Reducer
from ..transport.p2p import DEFAULT_SEGMENT_BYTES
from ..transport.worker import SerialWorker
from .guard import norm_of

__all__ = ["QuorumReducer", "finite", "average_fitting", "average_judged"]


class QuorumReducer(Reducer):
    """The drop-in's reducer over `params` (in buckets of `caps` MiB), each bucket averaged by `manager`."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], caps, manager) -> None:
        self.manager = manager
        self.begin(started=False)
        super().__init__(params, module, assign_buckets(params, caps), caps, group=None, rank=0, peers=[0],
                         device=params[0].device if params else torch.device("cpu"), algorithm=manager.algorithm,
                         segment_bytes=DEFAULT_SEGMENT_BYTES, timeout=manager.timeout, gradient_as_bucket_view=False,
                         rebuild=False)
        self.reduce, self.reduces_to_average = self.average_bucket, True
        self.use([_TakeQuorum(self)])

    def group_state(self, group) -> SimpleNamespace:
        """No group's state: only a worker, a thread of this reducer's own, whatever the quorum's group is."""
        return SimpleNamespace(worker=SerialWorker("manualdp-ft-buckets"))

    def begin(self, started: bool = True) -> None:
        """A step starts (`start_step`): no bucket averaged, no norm, nothing deferred."""
        self.started = started    # start_step() ran and step() not yet
        self.late = False         # the quorum must be entered first: the buckets wait for `average_late`
        self.averaged = False     # a bucket was averaged during a backward pass of this step
        self.norms: list[float] = []  # the norm of each bucket this replica contributed, for the guard
        self.error: BaseException | None = None  # what taking the quorum raised in backward, raised by step()
        self.nonfinite: int | None = None  # the first bucket whose average came back NaN or Inf: step() discards

    def average_bucket(self, index: int, bucket) -> None:
        """On the worker (or late, on the main thread): average `bucket`'s gradients over the quorum."""
        bucket.flags.fill_(1)  # every parameter used by every member: `write_grads` writes them all
        if self.late:
            return
        self.norms.append(norm_of(bucket.grads))
        # False (a member failed): the manager votes discard, later buckets skip. True: every member holds the
        # same average, so a NaN left in it (a member's NaN, a fault on the way) is seen by all
        ok, fits = average_judged(self.manager, bucket.grads, lambda grads: self.refill(bucket))
        if ok and self.nonfinite is None and not fits:
            self.nonfinite = index
        self.averaged = True

    @staticmethod
    def refill(bucket) -> None:
        """`bucket`'s gradients copied in again from `.grad` (untouched until `write_grads`), as `mark_ready` did."""
        for i, p in enumerate(bucket.params):
            bucket.copy_in(i, p.grad)

    @torch.no_grad()
    def average_late(self) -> None:
        """After backward, on the main thread: enter the step's quorum, then average every bucket from `.grad`."""
        self.manager.quorum  # noqa: B018 - enters a quorum asked ahead (it may load a state: not under autograd)
        self.late = False
        for b, bucket in enumerate(self.buckets):
            self.refill(bucket)
            self.average_bucket(b, bucket)
            self.write_grads(bucket)
        self.reset()

    def abandon(self) -> None:
        """A backward that raised part-way: wait for the buckets it sent, then forget it."""
        concurrent.futures.wait([b.future for b in self.buckets if b.future is not None])
        self.reset()

    def close(self) -> None:
        """The model may outlive its wrapper: its backward stops averaging, and the thread ends."""
        self.remove_hooks()
        self.worker.shutdown()


def finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite: its norm, one pass, is; else (NaN, Inf, or squares that overflowed) the
    exact test. `isfinite(t).all()` alone makes a boolean tensor of `t`'s size: about 16x the norm's CPU time.
    Integers and booleans are always finite (torch's norm refuses them)."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return math.isfinite(float(torch.linalg.vector_norm(t))) or bool(torch.isfinite(t).all())


def average_fitting(manager, t: torch.Tensor, refill: Callable[[torch.Tensor], None]) -> bool:
    """`manager.average(t)`; if the average came back NaN or Inf, `refill(t)` with the shares and average again,
    each member's share divided first. False if a member failed.

    Sum then divide is kept where it fits: its bits are what every reference holds (torchft's formula, the
    one-process runs). But shares whose average fits the dtype can sum past it (two float16 40000s, two float32
    2e38s): torch's DDP divides first for that (float16 and bfloat16 summed in float32: `share.py`). A discarded
    step retakes the same batch, so that step would be discarded forever. Every member holds the same average, so
    all see alike that it is not finite, and all average again; a member's NaN comes back NaN again (the guard
    names it), at one more allreduce.
    """
    return average_judged(manager, t, refill)[0]


def average_judged(manager, t: torch.Tensor, refill: Callable[[torch.Tensor], None]) -> tuple[bool, bool]:
    """`average_fitting`'s answer, and whether the average is finite: judged once (a norm of the bucket: ~80 us of an
    mlp's step), not again by the caller."""
    if not manager.average(t):
        return False, False
    if finite(t):
        return True, True
    refill(t)
    return (True, finite(t)) if manager.average(t, divide_first=True) else (False, False)


class _TakeQuorum(Feature):
    """As backward starts, on the main thread: take the quorum asked ahead; if it must be entered, average late."""

    def __init__(self, reducer: QuorumReducer) -> None:
        self.reducer = reducer

    def backward_start(self) -> None:
        r = self.reducer
        if not r.started:  # no step under way: step() says so, on the main thread
            r.late = True
            return
        try:
            r.late = r.late or not r.manager.quorum_ready()
        except BaseException as e:  # noqa: BLE001 - the run ended, no quorum in time: raised by step(), not in autograd
            r.error, r.late = e, True
