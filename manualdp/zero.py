"""ZeRO-1 and ZeRO-2 on a list of devices (single controller): every device updates one shard.

Plain data parallelism keeps a full copy of the optimizer state on every device: for Adam
two extra tensors the size of the model, on each of N devices. ZeRO cuts the flat
parameter vector into N chunks (`manualdp.collectives.chunk`) and lets device i keep the
optimizer state of its chunk only:

1. the gradients are summed, but each device needs only its own chunk of the sum, so a
   reduce-scatter is enough (stage 2); stage 1 keeps the usual allreduce;
2. device i steps its optimizer on its chunk: state for 1/N of the parameters;
3. an all-gather sends every updated chunk to every device.

Reduce-scatter + all-gather is the ring allreduce cut in two (`manualdp.schedule.ring`),
with the optimizer step moved into the middle: the same bytes on the wire, 1/N of the state.

The layout (`manualdp.shards`) makes it equal to plain data parallelism, not merely close:
the parameters *are* views of flat buffers, so loading a checkpoint into the model is what
the shards see; each device steps one piece per parameter its chunk overlaps, so a parameter
with no gradient is skipped and each parameter group keeps its options; float32 and float64
stay in buffers of their own. The optimizers torch offers are elementwise (SGD, Adam, AdamW),
so stepping pieces gives exactly the numbers that stepping whole parameters would.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .collectives import all_gather, reduce_scatter
from .lockstep import DeviceShard
from .memory import HeldBytes, peak_of, state_bytes, storage_bytes
from .shards import ShardPlan, check_shard_fits, options_of, param_groups_of
from .validate import factory, no_closure, one_of

__all__ = ["ShardedOptimizer", "make_optimizer", "state_bytes", "storage_bytes"]


def make_optimizer(optimizer_class, params, **defaults) -> torch.optim.Optimizer:
    """`optimizer_class(params, **defaults)`: a torch.optim class or any factory taking the parameters, whose step
    needs no closure (LBFGS's evaluates the whole loss: it is not elementwise, and no shard could take it)."""
    return no_closure("optimizer_class", factory("optimizer_class", optimizer_class)(params, **defaults))


class ShardedOptimizer(HeldBytes, torch.optim.Optimizer):
    """A sharded optimizer for `replicas` (one model per device, as from `manualdp.replicate`).

    Args:
        optimizer_class: e.g. `torch.optim.Adam`, or a factory `f(params, **defaults)`.
        stage: 1 shards the optimizer state and expects summed gradients (after
            `allreduce_gradients`); 2 also shards the gradients: `step` reduce-scatters them.
        algorithm: of the reduce-scatter and the all-gather (`manualdp.schedule.COLLECTIVES`).
        param_groups: optional groups over `replicas[0]`'s parameters, as torch's optimizers
            take them (`[{"params": [...], "lr": ...}, ...]`); the other replicas follow by position.
        defaults: keyword arguments for the optimizer (`lr=...`, `betas=...`).

    It is a `torch.optim.Optimizer` whose `param_groups` are replica 0's parameters, so
    learning-rate schedulers work: their options reach every device's optimizer at `step`.
    `train_batch` takes `zero.per_device()` in place of its list of optimizers.

    Memory (`manualdp.memory`): every device holds the whole model (`param_bytes()`); after `step`, the whole summed
    gradient at stage 1, only its chunk of it at stage 2 (`gradient_bytes()`); `state_bytes()`; and `peak_bytes()`,
    the most of each held at once from the reduction to the end of `step`.
    """

    def __init__(self, replicas: list[nn.Module], optimizer_class, *, stage: int = 1, algorithm: str = "ring",
                 param_groups=None, **defaults) -> None:
        if isinstance(replicas, nn.Module) or not replicas or not all(isinstance(r, nn.Module) for r in replicas):
            raise TypeError(f"replicas must be a non-empty list of nn.Module, got {replicas!r:.80}")
        self.stage = one_of("stage", stage, (1, 2))
        factory("optimizer_class", optimizer_class)
        self.algorithm = algorithm
        groups = param_groups_of(replicas[0].parameters() if param_groups is None else param_groups, "param_groups")
        first = list(replicas[0].parameters())
        index = {id(p): k for k, p in enumerate(first)}
        for g in groups:
            if any(id(p) not in index for p in g["params"]):
                raise ValueError("param_groups must hold parameters of replicas[0] only")
        positions = [[index[id(p)] for p in g["params"]] for g in groups]
        n = self.num_devices = len(replicas)
        self.plan = ShardPlan([g["params"] for g in groups], n)
        self.replicas, self.params = list(replicas), []  # device i's trainable parameters, in the plan's order
        for i, r in enumerate(replicas):
            ps = list(r.parameters())
            if len(ps) != len(first) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ps, first)):
                raise ValueError(f"replicas[{i}] does not have replicas[0]'s parameters (shapes, dtypes)")
            self.params.append([ps[k] for pos in positions for k in pos])
        self.flats = [self.plan.bind(ps) for ps in self.params]
        # Device i's optimizer steps views of its own chunks: one piece per parameter it overlaps.
        self.pieces, self.optimizers = [], []
        for i in range(n):
            pieces = [(j, lo, hi, self.flats[i][self.plan.where[j][0]][lo:hi]) for j, lo, hi in self.plan.pieces(i)]
            inner = [{"params": [v for j, _, _, v in pieces if self.plan.group_of[j] == g], **options_of(group)}
                     for g, group in enumerate(groups)]
            self.pieces.append(pieces)
            self.optimizers.append(make_optimizer(optimizer_class, inner, **defaults) if pieces else None)
        template = next(o for o in self.optimizers if o is not None)
        super().__init__([{"params": g["params"], **options_of(t)} for g, t in zip(groups, template.param_groups)], {})
        self._stepped: set[int] = set()
        self.grad_shards: list[list[torch.Tensor]] = [[] for _ in range(n)]  # stage 2: device i's chunk of the sum

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: the caller must not allreduce the gradients, `step` reduce-scatters them."""
        return self.stage == 2

    def zero_grad(self, set_to_none: bool = True) -> None:
        for i in range(self.num_devices):
            self.zero_grad_on(i, set_to_none)

    def zero_grad_on(self, device: int, set_to_none: bool = True) -> None:
        self.grad_shards[device] = []
        for p in self.params[device]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _sync_options(self) -> None:
        """Copy the options of `self.param_groups` (a scheduler may have changed `lr`) to every device's optimizer."""
        for opt in self.optimizers:
            if opt is not None:
                for outer, inner in zip(self.param_groups, opt.param_groups):
                    inner.update(options_of(outer))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Update every device's shard, then all-gather the parameters."""
        if closure is not None:
            raise ValueError("closure is not supported: ZeRO steps after the gradients are reduced")
        # A parameter no device has a gradient for is skipped, as torch's optimizers skip it.
        used = [any(ps[j].grad is not None for ps in self.params) for j in range(len(self.params[0]))]
        grads = self._reduce(used)
        held = [self.held_bytes()]
        self._sync_options()
        for i, (pieces, opt, g) in enumerate(zip(self.pieces, self.optimizers, grads)):
            for j, lo, hi, piece in pieces:
                b = self.plan.where[j][0]
                start = self.plan.bounds(b, i)[0] if self.reduces_gradients else 0  # stage 2 holds its chunk only
                piece.grad = g[b][lo - start:hi - start] if used[j] else None
            if opt is not None:
                opt.step()
            for *_, piece in pieces:
                piece.grad = None  # views of the gradient buffers, which outlive the step as `.grad` or `grad_shards`
        held.append(self.held_bytes())
        for b in range(len(self.plan.buffers)):
            all_gather([flats[b] for flats in self.flats], self.algorithm)
        self._peak = peak_of(held + [self.held_bytes()])

    def _reduce(self, used: list[bool]) -> list[list[torch.Tensor]]:
        """Every device's summed gradient, per buffer: whole at stage 1, its own chunk at stage 2."""
        grads = [self.plan.flat_grads(ps) for ps in self.params]
        if not self.reduces_gradients:  # stage 1: `.grad` becomes a view of the flat copy, so none is held twice
            for ps, g in zip(self.params, grads):
                for j, (b, lo, hi) in enumerate(self.plan.where):
                    if used[j]:
                        ps[j].grad = g[b][lo:hi].view_as(ps[j])
            return grads
        for b in range(len(self.plan.buffers)):  # stage 2: only the own chunk of the sum is needed
            reduce_scatter([g[b] for g in grads], self.algorithm)
        self.grad_shards = [[f[slice(*self.plan.bounds(b, i))].clone() for b, f in enumerate(g)]
                            for i, g in enumerate(grads)]
        for ps in self.params:  # ZeRO-2 lets go of the whole gradients: a device keeps its chunk of the sum
            for p in ps:
                p.grad = None
        return self.grad_shards

    def state_dict(self) -> dict:
        """Every device's shard of the state, and the options of `param_groups` (a scheduler's `lr`)."""
        return {"stage": self.stage, "num_devices": self.num_devices,
                "param_groups": [options_of(g) for g in self.param_groups],
                "shards": [opt.state_dict() if opt is not None else None for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict` gave; refuses a state of another stage or number of devices, changing nothing."""
        if not isinstance(state, dict) or "shards" not in state:
            raise ValueError("state is not a ShardedOptimizer state_dict (it has no 'shards')")
        if (state.get("stage"), state.get("num_devices")) != (self.stage, self.num_devices):
            raise ValueError(f"state is ZeRO-{state.get('stage')} on {state.get('num_devices')} devices; "
                             f"this is ZeRO-{self.stage} on {self.num_devices}")
        if len(state.get("param_groups", ())) != len(self.param_groups):
            raise ValueError(f"state has {len(state.get('param_groups', ()))} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for i, (opt, s) in enumerate(zip(self.optimizers, state["shards"])):  # check all before loading any
            check_shard_fits(s, opt, f"state's shard {i}", f"device {i}'s")
        for opt, s in zip(self.optimizers, state["shards"]):
            if opt is not None:
                opt.load_state_dict(copy.deepcopy(s))  # replicas must never share storage
        for outer, saved in zip(self.param_groups, state["param_groups"]):
            outer.update(saved)
        self._sync_options()

    def per_device(self) -> list["DeviceShard"]:
        """One handle per device with an optimizer's `zero_grad` and `step`, for `train_batch`."""
        return [DeviceShard(self, i) for i in range(self.num_devices)]

