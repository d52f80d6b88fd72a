"""`fully_shard` swapped into a real FSDP2 script: torch's own utilities on the sharded model give torch's numbers.

One script (`_script`) in the shape of pytorch/examples' FSDP2 example and torchtitan: blocks in an
`nn.ModuleList` each a unit, AdamW with parameter groups built by name (no decay on biases and
norms), two micro-batches a step with gradient sync off for the first, `clip_grad_norm_`, torch's
state-dict API. It runs with torch's `fully_shard` and with ours, at 2 and 3 ranks, and without
sharding in one process; the assertions run here, in the parent.
"""
import functools
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch, shard
from manualdp.spmd.sharding.fsdp import FSDPModule, fully_shard

STEPS, VOCAB, DIM = 3, 13, 6
FULL = StateDictOptions(full_state_dict=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM + 1)  # 13 rows: uneven at 2 and 3 ranks
        self.down = nn.Linear(2 * DIM + 1, DIM)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Net(nn.Module):
    def __init__(self, seed=0, blocks=3):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x, skip=()):
        h = self.embed(x)
        for k, block in enumerate(self.blocks):
            if k not in skip:
                h = block(h)
        return self.head(self.norm(h))


def _shard(model, shard_fn, **kwargs):
    for block in model.blocks:
        shard_fn(block, **kwargs)
    shard_fn(model, **kwargs)
    return model


def _optimizer(model):
    """AdamW with weight decay on matrices only, chosen by parameter name (as nanoGPT and torchtitan do)."""
    decay = [p for name, p in model.named_parameters() if name.endswith("weight") and "norm" not in name]
    rest = [p for name, p in model.named_parameters() if not (name.endswith("weight") and "norm" not in name)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=2e-2)


def _batches():
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(0, VOCAB, (6, 4), generator=g), torch.randint(0, VOCAB, (6, 4), generator=g))
             for _ in range(2)] for _ in range(STEPS)]


def _full(model, opt=None):
    state = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    if opt is not None:
        optim = get_optimizer_state_dict(model, opt, options=FULL)["state"]
        state.update({f"opt.{k}.{s}": v.clone() for k, st in optim.items() for s, v in st.items() if s != "step"})
    return state


def _train_steps(model, opt, rank, n, steps, *, skip=()):
    """Two micro-batches a step (no gradient sync on the first), clip at 0.5, step. Returns the clip norms."""
    norms = []
    for micro in steps:
        for i, (X, y) in enumerate(micro):
            if n:
                model.set_requires_gradient_sync(i == len(micro) - 1)
            Xs, ys = shard(X, y, rank, n) if n else (X, y)
            out = model(Xs, skip=skip)
            loss = nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), ys.reshape(-1), reduction="sum")
            (loss / (y.numel() * len(micro)) * (n or 1)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return norms


def _script(shard_fn, rank, n, *, mp=None, skip=()):
    """The FSDP2 script: build, shard, train, export the full state; n=0: no sharding, one process."""
    model = Net()
    if n:
        _shard(model, shard_fn, **({"mp_policy": mp} if mp else {}))
    opt = _optimizer(model)
    norms = _train_steps(model, opt, rank, n, _batches(), skip=skip)
    return {"norms": norms, "state": _full(model, opt) if n else _single_state(model, opt)}


def _single_state(model, opt):
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): i for i, p in enumerate(model.parameters())}
    for p, st in opt.state.items():
        state.update({f"opt.{list(model.state_dict())[names[id(p)]]}.{s}": v.clone()
                      for s, v in st.items() if s != "step"})
    return state


def _meta_script(shard_fn, rank, n):
    """pytorch/examples' order: build on the meta device, shard, `to_empty`, initialise, train."""
    with torch.device("meta"):
        model = Net()
    _shard(model, shard_fn)
    model.to_empty(device="cpu")
    torch.manual_seed(11)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    opt = _optimizer(model)
    norms = _train_steps(model, opt, rank, n, _batches()[:2])
    return {"norms": norms, "state": _full(model)}


def _checkpoint_save(folder):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _shard(Net(), fully_shard)
    opt = _optimizer(model)
    _train_steps(model, opt, rank, n, _batches()[:2])
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=folder)
    saved = _full(model, opt)
    _train_steps(model, opt, rank, n, _batches()[2:])
    return {"saved": saved, "after": _full(model)}


def _checkpoint_load(folder):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _shard(Net(seed=5), fully_shard)
    opt = _optimizer(model)
    for p in model.parameters():  # the optimizer's state must exist to be loaded into (as in torch's example)
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _full(model, opt)
    _train_steps(model, opt, rank, n, _batches()[2:])
    return {"loaded": loaded, "after": _full(model)}


def _full_in_and_out():
    """A one-process model's full state dict into a sharded model (torch's API) and back out."""
    rank, n = dist.get_rank(), dist.get_world_size()
    single = Net(seed=9)
    model = _shard(Net(seed=rank), fully_shard)
    set_model_state_dict(model, single.state_dict(), options=FULL)
    out = _full(model)
    model.load_state_dict(get_model_state_dict(model))  # a sharded state dict into itself
    return {"in": {k: v.clone() for k, v in single.state_dict().items()}, "out": out, "again": _full(model)}


def _between_steps():
    """What users do between steps: print a weight, sum it, test the class, unshard by hand."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _shard(Net(), fully_shard)
    opt = _optimizer(model)
    _train_steps(model, opt, rank, n, _batches()[:1])
    block = model.blocks[0]
    out = {"repr": repr(block.up.weight)[:9], "sum": float(block.up.weight.full_tensor().sum()),
           "local sum": float(block.up.weight.to_local().sum()),
           "isinstance": [isinstance(m, FSDPModule) for m in (model, block, block.up)],
           "class": type(block).__name__}
    block.unshard()
    out["unsharded"] = type(block.up.weight).__name__, tuple(block.up.weight.shape)
    block.reshard()
    out["resharded"] = type(block.up.weight).__name__
    before = nn.Linear(3, 3)
    early = torch.optim.SGD(before.parameters(), lr=0.1)
    fully_shard(before)
    before(torch.ones(2, 3)).sum().backward()
    try:
        early.step()
        out["early"] = None
    except ValueError as e:
        out["early"] = str(e)
    try:
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
        out["container"] = None
    except ValueError as e:
        out["container"] = str(e)
    summed = _shard(Net(), fully_shard)
    for m in summed.modules():  # each module's own parameters (as torch's): every unit
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    X, y = shard(*_batches()[0][0], rank, n)
    nn.functional.cross_entropy(summed(X).reshape(-1, VOCAB), y.reshape(-1)).backward()
    out["summed grad"] = _local_grad_norm(summed)
    averaged = _shard(Net(), fully_shard)
    nn.functional.cross_entropy(averaged(X).reshape(-1, VOCAB), y.reshape(-1)).backward()
    out["averaged grad"] = _local_grad_norm(averaged)
    out.update(_options(rank, n))
    return out


def _refusal(fn):
    try:
        fn()
    except (TypeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _options(rank, n):
    """torch's other keywords and methods: each gives torch's numbers, or one line saying it is not supported."""
    import copy
    X, y = shard(*_batches()[0][0], rank, n)

    def grads(model):
        nn.functional.cross_entropy(model(X).reshape(-1, VOCAB), y.reshape(-1)).backward()
        return {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                for k, p in model.named_parameters() if p.grad is not None}

    plain = grads(_shard(Net(), fully_shard))
    prefetched = _shard(Net(), fully_shard)
    blocks = list(prefetched.blocks)
    for k, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[k + 1:k + 2])
        block.set_modules_to_backward_prefetch(blocks[k - 1:k] if k else [])
    kept = _shard(Net(), fully_shard, reshard_after_forward=False)
    narrow = _shard(Net(), fully_shard, reshard_after_forward=1)
    model = Net()
    ignored = set(model.head.parameters())
    _shard(model, fully_shard, ignored_params=ignored)
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    out = {"same grads": {name: all(torch.equal(g[k], plain[k]) for k in plain)
                          for name, g in (("prefetch", grads(prefetched)), ("kept", grads(kept)),
                                          ("reshard 1", grads(narrow)))},
           "ignored": [type(p).__name__ for p in model.head.parameters()],
           "unshard async": type(model.blocks[0].up.weight).__name__}
    model.blocks[0].reshard()
    out["mp outputs"] = [_mp_output(fn) for fn in (fully_shard, torch_fully_shard)]
    out["doubled"] = [_doubled(fn) for fn in (fully_shard, torch_fully_shard)]
    out["ignored grads"] = {k: type(v).__name__ for k, v in grads(model).items() if k.startswith("head")}
    out["refused"] = {
        "deepcopy": _refusal(lambda: copy.deepcopy(model)),
        "0-dim": _refusal(lambda: fully_shard(_Scalar())),
        "2-D mesh keyword": _refusal(lambda: fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda p: 0)),
        **{f"reshard {k}": _refusal(lambda k=k: fully_shard(nn.Linear(2, 2), reshard_after_forward=k))
           for k in (5, 0, -1, -2)},  # torch's int is a size to reshard to: it must divide the group size
        "custom all-gather": _refusal(lambda: model.set_custom_all_gather(None)),
        "divide by 0": _refusal(lambda: model.set_gradient_divide_factor(0)),
        "mp policy": _refusal(lambda: fully_shard(nn.Linear(2, 2), mp_policy="bf16")),
    }
    return out


def _mp_output(shard_fn):
    """Float32 inputs into bf16 parameters (`cast_forward_inputs`), a float32 output (`output_dtype`)."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    shard_fn(net[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    shard_fn(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    return net(torch.randn(4, 5, generator=torch.Generator().manual_seed(4))).detach()


def _doubled(shard_fn):
    """`model.double()` after sharding: float64 shards, gathers and gradients."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    shard_fn(net[0])
    shard_fn(net)
    net.double()
    net(torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))).sum().backward()
    return [p.grad.full_tensor() for p in net.parameters()]


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))


def _local_grad_norm(model):
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor())


def _job(folder):
    rank, n = dist.get_rank(), dist.get_world_size()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {"ours": _script(fully_shard, rank, n), "torch": _script(torch_fully_shard, rank, n),
           "ours skip": _script(fully_shard, rank, n, skip=(1,)), "torch skip": _script(torch_fully_shard, rank, n,
                                                                                       skip=(1,)),
           "ours bf16": _script(fully_shard, rank, n, mp=bf16), "torch bf16": _script(torch_fully_shard, rank, n,
                                                                                     mp=bf16),
           "ours meta": _meta_script(fully_shard, rank, n), "torch meta": _meta_script(torch_fully_shard, rank, n),
           "full": _full_in_and_out(), "between": _between_steps()}
    if n == 2:
        out["checkpoint"] = _checkpoint_save(folder)
    else:
        out["checkpoint"] = _checkpoint_load(folder)
    return out


@functools.lru_cache(maxsize=None)
def _results(folder):
    """Two ranks save a DCP checkpoint in `folder`; then three ranks load it."""
    return {n: launch(_job, n, args=(folder,), timeout=300.0) for n in (2, 3)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(str(tmp_path_factory.mktemp("dcp") / "checkpoint"))


@functools.lru_cache(maxsize=None)
def _single(skip=()):
    return _script(None, 0, 0, skip=skip)


def _equal(a, b, atol=0.0, what=""):
    assert list(a) == list(b), what
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=0, atol=atol, msg=f"{what} {k}")


@pytest.mark.parametrize("n", [2, 3])
def test_clip_accumulate_and_decay_by_name_equal_torch_fsdp2_and_one_process(results, n):
    """Bitwise torch's at 2 ranks; float32 rounding at 3 and against one process."""
    for r, got in enumerate(results[n]):
        for key, single in (("", _single()), (" skip", _single(skip=(1,)))):
            ours, theirs = got["ours" + key], got["torch" + key]
            _equal(ours["state"], theirs["state"], atol=0.0 if n == 2 else 1e-6, what=f"rank {r}{key} vs torch")
            assert ours["norms"] == pytest.approx(theirs["norms"], abs=1e-6 if n == 3 else 0)
            _equal(ours["state"], single["state"], atol=1e-5, what=f"rank {r}{key} vs one process")
            assert ours["norms"] == pytest.approx(single["norms"], abs=1e-5)
            assert single["norms"][0] > 0.5, "the clip clips"
    skipped = results[n][0]["ours skip"]["state"]
    start = Net().state_dict()
    assert torch.equal(skipped["blocks.1.up.weight"], start["blocks.1.up.weight"]), "a unit not run: no decay"


@pytest.mark.parametrize("n", [2, 3])
def test_bf16_parameters_with_fp32_reduction_equal_torch_fsdp2(results, n):
    for r, got in enumerate(results[n]):
        _equal(got["ours bf16"]["state"], got["torch bf16"]["state"], atol=0.0 if n == 2 else 1e-6,
               what=f"rank {r} bf16")
        assert got["ours bf16"]["norms"] == pytest.approx(got["torch bf16"]["norms"], abs=1e-6 if n == 3 else 0)
        assert got["ours bf16"]["state"]["head.weight"].dtype == torch.float32, "the shards stay in float32"
    assert got["ours bf16"]["norms"] != got["ours"]["norms"], "bf16 compute is not float32's"


@pytest.mark.parametrize("n", [2, 3])
def test_a_meta_device_model_initialised_after_to_empty_equals_torch_fsdp2(results, n):
    for r, got in enumerate(results[n]):
        _equal(got["ours meta"]["state"], got["torch meta"]["state"], atol=0.0 if n == 2 else 1e-6,
               what=f"rank {r} meta")
        assert got["ours meta"]["norms"] == pytest.approx(got["torch meta"]["norms"], abs=1e-6)


def test_a_dcp_checkpoint_saved_at_two_ranks_loads_at_three(results):
    saved = results[2][0]["checkpoint"]["saved"]
    for r, got in enumerate(results[3]):
        _equal(got["checkpoint"]["loaded"], saved, what=f"rank {r}: loaded at 3 ranks, model and AdamW state")
        _equal(got["checkpoint"]["after"], results[2][0]["checkpoint"]["after"], atol=1e-6,
               what=f"rank {r}: the resumed run continues as the uninterrupted one")


@pytest.mark.parametrize("n", [2, 3])
def test_a_full_state_dict_goes_into_a_sharded_model_and_back(results, n):
    for got in results[n]:
        _equal(got["full"]["out"], got["full"]["in"])
        _equal(got["full"]["again"], got["full"]["in"])


@pytest.mark.parametrize("n", [2, 3])
def test_between_steps_a_weight_prints_sums_and_tells_its_class(results, n):
    for r, got in enumerate(results[n]):
        b = got["between"]
        assert b["repr"] == "DTensor(l" and b["isinstance"] == [True, True, False] and b["class"] == "FSDPBlock"
        assert b["sum"] == pytest.approx(results[n][0]["between"]["sum"], abs=0), "the same full weight on every rank"
        assert b["unsharded"] == ("Parameter", (2 * DIM + 1, DIM)) and b["resharded"] == "DTensor"
        assert "build the optimizer after fully_shard" in b["early"]
        assert "ModuleList" in b["container"] and "children" in b["container"]
        assert b["summed grad"] == pytest.approx(n * b["averaged grad"], rel=1e-5), "divide factor 1: sums"


@pytest.mark.parametrize("n", [2, 3])
def test_torchs_other_keywords_and_methods_give_the_same_gradients_or_refuse_in_one_line(results, n):
    for got in results[n]:
        b = got["between"]
        assert b["same grads"] == {"prefetch": True, "kept": True, "reshard 1": True}
        assert b["ignored"] == ["Parameter", "Parameter"] and b["ignored grads"] == {"head.weight": "Tensor",
                                                                                     "head.bias": "Tensor"}
        assert b["unshard async"] == "Parameter"
        ours, theirs = b["mp outputs"]
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs), "inputs cast to bf16, the output to fp32"
        ours, theirs = b["doubled"]
        assert all(a.dtype == torch.float64 and torch.equal(a, t) for a, t in zip(ours, theirs)), "model.double()"
        refused = b["refused"]
        assert all(refused.values()), refused
        assert "deep-copied" in refused["deepcopy"] and "0-dim" in refused["0-dim"]
        assert re.search("Change scale to a 1D tensor with numel equal to 1.", refused["0-dim"])  # torch's words
        assert "shard_placement_fn" in refused["2-D mesh keyword"]
        for k in (5, 0, -1, -2):
            message = refused[f"reshard {k}"]
            assert message.startswith("ValueError: reshard_after_forward") and message.endswith(f"got {k}"), message
        assert "set_custom_all_gather" in refused["custom all-gather"] and "factor" in refused["divide by 0"]
        assert "MixedPrecisionPolicy" in refused["mp policy"]

