"""A `load_state_dict` that a drop-in refuses changes nothing: every parameter and every piece of optimizer state is
bitwise what it was before the call (before: the submodules walked first were loaded, then the refusal came)."""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard
from manualdp.spmd import BucketedDDP, launch


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _values(tensors):
    return [(t.to_local() if hasattr(t, "to_local") else t).detach().clone() for t in tensors]


def _refused(load, tensors):
    """What `load()` raised (one line), and whether every tensor is bitwise as before."""
    before = _values(tensors)
    try:
        load()
        said = None
    except (RuntimeError, ValueError) as e:
        said = f"{type(e).__name__}: {e}"
    return said, all(torch.equal(a, b) for a, b in zip(before, _values(tensors)))


def _job():
    torch.set_num_threads(1)
    out = {}
    model = DistributedDataParallel(_net(), timeout=20)
    good = {k: v + 1 for k, v in model.state_dict().items()}  # the first layer's keys come first and would load
    resized = dict(good, **{"module.1.weight": torch.zeros(2, 5)})
    missing = {k: v for k, v in good.items() if k != "module.1.bias"}
    out["ddp resized"] = _refused(lambda: model.load_state_dict(resized), list(model.parameters()))
    out["ddp missing"] = _refused(lambda: model.load_state_dict(missing), list(model.parameters()))
    rung = BucketedDDP(_net(), timeout=20)  # a rung of the ladder, the same
    out["rung resized"] = _refused(lambda: rung.load_state_dict(resized), list(rung.parameters()))
    sharded = _net()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    state = {k: v * 2 for k, v in sharded.state_dict().items()}
    full = dict(state, **{"1.weight": torch.zeros(2, 3)})  # a full tensor where a shard sits: refused by layer 1
    out["fsdp full"] = _refused(lambda: sharded.load_state_dict(full), list(sharded.parameters()))
    net = _net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.1, timeout=20)
    net(torch.randn(2, 4)).sum().backward()
    for p in net.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    plain = torch.optim.Adam(_net().parameters(), lr=0.1)
    _net()(torch.randn(2, 4)).sum().backward()
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    plain.step()
    wrong = plain.state_dict()
    wrong["state"][3]["exp_avg"] = torch.zeros(5)  # the last parameter's: 2 elements
    state_tensors = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out["zero wrong size"] = _refused(lambda: opt.load_state_dict(wrong), state_tensors + list(net.parameters()))
    return out


def test_a_refused_load_state_dict_leaves_every_tensor_as_it_was():
    for rank, out in enumerate(launch(_job, 2, timeout=180)):
        for case, (said, unchanged) in out.items():
            assert said is not None and "\n" not in said, (case, said)
            assert unchanged, (rank, case, said)
        assert "size mismatch for module.1.weight: shape (2, 5) in the state dict, (2, 3) in the model" in \
            out["ddp resized"][0]
        assert "missing key(s) module.1.bias" in out["ddp missing"][0]
        assert out["rung resized"][0].startswith("RuntimeError: BucketedDDP: load_state_dict: size mismatch for "
                                                 "module.1.weight"), out["rung resized"]
        assert out["fsdp full"][0].startswith("ValueError: load_state_dict: 1.weight is a full tensor"), out


class _Renames(nn.Module):
    """A module that loads its keys its own way (an old name, taken in by its own loader)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "old" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "old")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_what_torch_loads_passes_the_check_first():
    from manualdp.spmd.ladder.loading import check_loadable
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), _Renames())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del state["1.num_batches_tracked"]  # an old BatchNorm's: its loader fills it in
    state["2.old"] = state.pop("2.weight") + 1
    check_loadable(model, state, True, "model")
    model.load_state_dict(state)  # torch agrees
    assert torch.equal(model[2].weight.detach(), torch.ones(2))
