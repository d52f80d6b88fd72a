"""Sharding: each rank keeps 1/N of the optimizer state (ZeRO-1), of the gradients (ZeRO-2), of the parameters (ZeRO-3).

- `zero.py`: `ZeroRedundancyOptimizer`, a drop-in for torch's, at stage 1 or 2, and its step;
  `zero_layout.py`: the flat buffers, and the pieces of them this rank steps;
  `zero_grad_shards.py`: stage 2's gradient buckets, reduce-scattered during backward;
  `zero_guards.py`: the ranks agree, and what changed between steps is taken in or refused;
  `zero_torch_api.py`: what makes it torch's (state-dict consolidation, Join);
- `fsdp.py`: `fully_shard` (ZeRO-3, in the manner of torch's FSDP2); `fsdp_unit.py`: what one
  unit does in a step (gather, free, gather again, reduce-scatter).
"""
from .zero import ZeroRedundancyOptimizer
from .fsdp import FSDPModule, full_state_dict, fully_shard

__all__ = ["ZeroRedundancyOptimizer", "fully_shard", "FSDPModule", "full_state_dict"]
