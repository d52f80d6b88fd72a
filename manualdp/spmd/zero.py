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
The parameters and gradients are moved into two flat buffers (as torch's
`parameters_as_bucket_view` and DDP's `gradient_as_bucket_view` do); the gradients are
zeroed in place, never set to None, so that they stay there.
"""
from __future__ import annotations

import torch

from ..buckets import flatten
from ..collectives import shard
from ..validate import one_of, timeout_seconds
from ..zero import make_optimizer, state_bytes
from .collectives import all_gather, reduce_scatter
from .peers import group_ranks

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
            # The parameters and their gradients become views of two flat buffers, so that
            # the collectives and the optimizer work in place: no copy of the model is made.
            self.flat = flatten(self.params)
            self.flat_grad = torch.zeros_like(self.flat)
            for p, view in zip(self.params, self._views(self.flat)):
                p.data = view
            self._point_grads_at_buffer()
        # This rank's shard is a slice of the flat parameters: stepping it updates them in place.
        self.shard = shard(self.flat, self.rank, self.world_size)
        self.optimizer = make_optimizer(optimizer_class, [self.shard], **defaults)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self.params:
            out.append(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        return out

    def _point_grads_at_buffer(self) -> None:
        """Make every `p.grad` a view of `flat_grad` again, keeping what it holds (autograd and DDP then write there)."""
        for p, view in zip(self.params, self._views(self.flat_grad)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: the gradients must not be averaged before `step`, which reduce-scatters them."""
        return self.stage == 2

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # so that learning-rate schedulers work

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place, whatever `set_to_none` says: they must stay views of the flat buffer."""
        self.flat_grad.zero_()
        self._point_grads_at_buffer()

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter (stage 2) the gradients, update this rank's shard, all-gather the parameters."""
        kw = {"algorithm": self.algorithm, "group": self.group, "timeout": self.timeout}
        self._point_grads_at_buffer()  # in case a caller replaced a p.grad
        if self.reduces_gradients:
            # Sum, then divide, as the DDP wrapper does: DDP hands the optimizer averages.
            mine = reduce_scatter(self.flat_grad, **kw).div_(self.world_size)
        else:
            mine = shard(self.flat_grad, self.rank, self.world_size)
        self.shard.grad = mine
        self.optimizer.step()
        self.shard.grad = None
        all_gather(self.flat, **kw)

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
