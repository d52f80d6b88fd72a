"""The engine: one process per device over `torch.distributed`, each step a function you can read.

Rooms, in reading order (a room imports only the rooms before it; `tests/test_layout.py` holds this list to
ARCHITECTURE.md's and to the imports):
- `transport/`: how bytes move between ranks: a schedule's plan for one rank, the p2p executor, the group's
  ordered worker, deadlines and `PeerError`, the call check, and the one way ranks agree (`agree.py`);
- `auto/`: `algorithm="auto"`: measure the link, let the cost model pick the schedule;
- `collectives.py`, `comm_hooks.py`, `syncbn.py`: what users call (`allreduce`, `reduce_scatter`, `all_gather`,
  `reduce`, `broadcast`), and what rests on those alone: torch's comm hooks (fp16/bf16 compression, PowerSGD,
  no-op) and `SyncBatchNorm`;
- `ladder/`: rungs 1-4 of DDP, naive to bucketed, each the one below plus one idea;
- `ddp/`: rung 5, the drop-in `DistributedDataParallel`: rung 4's buckets plus torch's features;
- `sharding/`: ZeRO-1/2 (`ZeroRedundancyOptimizer`) and ZeRO-3 (`fully_shard`, in FSDP2's roles);
- `launch.py`, `sampler.py`: starting ranks (torchrun or on this machine), each rank's shard of the data;
- `ft/`: fault tolerance: replicas that agree on a quorum each step, commit or discard it together, and take a
  restarted replica back in, one process or a group of ranks per replica (`manualdp.spmd.ft`, imported on its own).

The drop-ins users swap for torch's are also importable from `manualdp.distributed`.
"""
from .transport.peers import DEFAULT_TIMEOUT, PeerError
from .transport.plan import DEFAULT_SEGMENT_BYTES, Message, Round, plan
from .collectives import all_gather, allreduce, broadcast, reduce, reduce_scatter
from .ladder import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP
from .ladder.bucket import Bucket
from .ddp import DistributedDataParallel
from .comm_hooks import GradBucket, PowerSGDState
from .syncbn import SyncBatchNorm, convert_sync_batchnorm
from .launch import init_from_env, launch, rank_device, shard
from .sampler import ShardedBatchSampler, shard_loader

__all__ = [
    "DEFAULT_TIMEOUT", "PeerError", "DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan",
    "allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast",
    "NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP", "Bucket", "DistributedDataParallel",
    "GradBucket", "PowerSGDState", "SyncBatchNorm", "convert_sync_batchnorm",
    "ZeroRedundancyOptimizer", "fully_shard", "FSDPModule", "full_state_dict",
    "init_from_env", "launch", "rank_device", "shard", "ShardedBatchSampler", "shard_loader",
]


_SHARDING = ("FSDPModule", "ZeroRedundancyOptimizer", "full_state_dict", "fully_shard")


def __getattr__(name: str):
    """The sharding names, imported on first use: they pull in torch's DTensor and FSDP (seconds at every start)."""
    if name in _SHARDING:
        from . import sharding
        return getattr(sharding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
