"""What a device holds, in bytes, by kind: parameters, gradients and optimizer state, counted from its tensors.

Chapter 6 asks how much each device of a sharded optimizer holds. The answer here is counted,
not computed: from the storages behind the tensors a device holds (a view of a flat buffer adds
nothing), so that the tests can hold the count to the chapter's formulas. `HeldBytes` gives
`manualdp.zero.ShardedOptimizer` and `manualdp.zero3.Zero3` their reports: each step records what
the devices held at its moments, and `peak_bytes()` is the most of each kind (`peak_of`).
"""
from __future__ import annotations

import torch

__all__ = ["KINDS", "HeldBytes", "gathered_bytes", "held", "peak_of", "state_bytes", "storage_bytes"]
KINDS = ("parameters", "gradients", "optimizer_state")  # what `peak_bytes` reports, per device


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes held in `optimizer`'s state tensors (momentum, exp_avg, ...), counted from the tensors themselves."""
    return sum(v.numel() * v.element_size() for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
               if isinstance(v, torch.Tensor))


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views of one flat buffer share one)."""
    tensors = list(tensors)
    bad = next((t for t in tensors if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        raise TypeError(f"tensors must hold tensors only, got {type(bad).__name__} {bad!r:.60}")
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def held(parameters: int, gradients, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """One device's bytes by kind: `parameters` bytes, the storages behind `gradients`, `optimizer`'s state."""
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 0:
        raise ValueError(f"parameters must be a number of bytes (an int >= 0), got {parameters!r:.60}")
    return dict(zip(KINDS, (parameters, storage_bytes(gradients), state_bytes(optimizer))))


def gathered_bytes(collectives: list, n: int) -> list[list[dict]]:
    """The parameter bytes each of `n` devices held at most after a collective (each has `held`, per device), as one
    report for `peak_of`; none if no collective ran."""
    return [[dict(zip(KINDS, (max(c.held[i] for c in collectives), 0, 0))) for i in range(n)]] if collectives else []


def peak_of(reports: list[list[dict]]) -> list[dict]:
    """Per device, the largest value of each kind over `reports` (one list of per-device dicts per moment)."""
    if not reports:
        raise ValueError("reports must hold at least one moment, got none")
    return [{k: max(r[i][k] for r in reports) for k in KINDS} for i in range(len(reports[0]))]


class HeldBytes:
    """The memory report of a sharded optimizer over `replicas`, one per device, with `optimizers` (None where a
    device steps nothing) and `grad_shards` (each device's chunks of the summed gradients, while it holds them).

    Its step sets `_peak` to `peak_of` the moments it measured (`held_bytes()`); `_measured_in` names that step.
    """

    replicas: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer | None]
    grad_shards: list
    _peak: list[dict] | None = None  # what `peak_bytes` reports, measured in the last step
    _measured_in = "step()"

    def held_bytes(self) -> list[dict]:
        """What each device holds now, in bytes, by kind: parameters, gradients and optimizer state."""
        return [held(pb, [*(p.grad for p in r.parameters() if p.grad is not None), *shards], opt)
                for pb, r, shards, opt in zip(self.param_bytes(), self.replicas, self.grad_shards, self.optimizers)]

    def param_bytes(self) -> list[int]:
        """Parameter bytes on each device, counted from the storages of its replica's parameters."""
        return [storage_bytes(r.parameters()) for r in self.replicas]

    def gradient_bytes(self) -> list[int]:
        """Gradient bytes on each device: its parameters' `.grad` and its chunks of the summed gradients."""
        return [h["gradients"] for h in self.held_bytes()]

    def state_bytes(self) -> list[int]:
        """Optimizer-state bytes on each device."""
        return [state_bytes(opt) for opt in self.optimizers]

    def peak_bytes(self) -> list[dict]:
        """Per device and kind (`KINDS`), the most bytes held at once during the last step."""
        if self._peak is None:
            raise RuntimeError(f"peak_bytes is measured in {self._measured_in}: call it after a step")
        return self._peak
