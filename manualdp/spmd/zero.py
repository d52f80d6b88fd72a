"""ZeRO-1 and ZeRO-2 across processes: each rank keeps the optimizer state of one shard.

The SPMD twin of `manualdp.zero`, with torch's `ZeroRedundancyOptimizer` interface where
it makes sense (`optimizer_class`, parameter groups, keyword defaults, `step`, `zero_grad`,
`state_dict`, learning-rate schedulers):

    model = DistributedDataParallel(net)                           # stage 1: DDP averages the gradients
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    with model.no_sync():                                          # stage 2: the optimizer reduce-scatters
        loss.backward()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-3)

torch shards whole parameters (each rank owns some tensors); we shard the flat vector into
near-equal chunks, as the ring does, with the layout of `manualdp.shards.ShardPlan`: one flat
buffer per (parameter group, dtype), the parameters made views of it, and this rank's chunk
handed to its optimizer as one piece per parameter it overlaps. Elementwise optimizers give
the same numbers either way, and a parameter no rank has a gradient for is skipped.
"""
from __future__ import annotations

import copy

import torch

from ..validate import factory, one_of, timeout_seconds
from ..shards import ShardPlan, check_shard_fits, options_of, param_groups_of
from ..zero import make_optimizer, state_bytes
from .collectives import all_gather, reduce_scatter
from .p2p import allreduce
from .peers import group_ranks

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shard `params`' optimizer state (stage 1) and gradients (stage 2) over the ranks of `group`.

    Args:
        params: tensors, or parameter groups (dicts with "params"), as torch's optimizers take them.
        optimizer_class: e.g. `torch.optim.Adam`, or a factory `f(params, **defaults)`.
        stage: 1 expects averaged gradients (from the DDP wrapper); 2 expects this rank's own
            gradients (backward under `no_sync()`) and averages them by reduce-scatter.
        algorithm: of the reduce-scatter and the all-gather (`manualdp.schedule.COLLECTIVES`).

    Every rank must build it with the same stage and the same parameter shapes: the ranks
    compare them at construction and all raise, naming the ranks that differ.
    """

    def __init__(self, params, optimizer_class, *, stage: int = 1, algorithm: str = "ring", group=None,
                 timeout: float | None = None, **defaults) -> None:
        groups = param_groups_of(params)
        self.stage = one_of("stage", stage, (1, 2))
        factory("optimizer_class", optimizer_class)
        self.algorithm, self.group, self.timeout = algorithm, group, timeout_seconds("timeout", timeout)
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.params = [p for g in groups for p in g["params"]]
        self.plan = ShardPlan([g["params"] for g in groups], self.world_size)
        self._agree_on_setup()
        # The parameters become views of flat buffers, so that the collectives and the
        # optimizer work in place and a checkpoint loaded into the model is what they see.
        self.flats = self.plan.bind(self.params)
        self.pieces = [(j, lo, hi, self.flats[self.plan.where[j][0]][lo:hi]) for j, lo, hi in self.plan.pieces(self.rank)]
        inner = [{"params": [v for j, _, _, v in self.pieces if self.plan.group_of[j] == g], **options_of(group)}
                 for g, group in enumerate(groups)]
        # A rank whose chunks are empty (more ranks than elements) has nothing to step.
        self.optimizer = make_optimizer(optimizer_class, inner, **defaults) if self.pieces else None
        template = (self.optimizer if self.optimizer is not None
                    else make_optimizer(optimizer_class, [dict(g) for g in groups], **defaults))
        super().__init__([{"params": g["params"], **options_of(t)} for g, t in zip(groups, template.param_groups)], {})

    def _agree_on_setup(self) -> None:
        """Every rank sends (stage, buffers, elements, parameters); a rank that differs is named on all of them."""
        fields = ("stage", "buffers", "elements", "parameters")
        table = torch.zeros(self.world_size, len(fields), dtype=torch.float64, device=self.params[0].device)
        table[self.rank] = torch.tensor([self.stage, len(self.plan.sizes), sum(self.plan.sizes), len(self.params)],
                                        dtype=torch.float64)
        allreduce(table.view(-1), self.algorithm, group=self.group, timeout=self.timeout)
        table = table.cpu().long()
        for k, field in enumerate(fields):
            values = {r: int(table[r, k]) for r in range(self.world_size)}
            if len(set(values.values())) > 1:
                what = "ZeRO stages" if field == "stage" else f"numbers of {field} to shard"
                raise ValueError(f"ranks ask for different {what}: {values} (rank: {field}); every rank must pass "
                                 "the same")

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: the gradients must not be averaged before `step`, which reduce-scatters them."""
        return self.stage == 2

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Reduce-scatter (stage 2) the gradients, update this rank's shard, all-gather the parameters."""
        if closure is not None:
            raise ValueError("closure is not supported: ZeRO steps after the gradients are reduced")
        kw = {"algorithm": self.algorithm, "group": self.group, "timeout": self.timeout}
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                            device=self.flats[0].device)
        grads = self.plan.flat_grads(self.params)
        if self.reduces_gradients:
            # Which parameters has any rank a gradient for? Those no rank used are skipped.
            allreduce(used, **kw)
            for g in grads:  # sum, then divide, as the DDP wrapper does: DDP hands the optimizer averages
                reduce_scatter(g, **kw).div_(self.world_size)
        used = used.tolist()
        if self.optimizer is not None:
            for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
                inner.update(options_of(outer))  # a scheduler may have changed lr
            for j, lo, hi, piece in self.pieces:
                piece.grad = grads[self.plan.where[j][0]][lo:hi] if used[j] else None
            self.optimizer.step()
            for *_, piece in self.pieces:
                piece.grad = None
        for flat in self.flats:
            all_gather(flat, **kw)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank."""
        return state_bytes(self.optimizer)

    def state_dict(self) -> dict:
        """This rank's shard of the state (each rank saves its own, as a sharded checkpoint)."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "param_groups": [options_of(g) for g in self.param_groups],
                "shard": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard; another rank's, stage's or world size's is refused, changing nothing."""
        if not isinstance(state, dict) or "shard" not in state:
            raise ValueError("state is not a ZeroRedundancyOptimizer state_dict (it has no 'shard')")
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise ValueError(f"state is rank {state.get('rank')} of {state.get('world_size')}; "
                             f"this is rank {self.rank} of {self.world_size}")
        if state.get("stage") != self.stage:
            raise ValueError(f"state is ZeRO-{state.get('stage')}; this is ZeRO-{self.stage}")
        check_shard_fits(state["shard"], self.optimizer, "state's shard", f"rank {self.rank}'s")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["shard"]))
        for outer, saved in zip(self.param_groups, state.get("param_groups", ())):
            outer.update(saved)
