"""Sharding: each rank keeps 1/N of the optimizer state (ZeRO-1), of the gradients (ZeRO-2), of the parameters (ZeRO-3).

- `zero.py`: `ZeroRedundancyOptimizer`, a drop-in for torch's, at stage 1 or 2, and its step;
  `zero_layout.py`: the flat buffers, and the pieces of them this rank steps;
  `zero_grad_shards.py`: stage 2's gradient buckets, reduce-scattered during backward;
  `zero_guards.py`: the ranks agree, and what changed between steps is taken in or refused;
  `zero_torch_api.py`: what makes it torch's (state-dict consolidation, Join);
- `fsdp.py`: `fully_shard` (ZeRO-3, in the manner of torch's FSDP2), `FSDPModule`, `full_state_dict`;
  `fsdp_init.py`: its checks; `fsdp_param.py`: one parameter as a shard and in full;
  `fsdp_unit.py`: what one unit does in a step (gather, free, gather again, reduce-scatter);
  `fsdp_collectives.py`: its all-gathers and reduce-scatters, and their tails check;
  `fsdp_hsdp.py`: HSDP's all-reduce of the reduce-scattered rows across the replicas;
  `fsdp_hooks.py`: the hooks around a unit's forward and backward (prefetch included);
  `fsdp_step.py`: the step under way of a tree of units (their order, the end of backward).
"""
from .zero import ZeroRedundancyOptimizer
from .fsdp import FSDPModule, full_state_dict, fully_shard

__all__ = ["ZeroRedundancyOptimizer", "fully_shard", "FSDPModule", "full_state_dict"]
