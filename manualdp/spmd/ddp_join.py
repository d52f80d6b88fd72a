"""Uneven inputs for `DistributedDataParallel`: ranks out of data shadow the others until all are done.

torch's `Join` context calls the wrapper's `join_hook`: while some ranks still train, a rank
that has run out of batches answers each of their steps with the same collectives (the
buffer broadcast, the step's call check and zero buckets), so the training ranks' messages
always find a partner. At the end every rank takes the model of the last rank to join.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..validate import boolean
from .ddp_sync import state_tensors, broadcast_from_rank0

__all__ = ["UnevenInputs"]


class UnevenInputs(Joinable):
    """The Join half of `DistributedDataParallel` (a mixin: it uses the wrapper's buckets and worker)."""

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context for uneven inputs: ranks out of data shadow the others' collectives until all are done."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """What this wrapper does while its rank has joined (`divide_by_initial_world_size`: default True)."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        boolean("divide_by_initial_world_size", divide)
        self._join_divide_by_initial = divide
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
        dist.all_reduce(counts, group=self.process_group)
        return int(counts[0]), int(counts[1])

    def _shadow_step(self) -> None:
        """One step of a joined rank: the buffer broadcast and zero buckets that the training ranks expect."""
        if self.require_forward_param_sync and self.broadcast_buffers:
            broadcast_from_rank0(state_tensors(self.module, self.parameters_to_ignore), self.rank, self._peers,
                                 self.process_group, self.timeout)
        active, syncing = self._agree_on_step(0, 0)
        self.require_forward_param_sync = syncing > 0
        if not syncing:
            return
        self._divisor = self.world_size if self._join_divide_by_initial else active
        self._joined = True
        self._step_check = self._check_step()  # as the training ranks' first gradient hook does
        for b, bucket in enumerate(self._buckets):
            bucket.flat.zero_()
            bucket.future = self._executor.submit(self._reduce, b, bucket)
        try:
            for bucket in self._buckets:
                bucket.future.result()
        finally:
            self._reset_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (the highest such rank)."""
        self._joined = False
        candidate = torch.tensor([self.rank if is_last_joiner else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        self._authoritative_rank = int(candidate)  # torch's name for it; its Join tests read it
        root = self._peers[self._authoritative_rank]
        with torch.no_grad():
            for t in state_tensors(self.module, self.parameters_to_ignore, params=True):
                dist.broadcast(t.data, src=root, group=self.process_group)


class _JoinedRank(JoinHook):
    """Join's hook for the wrapper: shadow each training step, then agree on the final model."""

    def __init__(self, ddp: UnevenInputs) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
