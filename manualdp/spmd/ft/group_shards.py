"""A rank's shard state under `fully_shard`, as plain tensors: what a lane sends and `--checkpoint-dir` keeps.

A sharded model's `state_dict()` holds DTensors, whose pickle names a device mesh of this process
(`torch.load(weights_only=True)` refuses it, and a mesh means nothing in another group). Rank i of every
group holds the same shard (the same row range of each parameter), so the local tensors are all a
lane needs: `local_model_state` and `local_optim_state` keep the local shards, and their loaders put
them back as DTensors on this rank's own mesh, with the placements of the parameters they belong to.
`flat_local_grads` and `put_local_grads` move the local shards of the gradients into one flat tensor, for
`GroupManager.average`, and back.

Each state records where its shard belongs, `manualdp_shard`: the rank in the shard group, the group's size, and
each sharded entry's [global shape, shard dim, first row], in ints and lists, which `torch.load(weights_only=True)`
reads (the model's state: an OrderedDict of tensors alone, the record its attribute, as torch's `_metadata`; the
optimizer's: a key beside `manualdp_sharded`). The loaders refuse a state recorded for another rank, group size or
layout before writing anything. A state without the record (written by an older manualdp, e.g. a `--checkpoint-dir`
of `runners/ft_group_train.py`, or a copy into a new dict) is loaded as before, on the shapes alone.

A user's own loop (fault-tolerant HSDP, as `manualdp train --zero 3` runs it):

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

from collections import OrderedDict
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...validate import nn_module, tensor_list
from ..sharding.fsdp import FSDPModule
from ..sharding.fsdp_param import owner_of

__all__ = ["local_model_state", "load_local_model_state", "local_optim_state", "load_local_optim_state", "local",
           "like", "flat_local_grads", "put_local_grads"]

_SHARDED = "manualdp_sharded"  # in an optimizer's saved state: the (param index, key) pairs that were DTensors
_WHERE = "manualdp_shard"  # in both states: where the shard belongs (rank, size, layout); absent in older ones


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def local(value: torch.Tensor) -> torch.Tensor:
    """`value`'s local shard if it is a DTensor, else `value`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"value must be a torch.Tensor (a DTensor or a plain tensor), got {type(value).__name__}")
    return _local(value)


def like(value: torch.Tensor, model: DTensor) -> DTensor:
    """`value` (a local shard) as a DTensor on `model`'s mesh and placements, of `model`'s global shape."""
    if not isinstance(model, DTensor):
        raise TypeError(f"model must be a DTensor (a parameter sharded by fully_shard), got {type(model).__name__}")
    _fits("value", value, model.to_local(), "model's local shard")
    return DTensor.from_local(value, model.device_mesh, model.placements, shape=model.shape, stride=model.stride())


def local_model_state(module: nn.Module) -> dict:
    """`module.state_dict()` with each DTensor replaced by this rank's local shard; where it belongs its attribute."""
    now = _sharded("module", module).state_dict()
    state = OrderedDict((k, _local(v)) for k, v in now.items())  # tensors alone: a user may iterate them
    setattr(state, _WHERE, _where(now))  # pickled with the dict, as torch's `_metadata` is
    return state


def load_local_model_state(module: nn.Module, state: dict) -> None:
    """Load `local_model_state`'s output as DTensors like those it replaces (one without a record: on shapes alone)."""
    now = _sharded("module", module).state_dict()
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    _same_place(f"state.{_WHERE}", getattr(state, _WHERE, None), _where(now), "module")
    _same_keys("state", state, now, "module's state_dict()")
    for k, v in now.items():  # every entry checked before the load writes any
        if isinstance(v, torch.Tensor):
            what = "module's local shard" if isinstance(v, DTensor) else "module's"
            _fits(f"state[{k!r}]", state[k], _local(v), what)
    module.load_state_dict({k: like(v, now[k]) if isinstance(now[k], DTensor) else v for k, v in state.items()})


def local_optim_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with each DTensor (momentum, Adam's moments) replaced by its local shard."""
    params = _sharded_params("optimizer", optimizer)
    saved = optimizer.state_dict()
    sharded = [[i, key] for i, entry in saved["state"].items() for key, v in entry.items() if isinstance(v, DTensor)]
    state = {i: {key: _local(v) for key, v in entry.items()} for i, entry in saved["state"].items()}
    return {**saved, "state": state, _SHARDED: sharded, _WHERE: _where(dict(enumerate(params)))}


def load_local_optim_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load `local_optim_state`'s output, DTensors where they were (one without a record: on keys and shapes alone)."""
    params = _sharded_params("optimizer", optimizer)
    if isinstance(state, dict):  # where the shard belongs first: another rank's shapes may differ or not
        _same_place(f"state[{_WHERE!r}]", state.get(_WHERE), _where(dict(enumerate(params))), "optimizer")
    _check_optim_state(state, params)
    _check_optim_entries(optimizer, state, params)
    entries = {i: dict(entry) for i, entry in state["state"].items()}
    for i, key in state.get(_SHARDED, []):
        entries[i][key] = like(entries[i][key], params[i])
    optimizer.load_state_dict({k: v for k, v in state.items() if k not in (_SHARDED, _WHERE)} | {"state": entries})


def flat_local_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """The local shard of each parameter's gradient (zeros where it has none), in order, in one flat tensor."""
    _one_dtype("params", params)
    _ours("params", params)
    return torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                      for p in params])


def put_local_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make `flat` (as `flat_local_grads` lays it out) the parameters' gradients: DTensors for sharded ones."""
    dtype = _one_dtype("params", params)
    _ours("params", params)
    shards = [_local(p) for p in params]
    size = sum(q.numel() for q in shards)
    if not isinstance(flat, torch.Tensor) or isinstance(flat, DTensor):
        raise TypeError(f"flat must be a plain torch.Tensor (flat_local_grads' output), got {type(flat).__name__}")
    if flat.dim() != 1 or flat.numel() != size or flat.dtype != dtype or flat.device != shards[0].device:
        raise ValueError(f"flat must be 1-D of {size} {dtype} elements on {shards[0].device} (the local shards of "
                         f"params, as flat_local_grads lays them out), got shape {tuple(flat.shape)}, {flat.dtype} "
                         f"on {flat.device}")
    for p, q, g in zip(params, shards, flat.split([q.numel() for q in shards])):
        p.grad = like(g.view_as(q).clone(), p) if isinstance(p, DTensor) else g.view_as(p).clone()


# The checks: each raises one line naming the argument and the value, before anything is written.

def _sharded(name: str, module) -> nn.Module:
    """A module that `fully_shard` sharded, itself or a module inside it: its state_dict holds DTensors."""
    if not any(isinstance(m, FSDPModule) for m in nn_module(name, module).modules()):
        raise ValueError(f"{name} ({type(module).__name__}) holds no module sharded by manualdp's fully_shard: its "
                         f"state is not a shard; use {name}.state_dict() and {name}.load_state_dict()")
    return module


def _sharded_params(name: str, optimizer) -> list[torch.Tensor]:
    """The parameters of an optimizer that steps at least one DTensor (a shard of `fully_shard`), in its order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        raise ValueError(f"{name} ({type(optimizer).__name__}) steps no parameter sharded by fully_shard (none of "
                         f"its {len(params)} is a DTensor): use {name}.state_dict() and {name}.load_state_dict()")
    _ours(f"{name}'s parameters", params)
    return params


def _ours(name: str, params: list) -> None:
    """Every DTensor of `params` is a shard of manualdp's `fully_shard` (torch's own marks its shards otherwise)."""
    for i, p in enumerate(params):
        if isinstance(p, DTensor) and owner_of(p) is None:
            raise ValueError(f"{name}[{i}] is a DTensor of shape {tuple(p.shape)} placed {p.placements} that "
                             f"manualdp's fully_shard did not make (torch's own fully_shard, or a copy): its shard "
                             f"state is torch's; use torch.distributed.checkpoint")


def _fits(name: str, value, model: torch.Tensor, what: str) -> None:
    """`value` is a plain tensor of `model`'s shape, dtype and device."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        raise TypeError(f"{name} must be a plain torch.Tensor (a local shard), got {type(value).__name__}")
    ours, theirs = (tuple(value.shape), value.dtype, value.device), (tuple(model.shape), model.dtype, model.device)
    if ours != theirs:
        raise ValueError(f"{name} has shape {ours[0]}, {ours[1]} on {ours[2]}, but {what} has shape {theirs[0]}, "
                         f"{theirs[1]} on {theirs[2]}: a state of another model, rank or dtype")


def _same_keys(name: str, state, expected: dict, what: str) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{name} must be a dict, got {type(state).__name__}")
    missing, extra = [k for k in expected if k not in state], [k for k in state if k not in expected]
    if missing or extra:
        raise ValueError(f"{name} does not hold the keys of {what}: missing {_few(missing)}, unexpected {_few(extra)}")


def _few(keys: list) -> str:
    return "none" if not keys else ", ".join(map(repr, keys[:3])) + (f" (and {len(keys) - 3} more)" if keys[3:] else "")


def _check_optim_state(state, params: list[torch.Tensor]) -> None:
    """`local_optim_state`'s output for `params`: every entry that becomes a DTensor of its parameter's shard."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or not isinstance(
            state.get("param_groups"), list):
        raise TypeError(f"state must be local_optim_state's dict (with 'state' and 'param_groups'), got "
                        f"{type(state).__name__}{f' with keys {_few(list(state))}' if isinstance(state, dict) else ''}")
    count = sum(len(g.get("params", ())) if isinstance(g, dict) else 0 for g in state["param_groups"])
    if count != len(params) or any(not (isinstance(i, int) and 0 <= i < len(params)) for i in state["state"]):
        raise ValueError(f"state holds the state of {count} parameters (indices {_few(list(state['state']))}), but "
                         f"optimizer steps {len(params)}: a state of another optimizer")
    sharded = state.get(_SHARDED, [])
    for pair in sharded if isinstance(sharded, list) else [sharded]:
        i, key = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
        if not isinstance(state["state"].get(i), dict) or key not in state["state"][i]:
            raise ValueError(f"state[{_SHARDED!r}] names {pair!r}, which is not an entry of state['state']")
        if not isinstance(params[i], DTensor):
            raise ValueError(f"state[{_SHARDED!r}] names {pair!r}, but parameter {i} of optimizer is not sharded")
        _fits(f"state['state'][{i}][{key!r}]", state["state"][i][key], params[i].to_local(), f"parameter {i}'s shard")


def _one_dtype(name: str, params) -> torch.dtype:
    """A non-empty list of tensors of one dtype (one flat tensor holds one dtype)."""
    tensor_list(name, params)
    if not params:
        raise ValueError(f"{name} must not be empty, got {params!r}")
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise TypeError(f"{name} hold {' and '.join(dtypes)}: one flat tensor holds one dtype; call once per dtype")
    return params[0].dtype


# Where a shard belongs: a state of another rank, group size or layout can hold tensors of the same shapes.

def _where(values: dict) -> dict:
    """The rank in the shard group, the group's size and, per DTensor of `values`, [global shape, dim, first row]."""
    rank, size, layout = 0, 1, {}
    for k, v in values.items():
        if isinstance(v, DTensor):
            mesh, dim = v.device_mesh, v.placements[-1].dim  # our shards: Shard(dim) on the mesh's last dim
            rank, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
            rows = v.shape[dim]
            layout[k] = [list(v.shape), dim, min(rank * -(-rows // size), rows)]  # torch.chunk's cut, as Param's
    return {"rank": rank, "size": size, "layout": layout}


def _same_place(name: str, record, now: dict, what: str) -> None:
    """`record` (a state's `manualdp_shard`, None in older states) is `now`'s: this rank, group size and layout."""
    if record is None:
        return  # written by an older manualdp: the shapes are all there is to check
    if not isinstance(record, dict) or not isinstance(record.get("layout"), dict) or any(
            type(record.get(k)) is not int for k in ("rank", "size")):
        raise TypeError(f"{name} must be a dict of 'rank', 'size' and 'layout' (as local_*_state "
                        f"writes it), got {record!r:.200}")
    if (record["rank"], record["size"]) != (now["rank"], now["size"]):
        raise ValueError(f"state was saved by rank {record['rank']} of a shard group of {record['size']}, but this "
                         f"is rank {now['rank']} of {now['size']}: its rows are not this rank's; load each rank's "
                         f"own state, at the group size it was saved with")
    _same_keys(f"{name}['layout']", record["layout"], now["layout"],
               f"{what}'s sharded entries (a state of another model or optimizer)")
    for k, place in now["layout"].items():
        if record["layout"][k] != place:
            raise ValueError(f"{name} places {k!r} as {record['layout'][k]!r:.100} ([global shape, "
                             f"shard dim, first row]), but {what}'s shard is {place!r}: a state of another layout")


# An optimizer's state: its groups' keys, and each entry as the optimizer's own state after a step would hold it.

def _check_optim_entries(optimizer: torch.optim.Optimizer, state: dict, params: list[torch.Tensor]) -> None:
    """Each group holds the optimizer's keys; each parameter's entries are those a step makes, of their shapes."""
    own = optimizer.param_groups
    if len(state["param_groups"]) != len(own):
        raise ValueError(f"state holds {len(state['param_groups'])} param groups, but optimizer has {len(own)}")
    for j, (saved, group) in enumerate(zip(state["param_groups"], own)):
        _same_keys(f"state['param_groups'][{j}]", saved, group,
                   f"optimizer's param group {j} ({type(optimizer).__name__}): a state of another optimizer")
    sharded = {(i, key) for i, key in state.get(_SHARDED, [])}
    expected = _probe(optimizer, params)
    for i, entry in state["state"].items():
        if not isinstance(entry, dict):
            raise TypeError(f"state['state'][{i}] must be a dict, got {type(entry).__name__}")
        if expected is not None and entry:
            _same_keys(f"state['state'][{i}]", entry, expected.get(i, {}),
                       f"{type(optimizer).__name__}'s state of parameter {i} after a step")
        for key, v in entry.items():
            name = f"state['state'][{i}][{key!r}]"
            if (i, key) in sharded or not isinstance(v, torch.Tensor):
                continue  # a shard (checked by _check_optim_state), or a number or list (LBFGS's)
            if isinstance(params[i], DTensor) and v.dim() > 0 and v.shape == params[i].to_local().shape:
                raise ValueError(f"{name} is a shard of parameter {i}, but state[{_SHARDED!r}] does not name it: "
                                 f"it would load as a plain tensor beside a DTensor parameter")
            if expected is not None and isinstance(expected[i][key], SimpleNamespace):
                _fits(name, v, expected[i][key], f"{type(optimizer).__name__}'s own {key!r} of parameter {i}")


def _probe(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict | None:
    """Per parameter, the entries a step of `optimizer`'s kind makes for its local shard; None if none can be made."""
    for device in ("meta", None):  # meta first: no memory; on the shards' devices for those meta refuses (LBFGS)
        clones = [torch.zeros_like(_local(p).detach(), device=device) for p in params]
        for c in clones:
            c.grad = torch.ones_like(c)  # not zeros: LBFGS stops before it makes its state at a zero gradient
        groups, at = [], 0
        for group in optimizer.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                           "params": clones[at:at + count]})
            at += count
        try:  # a user's optimizer may take other arguments, or refuse the probe: its entries then go unchecked
            probe = type(optimizer)(groups)
            probe.step(lambda: torch.zeros(()))
        except Exception:  # noqa: BLE001 (any refusal means: no reference here)
            continue
        return {i: {key: _as_found(v, _local(p).device) for key, v in probe.state[c].items()}
                for i, (p, c) in enumerate(zip(params, clones)) if c in probe.state}
    return None


def _as_found(value, device: torch.device):
    """A probe's entry: a tensor as its shape, dtype and device (a meta one's: the shard's), else itself."""
    if not isinstance(value, torch.Tensor):
        return value
    return SimpleNamespace(shape=value.shape, dtype=value.dtype, device=device if value.is_meta else value.device)
