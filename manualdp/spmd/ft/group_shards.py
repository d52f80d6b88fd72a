"""A rank's shard state under `fully_shard`, as plain tensors: what a lane sends and `--checkpoint-dir` keeps.

A sharded model's `state_dict()` holds DTensors, whose pickle names a device mesh of this process
(`torch.load(weights_only=True)` refuses it, and a mesh means nothing in another group). Rank i of every
group holds the same shard (the same row range of each parameter), so the local tensors are all a
lane needs: `local_model_state` and `local_optim_state` keep the local shards, and their loaders put
them back as DTensors on this rank's own mesh, with the placements of the parameters they belong to.
`flat_local_grads` and `put_local_grads` move the local shards of the gradients into one flat tensor, for
`GroupManager.average`, and back. A user's own loop (fault-tolerant HSDP, as `manualdp train --zero 3` runs it):

    dist.init_process_group("gloo", timeout=...)   # the group's own world (torchrun's), e.g. 2 ranks
    for layer in model.layers:
        fully_shard(layer)                         # over the group's ranks: gathered and reduce-scattered in it
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # this rank's shards
    manager = GroupManager("a", "127.0.0.1", 29510)
    manager.register_state("model", lambda: local_model_state(model), lambda s: load_local_model_state(model, s))
    manager.register_state("optim", lambda: local_optim_state(optimizer),
                           lambda s: load_local_optim_state(optimizer, s))
    params = [p for p in model.parameters() if p.requires_grad]
    while manager.step < steps:
        quorum = manager.start_step()    # a group behind: rank i receives its shards from rank i of a healthy one
        optimizer.zero_grad()
        loss_of(model, my_shard(batch, quorum.rank("a"), dist.get_rank())).backward()  # reduce-scattered
        flat = flat_local_grads(params)  # this rank's shard of every gradient, averaged over the group's ranks
        if manager.should_commit(manager.average(flat)):   # lane i: with rank i of the other groups
            put_local_grads(params, flat)
            optimizer.step()
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["local_model_state", "load_local_model_state", "local_optim_state", "load_local_optim_state", "local",
           "like", "flat_local_grads", "put_local_grads"]

_SHARDED = "manualdp_sharded"  # in an optimizer's saved state: the (param index, key) pairs that were DTensors


def local(value):
    """`value`'s local shard if it is a DTensor, else `value`."""
    return value.to_local() if isinstance(value, DTensor) else value


def like(value: torch.Tensor, model: DTensor) -> DTensor:
    """`value` (a local shard) as a DTensor on `model`'s mesh and placements, of `model`'s global shape."""
    return DTensor.from_local(value, model.device_mesh, model.placements, shape=model.shape, stride=model.stride())


def local_model_state(module: nn.Module) -> dict:
    """`module.state_dict()` with each DTensor replaced by this rank's local shard."""
    return {k: local(v) for k, v in module.state_dict().items()}


def load_local_model_state(module: nn.Module, state: dict) -> None:
    """Load `local_model_state`'s output: each shard becomes a DTensor like the one it replaces."""
    now = module.state_dict()
    module.load_state_dict({k: like(v, now[k]) if isinstance(now.get(k), DTensor) else v for k, v in state.items()})


def local_optim_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with each DTensor (momentum, Adam's moments) replaced by its local shard."""
    saved = optimizer.state_dict()
    sharded = [[i, key] for i, entry in saved["state"].items() for key, v in entry.items() if isinstance(v, DTensor)]
    state = {i: {key: local(v) for key, v in entry.items()} for i, entry in saved["state"].items()}
    return {**saved, "state": state, _SHARDED: sharded}


def load_local_optim_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load `local_optim_state`'s output: each entry that was a DTensor becomes one like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries = {i: dict(entry) for i, entry in state["state"].items()}
    for i, key in state.get(_SHARDED, []):
        entries[i][key] = like(entries[i][key], params[i])
    optimizer.load_state_dict({k: v for k, v in state.items() if k != _SHARDED} | {"state": entries})


def flat_local_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """The local shard of each parameter's gradient (zeros where it has none), in order, in one flat tensor."""
    return torch.cat([(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
                      for p in params])


def put_local_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make `flat` (as `flat_local_grads` lays it out) the parameters' gradients: DTensors for sharded ones."""
    shards = [local(p) for p in params]
    for p, q, g in zip(params, shards, flat.split([q.numel() for q in shards])):
        p.grad = like(g.view_as(q).clone(), p) if isinstance(p, DTensor) else g.view_as(p).clone()
