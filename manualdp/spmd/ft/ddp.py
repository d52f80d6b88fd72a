"""`FaultTolerantDDP`: data parallelism whose steps survive a replica that dies, used as the drop-in is.

    ft = FaultTolerantDDP(model, optimizer, manager)
    while manager.step < steps:
        ft.start_step()                               # the quorum; the state, if this replica is behind
        X, y = my_shard(batch(ft.batch_index))        # the same batch again after a discarded step
        loss_fn(ft(X), y).backward()                  # the loss of my shard, averaged over my shard
        committed = ft.step()                         # averaged gradients, then every member steps, or none

During backward each bucket of gradients is averaged over the quorum's members as soon as it is
full, as `DistributedDataParallel` does (the drop-in's reducer, `bucketed.py`, whose comm hook is
`Manager.average`: torchft's design). `step()` asks the members whether to commit, and runs the
optimizer only if they all can: a member that failed during any bucket's average discards the
step on every member. It returns True when the step was applied, False when it was discarded
(nothing changed, and the same batch is taken again); it leaves no gradients behind either way.
`no_sync()` accumulates gradients locally, as the drop-in's. A replica that joins receives the
model's and the optimizer's state from a member at the highest step before its first step. With
a `Manager(async_quorum=True)`, `start_step()` returns at once and the quorum is decided during
forward (`ahead.py`), taken as backward starts: the fast setting, and the one `bench/ft.py` measures.

The math when a member leaves: the gradient of a step is the mean of its members' shard
gradients, (1/|M|) sum over i in M of g_i. With equal shards that is the gradient of the mean
loss over the members' part of the global batch: the dead member's shard is simply not in
this step's batch, an unbiased step on a smaller batch, with a little more noise.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ...buckets import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB
from ...validate import initialized, nn_module, no_closure, positive_number
from ..ddp.wrapper import DistributedDataParallel
from .average import average_and_vote
from .bucketed import QuorumReducer
from .manager import Manager
from .quorum import Quorum

__all__ = ["FaultTolerantDDP", "check_wrapped", "optimizer_settings"]

_log = logging.getLogger("manualdp.spmd.ft")  # the guard's: one line a discarded step


class FaultTolerantDDP(nn.Module):
    """Wrap `module` and its `optimizer` so that each step is averaged over, and committed by, `manager`'s quorum.

    `module` and `optimizer` are registered with the manager as the state a recovering replica
    receives (register more, such as a learning-rate scheduler, with `manager.register_state`).
    Buffers (BatchNorm's running statistics) are each replica's own between recoveries.
    `bucket_cap_mb`: the gradients are averaged in buckets of at most this many MiB, in reverse
    parameter order (the default: a first bucket of 1 MiB, as DDP's); None: one per parameter.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, manager: Manager, *,
                 bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__()
        check_wrapped(module, optimizer, manager)
        positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
        self.module, self.optimizer, self.manager = module, optimizer, manager
        manager.register_state("model", module.state_dict, module.load_state_dict)
        manager.register_state("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        manager.require_same(method="ddp", bucket_cap_mb=bucket_cap_mb, **optimizer_settings(optimizer))
        caps = [FIRST_BUCKET_CAP_MB, bucket_cap_mb] if bucket_cap_mb == DEFAULT_BUCKET_CAP_MB else bucket_cap_mb
        self.reducer = QuorumReducer(module, [p for p in module.parameters() if p.requires_grad], caps, manager)
        self.require_backward_grad_sync = True  # False inside no_sync()

    def forward(self, *args, **kwargs):
        self.reducer.syncing = self.require_backward_grad_sync  # as the drop-in: the forward decides
        return self.module(*args, **kwargs)

    no_sync = DistributedDataParallel.no_sync  # the drop-in's: the backward passes of forwards inside average nothing

    @property
    def batch_index(self) -> int:
        """The index of the batch this step trains on: the steps committed so far, the same on every member."""
        return self.manager.step

    def start_step(self) -> Quorum:
        """Agree on this step's quorum (and receive the state if behind); clear the gradients. Returns the quorum."""
        quorum = self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer.begin()
        return quorum

    def step(self, also: tuple[torch.Tensor, ...] = ()) -> bool:
        """Vote on the step the buckets averaged, then apply it on every member or on none; True if applied.

        `also`: more tensors averaged with the step (a loop's loss totals), changed only if it is applied.
        """
        r = self.reducer
        if not r.started:
            raise RuntimeError(f"replica {self.manager.id!r}: step() without a step under way: call start_step() "
                               f"before forward and backward")
        r.started = False
        if r.error is not None:
            raise r.error
        if r.in_backward:  # backward raised part-way: some buckets went, others never will; nobody can commit it
            r.abandon()
            committed = self.manager.should_commit(False)
        else:
            if r.late or not r.averaged:  # the quorum entered after backward, or no backward reached the buckets
                r.average_late()
            norms = torch.tensor(r.norms, dtype=torch.float64)  # the guard judges the whole contribution by them
            if r.nonfinite is not None:  # the guard judged the norms before the average: it cannot see this
                _log.warning(f"replica {self.manager.id}: step {self.manager.step} discarded: bucket {r.nonfinite}'s "
                             f"average came back non-finite (NaN or Inf), the same on every member")
            committed = average_and_vote(self.manager, [], also, judged=[norms], ok=r.nonfinite is None)
        if committed:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return committed

    def __del__(self) -> None:
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.close()


def check_wrapped(module: nn.Module, optimizer: torch.optim.Optimizer, manager: Manager) -> None:
    """The checks of every wrapper of this room, before it registers anything with `manager`."""
    initialized("module", nn_module("module", module))
    no_closure("optimizer", optimizer)
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a manualdp.spmd.ft.Manager, got {type(manager).__name__}")
    ours = {id(p) for p in module.parameters()}
    for i, group in enumerate(getattr(optimizer, "param_groups", [])):
        if any(id(p) not in ours for p in group["params"]):
            raise ValueError(f"optimizer: its parameter group {i} holds tensors that are not parameters of module "
                             f"(an optimizer over another model's parameters would step nothing this averages): "
                             f"build it from module.parameters()")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's class and each group's hyperparameters (lr, momentum, ...): what replicas must share."""
    groups = getattr(optimizer, "param_groups", [])
    out = {"optimizer": type(optimizer).__name__}
    for i, group in enumerate(groups):
        for key, value in group.items():
            if key != "params":
                out[key if len(groups) == 1 else f"group {i} {key}"] = value
    return out
