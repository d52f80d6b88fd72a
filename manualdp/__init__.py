"""manualdp: data-parallel training by hand, on PyTorch.

Read in this order: split -> replicate -> allreduce -> train_batch -> train.
"""
from . import distributed, schedule  # noqa: F401  (manualdp.distributed.DistributedDataParallel, manualdp.schedule.ring)
from .allreduce import allreduce
from .data import load_data
from .devices import cpu_devices, try_all_gpus, try_gpu
from .models import get_model, lenet, mlp, resnet18
from .replicate import broadcast, replicate, replicate_params
from .split import split_batch
from .train import History, allreduce_gradients, evaluate, train, train_batch

__version__ = "0.1.0"

__all__ = [
    "allreduce", "allreduce_gradients", "broadcast", "cpu_devices", "evaluate", "get_model", "History", "lenet",
    "load_data", "mlp", "resnet18",
    "replicate", "replicate_params", "split_batch", "train", "train_batch", "try_all_gpus", "try_gpu",
]
