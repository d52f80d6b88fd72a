"""How ZeRO lays out the parameters: flat buffers, and each device's pieces of them.

`manualdp.zero` (one process) and `manualdp.spmd.sharding.zero` (one rank per device) share this
layout. The parameters are grouped by parameter group and dtype; each group becomes one
flat buffer, and the parameters become views of it. Device i owns the near-equal chunk
`manualdp.collectives.chunk(buffer, i, N)` of every buffer, and hands it to its optimizer
as one piece per parameter that the chunk overlaps: torch's optimizers then skip a
parameter without a gradient and apply each group's options, exactly as on whole tensors.
"""
from __future__ import annotations

import copy

import torch

from .collectives import chunk
from .schedule import chunk_bounds, owned_chunk

__all__ = ["ShardPlan", "check_shard_fits", "full_from_shards", "load_shards", "options_of", "param_groups_of",
           "shards_state"]


def param_groups_of(params, name: str = "params", *, keep_frozen: bool = False,
                    require_trainable: bool = True) -> list[dict]:
    """`params` as torch's optimizers take them (tensors, or dicts with "params"), as a list of group dicts.

    Only parameters that require grad are kept (all, with `keep_frozen`, as torch's optimizers keep
    them); at least one must (at least one tensor, frozen or not, without `require_trainable`, as
    torch's `ZeroRedundancyOptimizer` takes a group of frozen tensors). A parameter named twice is
    refused, as torch refuses it.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{name} must be an iterable of tensors or of dicts, got a single tensor")
    items = list(params)
    groups = [dict(g) for g in items] if items and all(isinstance(g, dict) for g in items) else [{"params": items}]
    seen = set()
    for i, g in enumerate(groups):
        if "params" not in g:
            raise ValueError(f"{name}[{i}] has no 'params' key")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name}[{i}] holds a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                raise ValueError(f"{name}: a parameter appears twice (in group {i})")
            seen.add(id(p))
        g["params"] = [p for p in ps if p.requires_grad or keep_frozen]
    if require_trainable and not any(p.requires_grad for g in groups for p in g["params"]):
        raise ValueError(f"{name} must hold at least one parameter that requires grad, got none")
    if not any(g["params"] for g in groups):
        raise ValueError(f"{name} must hold at least one tensor, got none")
    return groups


class ShardPlan:
    """Where every parameter's elements go: flat buffers, and each device's pieces of them.

    Built from one model's parameter groups (every replica, every rank has the same shapes).
    Parameter j (counting through the groups in order) lives in buffer `buffer_of[j]` at
    `[start, end)`; each buffer holds the parameters of one group that share a dtype.
    """

    def __init__(self, groups: list[list[torch.Tensor]], num_devices: int) -> None:
        self.num_devices = num_devices
        self.group_of: list[int] = []
        self.buffers: list[list[int]] = []        # parameter indices in each buffer
        self.where: list[tuple[int, int, int]] = []  # (buffer, start, end) of each parameter
        for g, params in enumerate(groups):
            by_dtype: dict[torch.dtype, list[int]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(len(self.group_of))
                self.group_of.append(g)
                self.where.append((-1, 0, 0))
            self.buffers += by_dtype.values()
        self.sizes = []
        flat_params = [p for ps in groups for p in ps]
        for b, members in enumerate(self.buffers):
            at = 0
            for j in members:
                self.where[j] = (b, at, at + flat_params[j].numel())
                at += flat_params[j].numel()
            self.sizes.append(at)

    def bounds(self, buffer: int, device: int) -> tuple[int, int]:
        """The slice of buffer `buffer` that `device` owns (what reduce-scatter sums there)."""
        return chunk_bounds(self.sizes[buffer], self.num_devices)[owned_chunk(device, self.num_devices)]

    def pieces(self, device: int) -> list[tuple[int, int, int]]:
        """(parameter, lo, hi) for every parameter that overlaps `device`'s chunks, [lo, hi) in its buffer."""
        out = []
        for j, (b, start, end) in enumerate(self.where):
            lo, hi = self.bounds(b, device)
            if max(start, lo) < min(end, hi):
                out.append((j, max(start, lo), min(end, hi)))
        return out

    @torch.no_grad()
    def bind(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move `params` into new flat buffers, one per buffer of the plan, and make them views of those."""
        flats = []
        for members in self.buffers:
            flat = torch.cat([params[j].detach().reshape(-1) for j in members])
            for j in members:
                _, start, end = self.where[j]
                params[j].data = flat[start:end].view_as(params[j])
            flats.append(flat)
        return flats

    def flat_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients as new flat buffers laid out as the parameters are (zeros where a grad is None)."""
        return [torch.cat([(params[j].grad if params[j].grad is not None else torch.zeros_like(params[j])).reshape(-1)
                           for j in members]) for members in self.buffers]


def check_shard_fits(saved: dict | None, optimizer: torch.optim.Optimizer | None, what: str, whose: str) -> None:
    """Refuse an optimizer state whose tensors are not the sizes of `optimizer`'s pieces (another shard's state)."""
    if (saved is None) != (optimizer is None):
        raise ValueError(f"{what} does not fit {whose} shard ({'no' if saved is None else 'a'} state for "
                         f"{'a' if saved is None else 'no'} shard)")
    if saved is None:
        return
    pieces = [p for g in optimizer.param_groups for p in g["params"]]
    groups = saved.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(f"{what} has {sum(len(g['params']) for g in groups)} pieces in {len(groups)} groups; "
                         f"{whose} shard has {len(pieces)} in {len(optimizer.param_groups)}")
    for k, values in saved.get("state", {}).items():
        for name, v in values.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and (k >= len(pieces) or v.numel() != pieces[k].numel()):
                raise ValueError(f"{what} holds {name} of {v.numel()} elements for piece {k}; "
                                 f"{whose} piece {k} has {pieces[k].numel() if k < len(pieces) else 'none'}")


def options_of(group: dict) -> dict:
    """A parameter group's options (`lr`, `momentum`, ...): everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def shards_state(shards: list, optimizers: list) -> dict:
    """Every device's shards ([device][unit][buffer]) and optimizer state, copied: what a checkpoint holds."""
    return {"shards": [[[t.clone() for t in unit] for unit in device] for device in shards],
            "optimizers": [opt.state_dict() if opt is not None else None for opt in optimizers]}


@torch.no_grad()
def load_shards(shards: list, optimizers: list, state: dict) -> None:
    """Put back what `shards_state` gave, in place; a state of other shapes is refused, changing nothing."""
    shapes = lambda held: [[[tuple(t.shape) for t in unit] for unit in device] for device in held]
    if not isinstance(state, dict) or shapes(state.get("shards", [])) != shapes(shards):
        raise ValueError("state does not hold this model's shards on this many devices")
    for mine, saved in zip(shards, state["shards"]):
        for unit, saved_unit in zip(mine, saved):
            for t, v in zip(unit, saved_unit):
                t.copy_(v)  # in place: the optimizers' pieces are views of the shards
    for opt, saved in zip(optimizers, state["optimizers"]):
        if opt is not None:
            opt.load_state_dict(copy.deepcopy(saved))


@torch.no_grad()
def full_from_shards(plans: list[ShardPlan], shards: list, like: list[torch.Tensor], order: list) -> list[torch.Tensor]:
    """Whole parameters put together from every device's shards: parameter k is unit u's j-th, `order[k] = (u, j)`,
    shaped as `like[k]`."""
    n, fulls = len(shards), {}
    for u, plan in enumerate(plans):
        for b, size in enumerate(plan.sizes):
            fulls[u, b] = torch.empty(size, dtype=shards[0][u][b].dtype, device=shards[0][u][b].device)
            for i in range(n):
                chunk(fulls[u, b], i, n).copy_(shards[i][u][b])
    return [fulls[u, plans[u].where[j][0]][slice(*plans[u].where[j][1:])].view_as(t) for (u, j), t in zip(order, like)]
