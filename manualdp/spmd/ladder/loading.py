"""What a wrapper checks of a state dict before `load_state_dict` writes any tensor, and what it puts back after.

torch's `nn.Module.load_state_dict` copies each key as it walks the submodules and raises at the end (a size
mismatch, a missing or unexpected key), or in the middle (a submodule's pre-hook refusing): the submodules walked
first are loaded, the rest are not. The drop-ins (`DistributedDataParallel`, `fully_shard`'s modules) check the whole
state dict first, so that a refused load says what is wrong in one line (`check_loadable`). Checking every way
torch's loader can refuse ahead of time would always miss one (a meta or sparse value, a DTensor for a plain
parameter, an `_extra_state` or `num_batches_tracked` key, a user's pre-hook): so the load also runs inside
`unchanged_if_refused`, which keeps the data of every parameter and buffer and every extra state, and puts them back,
bitwise, if torch's load raises. A refused load changes nothing; the price is one copy of the model's state (on its
device) for the load's time.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parameter import is_lazy

from ...validate import boolean, nn_module

__all__ = ["check_loadable", "unchanged_if_refused"]

_COUNT = "num_batches_tracked"  # BatchNorm's, which its loader fills in for a state saved before version 2
_EXTRA = "_extra_state"  # the key of a module's extra state (`get_extra_state`)
_PLAIN = (nn.Module._load_from_state_dict, nn.modules.batchnorm._NormBase._load_from_state_dict)  # torch's usual


def check_loadable(module: nn.Module, state_dict: Mapping, strict: bool, who: str,
                   sharded: Callable[[nn.Module, str], bool] | None = None, assign: bool = False) -> None:
    """Raise one line, before anything is written, where `module.load_state_dict(state_dict, strict, assign)` would
    refuse: a value that is not a tensor, a tensor of another shape, (without `assign`) a meta or sparse value or a
    DTensor for a plain tensor, and (`strict`) a missing or unexpected key, extra states and BatchNorm's
    `num_batches_tracked` counted as torch's loader counts them.

    `sharded(sub, name)`: whether parameter `name` of submodule `sub` is a shard, whose shape is checked elsewhere."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{who}: load_state_dict: state_dict must be a mapping, got {type(state_dict).__name__}")
    expected, optional, own = set(), set(), []  # own: prefixes of submodules that load their own way, left to torch
    for prefix, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        if type(sub)._load_from_state_dict not in _PLAIN:
            own.append(prefix)
        if type(sub).set_extra_state is not nn.Module.set_extra_state:  # torch's loader then wants the key
            expected.add(prefix + _EXTRA)
        if _fills_count(sub, state_dict, prefix):
            optional.add(prefix + _COUNT)
        persistent = {n: b for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set}
        for name, held in [*sub._parameters.items(), *persistent.items()]:
            if held is None:
                continue
            key = prefix + name
            expected.add(key)
            if key in state_dict:
                shard = sharded is not None and sharded(sub, name)
                _check_value(key, state_dict[key], held, who, shaped=not shard, assign=assign)
    if strict:
        given, own = set(state_dict.keys()), tuple(own)
        missing = sorted(k for k in expected - given - optional if not k.startswith(own))
        unexpected = sorted(k for k in given - expected if not k.startswith(own))
        if missing or unexpected:
            said = [f"missing key(s) {', '.join(missing)}" if missing else "",
                    f"unexpected key(s) {', '.join(unexpected)}" if unexpected else ""]
            raise RuntimeError(f"{who}: load_state_dict: {'; '.join(s for s in said if s)}; nothing was loaded "
                               "(pass strict=False to load the keys that match)")


def _fills_count(sub: nn.Module, state_dict: Mapping, prefix: str) -> bool:
    """Whether BatchNorm's loader fills in a missing `num_batches_tracked`: a state saved before version 2."""
    if not isinstance(sub, nn.modules.batchnorm._NormBase) or not sub.track_running_stats:
        return False
    version = (getattr(state_dict, "_metadata", None) or {}).get(prefix[:-1], {}).get("version")
    return version is None or version < 2


def _check_value(key: str, value, held: torch.Tensor, who: str, shaped: bool, assign: bool) -> None:
    """One key: a tensor of the held tensor's shape (torch's loader takes a 1-element vector for a scalar too) that
    torch's loader can copy (without `assign`); `shaped` False: a shard, whose shape and placement are checked
    elsewhere."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{who}: load_state_dict: {key} is a {type(value).__name__}, not a tensor; nothing was "
                           "loaded")
    if not assign and value.device.type == "meta" and held.device.type != "meta":
        raise RuntimeError(f"{who}: load_state_dict: {key} is on the meta device (it holds no values); nothing was "
                           "loaded")
    if not assign and value.layout != held.layout:
        raise RuntimeError(f"{who}: load_state_dict: {key} is a {value.layout} tensor and the model holds a "
                           f"{held.layout} one (load value.to_dense()); nothing was loaded")
    if not shaped:
        return
    if not assign and isinstance(value, DTensor) and not isinstance(held, DTensor):
        raise RuntimeError(f"{who}: load_state_dict: {key} is a DTensor and the model holds a plain tensor (load "
                           "value.full_tensor()); nothing was loaded")
    if is_lazy(held) or value.shape == held.shape or (held.dim() == 0 and value.shape == (1,)):
        return
    raise RuntimeError(f"{who}: load_state_dict: size mismatch for {key}: shape {tuple(value.shape)} in the state "
                       f"dict, {tuple(held.shape)} in the model; nothing was loaded")


@contextmanager
def unchanged_if_refused(module: nn.Module, objects: bool = False,
                         kept: Callable[[nn.Module, str, torch.Tensor], torch.Tensor] | None = None) -> Iterator[None]:
    """Run a load of `module`; if it raises, put back bitwise what it may have changed, then re-raise.

    Kept: the data of every persistent parameter and buffer (one copy of the model's state for the load's time) and
    each submodule's extra state. `objects`: also put the tensors themselves back in their places (a load with
    `assign=True` replaces them). `kept(sub, name, tensor)`: the tensor that holds `name`'s value (a shard)."""
    nn_module("module", module)
    boolean("objects", objects)
    if kept is not None and not callable(kept):
        raise TypeError(f"kept must be callable, got {type(kept).__name__}")
    places, data, extras = [], {}, []
    with torch.no_grad():
        for sub in module.modules():
            persistent = {n: b for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set}
            for table, tensors in (("_parameters", sub._parameters), ("_buffers", persistent)):
                for name, held in tensors.items():
                    if held is None:
                        continue
                    held = kept(sub, name, held) if kept is not None else held
                    places.append((sub, table, name, held))
                    if id(held) not in data and not is_lazy(held):
                        data[id(held)] = (held, _local(held).clone())
            if _own_extra_state(sub):  # what torch's loader may set (`set_extra_state`), as it was (`get_extra_state`)
                extras.append((sub, _copied(sub.get_extra_state())))
    try:
        yield
    except BaseException:
        _put_back(places, data.values(), extras, objects)
        raise


def _own_extra_state(sub: nn.Module) -> bool:
    """Whether `sub` both reads and sets an extra state of its own."""
    return (type(sub).get_extra_state is not nn.Module.get_extra_state
            and type(sub).set_extra_state is not nn.Module.set_extra_state)


def _copied(state):
    """A deep copy of an extra state, or the state itself where it cannot be copied (it is put back as it was)."""
    try:
        return copy.deepcopy(state)
    except Exception:  # noqa: BLE001 - a state that holds a lock or a handle: keep the object, not a copy
        return state


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `t`'s values on this rank (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _put_back(places, data, extras, objects: bool) -> None:
    """What `unchanged_if_refused` kept, back where it was, in place (storage and version of each tensor kept)."""
    with torch.no_grad():
        if objects:
            for sub, table, name, held in places:
                getattr(sub, table)[name] = held
        for held, saved in data:
            local = _local(held)
            if local.shape == saved.shape and local.dtype == saved.dtype:
                local.copy_(saved)
            else:  # torch's loader materialised a lazy one, or a user's hook resized it
                held.data = saved
        for sub, state in extras:
            sub.set_extra_state(state)
