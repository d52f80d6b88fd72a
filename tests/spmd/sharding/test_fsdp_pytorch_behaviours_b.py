"""Behaviours that pytorch's FSDP2 mixed-precision, state-dict, init and extension tests check, as our own tests.

One spawned run at 2 ranks: each case runs with our `fully_shard` and with torch's on the same model, data and
ranks, and the parent compares them.
- float16 compute and reduction (`MixedPrecisionPolicy(param_dtype=torch.float16)`): the gradients are divided
  partly before the sum and partly after it, as torch's (in float16 a sum divided after differs in the last bit
  of tiny gradients, and Adam turns that into a different parameter).
- a unit's first forward inside `torch.func.jvp` (no forward before it): the full parameters are gathered as
  plain tensors, and the output and its tangent are torch's (was: "Cannot access storage of TensorWrapper").
- a 2-D mesh without `mesh_dim_names` is refused in one line with torch's words, an AssertionError as torch's
  and a ValueError too (was: taken for HSDP).
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


def _jvp_first_forward(shard_fn):
    """`torch.func.jvp` through a unit never run before, whose output does not depend on the primal."""
    torch.manual_seed(0)
    enc, dec = nn.Linear(12, 10, bias=False), nn.Linear(10, 6, bias=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (enc, dec):
        shard_fn(module, mp_policy=policy, reshard_after_forward=False)
    e = enc(torch.randn(12))
    primal, tangent = torch.randn(6, requires_grad=True), torch.randn(6)
    output, tangent_out = torch.func.jvp(lambda unused: dec(e) + unused, (primal,), (tangent,))
    return {"output": output.detach(), "tangent": tangent_out}


def _unnamed_2d_mesh(shard_fn, n):
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, n))
    try:
        shard_fn(nn.Linear(4, 4), mesh=mesh)
    except Exception as e:  # the parent raises it again inside pytest.raises, checking its type and words
        return e
    return "accepted"


def _job():
    rank, n = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {"unnamed": {name: _unnamed_2d_mesh(fn, n) for name, fn in SHARD_FNS.items()}}
    for name, fn in SHARD_FNS.items():
        out[name] = {f"{dtype} {raf}": _case(_low_precision, fn, rank, dtype, raf)
                     for dtype in (torch.float16, torch.bfloat16) for raf in (True, False)}
        out[name]["jvp"] = _case(_jvp_first_forward, fn)
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240.0)


def test_float16_and_bfloat16_compute_and_reduction_train_as_torchs_bitwise(results):
    for r, got in enumerate(results):
        for case, theirs in got["torch"].items():
            if case == "jvp":
                continue
            ours = got["ours"][case]
            assert "raised" not in ours and "raised" not in theirs, (r, case, ours, theirs)
            for step, (a, b) in enumerate(zip(ours, theirs)):
                for name in b:
                    assert torch.equal(a[name], b[name]), f"rank {r} {case} step {step}: {name}"


def test_a_units_first_forward_inside_torch_func_jvp_gives_torchs_output_and_tangent(results):
    for r, got in enumerate(results):
        ours, theirs = got["ours"]["jvp"], got["torch"]["jvp"]
        assert "raised" not in theirs, theirs
        assert "raised" not in ours, (r, ours)
        for key in ("output", "tangent"):
            assert torch.equal(ours[key], theirs[key]), (r, key)


def test_a_2d_mesh_without_dim_names_is_refused_in_one_line_as_torchs_refuses_it(results):
    words = "Please init the 2D mesh for HSDP with mesh_dim_names specified"
    for got in results:
        for impl in ("torch", "ours"):  # pytorch's test expects an AssertionError with torch's words
            with pytest.raises(AssertionError, match=words):
                raise got["unnamed"][impl]
        with pytest.raises(ValueError, match=words) as e:  # and a user's `except ValueError` still catches ours
            raise got["unnamed"]["ours"]
        assert "pass mesh_dim_names=('replicate', 'shard')" in str(e.value) and "\n" not in str(e.value), e.value
