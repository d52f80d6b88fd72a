"""torch's all-gather extensions (`fsdp_pre_all_gather`/`fsdp_post_all_gather`) on ONE rank only are named on every
rank in one line (issue 43; was: that rank refused, its peers waited in the all-gather or the agreement until its
process exited, then a PeerError that does not say why):
- set on a shard's local tensor after `fully_shard`: the unit's all-gather carries the flag in its tail;
- a parameter of a tensor subclass that defines them, at `fully_shard`: the refusal is a field of its agreement.
"""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of


class _Hooked(nn.Parameter):
    """A parameter class with torch's all-gather extension hooks (never called by ours: it refuses them)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self,), None

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outs[0], (outs[0],))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))


def _set_after_sharding(rank):
    """Shard; rank 1 alone sets the hooks on its shards' local tensors; one forward and backward."""
    model = _model()
    for layer in model:
        fully_shard(layer, timeout=20)
    fully_shard(model, timeout=20)
    if rank == 1:
        for p in model.parameters():
            p._local_tensor.fsdp_pre_all_gather = _Hooked.fsdp_pre_all_gather.__get__(p._local_tensor)
    return error_of(lambda: model(torch.randn(2, 8)).sum().backward())


def _subclass_at_sharding(rank):
    """Rank 1 alone makes a weight a `_Hooked` parameter before `fully_shard`."""
    model = _model()
    if rank == 1:
        model[1].weight = _Hooked(model[1].weight.detach().clone())
    return error_of(lambda: fully_shard(model, timeout=20))


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    return {"after": _set_after_sharding(rank), "subclass": _subclass_at_sharding(rank)}


def test_all_gather_extensions_on_one_rank_only_are_named_on_every_rank_in_one_line():
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        after = out["after"]
        assert after is not None and "\n" not in after, (rank, after)
        assert after.startswith("NotImplementedError: "), (rank, after)
        assert "fsdp_pre_all_gather/fsdp_post_all_gather" in after and "set on rank(s) 1)" in after, (rank, after)
        assert ("0.weight: " if rank == 1 else "unit 2 (FSDPLinear 0): ") in after, (rank, after)
        subclass = out["subclass"]
        assert subclass is not None and "\n" not in subclass, (rank, subclass)
        assert subclass.startswith(f"ValueError: rank {rank}: fully_shard(Sequential) differs across ranks: refused "
                                   "nothing..NotImplementedError: 1.weight is a _Hooked (a tensor subclass with "
                                   "torch's all-gather extensions"), (rank, subclass)
