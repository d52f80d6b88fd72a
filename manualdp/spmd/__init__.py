"""The engine: one process per device over `torch.distributed`.

Read in this order:
- `peers.py`: waiting on other ranks with a deadline; `PeerError` names who is silent;
- `p2p.py`: the book's schedules run by one rank as `isend`/`irecv` messages;
- `call_check.py`: ranks that call an allreduce differently all raise, its headers beside the data;
- `ddp.py`: `DistributedDataParallel`, the drop-in for torch's: buckets, hooks, the worker;
  `ddp_sync.py` (the ranks compare and copy the model at construction), `ddp_checks.py`
  (debug, static graph, unused parameters) and `ddp_join.py` (uneven inputs) are its parts;
- `hooks.py`: comm hooks (allreduce, fp16/bf16 compression, PowerSGD, no-op);
- `syncbn.py`: `SyncBatchNorm`, statistics over the process group;
- `launch.py`: joining torchrun's group, starting ranks on this machine, `shard`;
- `sampler.py`: ranks that load only their own shard of each global batch;
- `tune.py`: `algorithm="auto"`, the cost model's pick with constants fitted to the transport;
- `collectives.py`, `zero.py`: reduce-scatter, all-gather, broadcast, reduce, and ZeRO-1/2
  (`zero_grads.py`: ZeRO-2's buckets, reduce-scattered during backward).
"""
from .naive import NaiveDDP
from .flat import FlatDDP
from .overlapped import OverlappedDDP
from .bucketed import BucketedDDP
from .ddp import Bucket, DistributedDataParallel
from .hooks import GradBucket, PowerSGDState
from .syncbn import SyncBatchNorm, convert_sync_batchnorm
from .launch import init_from_env, launch, rank_device, shard
from .collectives import allreduce
from .p2p import DEFAULT_SEGMENT_BYTES, Message, Round, plan
from .peers import DEFAULT_TIMEOUT, PeerError
from .sampler import ShardedBatchSampler, shard_loader
from .fsdp import full_state_dict, fully_shard

__all__ = [
    "NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP", "Bucket", "DistributedDataParallel", "GradBucket", "PowerSGDState", "SyncBatchNorm", "convert_sync_batchnorm",
    "init_from_env", "launch", "rank_device", "shard",
    "DEFAULT_SEGMENT_BYTES", "Message", "Round", "allreduce", "plan", "DEFAULT_TIMEOUT", "PeerError",
    "ShardedBatchSampler", "shard_loader",
    "fully_shard", "full_state_dict",
]
