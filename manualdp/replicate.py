"""Replicate a model's parameters on every device, and broadcast between replicas."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .devices import check_devices

__all__ = ["replicate", "replicate_params", "broadcast", "broadcast_buffers", "copy_params_"]


def replicate_params(params, device) -> list[torch.Tensor]:
    """Copy `params` to `device` as fresh leaf tensors that require grad (the textbook's `get_params`)."""
    device = check_devices([device], "device")[0]
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
    # copy=True: with every simulated device being `cpu`, a plain .to() would return the
    # very same tensor and the "replicas" would silently share storage.
    return [p.detach().to(device, copy=True).requires_grad_(p.is_floating_point()) for p in params]


def replicate(module: nn.Module, devices) -> list[nn.Module]:
    """Return one independent copy of `module` per device; replicas never share storage."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    devices = check_devices(devices)
    # deepcopy gives new storage even where .to(device) would be a no-op.
    return [copy.deepcopy(module).to(d) for d in devices]


def broadcast(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Copy `tensors[src]` into every other tensor of the list, in place."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(tensors):
        raise ValueError(f"src must index tensors (0..{len(tensors) - 1}), got {src!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != tensors[src].shape:
            raise ValueError(f"tensors[{i}] has shape {tuple(t.shape)}, but tensors[{src}] has {tuple(tensors[src].shape)}")
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if i != src:
                t.copy_(tensors[src])  # in place: rebinding the list entry would leave the replica stale


def broadcast_buffers(replicas: list[nn.Module], src: int = 0) -> None:
    """Copy the buffers (e.g. BatchNorm running statistics) of `replicas[src]` to the others."""
    per_replica = [list(r.buffers()) for r in replicas]
    for tensors in zip(*per_replica):
        broadcast(list(tensors), src)


def copy_params_(dst: nn.Module, src: nn.Module) -> None:
    """Write the parameters and buffers of `src` into `dst`, in place (any device)."""
    with torch.no_grad():
        for a, b in zip(dst.parameters(), src.parameters()):
            a.copy_(b)
        for a, b in zip(dst.buffers(), src.buffers()):
            a.copy_(b)
