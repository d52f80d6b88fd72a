"""Devices: real GPUs when there are some, simulated CPU devices otherwise."""
from __future__ import annotations

import torch

from .validate import check_devices, non_negative_int, positive_int

__all__ = ["try_gpu", "try_all_gpus", "cpu_devices", "check_devices"]


def try_gpu(i: int = 0) -> torch.device:
    """Return `cuda:i` if it exists, else `cpu`."""
    non_negative_int("i", i)
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
    positive_int("n", n)
    return [torch.device("cpu")] * n
