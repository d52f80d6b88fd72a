"""`FaultTolerantDDP`: data parallelism whose steps survive a replica that dies, used as the drop-in is.

    ft = FaultTolerantDDP(model, optimizer, manager)
    while manager.step < steps:
        ft.start_step()                               # the quorum; the state, if this replica is behind
        X, y = my_shard(batch(ft.batch_index))        # the same batch again after a discarded step
        loss_fn(ft(X), y).backward()                  # the loss of my shard, averaged over my shard
        committed = ft.step()                         # averaged gradients, then every member steps, or none

`step()` averages the gradients over the quorum's members (one flat allreduce per dtype, as
rung 2 of the ladder, on the book's schedules), asks the members whether to commit, and runs
the optimizer only if they all can. It returns True when the step was applied, False when
it was discarded (a member failed: nothing changed, and the same batch is taken again); it
leaves no gradients behind either way. A replica that joins receives the model's and the
optimizer's state from a member at the highest step before its first step. With a
`Manager(async_quorum=True)`, `start_step()` returns at once and the quorum is decided during
forward and backward (`ahead.py`): the fast setting, and the one `bench/ft.py` measures.

The math when a member leaves: the gradient of a step is the mean of its members' shard
gradients, (1/|M|) sum over i in M of g_i. With equal shards that is the gradient of the mean
loss over the members' part of the global batch: the dead member's shard is simply not in
this step's batch, an unbiased step on a smaller batch, with a little more noise.
"""
from __future__ import annotations

import torch
from torch import nn

from ...validate import initialized, nn_module, no_closure
from .average import average_and_vote
from .manager import Manager
from .quorum import Quorum

__all__ = ["FaultTolerantDDP", "check_wrapped", "optimizer_settings"]


class FaultTolerantDDP(nn.Module):
    """Wrap `module` and its `optimizer` so that each step is averaged over, and committed by, `manager`'s quorum.

    `module` and `optimizer` are registered with the manager as the state a recovering replica
    receives (register more, such as a learning-rate scheduler, with `manager.register_state`).
    Buffers (BatchNorm's running statistics) are each replica's own between recoveries.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, manager: Manager) -> None:
        super().__init__()
        check_wrapped(module, optimizer, manager)
        self.module, self.optimizer, self.manager = module, optimizer, manager
        manager.register_state("model", module.state_dict, module.load_state_dict)
        manager.register_state("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        manager.require_same(method="ddp", **optimizer_settings(optimizer))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def batch_index(self) -> int:
        """The index of the batch this step trains on: the steps committed so far, the same on every member."""
        return self.manager.step

    def start_step(self) -> Quorum:
        """Agree on this step's quorum (and receive the state if behind); clear the gradients. Returns the quorum."""
        quorum = self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=True)
        return quorum

    def step(self, also: tuple[torch.Tensor, ...] = ()) -> bool:
        """Average the gradients over the quorum, then apply the step on every member or on none; True if applied.

        `also`: more tensors averaged with the step (a loop's loss totals), changed only if it is applied.
        """
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused in this step on this replica: it contributes zeros
                p.grad = torch.zeros_like(p)
        committed = average_and_vote(self.manager, [p.grad for p in params], also)
        if committed:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return committed


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
