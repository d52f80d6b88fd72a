"""The engine: one process per device over `torch.distributed`.

Read in this order:
- `peers.py`: waiting on other ranks with a deadline; `PeerError` names who is silent;
- `p2p.py`: the book's schedules run by one rank as `isend`/`irecv` messages;
- `ddp.py`: `DistributedDataParallel`, the drop-in for torch's (Join included);
- `hooks.py`: comm hooks (allreduce, fp16/bf16 compression, PowerSGD, no-op);
- `syncbn.py`: `SyncBatchNorm`, statistics over the process group;
- `launch.py`: joining torchrun's group, starting ranks on this machine, `shard`.
"""
from .ddp import Bucket, DistributedDataParallel
from .hooks import GradBucket, PowerSGDState
from .syncbn import SyncBatchNorm, convert_sync_batchnorm
from .launch import init_from_env, launch, rank_device, shard
from .p2p import DEFAULT_SEGMENT_BYTES, Message, Round, allreduce, plan
from .peers import DEFAULT_TIMEOUT, PeerError

__all__ = [
    "Bucket", "DistributedDataParallel", "GradBucket", "PowerSGDState", "SyncBatchNorm", "convert_sync_batchnorm",
    "init_from_env", "launch", "rank_device", "shard",
    "DEFAULT_SEGMENT_BYTES", "Message", "Round", "allreduce", "plan", "DEFAULT_TIMEOUT", "PeerError",
]
