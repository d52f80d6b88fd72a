"""manualdp: data-parallel training by hand, on PyTorch.

The book, in reading order: devices -> split -> replicate -> allreduce -> schedule ->
buckets -> train (`train_batch`) -> guard. Then `spmd/` (one process per device),
`support/` (checkpoints, data, models, plots) and `runners/` (the full loops, the CLI).
"""
from . import distributed, schedule, spmd  # noqa: F401  (manualdp.distributed.DistributedDataParallel, ...)
from .allreduce import allreduce
from .devices import cpu_devices, try_all_gpus, try_gpu
from .guard import NonFiniteGradientError
from .replicate import broadcast, replicate, replicate_params
from .runners.loop import train, train_spmd
from .split import split_batch
from .support.data import load_data
from .support.history import History
from .support.models import get_model, lenet, mlp, resnet18
from .train import allreduce_gradients, evaluate, train_batch

__version__ = "0.1.0"

__all__ = [
    "allreduce", "allreduce_gradients", "broadcast", "cpu_devices", "evaluate", "get_model", "History", "lenet",
    "load_data", "mlp", "NonFiniteGradientError", "resnet18", "replicate", "replicate_params", "split_batch",
    "train", "train_batch", "train_spmd", "try_all_gpus", "try_gpu",
]
