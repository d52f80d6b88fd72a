"""Devices: real GPUs when there are some, simulated CPU devices otherwise."""
from __future__ import annotations

import torch

__all__ = ["try_gpu", "try_all_gpus", "cpu_devices", "check_devices"]


def try_gpu(i: int = 0) -> torch.device:
    """Return `cuda:i` if it exists, else `cpu`."""
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f"i must be a non-negative int, got {i!r}")
    if torch.cuda.is_available() and torch.cuda.device_count() > i:
        return torch.device(f"cuda:{i}")
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """Return every GPU, or `[cpu]` when there is none."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]


def cpu_devices(n: int) -> list[torch.device]:
    """Return `n` simulated devices: `n` entries of `cpu`.

    They are the same physical device, so every copy between them is a real memory
    copy in host RAM; manualdp never relies on device identity to skip a copy.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    return [torch.device("cpu")] * n


def check_devices(devices, name: str = "devices") -> list[torch.device]:
    """Validate a non-empty list of devices and return it as `torch.device` objects."""
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"{name} must be a list of devices, got {devices!r}")
    out = []
    for d in devices:
        try:
            device = torch.device(d)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name} contains {d!r}, which is not a device") from e
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (device.index or 0) >= count:
                raise ValueError(f"{name} contains {str(device)!r}, but this machine has {count} GPU(s)")
        elif device.type != "cpu":
            raise ValueError(f"{name} contains {str(device)!r}; manualdp runs on 'cpu' and 'cuda' devices")
        out.append(device)
    if not out:
        raise ValueError(f"{name} must not be empty, got {devices!r}")
    return out
