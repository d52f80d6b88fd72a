"""A load that torch's own loader refuses changes nothing, and is refused in one line (issue 43).

Before: torch's loader wrote the keys walked before the bad one and then raised (a half-loaded model). Each row is
the adversary's: a meta, a sparse or a DTensor value for a plain parameter, an unexpected `num_batches_tracked` key,
an old BatchNorm state without one under `_metadata` version 2, a missing or unexpected `_extra_state`, a user's
load pre-hook that raises on the last submodule. On the drop-in and on a rung, on both ranks, each is refused in one
line (`check_loadable`; the hook's own error for the hook, which `unchanged_if_refused` undoes), every parameter,
buffer and extra state is bitwise what it was; a load torch accepts still loads what torch's loader does.
"""
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import BucketedDDP, launch
from manualdp.spmd.ladder.loading import unchanged_if_refused


class _Extra(nn.Module):
    """A parameter and an extra state (a counter), as a module that saves more than tensors."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.count = 5

    def get_extra_state(self):
        return {"count": self.count}

    def set_extra_state(self, state):
        self.count = state["count"]

    def forward(self, x):
        return x * self.w.sum()


def _refusing(module, *args):
    raise RuntimeError("the user's pre-hook refuses")


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bn":
        return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    if kind == "extra":
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), _Extra())
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    if kind == "hook":
        net[1].register_load_state_dict_pre_hook(_refusing)
    return net


def _plus(state) -> OrderedDict:
    """Every floating tensor one larger (the first layer's keys come first, so torch's loader writes them first)."""
    out = OrderedDict((k, v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                      for k, v in state.items())
    out._metadata = state._metadata
    return out


def _rows():
    """name -> (model kind, the state dict made from the wrapper's own)."""
    def dtensor(s):
        from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return {**_plus(s), "module.1.bias": DTensor.from_local(torch.zeros(2), mesh, [Replicate()])}

    def without(key, version=None):
        def made(s):
            out = _plus(s)
            del out[key]
            if version is not None:
                out._metadata["module.1"]["version"] = version
            return out
        return made

    return {"A1 meta": ("plain", lambda s: {**_plus(s), "module.1.bias": torch.empty(2, device="meta")}),
            "A2 sparse": ("plain", lambda s: {**_plus(s), "module.1.bias": torch.zeros(2).to_sparse()}),
            "A3 dtensor": ("plain", dtensor),
            "A6 num_batches_tracked": ("plain", lambda s: {**_plus(s),
                                                           "module.9.num_batches_tracked": torch.tensor(1)}),
            "A7 bn v2": ("bn", without("module.1.num_batches_tracked", version=2)),
            "A9 extra missing": ("extra", without("module.2._extra_state")),
            "A10 extra unexpected": ("plain", lambda s: {**_plus(s), "module.1._extra_state": {"count": 1}}),
            "A11 pre-hook": ("hook", _plus)}


def _snapshot(model: nn.Module) -> list:
    kept = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    return kept + [m.count for m in model.modules() if isinstance(m, _Extra)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


def _job():
    torch.set_num_threads(1)
    out = {}
    for wrapper in (DistributedDataParallel, BucketedDDP):
        for row, (kind, made) in _rows().items():
            model = wrapper(_net(kind), timeout=20)
            state = made(model.state_dict())
            before = _snapshot(model)
            try:
                model.load_state_dict(state)
                said = None
            except RuntimeError as e:
                said = str(e)
            out[f"{wrapper.__name__} {row}"] = (said, _same(before, _snapshot(model)))
        model = wrapper(_net("extra"), timeout=20)  # a load torch accepts: loaded as torch's loader loads it
        state = _plus(model.state_dict())
        state["module.2._extra_state"] = {"count": 9}
        model.load_state_dict(state)
        reference = _net("extra")
        reference.load_state_dict(OrderedDict((k[len("module."):], v) for k, v in state.items()))
        out[f"{wrapper.__name__} accepted"] = _same(_snapshot(reference), _snapshot(model.module))
    return out


def test_a_load_torch_refuses_changes_nothing_on_the_wrappers():
    for rank, out in enumerate(launch(_job, 2, timeout=240)):
        assert len(out) == 2 * (len(_rows()) + 1), sorted(out)
        for case, value in out.items():
            if case.endswith("accepted"):
                assert value, (rank, case)
            else:
                said, unchanged = value
                assert said is not None and unchanged, (rank, case, said, unchanged)
                assert "\n" not in said, (rank, case, said)  # one line: ours, or the user's hook's own
                assert case.endswith("pre-hook") or ("module.1." in said or "module.2." in said or
                                                     "module.9." in said) and "nothing was loaded" in said, said
        assert "module.1.bias is on the meta device" in out["DistributedDataParallel A1 meta"][0]
        assert "module.1.bias is a torch.sparse_coo tensor" in out["BucketedDDP A2 sparse"][0]
        assert "module.1.bias is a DTensor and the model holds a plain tensor" in out["BucketedDDP A3 dtensor"][0]
        assert "unexpected key(s) module.9.num_batches_tracked;" in out["BucketedDDP A6 num_batches_tracked"][0]
        assert "missing key(s) module.1.num_batches_tracked;" in out["DistributedDataParallel A7 bn v2"][0]
        assert "missing key(s) module.2._extra_state;" in out["DistributedDataParallel A9 extra missing"][0]
        assert "unexpected key(s) module.1._extra_state;" in out["BucketedDDP A10 extra unexpected"][0]


def test_unchanged_if_refused_puts_back_data_objects_and_extra_state_bitwise():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), _Extra())
    weight, before = model[0].weight, _snapshot(model)
    storage = weight.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="late"):
        with unchanged_if_refused(model, objects=True):
            with torch.no_grad():
                weight.add_(1)
                model[1].running_mean.fill_(float("nan"))
            model[0].weight = nn.Parameter(torch.zeros(2, 3))  # as a load with assign=True puts a new one
            model[2].count = 7
            raise ValueError("refused late")
    assert model[0].weight is weight and weight.untyped_storage().data_ptr() == storage
    assert _same(before, _snapshot(model))


def test_unchanged_if_refused_leaves_a_load_that_succeeds_alone():
    model = nn.Linear(2, 2)
    with unchanged_if_refused(model):
        with torch.no_grad():
            model.weight.fill_(3.0)
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 3.0))


def test_unchanged_if_refused_names_a_bad_argument():
    with pytest.raises(TypeError, match="module must be an nn.Module, got dict"):
        with unchanged_if_refused({}):
            pass
    with pytest.raises(TypeError, match="objects must be a bool, got 1"):
        with unchanged_if_refused(nn.Linear(1, 1), objects=1):
            pass
    with pytest.raises(TypeError, match="kept must be callable, got int"):
        with unchanged_if_refused(nn.Linear(1, 1), kept=3):
            pass


class _SavesOnly(nn.Linear):
    """Saves an extra state but takes none back (no `set_extra_state`): nothing of it to put back."""

    def get_extra_state(self):
        return {"note": 1}


def test_a_module_that_only_saves_an_extra_state_gets_the_loads_own_error_back():
    model = _SavesOnly(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="refused"):
        with unchanged_if_refused(model):
            with torch.no_grad():
                model.weight.add_(1)
            raise ValueError("refused")
    assert torch.equal(model.weight.detach(), before)
