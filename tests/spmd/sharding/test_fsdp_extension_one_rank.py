"""torch's all-gather extensions (`fsdp_pre_all_gather`/`fsdp_post_all_gather`) on ONE rank only are named on every
rank in one line (issue 43; was: that rank refused, its peers waited in the all-gather or the agreement until its
process exited, then a PeerError that does not say why). The unit's all-gather carries in its tail which parameters
define them, so that every rank raises at the first forward, before any hook's input moves:
- set on a shard's local tensor after `fully_shard`;
- a parameter of a tensor subclass whose class defines them (sharded as torch's, with its hooks: `fsdp_ext.py`);
- one hook of the pair alone on one rank (torch's asserts both).
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of


class _Hooked(nn.Parameter):
    """A parameter class with torch's all-gather extension hooks."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self,), None

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outs[0], (outs[0],))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))


def _set_after_sharding(rank, both=True):
    """Shard; rank 1 alone sets the hooks (`both`, else the pre-hook only) on its shards' local tensors; one forward
    and backward."""
    model = _model()
    for layer in model:
        fully_shard(layer, timeout=20)
    fully_shard(model, timeout=20)
    if rank == 1:
        for p in model.parameters():
            p._local_tensor.fsdp_pre_all_gather = _Hooked.fsdp_pre_all_gather.__get__(p._local_tensor)
            if both:
                p._local_tensor.fsdp_post_all_gather = _Hooked.fsdp_post_all_gather.__get__(p._local_tensor)
    return error_of(lambda: model(torch.randn(2, 8)).sum().backward())


def _subclass_at_sharding(rank):
    """A weight is a `TwoTensor` (a tensor subclass; sharding keeps its class) on every rank; rank 1 alone gives the
    class the hooks; one forward."""
    model = _model()
    model[1].weight = nn.Parameter(TwoTensor(model[1].weight.detach().clone(), model[1].weight.detach().clone()))
    if rank == 1:
        TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = _Hooked.fsdp_pre_all_gather, \
            _Hooked.fsdp_post_all_gather
    try:
        return error_of(lambda: fully_shard(model, timeout=20)(torch.randn(2, 8)))
    finally:
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            if name in TwoTensor.__dict__:
                delattr(TwoTensor, name)


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    return {"after": _set_after_sharding(rank), "subclass": _subclass_at_sharding(rank),
            "half": _set_after_sharding(rank, both=False)}


def test_all_gather_extensions_on_one_rank_only_are_named_on_every_rank_in_one_line():
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        after = out["after"]
        assert after is not None and "\n" not in after, (rank, after)
        assert after.startswith("UnitMismatch: " + ("0.weight: " if rank == 1 else "unit 2 (FSDPLinear 0): ")), \
            (rank, after)
        assert "fsdp_pre_all_gather/fsdp_post_all_gather" in after and "set on rank(s) 1)" in after, (rank, after)
        subclass = out["subclass"]
        assert subclass is not None and "\n" not in subclass, (rank, subclass)
        assert subclass.startswith("UnitMismatch: " + ("1.weight: " if rank == 1 else "unit 1 (FSDPSequential): ")
                                   + "fsdp_pre_all_gather/fsdp_post_all_gather"), (rank, subclass)
        assert "set on rank(s) 1)" in subclass, (rank, subclass)
        half = out["half"]
        assert half is not None and "\n" not in half, (rank, half)
        assert "must be defined together (one of them only, on rank(s) 1)" in half, (rank, half)
