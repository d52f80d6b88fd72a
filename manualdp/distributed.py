"""The front door for swapping torch's data-parallel wrappers for manualdp's: change one import.

    from manualdp.distributed import DistributedDataParallel as DDP   # was torch.nn.parallel
    from manualdp.distributed import ZeroRedundancyOptimizer          # was torch.distributed.optim
    from manualdp.distributed import fully_shard, FSDPModule          # was torch.distributed.fsdp

Each behaves as torch's does where torch's tests say so, and moves its bytes with the book's
schedules. The code lives in the engine, `manualdp.spmd` (`ddp/`, `sharding/`, `transport/`).
"""
from .spmd import (Bucket, DEFAULT_SEGMENT_BYTES, DistributedDataParallel, FSDPModule, Message, PeerError, Round,
                   SyncBatchNorm, ZeroRedundancyOptimizer, allreduce, convert_sync_batchnorm, full_state_dict,
                   fully_shard, init_from_env, plan)

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "fully_shard", "FSDPModule", "full_state_dict",
           "SyncBatchNorm", "convert_sync_batchnorm", "init_from_env", "PeerError", "allreduce", "Bucket",
           "DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan"]
