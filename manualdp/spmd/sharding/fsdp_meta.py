"""A model sharded on the meta device, initialised as one process would: `init_full`.

pytorch/examples and torchtitan build the model on the meta device, shard it, `to_empty` it, and call
each module's `reset_parameters()`. On a sharded model that draws each rank's shard from the same
seed as if it were the whole parameter, so every rank gets the same rows and the model never starts
where a one-process model would (torch's FSDP2 does the same; torchtitan's answer is a "seed
checkpoint" written by one process). `init_full` runs the initialisation on the full parameters
instead, on every rank from the same seed, then keeps this rank's rows: the sharded model starts
bitwise where the one-process model does, at any world size. The values never travel: the ranks
compare one sum per parameter, so that a rank seeded otherwise, or a parameter `init` left as
`to_empty` found it, is named on every rank. The price is the full model's memory on each rank while
it runs (freed after).

    with torch.device("meta"):
        model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)                # the same seed on every rank
    init_full(model, lambda m: [s.reset_parameters() for s in m.modules() if hasattr(s, "reset_parameters")])
"""
from __future__ import annotations

from collections.abc import Callable

import functools

import torch
from torch import nn

from ...validate import a_callable, nn_module
from ..transport.agree import agree
from .fsdp_unit import UNIT

__all__ = ["init_full"]


@torch.no_grad()
def init_full(module: nn.Module, init: Callable[[nn.Module], object]) -> nn.Module:
    """Run `init(module)` on `module`'s full parameters, then keep this rank's shard of each; returns `module`.

    `module` is sharded by `fully_shard` (the outermost unit, or any unit: its tree). Call it between steps,
    with the same random state on every rank; every rank then holds the shards of one and the same model (the
    ranks compare a sum of each parameter, and all raise, naming it, where one differs).
    """
    nn_module("module", module)
    a_callable("init", init)
    if UNIT not in module.__dict__:
        raise ValueError(f"module ({type(module).__name__}) is not sharded by fully_shard: call init(module) on it")
    units = module.__dict__[UNIT].tree()
    if any(u.gathered for u in units):
        raise ValueError("init_full: a unit's full parameters are in use (between a forward and its backward, or "
                         "unsharded by hand): call it between steps, after to_empty")
    params = [p for u in units for p in u.params]
    names = [f"{u.name}.{p.name}" if u.name else p.name for u in units for p in u.params]
    meta = [name for p, name in zip(params, names) if p.sharded.device.type == "meta"]
    if meta:
        raise ValueError(f"init_full: {meta[0]} is on the meta device: call model.to_empty(device=...) first")
    fulls = [nn.Parameter(torch.empty(p.shape, dtype=p.sharded.dtype, device=p.sharded.device),
                          requires_grad=p.sharded.requires_grad) for p in params]
    try:
        for p, full in zip(params, fulls):
            p.put(full)
        init(module)
        root = units[0]  # every rank must have made the same model: compare a sum of each parameter, in line
        sums = {f"parameter {name} (sum)": float(full.double().sum()) for name, full in zip(names, fulls)}
        for group in [root.group] + ([root.replicate] if root.replicate is not None else []):  # HSDP: replicas too
            root.worker.submit(functools.partial(agree, "init_full", sums, group, timeout=root.timeout,
                                                 hint="seed every rank alike, and make init set every parameter")
                               ).result()
        for p, full in zip(params, fulls):  # this rank's rows, as torch.chunk cuts them
            p.sharded.to_local().copy_(p.cut(full))
    finally:
        for p in params:
            p.put(p.sharded)
    return module
