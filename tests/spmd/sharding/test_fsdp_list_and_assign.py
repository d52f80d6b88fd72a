"""`fully_shard` of a list of modules (torchtitan's `[norm, output]`), and a meta-device model resumed by
`load_state_dict(..., assign=True)` (pytorch/examples' FSDP2 script): torch's FSDP2 is the control.

One spawned run at 2 ranks holds both, each with our `fully_shard` and with torch's; the assertions run here.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from manualdp.spmd import launch, shard
from manualdp.spmd.sharding.fsdp import FSDPModule, fully_shard

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}
VOCAB, DIM = 11, 6


class Titan(nn.Module):
    """torchtitan's shape: an embedding, two blocks, a norm and an output head (7 rows: uneven shards)."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.output(self.norm(h))


def _apply_fsdp(shard_fn, model, modules=None, **kwargs):
    """torchtitan's `apply_fsdp`: each block, then `[norm, output]` (or `modules`) as one unit, then the root."""
    for layer in model.layers:
        shard_fn(layer, **kwargs)
    returned = shard_fn(modules if modules is not None else [model.norm, model.output], **kwargs)
    shard_fn(model, **kwargs)
    return returned


def _batch(rank, n, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (4, 5), generator=g)
    return shard(x, x, rank, n)[0]


def _steps(model, opt, rank, n, first, count):
    """`count` steps from `first`: the loss of each (this rank's)."""
    losses = []
    for step in range(first, first + count):
        x = _batch(rank, n, step)
        loss = nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full(model):
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _list_unit(shard_fn, rank, n):
    """A list of modules as one unit: what `fully_shard` returns, the classes, the shards between steps, training."""
    torch.manual_seed(0)
    model = Titan()
    modules = [model.norm, model.output]
    returned = _apply_fsdp(shard_fn, model, modules, reshard_after_forward=True)
    model(_batch(rank, n, 0))  # a forward without backward: the list's unit frees its modules' parameters
    held = {k: isinstance(v, DTensor) for k, v in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = _steps(model, opt, rank, n, 0, 3)
    return {"returned is the list": returned is modules, "returned": type(returned).__name__,
            "classes": [isinstance(m, TorchFSDPModule) for m in modules],
            "ours": [isinstance(m, FSDPModule) for m in modules],
            "held": held, "losses": losses, "full": _full(model)}


def _meta_model(shard_fn):
    with torch.device("meta"):
        model = Titan()
    for layer in model.layers:  # pytorch/examples' order: each block, then the root
        shard_fn(layer)
    return shard_fn(model)


def _assign_resume(shard_fn, rank, n):
    """pytorch/examples' resume: a full state dict cut into DTensors by `distribute_tensor`, loaded with
    `assign=True` into a sharded model that never left the meta device; then training goes on."""
    torch.manual_seed(0)
    model = _meta_model(shard_fn)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():  # a full value drawn alike on every rank, then this rank's rows
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(model, opt, rank, n, 0, 2)
    saved = _full(model)
    uninterrupted = _steps(model, opt, rank, n, 2, 2)
    resumed = _meta_model(shard_fn)
    meta = resumed.state_dict()
    sharded = {k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
               for k, v in saved.items()}
    resumed.load_state_dict(sharded, strict=False, assign=True)  # "we cannot call copy_ on meta tensors"
    devices = sorted({p.device.type for p in resumed.parameters()})
    again = _steps(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), rank, n, 2, 2)
    want = _full(model)
    return {"uninterrupted": uninterrupted, "resumed": again, "devices": devices,
            "same": all(torch.equal(v, want[k]) for k, v in _full(resumed).items())}


def _assign_other_mesh(rank, n):
    """DTensors of a (1, 2) mesh (the same local rows) assigned into a model sharded on a 1-D mesh of 2."""
    model = _meta_model(fully_shard)
    other = init_device_mesh("cpu", (1, n), mesh_dim_names=("replicate", "shard"))
    full = Titan().state_dict()
    state = {k: nn.Parameter(distribute_tensor(v, other, [Replicate(), Shard(0)])) for k, v in full.items()}
    return _case(model.load_state_dict, state, True, True)


def _case(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the parent asserts on the message
        return f"{type(e).__name__}: {e}"


def _lists_apart(rank):
    """Rank 1 leaves the norm out of the list: every rank raises, naming the field, before anything changes."""
    model = Titan()
    return _case(fully_shard, [model.norm, model.output] if rank == 0 else [model.output])


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {name: {"list": _case(_list_unit, fn, rank, n), "assign": _case(_assign_resume, fn, rank, n)}
           for name, fn in SHARD_FNS.items()}
    out["apart"] = _lists_apart(rank)
    out["other mesh"] = _assign_other_mesh(rank, n)
    return out


@pytest.fixture(scope="module")
def results():
    """Both cases, ours and torch's, in one spawned run (starting ranks costs more than these steps)."""
    return launch(_job, 2, timeout=240.0)


def test_a_list_of_modules_is_one_unit_as_torchs_bitwise(results):
    for r, got in enumerate(results):
        ours, theirs = got["ours"]["list"], got["torch"]["list"]
        assert isinstance(ours, dict), ours
        assert ours["returned is the list"] and theirs["returned is the list"]
        assert ours["classes"] == ours["ours"] == theirs["classes"] == [True, True]
        assert ours["held"] == theirs["held"] and all(ours["held"].values()), "shards between forward and backward"
        assert ours["losses"] == theirs["losses"], f"rank {r}"
        assert list(ours["full"]) == list(theirs["full"])
        for k, v in theirs["full"].items():
            assert torch.equal(ours["full"][k], v), f"rank {r} {k}"
        assert len(set(ours["losses"])) > 1, "it trains"


def test_a_meta_model_resumes_by_load_state_dict_with_assign_as_torchs(results):
    for r, got in enumerate(results):
        for impl in ("ours", "torch"):
            run = got[impl]["assign"]
            assert isinstance(run, dict), f"{impl}: {run}"
            assert run["devices"] == ["cpu"], impl
            assert run["resumed"] == run["uninterrupted"] and run["same"], f"rank {r} {impl}: resume bitwise"
        assert got["ours"]["assign"]["resumed"] == got["torch"]["assign"]["resumed"]


def test_a_bad_list_of_modules_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"module must be an nn.Module or a non-empty list of them, got \[\]"):
        fully_shard([])
    with pytest.raises(TypeError, match=r"got \[Linear, int\]"):
        fully_shard([nn.Linear(2, 2), 3])


def test_ranks_that_shard_other_lists_all_raise_naming_the_field(results):
    for r, got in enumerate(results):
        assert isinstance(got["apart"], str) and "differs across ranks" in got["apart"], f"rank {r}: {got['apart']}"
        assert "fully_shard([LayerNorm, Linear])" in got["apart"] or "fully_shard(Linear)" in got["apart"]


def test_dtensors_of_another_mesh_assigned_are_refused_naming_both_meshes(results):
    """Same local rows on a (1, 2) mesh: refused at load_state_dict, not at the optimizer's step three lines deep."""
    for r, got in enumerate(results):
        line = got["other mesh"]
        head = "ValueError: load_state_dict: tok_embeddings.weight is a DTensor on DeviceMesh((replicate=1, shard=2)"
        assert isinstance(line, str) and line.startswith(head), f"rank {r}: {line}"
        assert "the model shards it on DeviceMesh((2,)" in line and "\n" not in line, f"rank {r}: {line}"
