"""The engine: one process per device over `torch.distributed`.

Read in this order:
- `peers.py`: waiting on other ranks with a deadline; `PeerError` names who is silent;
- `p2p.py`: the book's schedules run by one rank as `isend`/`irecv` messages;
- `ddp.py`: `DistributedDataParallel`, the drop-in for torch's;
- `launch.py`: joining torchrun's group, starting ranks on this machine, `shard`.
"""
from .ddp import Bucket, DistributedDataParallel
from .launch import init_from_env, launch, rank_device, shard
from .p2p import DEFAULT_SEGMENT_BYTES, Message, Round, allreduce, plan
from .peers import DEFAULT_TIMEOUT, PeerError

__all__ = [
    "Bucket", "DistributedDataParallel", "init_from_env", "launch", "rank_device", "shard",
    "DEFAULT_SEGMENT_BYTES", "Message", "Round", "allreduce", "plan", "DEFAULT_TIMEOUT", "PeerError",
]
