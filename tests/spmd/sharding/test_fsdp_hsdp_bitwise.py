"""HSDP (issue 43) against torch's FSDP2 HSDP on gloo, for every mesh of 4 processes or fewer.

The same script trains a small model with ours and torch's `fully_shard` in the same processes, on a 2-D mesh
(replicate, shard): float32, then float16 and bfloat16 `reduce_dtype`, then `set_gradient_divide_factor`; the
parameters after two SGD steps must be bitwise equal where our ring adds the terms in gloo's order (2 replicas, 2
shards), and equal to the rounding of the reduce dtype elsewhere (3 or 4 terms: gloo's ring adds downwards, ours
upwards; `fsdp_hsdp.py` says why we keep the ring). A divide factor on 1 shard per replica divides first, as torch's:
bitwise at (2, 1) (it was 1.49e-8 off). The 1-D mesh at 3 ranks is held too. Spawned runs of 2-4 ranks: in the soak.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of

pytestmark = pytest.mark.soak
# each case: (name, reduce dtype or None, gradient divide factor or None)
CASES = (("float32", None, None), ("float16", torch.float16, None), ("bfloat16", torch.bfloat16, None),
         ("divide factor", None, 6.0))


CASES_DTYPES = [(name, dtype or torch.float32) for name, dtype, _ in CASES]


def _train(shard, shape, reduce_dtype, factor):
    """Two SGD steps of a 2-unit model on `shape` (None: a 1-D mesh); the full parameters after."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) if shape else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    kwargs = {"mesh": mesh}
    if reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    shard(model[0], **kwargs)
    shard(model, **kwargs)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
        model[0].set_gradient_divide_factor(factor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, the same for both runs
    for _ in range(2):
        (model(torch.randn(5, 6, generator=data)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().clone() for p in model.parameters()]


def _job(runs):
    torch.set_num_threads(1)
    out = {}
    for shape, names in runs:
        for name, reduce_dtype, factor in (c for c in CASES if c[0] in names):
            got = {}
            for who, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
                got[who + " error"] = error_of(lambda: got.__setitem__(who, _train(shard, shape, reduce_dtype, factor)))
            out[(shape, name)] = got
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int):
    every = [c[0] for c in CASES]
    runs = {2: [((2, 1), every), ((1, 2), every)], 3: [((3, 1), every), ((1, 3), every), (None, every)],
            4: [((2, 2), every), ((4, 1), every), ((1, 4), every)]}[world]
    return launch(_job, world, (runs,), timeout=300.0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_hsdp_is_torchs_on_every_mesh_bitwise_where_the_order_of_the_sums_is_gloos(world):
    for rank, out in enumerate(_results(world)):
        assert out, f"rank {rank}: no case ran"
        for (shape, name), got in out.items():
            where = f"rank {rank}, mesh {shape}, {name}"
            assert got["ours error"] is None, f"{where}: {got['ours error']}"
            if "PREMUL_SUM with Gloo" in (got["torch error"] or ""):  # a factor torch's gloo cannot premultiply by
                continue
            assert got["torch error"] is None, f"{where}: torch's raised {got['torch error']}"
            terms = (shape or (1, 3))
            if max(terms) <= 2:  # two terms commute: the ring's order is gloo's
                for ours, theirs in zip(got["ours"], got["torch"]):
                    assert torch.equal(ours, theirs), f"{where}: {(ours - theirs).abs().max().item()} off"
            else:  # the same sums added in another order: the reduce dtype's rounding apart (a few of its ulps)
                eps = torch.finfo(dict(CASES_DTYPES)[name]).eps
                for ours, theirs in zip(got["ours"], got["torch"]):
                    torch.testing.assert_close(ours, theirs, rtol=0, atol=8 * eps, msg=where)
