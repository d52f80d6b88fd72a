"""Uneven inputs for `DistributedDataParallel`: ranks out of data shadow the others until all are done.

torch's `Join` context calls the wrapper's `join_hook`: while some ranks still train, a rank
that has run out of batches answers each of their steps with the same collectives (the
buffer broadcast, the step's call check and zero buckets), so the training ranks' messages
always find a partner, and gets the step's averaged gradients in `.grad` as they do, so that
a sharded optimizer in the same `Join` steps its shard right. At the end every rank takes the
model of the last rank to join, and a joined rank's `.grad` is back to what it was when it
joined, as torch's DDP leaves it (a next training loop may accumulate into it).

A rank that raises inside `join()` leaves its reason in the group's store before it leaves;
the others, whose next wait then fails, raise a `PeerError` that names it and says why.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ...validate import boolean
from .buffers import PRE_FORWARD
from .init_sync import state_tensors
from ..transport.peers import PeerError, talking_to, wait
from ..transport.postmortem import store_key

__all__ = ["JoinableWrapper", "UnevenInputs", "JoinContext"]


class JoinableWrapper(Joinable):
    """torch's `Joinable` for the wrapper (a mixin over its public `uneven`, `device`, `process_group`, `timeout`)."""

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context for uneven inputs: ranks out of data shadow the others' collectives until all are done."""
        return JoinContext([self], enable, throw_on_early_termination, self.timeout,
                           divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """What this wrapper does while its rank has joined (`divide_by_initial_world_size`: default True)."""
        return self.uneven.hook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group


class UnevenInputs:
    """The Join half of `DistributedDataParallel`: what its rank does once out of data, and after.

    The wrapper stays torch's `Joinable` (torch's `Join` takes it, and calls its `join_hook`);
    this object keeps the state and does the work, through the reducer's public names.
    """

    def __init__(self, reducer, module, ignored: set[str]) -> None:
        self.reducer, self.module, self.ignored = reducer, module, ignored
        self.joined = False  # True while Join shadows this rank's steps
        self.used = False  # True once a Join context has taken the wrapper (torch logs it)
        self.divide_by_initial = True  # divide by the initial world size, not by the ranks left
        self.authoritative_rank = 0  # the group rank whose model every rank took at the end of the last Join
        self.stale_grads: list = []  # what `.grad` held when this rank joined, given back at the end

    def is_joined(self) -> bool:
        return self.joined

    def hook(self, ddp, divide_by_initial_world_size: bool = True, **kwargs) -> JoinHook:
        """Join's hook for `ddp` (`divide_by_initial_world_size`: default True)."""
        boolean("divide_by_initial_world_size", divide_by_initial_world_size)
        self.divide_by_initial = divide_by_initial_world_size
        self.used = True  # torch logs it (`_get_ddp_logging_data()["join_uneven_inputs"]`)
        return _JoinedRank(ddp)

    def training_step(self, syncing: bool) -> None:
        """A training rank's forward inside Join: joined ranks learn whether this step syncs; the divisor follows."""
        r = self.reducer
        r.active, _ = self.agree_on_step(1, int(syncing))
        r.divisor = len(r.peers) if self.divide_by_initial else r.active

    def agree_on_step(self, active: int, syncing: int) -> tuple[int, int]:
        """Allreduce (ranks still training, ranks whose step syncs gradients); joined ranks add zeros."""
        counts = torch.tensor([active, syncing], dtype=torch.int64, device=self.reducer.device)
        self.collective(dist.all_reduce, counts)
        return int(counts[0]), int(counts[1])

    def collective(self, collective, tensor: torch.Tensor, **kwargs) -> None:
        """A collective of the group's ranks, waited for with the reducer's timeout: a `PeerError` if one is lost."""
        timeout = self.reducer.timeout
        with talking_to(None, timeout):
            work = collective(tensor, group=self.reducer.group, async_op=True, **kwargs)
        wait(work, None, timeout)

    def shadow_step(self, ddp) -> None:
        """One step of a joined rank: the buffer broadcast and zero buckets that the training ranks expect."""
        r = self.reducer
        ddp.buffer_sync.sync(PRE_FORWARD, ddp.require_forward_param_sync and ddp.forward_sync_buffers)
        active, syncing = self.agree_on_step(0, 0)
        ddp.require_forward_param_sync = syncing > 0
        if not syncing:
            return
        r.divisor = len(r.peers) if self.divide_by_initial else active
        if not self.joined:  # given back at the end (a bucket view by value)
            self.stale_grads = [(p, p.grad, p.grad.clone() if r.gradient_as_bucket_view and p.grad is not None
                                 else None) for p in r.params]
        self.joined = True
        ddp.calls.queue()  # as the training ranks' first gradient hook does
        # The step's averages into `.grad`, as the training ranks get them: a Joinable sharded
        # optimizer (manualdp.spmd.sharding.zero at stage 1) steps this rank's shard with them.
        r.shadow_step()

    def sync_final_model(self, is_last_joiner: bool, buffers: bool) -> None:
        """Every rank takes the model of the last rank to join (the highest such rank); buffers only if they sync."""
        r = self.reducer
        self.joined = False
        stale, self.stale_grads = self.stale_grads, []
        for p, grad, value in stale:
            p.grad = grad
            if value is not None:
                grad.copy_(value)
        candidate = torch.tensor([r.rank if is_last_joiner else -1], device=r.device)
        self.collective(dist.all_reduce, candidate, op=dist.ReduceOp.MAX)
        self.authoritative_rank = int(candidate)
        root = r.peers[self.authoritative_rank]
        with torch.no_grad():
            for t in state_tensors(self.module, self.ignored, params=True, buffers=buffers):
                self.collective(dist.broadcast, t.data, src=root)


class _JoinedRank(JoinHook):
    """Join's hook for the wrapper: shadow each training step, then agree on the final model."""

    def __init__(self, ddp) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp.uneven.shadow_step(self.ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp.uneven.sync_final_model(is_last_joiner, self.ddp.forward_sync_buffers)


class JoinContext(Join):
    """torch's `Join`, whose ranks name a rank that raised inside it, and wait for each other with a timeout."""

    def __init__(self, joinables, enable: bool, throw_on_early_termination: bool, timeout: float | None, **kwargs):
        super().__init__(joinables, enable, throw_on_early_termination, **kwargs)
        self._timeout = timeout

    def _get_num_nonjoined_procs(self):
        count = torch.zeros(1, device=self._device)
        with talking_to(None, self._timeout):
            work = dist.all_reduce(count, group=self._process_group, async_op=True)
        wait(work, None, self._timeout)
        return count.item()

    def __exit__(self, type, value, traceback):
        if isinstance(value, PeerError):
            raise _named(value, self._process_group) from value
        if value is not None:
            if self._enable:
                _leave_reason(value)
            return None  # the exception goes on, as with torch's Join
        try:
            return super().__exit__(type, value, traceback)
        except PeerError as e:  # lost while shadowing the others' steps
            raise _named(e, self._process_group) from e


def _store(timeout: float = 2.0):
    """The default group's store, whose operations give up after `timeout` s (it may be gone with a machine)."""
    store = dist.distributed_c10d._get_default_store()  # torch has no public getter
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _leave_reason(error: BaseException) -> None:
    """Before this rank leaves with `error`: its reason, where the others look when their waits fail."""
    text = (str(error).strip().splitlines() or [""])[0][:200]
    rank = dist.get_rank()
    try:
        _store().set(store_key(rank), f"rank {rank}: raised {type(error).__name__}: {text} inside Join")
    except Exception:  # no store to tell: the others still get a PeerError, without the reason
        pass


def _named(error: PeerError, group) -> PeerError:
    """`error`, naming the rank that raised inside Join and why, where that rank left its reason."""
    me = dist.get_rank()
    try:
        store = _store()
        peers = [error.peer] if error.peer is not None else dist.get_process_group_ranks(group)
        for peer in (p for p in peers if p != me):
            if store.check([store_key(peer)]):
                reason = store.get(store_key(peer)).decode().removeprefix(f"rank {peer}: ")
                return PeerError(me, peer, error.timed_out, error.timeout, reason, error.where)
    except Exception:
        pass
    return error
