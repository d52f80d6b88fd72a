"""Kept so that `from manualdp.distributed import DistributedDataParallel` goes on working.

The code lives in `manualdp.spmd`: `p2p.py` (allreduce across processes) and `ddp.py` (the wrapper).
"""
from .spmd.ddp import Bucket, DistributedDataParallel
from .spmd.collectives import allreduce
from .spmd.p2p import DEFAULT_SEGMENT_BYTES, Message, Round, plan

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "allreduce", "Bucket", "DistributedDataParallel"]
