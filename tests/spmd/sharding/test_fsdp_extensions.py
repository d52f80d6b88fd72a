"""torch's all-gather extensions and tensor-subclass parameters in our `fully_shard` (issue 43; was: refused, "w is a
TwoTensor (a tensor subclass): manualdp's fully_shard shards plain tensors").

Each case runs the same script with our `fully_shard` and with torch's, on the same model, data and ranks; the
parent compares them:
- weights that are `TwoTensor`s whose class defines `fsdp_pre_all_gather`/`fsdp_post_all_gather` (the pair written
  here): the losses, the shards and their gradients after every step are torch's, bitwise, and each hook ran as
  often as torch's; also in bfloat16, with gradient accumulation, and with a weight frozen after sharding;
- the same weights without the pair: all-gathered as their plain data, as torch's, bitwise;
- a post-hook that returns a wrong shape: refused in one line naming the parameter, on every rank;
- a pre-hook that returns an uneven shard's inputs unpadded: refused in one line on every rank (torch's raises on
  the short rank only, the others wait); the pair on a parameter sharded past dim 0 refused in one line;
- a pre-hook that raises on one rank: named on every rank in one line (torch's: the others wait in the all-gather);
- at 4 ranks on a 2x2 (replicate, shard) mesh (soak): the pair trains as torch's HSDP does.
(The pair set on one rank only: `test_fsdp_extension_one_rank.py`.)
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.two_tensor import TwoTensor

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}
STEPS = 4
HOWS = ("bf16", "accumulate", "freeze")


class _Pair:
    """The all-gather extension pair for `TwoTensor` (both halves gathered, the full one made of them), counting its
    calls; the halves of an uneven shard padded to ceil(rows / W) rows (as torch's requires) unless not `pad`; `cut`
    rows dropped from what the post-hook returns (a wrong shape); the pre-hook raises on rank `fail_on`."""

    def __init__(self, cut: int = 0, pad: bool = True, fail_on: int | None = None) -> None:
        self.calls = {"pre": 0, "post": 0, "post with out": 0}
        self.cut, self.pad, self.fail_on = cut, pad, fail_on

    def pre(self, t, mesh, outer_size, outer_stride, module, mp_policy):
        self.calls["pre"] += 1
        if dist.get_rank() == self.fail_on:
            raise RuntimeError("the pre-hook broke\non two lines")
        missing = -(-outer_size[0] // mesh.size()) - t.shape[0] if self.pad else 0
        return tuple(nn.functional.pad(h, (0, 0, 0, missing)) for h in (t.a, t.b)), tuple(outer_size)

    def post(self, t, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        assert a.shape[1:] == metadata[1:], (a.shape, metadata)
        if out is not None:
            self.calls["post with out"] += 1
            with torch.no_grad():  # (the full one's halves may be these very outputs: copied onto themselves)
                out.a.copy_(a[:out.shape[0]])
                out.b.copy_(b[:out.shape[0]])
            return None
        self.calls["post"] += 1
        full = TwoTensor(a.to(param_dtype), b.to(param_dtype))
        return (full[:full.shape[0] - self.cut] if self.cut else full), (a, b)

    def __enter__(self):
        pair = self

        def pre(t, mesh, outer_size, outer_stride, module, mp_policy):  # the signature torch's inspects
            return pair.pre(t, mesh, outer_size, outer_stride, module, mp_policy)

        def post(t, outputs, metadata, param_dtype, *, out=None):
            return pair.post(t, outputs, metadata, param_dtype, out=out)

        TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = pre, post
        return self

    def __exit__(self, *exc):
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def _model():
    """Two linear layers whose weights are `TwoTensor`s of two different halves (the second's 3 rows cut unevenly
    at 2 ranks); plain biases."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        w = layer.weight.detach()
        layer.weight = nn.Parameter(TwoTensor(w.clone(), w * 0.5 + 0.01))
    return model


def _plain(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A local tensor as plain tensors: a `TwoTensor`'s two halves, or itself."""
    return (t.a.clone(), t.b.clone()) if isinstance(t, TwoTensor) else (t.detach().clone(),)


def _train(shard_fn, mesh=None, how=""):
    """Shard each layer and the root, train STEPS steps of Adam on this rank's data: per step the loss, and the local
    shards and gradients. `how`: "bf16" (param_dtype), "accumulate" (a micro-batch without gradient sync before each
    step), "freeze" (the first weight frozen after the first step)."""
    model = _model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if how == "bf16" else MixedPrecisionPolicy()
    for m in (model[0], model[2], model):
        shard_fn(m, mesh=mesh, mp_policy=mp)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(dist.get_rank())
    steps = []
    for step in range(STEPS):
        if how == "freeze" and step == 1:
            model[0].weight.requires_grad_(False)
        if how == "accumulate":
            model.set_requires_gradient_sync(False)
            model(torch.randn(4, 8, generator=data)).sum().backward()
            model.set_requires_gradient_sync(True)
        loss = model(torch.randn(4, 8, generator=data)).sum()
        loss.backward()
        grads = {k: _plain(p.grad.to_local()) for k, p in model.named_parameters() if p.grad is not None}
        optim.step()
        optim.zero_grad()
        steps.append({"loss": _plain(loss), "grads": grads,
                      "shards": {k: _plain(p.to_local()) for k, p in model.named_parameters()}})
    return steps


def _with_pair(shard_fn, mesh=None, how=""):
    with _Pair() as pair:
        steps = _train(shard_fn, mesh, how)
    return {"steps": steps, "calls": pair.calls}


def _refused(pair, **kwargs):
    """What the first forward with `pair` raises (each unit sharded with `kwargs`)."""
    with pair:
        model = _model()
        for m in (model[0], model[2], model):
            fully_shard(m, **kwargs)
        return error_of(lambda: model(torch.randn(2, 8)))


def _job(mesh_shape=None):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    out = {name: {"pair": _with_pair(fn, mesh)} for name, fn in SHARD_FNS.items()}
    if mesh is None:
        for name, fn in SHARD_FNS.items():
            out[name]["plain"] = _train(fn)
            for how in HOWS:
                out[name][how] = _with_pair(fn, how=how)
        out["ours"]["wrong shape"] = _refused(_Pair(cut=1))
        out["ours"]["unpadded"] = _refused(_Pair(pad=False))  # torch's raises on the short rank only: the other waits
        out["ours"]["dim 1"] = _refused(_Pair(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
        out["ours"]["pre raised"] = _refused(_Pair(fail_on=1))  # torch's: rank 0 waits in the all-gather
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=300.0)


def _leaves(x, where: str):
    """(path, tensor) for every tensor in `x`, nested dicts, lists and tuples."""
    if not isinstance(x, (dict, list, tuple)):
        yield where, x
        return
    for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
        yield from _leaves(v, f"{where}/{k}")


def _assert_same(ours, theirs, where):
    """`ours` and `theirs` hold the same tensors at the same places, bitwise."""
    mine, peer = list(_leaves(ours, where)), list(_leaves(theirs, where))
    assert [p for p, _ in mine] == [p for p, _ in peer], where
    for (path, a), (_, b) in zip(mine, peer):
        assert torch.equal(a, b), (path, a, b)


def _assert_trains_as_torchs(results, how="pair"):
    for r, got in enumerate(results):
        ours, theirs = got["ours"][how], got["torch"][how]
        _assert_same(ours["steps"], theirs["steps"], f"rank {r}")
        assert theirs["calls"]["pre"] > 0 and theirs["calls"]["post with out"] > 0, theirs["calls"]
        assert ours["calls"] == theirs["calls"], (r, ours["calls"], theirs["calls"])
        assert len(ours["steps"][0]["loss"]) == 2  # the output is a TwoTensor: both halves were gathered
        assert not torch.equal(*ours["steps"][0]["loss"])


def test_a_twotensor_model_with_the_pair_trains_bitwise_as_torchs_and_calls_the_hooks_as_often(results):
    _assert_trains_as_torchs(results)


@pytest.mark.parametrize("how", HOWS)
def test_the_pair_trains_bitwise_as_torchs_in_bf16_with_accumulation_and_a_weight_frozen_after_sharding(results, how):
    _assert_trains_as_torchs(results, how)


def test_a_twotensor_model_without_the_pair_trains_bitwise_as_torchs(results):
    for r, got in enumerate(results):
        _assert_same(got["ours"]["plain"], got["torch"]["plain"], f"rank {r}")
        assert len(got["ours"]["plain"][0]["shards"]["0.weight"]) == 2  # the shard is a TwoTensor, as torch's


def test_a_post_hook_of_a_wrong_shape_is_refused_in_one_line_naming_the_parameter(results):
    for r, got in enumerate(results):
        wrong = got["ours"]["wrong shape"]
        assert wrong == ("ValueError: 0.weight: fsdp_post_all_gather returned a tensor of shape (15, 8), not the "
                         "parameter's (16, 8): return the all-gathered parameter"), (r, wrong)


def test_inputs_of_an_uneven_shard_not_padded_are_refused_in_one_line_on_every_rank(results):
    for r, got in enumerate(results):
        unpadded = got["ours"]["unpadded"]
        assert unpadded.startswith("UnitMismatch: 2.weight: "), (r, unpadded)
        assert "fsdp_pre_all_gather returned inputs of its shard's size on rank(s) 1," in unpadded, (r, unpadded)
        assert "\n" not in unpadded


def test_the_pair_on_a_parameter_sharded_past_dim_0_is_refused_in_one_line(results):
    for r, got in enumerate(results):
        assert got["ours"]["dim 1"] == ("NotImplementedError: 0.weight: fsdp_pre_all_gather/fsdp_post_all_gather on a "
                                        "parameter sharded on dim 1: shard it on dim 0"), (r, got["ours"]["dim 1"])


def test_a_pre_hook_that_raises_on_one_rank_is_named_in_one_line_on_every_rank(results):
    for r, got in enumerate(results):
        assert got["ours"]["pre raised"] == ("UnitMismatch: 0.weight: fsdp_pre_all_gather failed on rank(s) 1"
                                             + (" (RuntimeError: the pre-hook broke)" if r == 1 else "")), \
            (r, got["ours"]["pre raised"])


@pytest.mark.soak
def test_the_pair_trains_as_torchs_on_a_2x2_hsdp_mesh():
    _assert_trains_as_torchs(launch(_job, 4, args=((2, 2),), timeout=600.0))
