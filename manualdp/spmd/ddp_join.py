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

from ..validate import boolean
from .ddp_buffers import PRE_FORWARD
from .ddp_sync import state_tensors
from .peers import PeerError, talking_to, wait
from .postmortem import store_key

__all__ = ["UnevenInputs"]


class UnevenInputs(Joinable):
    """The Join half of `DistributedDataParallel` (a mixin: it uses the wrapper's buckets and worker)."""

    _join_used = False  # True once a Join context has taken this wrapper

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context for uneven inputs: ranks out of data shadow the others' collectives until all are done."""
        return _Join([self], enable, throw_on_early_termination, self.timeout,
                     divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """What this wrapper does while its rank has joined (`divide_by_initial_world_size`: default True)."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        boolean("divide_by_initial_world_size", divide)
        self._join_divide_by_initial = divide
        self._join_used = True  # torch logs it (`_get_ddp_logging_data()["join_uneven_inputs"]`)
        return _JoinedRank(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def _agree_on_step(self, active: int, syncing: int) -> tuple[int, int]:
        """Allreduce (ranks still training, ranks whose step syncs gradients); joined ranks add zeros."""
        counts = torch.tensor([active, syncing], dtype=torch.int64, device=self.device)
        self._join_collective(dist.all_reduce, counts)
        return int(counts[0]), int(counts[1])

    def _join_collective(self, collective, tensor: torch.Tensor, **kwargs) -> None:
        """A collective of the group's ranks, waited for with the wrapper's timeout: a `PeerError` if one is lost."""
        with talking_to(None, self.timeout):
            work = collective(tensor, group=self.process_group, async_op=True, **kwargs)
        wait(work, None, self.timeout)

    def _shadow_step(self) -> None:
        """One step of a joined rank: the buffer broadcast and zero buckets that the training ranks expect."""
        self._sync_buffers(PRE_FORWARD)
        active, syncing = self._agree_on_step(0, 0)
        self.require_forward_param_sync = syncing > 0
        if not syncing:
            return
        self._divisor = self.world_size if self._join_divide_by_initial else active
        if not self._joined:  # what `.grad` held when this rank joined, given back at the end (a bucket view by value)
            self._stale_grads = [(p, p.grad, p.grad.clone() if self.gradient_as_bucket_view and p.grad is not None
                                  else None) for p in self._params]
        self._joined = True
        self._step_check = self._check_step()  # as the training ranks' first gradient hook does
        for b, bucket in enumerate(self._buckets):
            bucket.flat.zero_()
            bucket.future = self._executor.submit(self._reduce, b, bucket)
        try:
            for bucket in self._buckets:
                bucket.future.result()
            # The step's averages into `.grad`, as the training ranks get them: a Joinable sharded
            # optimizer (manualdp.spmd.zero at stage 1) steps this rank's shard with them.
            for bucket in self._buckets:
                self._write_grads(bucket)
        finally:
            self._reset_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (the highest such rank); buffers only if they sync."""
        self._joined = False
        for p, grad, value in self.__dict__.pop("_stale_grads", ()):
            p.grad = grad
            if value is not None:
                grad.copy_(value)
        candidate = torch.tensor([self.rank if is_last_joiner else -1], device=self.device)
        self._join_collective(dist.all_reduce, candidate, op=dist.ReduceOp.MAX)
        self._authoritative_rank = int(candidate)  # torch's name for it; its Join tests read it
        root = self._peers[self._authoritative_rank]
        with torch.no_grad():
            for t in state_tensors(self.module, self.parameters_to_ignore, params=True, buffers=self.forward_sync_buffers):
                self._join_collective(dist.broadcast, t.data, src=root)


class _JoinedRank(JoinHook):
    """Join's hook for the wrapper: shadow each training step, then agree on the final model."""

    def __init__(self, ddp: UnevenInputs) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class _Join(Join):
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
