"""manualdp: data-parallel training by hand, on PyTorch.

The book, in reading order: devices -> split -> replicate -> allreduce -> schedule ->
buckets -> train (`train_batch`) -> guard. Then `spmd/` (one process per device),
`support/` (checkpoints, data, models, plots) and `runners/` (the full loops, the CLI).

Importing manualdp loads the book only; the engine, the utilities and the runners load
when a name of theirs is first used (`manualdp.train`, `manualdp.spmd`, ...).
"""
import importlib

from . import schedule  # noqa: F401
from .allreduce import allreduce
from .devices import cpu_devices, try_all_gpus, try_gpu
from .guard import NonFiniteGradientError
from .replicate import broadcast, replicate, replicate_params
from .split import split_batch
from .train import allreduce_gradients, evaluate, train_batch

del train  # the book's module `manualdp.train`: the name is the full training loop, below

__version__ = "0.1.0"

__all__ = [
    "allreduce", "allreduce_gradients", "broadcast", "cpu_devices", "evaluate", "get_model", "History", "lenet",
    "load_data", "mlp", "NonFiniteGradientError", "resnet18", "replicate", "replicate_params", "split_batch",
    "train", "train_batch", "train_spmd", "try_all_gpus", "try_gpu",
]

_LATER = {  # name -> the module below the book that defines it
    "train": "runners.loop", "train_spmd": "runners.loop", "load_data": "support.data",
    "History": "support.history", "get_model": "support.models", "lenet": "support.models",
    "mlp": "support.models", "resnet18": "support.models",
}
_LAYERS = ("distributed", "spmd", "support", "runners")


def __getattr__(name: str):
    """Load the engine, the utilities and the runners when first used (PEP 562)."""
    if name in _LATER:
        value = getattr(importlib.import_module(f"{__name__}.{_LATER[name]}"), name)
    elif name in _LAYERS:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LATER, *_LAYERS})
