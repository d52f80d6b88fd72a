"""Models: the textbook's LeNet, its small-image ResNet-18, and a small MLP."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..validate import positive_int

__all__ = ["lenet", "Residual", "resnet18", "mlp", "MODELS", "get_model"]


def lenet(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """LeNet of the d2l multi-GPU chapter, for 28x28 inputs (ReLU and average pooling)."""
    positive_int("num_classes", num_classes)
    positive_int("in_channels", in_channels)
    return nn.Sequential(
        nn.Conv2d(in_channels, 20, kernel_size=3), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),   # 26x26 -> 13x13
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),   # 9x9 -> 4x4, so 50 * 4 * 4 = 800 features
        nn.Flatten(),
        nn.Linear(800, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


class Residual(nn.Module):
    """The d2l residual block: two 3x3 convs with BatchNorm, plus a 1x1 conv on the shortcut when shapes change."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        # the shortcut must match the main path's channels and resolution to be added to it
        needs_projection = stride != 1 or in_channels != out_channels
        self.conv3 = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride) if needs_projection else None
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        return F.relu(Y + X)


def _stage(in_channels: int, out_channels: int, num_blocks: int, first: bool) -> nn.Sequential:
    # the first stage keeps the resolution; every later one halves it in its first block
    blocks = [Residual(in_channels, out_channels, stride=1 if first else 2)]
    blocks += [Residual(out_channels, out_channels) for _ in range(num_blocks - 1)]
    return nn.Sequential(*blocks)


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """ResNet-18 for small images, as in d2l: 3x3 stem without max-pool, stages of 64/128/256/512."""
    positive_int("num_classes", num_classes)
    positive_int("in_channels", in_channels)
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", _stage(64, 64, 2, first=True))
    net.add_module("resnet_block2", _stage(64, 128, 2, first=False))
    net.add_module("resnet_block3", _stage(128, 256, 2, first=False))
    net.add_module("resnet_block4", _stage(256, 512, 2, first=False))
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))
    return net


def mlp(in_features: int = 784, hidden: int = 256, num_classes: int = 10) -> nn.Sequential:
    """A one-hidden-layer perceptron that flattens its input (e.g. 1x28x28 -> 784)."""
    positive_int("in_features", in_features)
    positive_int("hidden", hidden)
    positive_int("num_classes", num_classes)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


MODELS: dict[str, Callable[..., nn.Module]] = {"lenet": lenet, "resnet18": resnet18, "mlp": mlp}


def get_model(name: str, **kwargs) -> nn.Module:
    """Build the model called `name` (one of `MODELS`) with keyword arguments `kwargs`."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    try:
        return MODELS[name](**kwargs)
    except TypeError as e:  # an unexpected keyword: say which model refused it
        raise TypeError(f"model {name!r}: {e}") from e
