"""Replicate a model's parameters on every device, and broadcast between replicas."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .validate import check_devices, check_tensors, index, initialized, nn_module, tensor_list

__all__ = ["replicate", "replicate_params", "broadcast", "broadcast_buffers", "copy_params_"]


def replicate_params(params, device) -> list[torch.Tensor]:
    """Copy `params` to `device` as fresh leaf tensors that require grad (the textbook's `get_params`)."""
    device = check_devices([device], "device")[0]
    params = tensor_list("params", list(params))
    # copy=True: with every simulated device being `cpu`, a plain .to() would return the
    # very same tensor and the "replicas" would silently share storage.
    return [p.detach().to(device, copy=True).requires_grad_(p.is_floating_point()) for p in params]


def replicate(module: nn.Module, devices) -> list[nn.Module]:
    """Return one independent copy of `module` per device; replicas never share storage."""
    nn_module("module", module)
    initialized("module", module)  # a lazy one would give every replica its own random values
    devices = check_devices(devices)
    # deepcopy gives new storage even where .to(device) would be a no-op.
    return [copy.deepcopy(module).to(d) for d in devices]


def broadcast(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Copy `tensors[src]` into every other tensor of the list, in place."""
    check_tensors(tensors, sums=False)
    index("src", src, len(tensors), "tensors")
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if i != src:
                t.copy_(tensors[src])  # in place: rebinding the list entry would leave the replica stale


def broadcast_buffers(replicas: list[nn.Module], src: int = 0) -> None:
    """Copy the buffers (e.g. BatchNorm running statistics) of `replicas[src]` to the others."""
    for tensors in zip(*(r.buffers() for r in replicas)):
        broadcast(list(tensors), src)


def copy_params_(dst: nn.Module, src: nn.Module) -> None:
    """Write the parameters and buffers of `src` into `dst`, in place (any device)."""
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters()):
            a.copy_(b)
        for a, b in zip(dst.buffers(), src.buffers()):
            a.copy_(b)
