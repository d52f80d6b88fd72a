"""Behaviours that pytorch's FSDP2 all-gather-extension and init tests check, as our own tests.

One spawned run at 2 ranks: each case runs with our `fully_shard` and with torch's on the same model, data and
ranks, and the parent compares them.
- `fsdp_pre_all_gather`/`fsdp_post_all_gather` set on a shard's local tensor: both call them (ours: `fsdp_ext.py`;
  was: never called, no word; then refused).
- a root parameter replaced after `fully_shard` by a new `nn.Parameter` (an init that assigns it), a DTensor
  placed as its shard or a plain tensor of its shape: taken up at the first forward (a plain one sharded from it),
  and the output and gradients are torch's (was: "... is on the meta device"; torch's crashes on a plain one);
  one of another shape is refused in one line naming it.
- a parameter left on the meta device at the first forward: the same words as torch's, in one line.
"""
import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard

from .test_fsdp_like_torch import _case, _full

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _raised(fn):
    """What `fn()` raised, as 'Type: message', or 'nothing'."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent, whose assertion names it
        return f"{type(e).__name__}: {e}"
    return "nothing"


def _extension(shard_fn):
    """A pre-all-gather hook on every weight's local tensor, then one forward: whether it ran, and what raised."""
    calls = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(1)
        return (self,), None

    def post(self, outs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outs[0], (outs[0],))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    for layer in model:
        shard_fn(layer)
    shard_fn(model)
    for p in model.parameters():
        p._local_tensor.fsdp_pre_all_gather = pre.__get__(p._local_tensor)
        p._local_tensor.fsdp_post_all_gather = post.__get__(p._local_tensor)
    raised = _raised(lambda: model(torch.randn(2, 8)))
    return {"called": bool(calls), "raised": raised}


class _Normed(nn.Module):
    """Two linear layers and a root parameter that an init method replaces (pytorch's weight-norm case)."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return self.layer2(self.layer1(x)).sum(dim=1) * self.weight_norm


def _replaced_root_param(shard_fn, rows, plain=False):
    """Build on meta, shard, materialise the layers, assign a new `weight_norm`, the row norms of their weights as
    pytorch's test does (a DTensor shard), or (`plain`) as a plain tensor of `rows`; forward and backward."""
    with torch.device("meta"):
        model = _Normed()
    for m in (model.layer1, model.layer2, model):
        shard_fn(m)
    for i, m in enumerate((model.layer1, model.layer2)):
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.weight.fill_(0.5 - 0.75 * i)
    with torch.no_grad():
        if plain:  # each row's norm of the full weights, whose rows are all alike
            wn = torch.full((rows,), 0.5 * 3 ** 0.5) + torch.full((rows,), 0.25 * 3 ** 0.5)
        else:
            wn = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
    model.weight_norm = nn.Parameter(wn)
    try:
        torch.manual_seed(1)
        out = model(torch.randn(3, 3))
        out.pow(2).sum().backward()
    except Exception as e:  # noqa: BLE001
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"out": out.detach(), "sharded": isinstance(model.weight_norm, DTensor),
            **{name: _full(p.grad) for name, p in model.named_parameters()}}


def _left_on_meta(shard_fn):
    """Shard on meta and run forward without materialising: what it raises."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 8))
    for m in (model[0], model[1], model):
        shard_fn(m)
    return _raised(lambda: model(torch.randn(4, 8)))


def _job():
    out = {}
    for name, fn in SHARD_FNS.items():
        out[name] = {"extension": _case(_extension, fn), "replaced": _case(_replaced_root_param, fn, 3),
                     "meta": _left_on_meta(fn)}
    out["ours"]["replaced_plain"] = _case(_replaced_root_param, fully_shard, 3, True)
    out["ours"]["replaced_other_shape"] = _case(_replaced_root_param, fully_shard, 4, True)
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240.0)


def test_all_gather_extension_hooks_are_called_as_torchs_calls_them(results):
    for r, got in enumerate(results):
        assert got["torch"]["extension"] == {"called": True, "raised": "nothing"}, got["torch"]["extension"]
        assert got["ours"]["extension"] == got["torch"]["extension"], (r, got["ours"]["extension"])


def test_a_root_parameter_replaced_after_fully_shard_is_taken_up_at_the_first_forward_as_torchs(results):
    for r, got in enumerate(results):
        theirs = got["torch"]["replaced"]
        assert "raised" not in theirs, theirs
        for form in ("replaced", "replaced_plain"):  # torch's crashes on a plain one (no `_local_tensor`)
            ours = got["ours"][form]
            assert "raised" not in ours, (r, form, ours)
            assert ours["sharded"] and theirs["sharded"]
            for key in set(theirs) - {"sharded"}:
                assert torch.allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-6), (r, form, key, ours[key])
            assert ours["weight_norm"].abs().sum() > 0  # the new parameter trains


def test_a_root_parameter_replaced_by_another_shape_is_refused_in_one_line_naming_it(results):
    for r, got in enumerate(results):
        raised = got["ours"]["replaced_other_shape"].get("raised", "")
        expected = "ValueError: weight_norm was replaced after fully_shard by a Parameter of shape (4,)"
        assert raised.startswith(expected), (r, raised)
        assert "\n" not in raised


def test_a_parameter_left_on_the_meta_device_is_named_in_torchs_words(results):
    expected = ("FSDP parameters should be materialized from meta device before training, but the following were "
                "still on meta device: ['0.0.weight', '0.0.bias', '0.1.weight', '0.1.bias']")
    for r, got in enumerate(results):
        theirs, ours = got["torch"]["meta"], got["ours"]["meta"]
        assert theirs.startswith("RuntimeError: " + expected), theirs
        assert ours.startswith("RuntimeError: " + expected), (r, ours)
        assert re.search(r"\['0\.0\.weight'", ours) and "\n" not in ours
