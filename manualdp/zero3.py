"""ZeRO-3 on a list of devices (single controller): each device keeps 1/N of the parameters too.

ZeRO-1 and ZeRO-2 (`manualdp.zero`) shard the optimizer state, but every device still holds
every parameter. ZeRO-3 shards those as well. The model is cut into units (submodules, as
FSDP cuts it: `manualdp.units`); each unit's parameters are laid out flat as ZeRO lays them
out (`manualdp.shards`), and device i keeps only its chunk of every unit. A step runs:

1. before a unit's forward, an all-gather gives every device the unit's full parameters;
   after it they are freed: besides its shards, a device holds the units in use only;
2. backward needs them again (an op saves the weight it multiplies by): the first op of the
   unit's backward that reads one all-gathers them, and they are freed after the last. A unit
   whose weights backward never reads (a first layer: its input needs no gradient) is not
   gathered again;
3. a reduce-scatter of each unit's gradients leaves every device the sum of its own chunk;
4. every device steps its chunk with any elementwise torch optimizer, as in ZeRO-1/2.

Per step that is two all-gathers and one reduce-scatter of the model: each device sends
3(n-1)/n of it, against the 2(n-1)/n of plain data parallelism's allreduce (`traffic_of`).
It buys memory with bytes: parameters, gradients and optimizer state are all 1/N per device
between steps, plus the units in use during one.

Why not `train_batch`: these collectives sit inside forward and backward, where no device can
pass one before all have reached it; so each device runs in its own thread, and the threads
meet at every collective (`manualdp.lockstep`). The default units are the root's children that
have parameters (a ModuleList's children in its place: the list never runs a forward), plus
the root unit: the root's own parameters and any that two units share (a tied weight).
Between steps the parameters read NaN: the values are in the shards.
"""
from __future__ import annotations

import torch
from torch import nn

from .collectives import chunk, reduce_scatter
from .cost import traffic_of
from .guard import NonFiniteGuard
from .lockstep import check_own_gpus
from .loss import correct_tensor, logits_of, summed_loss
from .replicate import broadcast_buffers
from .schedule import COLLECTIVES
from .shards import ShardPlan, full_from_shards, load_shards, shards_state
from .split import split_batch
from .train import StepResult
from .units import Collective, Units, choose_units
from .memory import HeldBytes, gathered_bytes, peak_of
from .validate import one_of, same_replicas, trainable
from .zero import make_optimizer

__all__ = ["Zero3", "traffic_of"]


class Zero3(HeldBytes):
    """ZeRO-3 over `replicas` (one model per device, as from `manualdp.replicate`): each device keeps its shards.

    Args:
        optimizer_class: an elementwise optimizer (`torch.optim.SGD`, `Adam`, `AdamW`), or a factory
            `f(params, **defaults)`.
        units: names of the submodules sharded as one piece each (`manualdp.units.choose_units`).
        algorithm: of the all-gathers and reduce-scatters (`manualdp.schedule.COLLECTIVES`).
        defaults: keyword arguments for the optimizer (`lr=...`).

    `train_batch(X, y)` is the step; `collectives` lists what the last one ran (`traffic_of` counts
    its bytes) and `planned()` what every step runs; `full_parameters()` puts the model together.
    `param_bytes()` and `state_bytes()` count what a device holds between steps, `peak_bytes()` the most
    it held at once during the last step (`manualdp.memory`): parameters peak while a unit is gathered, and the
    whole gradient is held from backward's end until the step's.
    """

    _measured_in = "train_batch"

    def __init__(self, replicas: list[nn.Module], optimizer_class, *, units=None, algorithm: str = "ring",
                 **defaults) -> None:
        replicas = same_replicas("replicas", replicas)  # all checked, optimizers built, before a replica is hooked
        trainable("replicas[0]", replicas[0])
        self.algorithm = one_of("algorithm", algorithm, COLLECTIVES["all_gather"])
        chosen = choose_units(replicas[0], units)
        check_own_gpus([next(r.parameters()).device for r in replicas])
        n = self.num_devices = len(replicas)
        index = {id(p): k for k, p in enumerate(replicas[0].parameters())}
        # (unit, position in the unit) of every parameter, in replicas[0].parameters() order
        self.order = sorted(((u, j) for u, (_, ps) in enumerate(chosen) for j in range(len(ps))),
                            key=lambda uj: index[id(chosen[uj[0]][1][uj[1]])])
        self.plans = [ShardPlan([ps], n) for _, ps in chosen]
        self.replicas, self.params, self.shards = replicas, [], []  # [device][unit][parameter or buffer]
        for i, r in enumerate(replicas):
            ps = list(r.parameters())
            self.params.append([[ps[index[id(p)]] for p in unit] for _, unit in chosen])
            self.shards.append([[chunk(flat, i, n).clone() for flat in plan.bind(self.params[i][u])]
                                for u, plan in enumerate(self.plans)])
        self.devices = [s[0][0].device for s in self.shards]
        self.names = dict(zip(self.order, (name for name, _ in replicas[0].named_parameters())))  # (unit, j) -> name
        # Device i's optimizer steps one piece of its shards per trainable parameter they overlap.
        self.pieces, self.optimizers = [], []
        for i in range(n):
            pieces = []
            for u, plan in enumerate(self.plans):
                for j, lo, hi in plan.pieces(i):
                    b = plan.where[j][0]
                    lo, hi = lo - plan.bounds(b, i)[0], hi - plan.bounds(b, i)[0]  # within the shard
                    if self.params[i][u][j].requires_grad:
                        pieces.append((u, j, b, lo, hi, self.shards[i][u][b][lo:hi]))
            self.pieces.append(pieces)
            opt = make_optimizer(optimizer_class, [v for *_, v in pieces], **defaults) if pieces else None
            self.optimizers.append(opt)
        self.units = Units(replicas, [name for name, _ in chosen], self.plans, self.params, self.shards, algorithm)
        self.grad_shards: list = [() for _ in range(n)]  # during a step: device i's chunks of the summed gradients

    @property
    def collectives(self) -> list[Collective]:
        """The collectives the last step ran, in order, with the parameter bytes every device held after each."""
        return self.units.collectives

    def planned(self) -> list[Collective]:
        """Each unit all-gathered for forward and for backward, then reduce-scattered: what the formula counts.
        A step runs fewer where backward reads none of a unit's weights, or a unit has nothing to train."""
        return [Collective(kind, phase, self.units.names[u], size, self.shards[0][u][b].element_size())
                for phase, kind in (("forward", "all_gather"), ("backward", "all_gather"), ("step", "reduce_scatter"))
                for u, plan in enumerate(self.plans) for b, size in enumerate(plan.sizes)]

    def train_batch(self, X: torch.Tensor, y: torch.Tensor, loss_fn=None, *, nonfinite: str | None = "raise",
                    step: int | None = None) -> StepResult:
        """One step on the global batch: forward and backward on every device side by side, then reduce-scatter
        and step every shard. The loss (each shard's sum over the global batch) and `nonfinite` are `train_batch`'s."""
        loss_fn = summed_loss(loss_fn)
        guard = NonFiniteGuard(nonfinite, self.replicas, [])  # before the forward pass: it may restore BatchNorm stats
        X_shards, y_shards = split_batch(X, y, self.devices)

        def forward_backward(i: int):
            with self.units.saved_tensors_hooks(i):
                out = self.replicas[i](X_shards[i])
                loss = loss_fn(out, y_shards[i]) / len(X)
            loss.backward()
            return loss.detach(), correct_tensor(logits_of(out).detach(), y_shards[i])

        try:
            results = self.units.run(forward_backward)
            passes = self._reduce_scatter_and_step(guard, step)
        finally:  # also after an error: no gradient is left behind, no shard half-stepped
            for p in (p for ps in self.params for unit in ps for p in unit):
                p.grad = None
        broadcast_buffers(self.replicas)
        return StepResult(sum(v.item() for v, _ in results) * len(X), sum(int(c) for _, c in results), not passes)

    @torch.no_grad()
    def _reduce_scatter_and_step(self, guard: NonFiniteGuard, step: int | None) -> bool:
        summed = [{} for _ in range(self.num_devices)]  # device i: (unit, buffer) -> its chunk of the sum
        self.grad_shards = [chunks.values() for chunks in summed]  # views: `held_bytes` sees each chunk once added
        held = [self.held_bytes()]  # backward is done: every device holds its whole gradient
        try:
            return self._step(guard, step, summed)
        finally:
            self._peak = peak_of(held + [self.held_bytes()] + gathered_bytes(self.collectives, self.num_devices))
            self.grad_shards = [() for _ in range(self.num_devices)]  # the chunks are let go of with `summed`

    def _step(self, guard: NonFiniteGuard, step: int | None, summed: list[dict]) -> bool:
        used = {(u, j): any(ps[u][j].grad is not None for ps in self.params) for u, j in self.order}
        for u, plan in enumerate(self.plans):
            flats = [plan.flat_grads(ps[u]) for ps in self.params]
            for b, members in enumerate(plan.buffers):
                if any(used[u, j] for j in members):  # a buffer of frozen or unused parameters has nothing to sum
                    for i, chunk in enumerate(reduce_scatter([f[b] for f in flats], self.algorithm)):
                        summed[i][u, b] = chunk.clone()  # the device keeps its own chunk only
                    self.units.log("reduce_scatter", "step", u, flats[0][b])
        # The chunks of all devices make the whole sum: reading them all, every device takes the same decision.
        if not guard.passes_on(((self.names[u, j], summed[i][u, b][lo:hi]) for i, pieces in enumerate(self.pieces)
                                for u, j, b, lo, hi, _ in pieces if (u, b) in summed[i]), step):
            return False
        for i, opt in enumerate(self.optimizers):
            for u, j, b, lo, hi, piece in self.pieces[i]:
                piece.grad = summed[i][u, b][lo:hi] if used[u, j] else None  # no gradient anywhere: skipped, as torch's
            if opt is not None:
                opt.step()
            for *_, piece in self.pieces[i]:
                piece.grad = None
        return True

    def param_bytes(self) -> list[int]:
        """Parameter bytes each device holds, counted from its tensors (`manualdp.units.Units.param_bytes`)."""
        return self.units.param_bytes()

    def state_dict(self) -> dict:
        """Every device's shards and optimizer state: what a checkpoint holds (`load_state_dict` takes it back)."""
        return shards_state(self.shards, self.optimizers)

    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` gave; a state of other shapes or devices is refused, changing nothing."""
        load_shards(self.shards, self.optimizers, state)

    def full_parameters(self) -> list[torch.Tensor]:
        """The model's parameters in `replicas[0].parameters()` order, put together from every device's shards."""
        return full_from_shards(self.plans, self.shards, [self.params[0][u][j] for u, j in self.order], self.order)
