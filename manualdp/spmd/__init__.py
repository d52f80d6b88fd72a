"""The engine: one process per device over `torch.distributed`.

Read in this order:
- `peers.py`: waiting on other ranks with a deadline; `PeerError` names who is silent;
- `p2p.py`: the book's schedules run by one rank as `isend`/`irecv` messages;
- `ddp.py`: `DistributedDataParallel`, the drop-in for torch's;
- `launch.py`: joining torchrun's group, starting ranks on this machine, `shard`;
- `sampler.py`: ranks that load only their own shard of each global batch.
"""
from .ddp import Bucket, DistributedDataParallel
from .launch import init_from_env, launch, rank_device, shard
from .p2p import DEFAULT_SEGMENT_BYTES, Message, Round, allreduce, plan
from .peers import DEFAULT_TIMEOUT, PeerError
from .sampler import ShardedBatchSampler, shard_loader

__all__ = [
    "Bucket", "DistributedDataParallel", "init_from_env", "launch", "rank_device", "shard",
    "DEFAULT_SEGMENT_BYTES", "Message", "Round", "allreduce", "plan", "DEFAULT_TIMEOUT", "PeerError",
    "ShardedBatchSampler", "shard_loader",
]
