"""`fully_shard` over tensor parallelism (FSDP + TP on a (dp, tp) = (2, 2) mesh), beside torch's FSDP2 and one process.

One spawned run at 4 ranks: each case runs with our `fully_shard` and with torch's on the same script (only the
function differs), and the parent compares them, and the training with one process on the whole batch:
- an MLP whose first layer is `ColwiseParallel`, its second `RowwiseParallel` and its head plain (10 rows: tp's
  pieces of 5 are cut 3 and 2 over dp) trains 3 steps of Adam, with `clip_grad_norm_`: bitwise torch's (parameters,
  losses, norms), and the one-process model's to float32 rounding (tp cuts the matmuls' sums otherwise);
- two micro-batches a step with gradient sync off for the first, units kept gathered: bitwise torch's;
- the placements of the parameters, their gradients and `state_dict()` are torch's: `(_StridedShard(0, 2),
  Shard(0))` where tp cuts dim 0 too, `(Shard(0), Shard(1))`, `(Shard(0), Replicate())`, the plain head `(Shard(0),)`
  on the dp mesh;
- `state_dict()` gives the whole model by `full_tensor()`, `load_state_dict` of such a state dict loads, and
  `get_model_state_dict` / `set_model_state_dict` (full) round-trip into a model sharded afresh;
- a model built on the meta device, parallelised, sharded, `to_empty` and `reset_parameters()`, starts where
  torch's does and trains; with our `init_full` it starts where one process does;
- what is not supported (HSDP over tp, a tp mesh from another root, `shard_placement_fn` off dim 0, a lower
  `param_dtype`, a model sharded by torch's `fully_shard` first) is one line, alike on every rank; dp ranks of which
  one forgot `parallelize_module` are named in one line on every rank (the placements are a field of the agreement).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard, init_full

from .test_fsdp_like_torch import _case, _full

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}
# the norm sees its tp rank's piece of the sequence (its weight's gradient is Partial over tp, summed before dp's
# reduce-scatter), in_proj gathers the sequence and cuts its output columns, out_proj sums them back
PLAN = {"norm": SequenceParallel(), "in_proj": ColwiseParallel(input_layouts=Shard(1)), "out_proj": RowwiseParallel()}
STEPS, BATCH, SEQ = 3, 8, 4


class Net(nn.Module):
    """A norm, in_proj (10 rows: 5 per tp rank, cut 3 and 2 over dp), out_proj, and a head tensor parallelism leaves
    plain."""

    def __init__(self, hidden: int = 10):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.in_proj = nn.Linear(4, hidden)
        self.out_proj = nn.Linear(hidden, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.out_proj(torch.relu(self.in_proj(self.norm(x))))))


def _net(hidden: int = 10):
    torch.manual_seed(0)
    return Net(hidden)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, SEQ, 4, generator=g) for _ in range(STEPS)]


def _mine(X, mesh):
    """This rank's input: its dp rank's half of the batch, its tp rank's half of the sequence."""
    return X.chunk(2)[mesh["dp"].get_local_rank()].chunk(2, dim=1)[mesh["tp"].get_local_rank()]


def _where(t):
    """(mesh dim names, placements) of a DTensor."""
    return (t.device_mesh.mesh_dim_names, tuple(t.placements))


def _sharded(shard_fn, mesh, model=None, **kwargs):
    model = model if model is not None else _net()
    parallelize_module(model, mesh["tp"], PLAN)
    shard_fn(model.in_proj, mesh=mesh["dp"], **kwargs)
    shard_fn(model.out_proj, mesh=mesh["dp"], **kwargs)
    shard_fn(model, mesh=mesh["dp"], **kwargs)
    return model


def _tp_params(model):
    """The parameters on the 2-D mesh (torch's clip_grad_norm_ cannot stack norms from two meshes, nor can torch's
    FSDP2's): the head's, on the dp mesh, are left out."""
    return [p for n, p in model.named_parameters() if not n.startswith("head")]


def _train(shard_fn, mesh, **kwargs):
    """Adam for STEPS steps with clip_grad_norm_: each dp rank its half of the batch, the tp ranks alike."""
    model = _sharded(shard_fn, mesh, **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    out = {"losses": [], "norms": [], "grads": {}}
    for X in _batches():
        loss = model(_mine(X, mesh)).pow(2).mean()
        loss.backward()
        out["grads"] = {n: _where(p.grad) for n, p in model.named_parameters()}
        out.setdefault("first grads", {n: _full(p.grad) for n, p in model.named_parameters()})
        out["norms"].append(torch.nn.utils.clip_grad_norm_(_tp_params(model), 0.5).full_tensor().item())
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _where(p) for n, p in model.named_parameters()}
    out["state_dict"] = {k: _where(v) for k, v in model.state_dict().items()}
    out["full"] = {n: _full(p) for n, p in model.named_parameters()}
    out["sizes"] = {n: (tuple(p.size()), p.stride()) for n, p in model.named_parameters()}
    return out


def _accumulate(shard_fn, mesh):
    """Two micro-batches a step, gradient sync off for the first (the gathered DTensors' gradients add up), units
    kept gathered after forward: two steps of Adam."""
    model = _sharded(shard_fn, mesh)
    model.set_reshard_after_forward(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    grads = []
    for X in _batches()[:2]:
        for k, micro in enumerate(_mine(X, mesh).chunk(2)):
            model.set_requires_gradient_sync(k == 1)
            model(micro).pow(2).mean().backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "full": {n: _full(p) for n, p in model.named_parameters()}}


def _one_process():
    """The same training in one process, on the whole batch: the reference."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    norms, first = [], None
    for X in _batches():
        model(X).pow(2).mean().backward()
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(_tp_params(model), 0.5).item())
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "first grads": first, "full": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _state_dicts(shard_fn, mesh):
    """state_dict's full tensors; a load of it doubled; get/set_model_state_dict (full) into a fresh model (8 rows:
    torch's distribute_tensor cannot cut an uneven `_StridedShard`, for torch's FSDP2 neither)."""
    model = _sharded(shard_fn, mesh, model=_net(8))
    sd = model.state_dict()
    out = {"full": {k: _full(v) for k, v in sd.items()}}
    model.load_state_dict({k: v.detach() * 2 for k, v in sd.items()})
    out["doubled"] = {k: _full(v) for k, v in model.state_dict().items()}
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = _sharded(shard_fn, mesh, model=Net(8))  # other initial values
    set_model_state_dict(fresh, whole, options=StateDictOptions(full_state_dict=True))
    out["set"] = {k: _full(v) for k, v in fresh.state_dict().items()}
    return out


def _meta(shard_fn, mesh):
    """Built on meta, parallelised and sharded there, then to_empty and reset_parameters(); one step after."""
    with torch.device("meta"):
        model = _sharded(shard_fn, mesh, model=Net())
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    start = {n: _full(p) for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model(_mine(_batches()[0], mesh)).pow(2).mean().backward()
    opt.step()
    return {"start": start, "after": {n: _full(p) for n, p in model.named_parameters()}}


def _init_full(mesh):
    """Ours: built on meta, then `init_full` runs reset_parameters() on the whole parameters: one process's values."""
    with torch.device("meta"):
        model = _sharded(fully_shard, mesh, model=Net())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    init_full(model, lambda m: [s.reset_parameters() for s in m.modules() if hasattr(s, "reset_parameters")])
    return {n: _full(p) for n, p in model.named_parameters()}


def _refused(fn):
    try:
        fn()
    except (ValueError, NotImplementedError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "taken"


def _refusals(mesh):
    cube = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
    world = init_device_mesh("cpu", (4,))

    def hsdp():
        fully_shard(parallelize_module(_net(), cube["tp"], PLAN), mesh=cube["rep", "shard"])

    def other_root():
        fully_shard(parallelize_module(_net(), mesh["tp"], PLAN), mesh=world)

    def dim_1():
        fully_shard(parallelize_module(_net(), mesh["tp"], PLAN), mesh=mesh["dp"],
                    shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None)

    def bf16():
        fully_shard(parallelize_module(_net(), mesh["tp"], PLAN), mesh=mesh["dp"],
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    def torchs_first():
        model = _net()
        torch_fully_shard(model, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    def dp_ranks_apart():  # dp rank 1 forgot parallelize_module: its parameters are plain, dp rank 0's DTensors
        model = _net()
        if mesh["dp"].get_local_rank() == 0:
            parallelize_module(model, mesh["tp"], PLAN)
        fully_shard(model, mesh=mesh["dp"])

    return {name: _refused(fn) for name, fn in (("hsdp", hsdp), ("other root", other_root), ("dim 1", dim_1),
                                                ("bf16", bf16), ("torch's first", torchs_first),
                                                ("dp ranks apart", dp_ranks_apart))}


def _own_dtype_policy(shard_fn, mesh):
    """A policy that names the parameters' own dtype changes nothing: trained as without one."""
    return _train(shard_fn, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))


def _job():
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {impl: {case: _case(fn, shard_fn, mesh) for case, fn in
                  (("train", _train), ("accumulate", _accumulate), ("state dicts", _state_dicts), ("meta", _meta),
                   ("own dtype policy", _own_dtype_policy))}
           for impl, shard_fn in SHARD_FNS.items()}
    out["one process"] = _one_process()
    out["init_full"] = _case(_init_full, mesh)
    out["refused"] = _case(_refusals, mesh)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 4, timeout=600.0)


def _answer(got, case):
    assert "raised" not in got, (case, got)
    return got


def _same(a: dict, b: dict, what: str, exact: bool = True):
    assert list(a) == list(b), what
    for k in a:
        ok = torch.equal(a[k], b[k]) if exact else torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
        assert ok, f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item()}"


@pytest.mark.soak
def test_fsdp_tp_trains_bitwise_as_torchs_and_as_one_process_to_float32_rounding(results):
    for r, got in enumerate(results):
        ours, theirs = _answer(got["ours"]["train"], "ours"), _answer(got["torch"]["train"], "torch")
        assert ours["losses"] == theirs["losses"] and ours["norms"] == theirs["norms"], f"rank {r}"
        _same(ours["full"], theirs["full"], f"rank {r} against torch's")
        # Adam's first steps hardly see a gradient's scale: the gradients themselves are compared too
        _same(ours["first grads"], theirs["first grads"], f"rank {r} gradients against torch's")
        _same(ours["first grads"], got["one process"]["first grads"], f"rank {r} gradients against one process",
              exact=False)
        _same(ours["full"], got["one process"]["full"], f"rank {r} against one process", exact=False)
        assert ours["norms"] == pytest.approx(got["one process"]["norms"], rel=1e-5)
        whole = {n: (tuple(p.size()), p.stride()) for n, p in _net().named_parameters()}
        assert ours["sizes"] == theirs["sizes"] == whole, "global size() and stride()"
    assert results[0]["ours"]["train"]["losses"] != results[2]["ours"]["train"]["losses"], "dp ranks see other data"


@pytest.mark.soak
def test_fsdp_tp_gradient_accumulation_without_resharding_equals_torchs_bitwise(results):
    for r, got in enumerate(results):
        ours, theirs = _answer(got["ours"]["accumulate"], "ours"), _answer(got["torch"]["accumulate"], "torch")
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
            _same(a, b, f"rank {r} step {step} gradients")
        _same(ours["full"], theirs["full"], f"rank {r} parameters")


@pytest.mark.soak
def test_fsdp_tp_placements_of_params_grads_and_state_dict_are_torchs(results):
    two_d = ("dp", "tp")
    expected = {"norm.weight": (two_d, (Shard(0), Replicate())), "norm.bias": (two_d, (Shard(0), Replicate())),
                "in_proj.weight": (two_d, (_StridedShard(0, split_factor=2), Shard(0))),
                "in_proj.bias": (two_d, (_StridedShard(0, split_factor=2), Shard(0))),
                "out_proj.weight": (two_d, (Shard(0), Shard(1))), "out_proj.bias": (two_d, (Shard(0), Replicate())),
                "head.weight": (("dp",), (Shard(0),)), "head.bias": (("dp",), (Shard(0),))}
    for got in results:
        ours, theirs = got["ours"]["train"], got["torch"]["train"]
        for what in ("params", "grads", "state_dict"):
            assert ours[what] == theirs[what] == expected, what


@pytest.mark.soak
def test_fsdp_tp_state_dict_full_tensors_load_and_dcp_round_trip(results):
    whole = _net(8).state_dict()
    for r, got in enumerate(results):
        ours = _answer(got["ours"]["state dicts"], "ours")
        _same(ours["full"], whole, f"rank {r} full_tensor()")
        _same(ours["doubled"], {k: v * 2 for k, v in whole.items()}, f"rank {r} load_state_dict")
        _same(ours["set"], ours["doubled"], f"rank {r} set_model_state_dict")
        _same(ours["doubled"], got["torch"]["state dicts"]["doubled"], f"rank {r} against torch's")


@pytest.mark.soak
def test_fsdp_tp_on_meta_initialises_as_torchs_and_trains(results):
    for r, got in enumerate(results):
        ours, theirs = _answer(got["ours"]["meta"], "ours"), _answer(got["torch"]["meta"], "torch")
        _same(ours["start"], theirs["start"], f"rank {r} start")
        _same(ours["after"], theirs["after"], f"rank {r} after a step")
        assert all(not torch.equal(ours["start"][k], ours["after"][k]) for k in ours["start"]), "it trains"
        _same(_answer(got["init_full"], "init_full"), dict(_net().named_parameters()), f"rank {r} init_full")


@pytest.mark.soak
def test_fsdp_tp_unsupported_is_one_line_alike_on_every_rank(results):
    refused = [got["refused"] for got in results]
    for got in refused:
        apart = got.pop("dp ranks apart")
        assert apart.startswith("ValueError") and "in_proj.weight" in apart and "Shard(dim=0)" in apart, apart
        assert "\n" not in apart, apart
        assert set(got) == {"hsdp", "other root", "dim 1", "bf16", "torch's first"}, got
        for name, line in got.items():
            assert line != "taken" and "\n" not in line and "tensor parallelism" in line, (name, line)
        assert got["hsdp"].startswith("NotImplementedError") and "HSDP" in got["hsdp"]
        assert "sibling" in got["other root"] and "Shard(1)" in got["dim 1"] and "param_dtype" in got["bf16"]
        assert "by torch's fully_shard" in got["torch's first"], got["torch's first"]
    assert all(got == refused[0] for got in refused), "every rank says the same"


@pytest.mark.soak
def test_fsdp_tp_takes_a_mixed_precision_policy_of_the_parameters_own_dtype_as_torchs(results):
    for r, got in enumerate(results):
        ours = _answer(got["ours"]["own dtype policy"], "ours")
        theirs = _answer(got["torch"]["own dtype policy"], "torch")
        assert ours["losses"] == theirs["losses"] == got["ours"]["train"]["losses"], f"rank {r}"
        _same(ours["full"], theirs["full"], f"rank {r} against torch's")
