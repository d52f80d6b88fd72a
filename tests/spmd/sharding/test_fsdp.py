"""`fully_shard` (ZeRO-3 in the engine): equals torch's FSDP2 and one process; shards, prefetch, checkpoints.

Spawned jobs (gloo on 127.0.0.1, one thread per rank, killed after a timeout) train a model
with a tied embedding and head, a frozen layer, a parameter and a buffer of the root's own,
and sizes that do not divide by 2 or 3 (uneven shards); the assertions run here, in the parent.
"""
import functools
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import full_state_dict, fully_shard, launch, shard
from manualdp.spmd.sharding.fsdp_unit import UNIT
from manualdp.support.trace import Trace

STEPS = 4
VOCAB = 11


class Tied(nn.Module):
    """Embedding tied to the output head, three layers (the middle one frozen), a scale and a shift of its own."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 5)
        self.layers = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 5)])
        self.layers[1].requires_grad_(False)
        self.head = nn.Linear(5, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.rand(5) + 0.5)
        self.register_buffer("shift", torch.randn(5))

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h * self.scale + self.shift)


NUMEL = VOCAB * 5 + (5 * 7 + 7) + (7 * 7 + 7) + (7 * 5 + 5) + 5  # the tied weight once


def _sharded(model, shard_fn=fully_shard, embed_unit=False, **kwargs):
    """Each layer a unit, then the root (which takes the tied weight; from the embedding's unit with `embed_unit`)."""
    if embed_unit:
        shard_fn(model.embed, **kwargs)
    for layer in model.layers:
        shard_fn(layer, **kwargs)
    return shard_fn(model, **kwargs)


def _batches(count=STEPS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (7, 3), generator=g), torch.randint(0, VOCAB, (7, 3), generator=g))
            for _ in range(count)]


def _step(model, opt, X, y, rank, n):
    """One step on this rank's shard; the summed loss over the global batch, times n (gradients are averaged)."""
    Xs, ys = shard(X, y, rank, n) if n else (X, y)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(Xs).reshape(-1, VOCAB), ys.reshape(-1), reduction="sum")
    (loss / y.numel() * (n or 1)).backward()
    opt.step()


def _full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _units(model):
    return [u for m in model.modules() if UNIT in vars(m) for u in [vars(m)[UNIT]]]


def _held(model):
    """Bytes held by the full (unsharded) parameters of every unit."""
    return sum(p.full.untyped_storage().nbytes() for u in _units(model) for p in u.params if p.full is not None)


def _raise(grad):
    raise ValueError("a hook fails in backward")


def _fail_in_backward(module, args, output):
    output.register_hook(_raise)


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    # Rank 1 builds other weights and buffers: fully_shard starts every rank from rank 0's.
    models = {"ours": _sharded(Tied(seed=rank)), "moved": _sharded(Tied(seed=rank), embed_unit=True),
              "kept": _sharded(Tied(seed=rank), reshard_after_forward=False), "failed": _sharded(Tied(seed=rank)),
              "torch": _sharded(Tied(), torch_fully_shard)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-2) for k, m in models.items()}
    single = Tied()
    single_opt = torch.optim.Adam(single.parameters(), lr=1e-2)
    steps, held, evaluated = [], [], []
    for step, (X, y) in enumerate(_batches()):
        if step == 0:  # "failed" first runs a backward that raises halfway: the next step must not notice
            failing = models["failed"].layers[0].register_forward_hook(_fail_in_backward)
            try:
                models["failed"](shard(X, y, rank, n)[0]).sum().backward()
            except ValueError:
                pass
            failing.remove()
        with torch.no_grad():  # an evaluation between steps: every rank the whole batch, nothing kept after
            evaluated.append({k: models[k](X) for k in ("ours", "kept")} | {"single": single(X)})
            held.append({k: _held(models[k]) for k in ("ours", "kept")})
        for k, model in models.items():
            _step(model, opts[k], X, y, rank, n)
        _step(single, single_opt, X, y, 0, 0)
        steps.append({k: full_state_dict(m) for k, m in models.items() if k != "torch"}
                     | {"torch": _full(models["torch"].state_dict()), "single": _full(single.state_dict())})
        held.append({k: _held(m) for k, m in models.items() if k != "torch"})
    ours = models["ours"]
    return {"steps": steps, "held": held, "evaluated": evaluated,
            "params": [(name, p.to_local().numel(), p.requires_grad, p.grad is not None, p.placements[0].is_shard(0),
                        tuple(p.shape)) for name, p in ours.named_parameters()],
            "prefetch": _prefetch_job(), "bad input": _bad_input_job(),
            "checkpoint": _checkpoint_job() if n == 3 else None}


@functools.lru_cache(maxsize=None)
def _results(n):
    """One spawned job per world size runs every test's part (starting ranks costs more than these steps)."""
    return launch(_job, n, timeout=240.0)


@pytest.mark.parametrize("n", [2, 3])
def test_equals_torch_fsdp2_and_one_process_with_tied_frozen_and_root_parameters(n):
    results = _results(n)
    for step in range(STEPS):
        want = results[0]["steps"][step]["single"]
        for r in range(n):
            got = results[r]["steps"][step]
            for k in ("ours", "moved", "kept", "failed"):
                assert list(got[k]) == list(want), f"{k}: keys as the unsharded model's, in its order"
                for key in want:
                    torch.testing.assert_close(got[k][key], got["torch"][key], rtol=0, atol=1e-6,
                                               msg=f"rank {r} step {step} {k} {key}: against torch's FSDP2")
                    torch.testing.assert_close(got[k][key], want[key], rtol=0, atol=1e-6,
                                               msg=f"rank {r} step {step} {k} {key}: against one process")
                    assert torch.equal(got[k][key], results[0]["steps"][step][k][key]), "ranks differ"
    for r in range(n):
        for got in results[r]["evaluated"]:
            for k in ("ours", "kept"):
                torch.testing.assert_close(got[k], got["single"], rtol=0, atol=1e-6, msg=f"{k}: forward under no_grad")
    last, start = results[0]["steps"][-1]["single"], Tied()
    assert not torch.equal(last["layers.0.weight"], start.layers[0].weight), "it trains"
    assert torch.equal(last["layers.1.weight"], start.layers[1].weight), "the frozen layer does not"


@pytest.mark.parametrize("n", [2, 3])
def test_parameters_are_this_ranks_shards_and_nothing_else_is_held_between_steps(n):
    results = _results(n)
    single = dict(Tied().named_parameters())
    assert [row[0] for row in results[0]["params"]] == list(single), "the model's own names, in its order"
    for name, p in single.items():  # rows cut as torch.chunk cuts them: ceil(rows / n) per rank, the last ones fewer
        rows = [len(c) for c in torch.chunk(p, n)] + [0] * n
        got = [next(row for row in r["params"] if row[0] == name) for r in results]
        assert [g[1] for g in got] == [rows[r] * p[0].numel() for r in range(n)], name
        assert all(g[4] and g[5] == tuple(p.shape) for g in got), "a DTensor of the full shape, sharded on dim 0"
        assert all(g[2] == p.requires_grad == g[3] for g in got), name
    for r in results:
        assert all(set(h.values()) == {0} for h in r["held"]), r["held"]


def _prefetch_job():
    rank, n = dist.get_rank(), dist.get_world_size()
    trace = Trace(pid=rank)
    model = _sharded(Tied(), recorder=trace)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    layers = list(model.layers)
    seen = []  # ("forward" | "backward", layer, whether the neighbour's all-gather has begun), in order

    def allocated(layer):
        full = vars(layer)[UNIT].params[0].full
        return full is not None and full.untyped_storage().nbytes() > 0

    def on_forward(k, module, args, output):  # runs after fully_shard's hooks on the same module
        if k + 1 < len(layers):
            seen.append(("forward", k, allocated(layers[k + 1])))
        if k > 0:
            output.register_hook(lambda grad: seen.append(("backward", k, allocated(layers[k - 1]))))

    for k, layer in enumerate(layers):
        layer.register_forward_hook(functools.partial(on_forward, k))
    for X, y in _batches(2):
        _step(model, opt, X, y, rank, n)
    return {"seen": seen, "spans": [e["name"] for e in trace.events if e["ph"] == "X"]}


def test_the_next_units_all_gather_starts_before_it_is_needed_in_forward_and_backward():
    got = _results(2)[0]["prefetch"]
    steps = [got["seen"][:4], got["seen"][4:]]  # per step: 2 forward, 2 backward observations
    assert [s[:2] for s in steps[0]] == [("forward", 0), ("forward", 1), ("backward", 2), ("backward", 1)]
    assert [s[2] for s in steps[0][:2]] == [False, False], "the first step has no order to follow yet"
    assert [s[2] for s in steps[1][:2]] == [True, True], "then each layer's forward finds the next one gathering"
    assert [s[2] for s in steps[0][2:] + steps[1][2:]] == [True] * 4, "backward gathers the layer before ahead"
    assert "all_gather layers.1 (prefetch)" in got["spans"] and "reduce_scatter layers.2" in got["spans"]


def _checkpoint_job():
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = _batches(4)
    model = _sharded(Tied())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for X, y in batches[:2]:
        _step(model, opt, X, y, rank, n)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    for X, y in batches[2:]:
        _step(model, opt, X, y, rank, n)
    resumed = _sharded(Tied(seed=5))
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    saved.seek(0)
    state = torch.load(saved)
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["opt"])
    for X, y in batches[2:]:
        _step(resumed, resumed_opt, X, y, rank, n)
    return {"keys": list(state["model"]), "straight": _local(model.state_dict()),
            "resumed": _local(resumed.state_dict()),
            "full": (full_state_dict(model), full_state_dict(resumed)),
            "opt": tuple({k: _local(s) for k, s in o.state_dict()["state"].items()} for o in (opt, resumed_opt))}


def _local(state):
    """DTensors as this rank's local tensors: what a job can send to the parent (which has no process group)."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}


def test_a_sharded_checkpoint_resumes_bitwise_at_three_ranks():
    for r in (r["checkpoint"] for r in _results(3)):
        assert list(r["keys"]) == list(Tied().state_dict())
        for a, b in [(r["straight"], r["resumed"]), r["full"]]:
            assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        for k, s in r["opt"][0].items():
            assert all(torch.equal(v, r["opt"][1][k][name]) for name, v in s.items())


def _bad_input_job():
    rank = dist.get_rank()
    out = {}

    def attempt(key, fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
            out[key] = (type(e).__name__, str(e))

    attempt("not a module", lambda: fully_shard("linear"))
    twice = fully_shard(nn.Linear(2, 2))
    before = [p.clone() for p in twice.parameters()]
    attempt("twice", lambda: fully_shard(twice))
    out["twice unchanged"] = all(torch.equal(a, b) for a, b in zip(before, twice.parameters()))
    attempt("group", lambda: fully_shard(nn.Linear(2, 2), group="all"))
    outsider = dist.new_group([0])
    if rank == 1:
        attempt("not a member", lambda: fully_shard(nn.Linear(2, 2), group=outsider))
    attempt("reshard", lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward="yes"))
    top_down = fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    attempt("top down", lambda: fully_shard(top_down[0]))
    siblings = Tied()
    fully_shard(siblings.embed)
    head = list(siblings.head._parameters.items())
    attempt("tied siblings", lambda: fully_shard(siblings.head)(torch.randn(2, 5)))  # as torch's: at the forward
    out["head unchanged"] = list(siblings.head._parameters.items()) == head
    attempt("differs", lambda: fully_shard(nn.Linear(2, 2 + rank)))
    attempt("full of unsharded", lambda: full_state_dict(nn.Linear(2, 2)))
    return out


def test_bad_input_is_refused_naming_it_and_changing_nothing():
    got = [r["bad input"] for r in _results(2)]
    for r, out in enumerate(got):
        assert out["not a module"] == ("TypeError", "module must be an nn.Module, got str")
        assert out["twice"][0] == "ValueError" and "already sharded" in out["twice"][1] and out["twice unchanged"]
        assert out["group"][0] == "TypeError" and "group" in out["group"][1] and "str" in out["group"][1]
        assert "reshard_after_forward" in out["reshard"][1] and "'yes'" in out["reshard"][1]
        assert "bottom-up" in out["top down"][1]
        assert "common ancestor" in out["tied siblings"][1] and out["head unchanged"]
        assert "differs across ranks" in out["differs"][1]
        assert "state_dict" in out["full of unsharded"][1]
    assert "not a member" in got[1]["not a member"][1]


# ---------------------------------------------------------------- planted bugs slipped past these (issue 20)
#
# The tests above train with Adam, which hardly sees a gradient scaled by the world size, and
# one backward pass a step. Here: plain SGD, two backward passes a step (the gradients
# accumulate in the shards), a unit whose frozen weight backward reads after its trainable
# one has its gradient, and where a trace puts the collectives.

SGD_STEPS = 3


def _frozen_net():
    """A unit of its own, then a unit whose first layer is frozen: its weight is read after the last layer's grad."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    net[2][0].requires_grad_(False)
    return net


def _halves():
    g = torch.Generator().manual_seed(2)
    return [[(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
             for _ in range(2)] for _ in range(SGD_STEPS)]


def _two_backward_step(model, opt, halves, rank, n):
    """Two backward passes, one per half of the global batch; the mean loss over both, times n (averaged)."""
    opt.zero_grad()
    for X, y in halves:
        Xs, ys = shard(X, y, rank, n) if n else (X, y)
        loss = nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / (2 * len(X))
        (loss * (n or 1)).backward()
    opt.step()


def _sgd_job():
    rank, n = dist.get_rank(), dist.get_world_size()
    trace = Trace(pid=rank)
    model = _frozen_net()
    fully_shard(model[0], recorder=trace)
    fully_shard(model[2], recorder=trace)
    fully_shard(model, recorder=trace)
    single = _frozen_net()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, single)]
    steps = []
    for halves in _halves():
        _two_backward_step(model, opts[0], halves, rank, n)
        _two_backward_step(single, opts[1], halves, 0, 0)
        steps.append((full_state_dict(model), {k: v.clone() for k, v in single.state_dict().items()}))
    names = {tid: track for track, tid in trace.tracks.items()}
    tracks = {e["name"]: names[e["tid"]] for e in trace.events if e["ph"] == "X"}
    return {"steps": steps, "tracks": tracks}


@functools.lru_cache(maxsize=None)
def _sgd_results():
    return launch(_sgd_job, 2, timeout=120.0)


def test_sgd_with_two_backward_passes_a_step_equals_one_process():
    for r, result in enumerate(_sgd_results()):
        for step, (ours, single) in enumerate(result["steps"]):
            assert list(ours) == list(single)
            for key in single:
                torch.testing.assert_close(ours[key], single[key], rtol=0, atol=1e-10,
                                           msg=f"rank {r} step {step} {key}")
    first, start = _sgd_results()[0]["steps"][-1][1], _frozen_net().state_dict()
    assert not torch.equal(first["0.weight"], start["0.weight"])
    assert torch.equal(first["2.0.weight"], start["2.0.weight"])


def test_a_trace_puts_the_all_gathers_and_reduce_scatters_on_the_comm_track():
    tracks = _sgd_results()[0]["tracks"]
    collectives = {name: track for name, track in tracks.items() if name.startswith(("all_gather", "reduce_scatter"))}
    assert any(name.startswith("reduce_scatter") for name in collectives), tracks
    assert set(collectives.values()) == {"comm"}, collectives
