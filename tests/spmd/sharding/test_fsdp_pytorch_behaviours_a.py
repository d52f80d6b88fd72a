"""Behaviours that pytorch's FSDP2 training tests check, written here as our own and compared with torch's.

One spawned run at 2 ranks: each case runs with our `fully_shard` and with torch's on the same model, data
and ranks, and the parent compares them (or reads our one-line refusal where torch's has no answer on cpu).
- `CPUOffloadPolicy(pin_memory=False)` on cpu: the shards already live in host memory, so it trains as torch's
  does with it, also over micro-batches without gradient sync; `pin_memory=True` (it needs an accelerator) and
  a policy that is not one are refused in one line.
- `set_unshard_in_backward(False)` on an embedding's unit (torch's memory-efficient grouping): backward runs
  without gathering its weight, and training equals torch's.
- A weight tied across two units that are not nested (an embedding and an output head sharded each on its
  own): `fully_shard` takes them, as torch's does, and the first forward raises on every rank in one line.
- A unit of two modules (`fully_shard([a, b])`) with `cast_forward_inputs`: each module's inputs are cast, also
  a float32 tensor made between them, and the output and gradients are torch's.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard

from .test_fsdp_like_torch import _case, _full, _refusal

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def _offloaded(shard_fn, rank, micro_batches):
    """Adam for 3 steps on units sharded with CPUOffloadPolicy; gradient sync only on each step's last micro-batch."""
    model = _model()
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in (model[0], model[2]):
        shard_fn(layer, offload_policy=policy)
    shard_fn(model, offload_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        for k in range(micro_batches):
            model.set_requires_gradient_sync(k == micro_batches - 1)
            model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {name: _full(p) for name, p in model.named_parameters()}


class Tagger(nn.Module):
    """An embedding, then two linear layers: the embedding's backward reads no weight of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def _embedding_not_gathered_in_backward(shard_fn, rank, reshard):
    """Adam for 3 steps with the embedding's unit told not to gather in backward."""
    model = Tagger()
    for m in (model.embed, model.body, model.head):
        shard_fn(m, reshard_after_forward=reshard)
    shard_fn(model, reshard_after_forward=reshard)
    model.embed.set_unshard_in_backward(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(20 + rank)
    for _ in range(3):
        model(torch.randint(0, 11, (4, 5), generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {name: _full(p) for name, p in model.named_parameters()}


class TiedApart(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 4)
        self.out = nn.Linear(4, 9, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.embed(tokens))


def _tied_apart(shard_fn):
    """Where a weight tied across two sibling units is refused: at `fully_shard`, at the forward, or nowhere."""
    model = TiedApart()
    try:
        for m in (model.embed, model.out, model):
            shard_fn(m)
    except ValueError as e:
        return {"raised at": "fully_shard", "message": str(e)}
    try:
        model(torch.randint(0, 9, (2, 3)))
    except ValueError as e:
        return {"raised at": "forward", "message": str(e)}
    return {"raised at": None}


class Upcast(nn.Module):
    """Two linear layers with a float32 tensor between them: `b` runs in bfloat16 only if its inputs are cast."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)

    def forward(self, x):
        return self.b(self.a(x).float())


def _grouped_cast_inputs(shard_fn, rank):
    model = Upcast()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    shard_fn([model.a, model.b], mp_policy=policy)
    shard_fn(model, mp_policy=policy)
    out = model(torch.randn(3, 6, generator=torch.Generator().manual_seed(rank)))
    out.float().pow(2).sum().backward()
    return {"out": out.detach(), **{name: _full(p.grad) for name, p in model.named_parameters()}}


def _offload_refusals():
    return {"pin_memory": _refusal(lambda: fully_shard(_model(), offload_policy=CPUOffloadPolicy())),
            "not a policy": _refusal(lambda: fully_shard(_model(), offload_policy="cpu"))}


def _job():
    rank = dist.get_rank()
    out = {name: {"offload": _case(_offloaded, fn, rank, 1), "offload accumulated": _case(_offloaded, fn, rank, 2),
                  "no unshard in backward": _case(_embedding_not_gathered_in_backward, fn, rank, True),
                  "no unshard in backward, kept": _case(_embedding_not_gathered_in_backward, fn, rank, False),
                  "tied apart": _case(_tied_apart, fn), "grouped cast": _case(_grouped_cast_inputs, fn, rank)}
           for name, fn in SHARD_FNS.items()}
    out["offload refusals"] = _case(_offload_refusals)
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 2, timeout=240.0)


def _same(ours, theirs, what, atol=1e-6):
    assert "raised" not in ours and "raised" not in theirs, (what, ours.get("raised"), theirs.get("raised"))
    assert list(ours) == list(theirs), what
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=atol, msg=f"{what}: {k}")


def test_cpu_offload_policy_on_cpu_trains_as_torch_does(results):
    for r, got in enumerate(results):
        for case in ("offload", "offload accumulated"):
            _same(got["ours"][case], got["torch"][case], f"rank {r} {case}")
    start = {k: v for k, v in _model().named_parameters()}
    assert any(not torch.equal(results[0]["ours"]["offload"][k], start[k]) for k in start)  # it trained


def test_cpu_offload_policy_that_needs_an_accelerator_or_is_not_a_policy_is_refused_in_one_line(results):
    for got in results:
        refusals = got["offload refusals"]
        assert refusals["pin_memory"].startswith("ValueError") and "pin_memory=False" in refusals["pin_memory"]
        assert refusals["not a policy"].startswith("TypeError") and "offload_policy" in refusals["not a policy"]
        assert all("\n" not in v for v in refusals.values())


def test_an_embedding_not_gathered_in_backward_trains_as_torch_does(results):
    for r, got in enumerate(results):
        for case in ("no unshard in backward", "no unshard in backward, kept"):
            _same(got["ours"][case], got["torch"][case], f"rank {r} {case}")


def test_a_weight_tied_across_sibling_units_is_refused_at_the_first_forward_as_torch_does(results):
    for got in results:
        ours, theirs = got["ours"]["tied apart"], got["torch"]["tied apart"]
        assert ours["raised at"] == theirs["raised at"] == "forward", (ours, theirs)
        assert "already managed by another" in ours["message"] and "common ancestor" in ours["message"]
        assert "\n" not in ours["message"]


def test_each_module_of_a_grouped_unit_casts_its_inputs_as_torch_does(results):
    for r, got in enumerate(results):
        _same(got["ours"]["grouped cast"], got["torch"]["grouped cast"], f"rank {r} grouped cast", atol=0)
        assert got["ours"]["grouped cast"]["out"].dtype == torch.bfloat16
