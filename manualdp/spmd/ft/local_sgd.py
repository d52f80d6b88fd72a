"""Local SGD and DiLoCo: H steps alone, then the replicas meet, on the same manager.

    ft = DiLoCo(model, inner_optimizer, manager, sync_every=H)   # or LocalSGD(model, optimizer, manager, H)
    while manager.step < outer_steps:
        ft.start_step()                            # a quorum at the first step of each block of H
        loss_fn(ft(X_of(ft.batch_index)), y).backward()
        ft.step()                                  # None inside a block; True or False at its end

Each replica takes H optimizer steps on its own data, sending nothing; then the members of
the block's quorum combine what they did. With theta the parameters all members started the
block from, theta_i replica i's after its H steps and M the quorum's members:

- local SGD: theta <- (1/|M|) sum over i in M of theta_i: the average of the parameters;
- DiLoCo (Douillard et al., 2023): the outer gradient is the average change,
      delta = (1/|M|) sum over i in M of (theta - theta_i),
  and an outer SGD with Nesterov momentum (learning rate eta, momentum mu) steps on it:
      b <- mu * b + delta            (b = 0 before the first block)
      theta <- theta - eta * (delta + mu * b)
  With eta = 1 and mu = 0 that is local SGD again.

One allreduce of the parameters per H steps instead of one of the gradients per step: 1/H of
DDP's bytes per step. The block is committed or discarded as one step of `FaultTolerantDDP`
is; a discarded block leaves no trace (the parameters and the inner optimizer's state go back
to the block's start) and is taken again from the same batches. `manager.step` counts blocks.
With H = 1, plain SGD and no momentum, local SGD is DDP (to float rounding).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ...validate import fraction, learning_rate, positive_int
from .average import average_and_vote
from .ddp import check_wrapped, optimizer_settings
from .manager import Manager
from .quorum import Quorum

__all__ = ["LocalSGD", "DiLoCo"]


class LocalSGD(nn.Module):
    """`sync_every` (H) optimizer steps alone, then the parameters averaged over the quorum (module docstring)."""

    method = "local_sgd"  # what the replicas compare (`Manager.require_same`)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, manager: Manager, sync_every: int) -> None:
        super().__init__()
        check_wrapped(module, optimizer, manager)
        self.module, self.optimizer, self.manager = module, optimizer, manager
        self.sync_every = positive_int("sync_every", sync_every)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.start = [p.detach().clone() for p in self.params]  # theta: the parameters at the block's start
        self._local = 0            # steps taken alone in this block
        self._inner_start = None   # the inner optimizer's state at the block's start
        manager.register_state("model", module.state_dict, module.load_state_dict)
        manager.register_state("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        manager.require_same(method=self.method, sync_every=self.sync_every, **optimizer_settings(optimizer))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def batch_index(self) -> int:
        """The index of the batch this step trains on: H per committed block, plus the steps of this one.

        A loop that ends blocks early (`step(end_block=True)`) counts its batches itself.
        """
        return self.manager.step * self.sync_every + self._local

    def start_step(self) -> Quorum | None:
        """At a block's first step, agree on its quorum (and receive the state if behind); clear the gradients."""
        quorum = None
        if self._local == 0:
            quorum = self.manager.start_step()
            with torch.no_grad():
                for s, p in zip(self.start, self.params):
                    s.copy_(p)
            self._inner_start = copy.deepcopy(self.optimizer.state_dict())
        self.optimizer.zero_grad(set_to_none=True)
        return quorum

    def step(self, end_block: bool = False, also: tuple[torch.Tensor, ...] = ()) -> bool | None:
        """An optimizer step alone; at the block's end the replicas combine: True if committed, False if discarded.

        Inside a block it returns None: nothing was sent. `end_block=True` ends this block before
        its H steps (every member must pass it at the same step: at an epoch's end, say). `also`:
        more tensors averaged at the block's end (a loop's loss totals), changed only if it commits.
        """
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._local += 1
        if self._local < self.sync_every and not end_block:
            return None
        self._local = 0
        with torch.no_grad():
            committed = self.combine(also)
            if not committed:  # the block never happened
                for s, p in zip(self.start, self.params):
                    p.copy_(s)
                self.optimizer.load_state_dict(self._inner_start)
        return committed

    def combine(self, also: tuple[torch.Tensor, ...] = ()) -> bool:
        """Local SGD: the parameters averaged over the members, if they all commit."""
        return average_and_vote(self.manager, [p.detach() for p in self.params], also)


class DiLoCo(LocalSGD):
    """`LocalSGD` whose combination is an outer Nesterov SGD step on the averaged change (see the module's docstring).

    Args:
        outer_lr, outer_momentum: eta and mu of the outer step (DiLoCo's paper: 0.7 and 0.9).
    """

    method = "diloco"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, manager: Manager, sync_every: int, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
        learning_rate("outer_lr", outer_lr)  # before the base class registers anything with the manager
        fraction("outer_momentum", outer_momentum)
        super().__init__(module, optimizer, manager, sync_every)
        manager.require_same(outer_lr=outer_lr, outer_momentum=outer_momentum)
        self.start = [nn.Parameter(s, requires_grad=True) for s in self.start]  # theta, stepped by the outer optimizer
        self.outer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        manager.register_state("outer_optimizer", self.outer.state_dict, self.outer.load_state_dict)

    def combine(self, also: tuple[torch.Tensor, ...] = ()) -> bool:
        deltas = [s.detach() - p.detach() for s, p in zip(self.start, self.params)]  # theta - theta_i
        if not average_and_vote(self.manager, deltas, also):  # delta, averaged over the members
            return False
        for s, delta in zip(self.start, deltas):
            s.grad = delta
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for s, p in zip(self.start, self.params):
            p.copy_(s)
        return True
