"""ZeRO-1 and ZeRO-2 on a list of devices (single controller): every device updates one shard.

Plain data parallelism keeps a full copy of the optimizer state on every device: for Adam
two extra tensors the size of the model, on each of N devices. ZeRO cuts the flat
parameter vector into N chunks (`manualdp.collectives.shard`) and lets device i keep the
optimizer state of its chunk only:

1. the gradients are summed, but each device needs only its own chunk of the sum, so a
   reduce-scatter is enough (stage 2); stage 1 keeps the usual allreduce;
2. device i steps its optimizer on its chunk: state for 1/N of the parameters;
3. an all-gather sends every updated chunk to every device.

Reduce-scatter + all-gather is the ring allreduce cut in two (`manualdp.schedule.ring`),
with the optimizer step moved into the middle: the same bytes on the wire, 1/N of the state.
The optimizers torch offers are elementwise (SGD, Adam, AdamW), so stepping a chunk gives
exactly the numbers that stepping whole parameters would.
"""
from __future__ import annotations

import torch
from torch import nn

from .buckets import flatten, unflatten_
from .collectives import all_gather, reduce_scatter, shard
from .validate import factory, one_of

__all__ = ["ZeroRedundancyOptimizer", "make_optimizer", "state_bytes"]


def make_optimizer(optimizer_class, params, **defaults) -> torch.optim.Optimizer:
    """`optimizer_class(params, **defaults)`: a torch.optim class or any factory taking the parameters."""
    return factory("optimizer_class", optimizer_class)(params, **defaults)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in `optimizer`'s state tensors (momentum, exp_avg, ...), counted from the tensors themselves."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class ZeroRedundancyOptimizer:
    """A sharded optimizer for `replicas` (one model per device, as from `manualdp.replicate`).

    Args:
        optimizer_class: e.g. `torch.optim.Adam`, or a factory `f(params, **defaults)`.
        stage: 1 shards the optimizer state and expects summed gradients (after
            `allreduce_gradients`); 2 also shards the gradients: `step` reduce-scatters them.
        algorithm: of the reduce-scatter and the all-gather (`manualdp.schedule.COLLECTIVES`).
        defaults: keyword arguments for the optimizer (`lr=...`, `betas=...`).

    `train_batch` takes `zero.per_device()` in place of its list of optimizers.
    """

    def __init__(self, replicas: list[nn.Module], optimizer_class, *, stage: int = 1, algorithm: str = "ring",
                 **defaults) -> None:
        if isinstance(replicas, nn.Module) or not replicas or not all(isinstance(r, nn.Module) for r in replicas):
            raise TypeError(f"replicas must be a non-empty list of nn.Module, got {replicas!r:.80}")
        self.stage = one_of("stage", stage, (1, 2))
        self.algorithm = algorithm
        self.params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        n = self.num_devices = len(replicas)
        with torch.no_grad():
            # Device i's shard: its chunk of the flat parameters, a leaf the optimizer owns.
            self.shards = [shard(flatten(ps), i, n).clone().requires_grad_() for i, ps in enumerate(self.params)]
        self.optimizers = [make_optimizer(optimizer_class, [s], **defaults) for s in self.shards]
        self._stepped: set[int] = set()

    @property
    def reduces_gradients(self) -> bool:
        """True at stage 2: the caller must not allreduce the gradients, `step` reduce-scatters them."""
        return self.stage == 2

    def zero_grad(self, set_to_none: bool = True) -> None:
        for i in range(self.num_devices):
            self.zero_grad_on(i, set_to_none)

    def zero_grad_on(self, device: int, set_to_none: bool = True) -> None:
        for p in self.params[device]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Update every device's shard, then all-gather the parameters."""
        grads = [flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]) for ps in self.params]
        n = self.num_devices
        # Stage 2: only the own chunk of the sum is needed; stage 1: the gradients are already summed.
        mine = reduce_scatter(grads, self.algorithm) if self.reduces_gradients else [
            shard(g, i, n) for i, g in enumerate(grads)]
        for s, g, opt in zip(self.shards, mine, self.optimizers):
            s.grad = g
            opt.step()
            s.grad = None  # a view of a buffer freed at the end of this step
        flats = [torch.empty_like(g) for g in grads]
        for i, (flat, s) in enumerate(zip(flats, self.shards)):
            shard(flat, i, n).copy_(s)
        all_gather(flats, self.algorithm)
        for flat, ps in zip(flats, self.params):
            unflatten_(flat, ps)

    def state_bytes(self) -> list[int]:
        """Optimizer-state bytes on each device."""
        return [state_bytes(opt) for opt in self.optimizers]

    def state_dict(self) -> dict:
        return {"stage": self.stage, "shards": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["shards"]):
            opt.load_state_dict(s)

    def per_device(self) -> list["DeviceShard"]:
        """One handle per device with an optimizer's `zero_grad` and `step`, for `train_batch`."""
        return [DeviceShard(self, i) for i in range(self.num_devices)]


class DeviceShard:
    """Device `device`'s view of a ZeroRedundancyOptimizer: `step` on the last device runs the collective step.

    The single controller steps the devices one after another; the collectives need every
    device's gradients at once, so the step waits until every device has asked for it.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer, device: int) -> None:
        self.zero, self.device = zero, device
        self.reduces_gradients = zero.reduces_gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad_on(self.device, set_to_none)

    def step(self) -> None:
        self.zero._stepped.add(self.device)
        if len(self.zero._stepped) == self.zero.num_devices:
            self.zero._stepped.clear()
            self.zero.step()

    def state_dict(self) -> dict:
        return self.zero.optimizers[self.device].state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.zero.optimizers[self.device].load_state_dict(state)
