"""ZeRO-1 and ZeRO-2 across processes: each rank keeps the optimizer state of one shard.

The SPMD twin of `manualdp.zero`, with torch's `ZeroRedundancyOptimizer` interface where
it makes sense (`optimizer_class`, keyword defaults, `step`, `zero_grad`, `state_dict`):

    model = DistributedDataParallel(net)                           # stage 1: DDP averages the gradients
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    with model.no_sync():                                          # stage 2: the optimizer reduce-scatters
        loss.backward()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)

torch shards whole parameters (each rank owns some tensors); we shard the flat vector into
near-equal chunks, as the ring does. Elementwise optimizers give the same numbers either way.
"""
from __future__ import annotations

import torch

from ..buckets import flatten, unflatten_
from ..collectives import shard
from ..validate import one_of, timeout_seconds
from ..zero import make_optimizer, state_bytes
from .collectives import all_gather, reduce_scatter
from .p2p import group_ranks

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer:
    """Shard `params`' optimizer state (stage 1) and gradients (stage 2) over the ranks of `group`.

    Args:
        optimizer_class: e.g. `torch.optim.Adam`, or a factory `f(params, **defaults)`.
        stage: 1 expects averaged gradients (from the DDP wrapper); 2 expects this rank's own
            gradients (backward under `no_sync()`) and averages them by reduce-scatter.
        algorithm: of the reduce-scatter and the all-gather (`manualdp.schedule.COLLECTIVES`).
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, algorithm: str = "ring", group=None,
                 timeout: float | None = None, **defaults) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params must hold at least one parameter that requires grad, got none")
        self.stage = one_of("stage", stage, (1, 2))
        self.algorithm, self.group, self.timeout = algorithm, group, timeout_seconds("timeout", timeout)
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        with torch.no_grad():
            self.shard = shard(flatten(self.params), self.rank, self.world_size).clone().requires_grad_()
        self.optimizer = make_optimizer(optimizer_class, [self.shard], **defaults)

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: the gradients must not be averaged before `step`, which reduce-scatters them."""
        return self.stage == 2

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # so that learning-rate schedulers work

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter (stage 2) the gradients, update this rank's shard, all-gather the parameters."""
        kw = {"algorithm": self.algorithm, "group": self.group, "timeout": self.timeout}
        flat = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        if self.reduces_gradients:
            # Sum, then divide, as the DDP wrapper does: DDP hands the optimizer averages.
            mine = reduce_scatter(flat, **kw).div_(self.world_size)
        else:
            mine = shard(flat, self.rank, self.world_size)
        self.shard.grad = mine
        self.optimizer.step()
        self.shard.grad = None
        shard(flat, self.rank, self.world_size).copy_(self.shard)  # the gradient buffer is reused for the parameters
        all_gather(flat, **kw)
        unflatten_(flat, self.params)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank."""
        return state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        """This rank's shard of the state (each rank saves its own, as a sharded checkpoint)."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "shard": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise ValueError(f"state is rank {state.get('rank')} of {state.get('world_size')}; "
                             f"this is rank {self.rank} of {self.world_size}")
        self.optimizer.load_state_dict(state["shard"])
