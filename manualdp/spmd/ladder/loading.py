"""What a wrapper checks of a state dict before `load_state_dict` writes any tensor of it.

torch's `nn.Module.load_state_dict` copies each key as it walks the submodules and raises at the end (a size
mismatch, a missing or unexpected key), or in the middle (a submodule's pre-hook refusing): the submodules walked
first are loaded, the rest are not. The drop-ins (`DistributedDataParallel`, `fully_shard`'s modules) check the whole
state dict first, so that a refused load changes no tensor of the model (`check_loadable`).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["check_loadable"]

_LEGACY = ("num_batches_tracked", "_extra_state")  # keys that a module's own loader may fill in, or handle itself
_PLAIN = (nn.Module._load_from_state_dict, nn.modules.batchnorm._NormBase._load_from_state_dict)  # torch's usual


def check_loadable(module: nn.Module, state_dict: Mapping, strict: bool, who: str,
                   sharded: Callable[[nn.Module, str], bool] | None = None) -> None:
    """Raise one line, before anything is written, where `module.load_state_dict(state_dict, strict)` would refuse:
    a value that is not a tensor, a tensor of another shape, and (`strict`) a missing or unexpected key.

    `sharded(sub, name)`: whether parameter `name` of submodule `sub` is checked elsewhere (a shard), not here."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{who}: load_state_dict: state_dict must be a mapping, got {type(state_dict).__name__}")
    expected, own = set(), []  # own: prefixes of submodules that load their keys their own way, left to torch
    for prefix, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        if type(sub)._load_from_state_dict not in _PLAIN:
            own.append(prefix)
        persistent = {n: b for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set}
        for name, held in [*sub._parameters.items(), *persistent.items()]:
            if held is None:
                continue
            key = prefix + name
            expected.add(key)
            if key not in state_dict or (sharded is not None and sharded(sub, name)):
                continue
            _check_value(key, state_dict[key], held, who)
    if strict:
        given = set(state_dict.keys())
        missing = sorted(k for k in expected - given if not k.endswith(_LEGACY) and not k.startswith(tuple(own)))
        unexpected = sorted(k for k in given - expected if not k.endswith(_LEGACY) and not k.startswith(tuple(own)))
        if missing or unexpected:
            said = [f"missing key(s) {', '.join(missing)}" if missing else "",
                    f"unexpected key(s) {', '.join(unexpected)}" if unexpected else ""]
            raise RuntimeError(f"{who}: load_state_dict: {'; '.join(s for s in said if s)}; nothing was loaded "
                               "(pass strict=False to load the keys that match)")


def _check_value(key: str, value, held: torch.Tensor, who: str) -> None:
    """One key: a tensor of the held tensor's shape (torch's loader takes a 1-element vector for a scalar too)."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{who}: load_state_dict: {key} is a {type(value).__name__}, not a tensor; nothing was "
                           "loaded")
    if is_lazy(held) or value.shape == held.shape or (held.dim() == 0 and value.shape == (1,)):
        return
    raise RuntimeError(f"{who}: load_state_dict: size mismatch for {key}: shape {tuple(value.shape)} in the state "
                       f"dict, {tuple(held.shape)} in the model; nothing was loaded")
