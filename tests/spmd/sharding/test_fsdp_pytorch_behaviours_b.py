"""Behaviours that pytorch's FSDP2 mixed-precision, state-dict, init and extension tests check, as our own tests.

One spawned run at 2 ranks: each case runs with our `fully_shard` and with torch's on the same model, data and
ranks, and the parent compares them.
- float16 compute and reduction (`MixedPrecisionPolicy(param_dtype=torch.float16)`): the gradients are divided
  partly before the sum and partly after it, as torch's (in float16 a sum divided after differs in the last bit
  of tiny gradients, and Adam turns that into a different parameter).
"""
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard

from .test_fsdp_like_torch import _case, _full

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _blocks():
    torch.manual_seed(42)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(3)])


def _low_precision(shard_fn, rank, dtype, reshard_after_forward):
    """Adam for 6 steps in `dtype` compute and reduction; the full parameters after each step."""
    model = _blocks()
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for block in model:
        shard_fn(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    shard_fn(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(43 + rank)
    x = torch.randn(4, 16, dtype=dtype)
    steps = []
    for _ in range(6):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        steps.append({name: _full(p) for name, p in model.named_parameters()})
    return steps


def _job():
    rank = torch.distributed.get_rank()
    out = {}
    for name, fn in SHARD_FNS.items():
        out[name] = {f"{dtype} {raf}": _case(_low_precision, fn, rank, dtype, raf)
                     for dtype in (torch.float16, torch.bfloat16) for raf in (True, False)}
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240.0)


def test_float16_and_bfloat16_compute_and_reduction_train_as_torchs_bitwise(results):
    for r, got in enumerate(results):
        for case, theirs in got["torch"].items():
            ours = got["ours"][case]
            assert "raised" not in ours and "raised" not in theirs, (r, case, ours, theirs)
            for step, (a, b) in enumerate(zip(ours, theirs)):
                for name in b:
                    assert torch.equal(a[name], b[name]), f"rank {r} {case} step {step}: {name}"
