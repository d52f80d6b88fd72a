"""Issue 35 (commits 4b31d2f, 65ae28b), tried by someone who did not write them, at 2 gloo ranks against torch's DDP.

1. the ladder's rungs leave a parameter that no rank used with its .grad untouched (None stays None);
2. the rungs copy rank 0's buffers before each training forward (broadcast_buffers=True; False accepted);
3. the drop-in raises on every rank, naming the step, when one rank runs an extra backward mid-step.

Classes (../shared/ADVERSARY.md): "Models that are not a plain stack" (unused on some/all ranks, alternating,
buffers of several dtypes, a buffer-only module, a submodule reached twice), "What a user does between and around
steps" (leftover .grad, no_grad/eval forwards, two forwards one backward, no_sync, extra backward on all ranks),
"Ranks that disagree" (broadcast_buffers differing, one extra backward, one rank's eval forward).
Each launch catches per case; the assertions run in the parent.
"""
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.spmd import BucketedDDP, DistributedDataParallel, FlatDDP, NaiveDDP, OverlappedDDP
from manualdp.spmd.launch import launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001),
         "bucketed_big": functools.partial(BucketedDDP, bucket_cap_mb=25)}
T = 15  # seconds a peer is waited for


def _torch(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchDDP(model, find_unused_parameters=True, **kw)


def _grads(model):
    return {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.module.named_parameters()}


def _state(model):
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _run(out, name, fn):
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out[name] = ("err", type(e).__name__, str(e))


# ---------------------------------------------------------------------------------------------------------------
# models

class Alternating(nn.Module):
    """`first` before everything (reached last by backward); `which(step, rank)` picks the layers used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.first, self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(3, 3)
        self.use = set()

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        if "c" in self.use:
            y = self.c(y)
        if "first" in self.use:
            y = y + self.first(x)
        return y


class Bufs(nn.Module):
    """Buffers of several dtypes with no BatchNorm: a float64 and an int64 counter moved by forward,
    and a non-persistent buffer; plus a BatchNorm reached twice through one submodule."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("ema", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(y.mean(0).double())
                self.count.add_(x.shape[0])
                self.scratch.copy_(y.std(0))
        y = self.bn(torch.tanh(self.bn(y)))  # one submodule, reached twice
        return y * (1 + self.ema.float().sum() * 0 + self.scratch.sum() * 0.01)


# ---------------------------------------------------------------------------------------------------------------
# launch 1: the ladder against torch's DDP, no error expected

def _alternating(make, r, plan, sgd_stale=None, accumulate=False):
    """plan[step][rank]: the set of optional layers used; AdamW with weight decay, and momentum SGD."""
    model = make(Alternating())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
    grads = []
    for step, uses in enumerate(plan):
        if not accumulate:
            opt.zero_grad()
        model.module.use = uses[r]
        if sgd_stale is not None and step == 1:
            model.module.first.weight.grad = torch.full((3, 3), sgd_stale(r))
        model(x).pow(2).sum().backward()
        grads.append(_grads(model))
        opt.step()
    return {"grads": grads, "state": _state(model)}


def _bufs(make, r, steps=3, eval_between=(False, False), no_grad_eval=True, eval_module=False):
    """`eval_module`: evaluate through `model.module`, as a user of torch's DDP must when one rank alone evaluates
    (torch's DDP copies rank 0's buffers in a no-grad forward that follows a training one, so its wrapper would
    wait for the other rank forever; the rungs copy them before forward passes with grad only)."""
    model = make(Bufs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * r + s)) for s in range(steps)]
    evals = []
    for step, x in enumerate(xs):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        if eval_between[r]:
            model.eval()
            if no_grad_eval:
                with torch.no_grad():
                    evals.append((model.module if eval_module else model)(x * 3).detach().clone())
            else:
                evals.append(model(x * 3).detach().clone())  # eval mode, grad on, no backward
            model.train()
    st = _state(model)
    st["scratch"] = model.module.scratch.clone()
    return {"state": st, "evals": evals}


def _two_forwards(make, r):
    model = make(Alternating())
    x1 = torch.randn(4, 3, generator=torch.Generator().manual_seed(20 + r))
    x2 = torch.randn(4, 3, generator=torch.Generator().manual_seed(30 + r))
    (model(x1).pow(2).sum() + model(x2).sum()).backward()
    return _grads(model)


PLANS = {
    # rank 0 alone uses c at step 0, rank 1 alone at step 1, nobody at step 2, both at step 3
    "alternating": [[{"c"}, set()], [set(), {"c"}], [set(), set()], [{"c"}, {"c"}]],
    # `first` (the earliest parameter, the last backward reaches) used by one rank, then nobody
    "first_param": [[{"first"}, set()], [set(), set()], [set(), {"first", "c"}]],
}


def _job_ladder():
    torch.set_num_threads(1)
    r = dist.get_rank()
    out = {}
    makers = {name: functools.partial(make, timeout=T) for name, make in RUNGS.items()}
    makers["torch"] = _torch
    for name, make in makers.items():
        for plan_name, plan in PLANS.items():
            _run(out, (plan_name, name), lambda: _alternating(make, r, plan))
        # no zero_grad: leftover .grad accumulates; `first` unused everywhere but holds another stale value per rank
        _run(out, ("accumulate", name), lambda: _alternating(make, r, PLANS["alternating"], accumulate=True))
        _run(out, ("stale one rank", name),
             lambda: _alternating(make, r, [[set(), set()]] * 3, sgd_stale=lambda rk: 5.0 if rk == 0 else float("nan")))
        _run(out, ("bufs", name), lambda: _bufs(make, r))
        _run(out, ("bufs eval rank0", name),
             lambda: _bufs(make, r, eval_between=(True, False), eval_module=name == "torch"))
        _run(out, ("bufs eval grad-on both", name),
             lambda: _bufs(make, r, eval_between=(True, True), no_grad_eval=False))
        _run(out, ("two forwards", name), lambda: _two_forwards(make, r))
    nb = {name: functools.partial(make, timeout=T, broadcast_buffers=False) for name, make in RUNGS.items()}
    nb["torch"] = functools.partial(_torch, broadcast_buffers=False)
    for name, make in nb.items():
        _run(out, ("bufs own", name), lambda: _bufs(make, r))
    return out


@functools.lru_cache(maxsize=None)
def _ladder():
    return launch(_job_ladder, 2, timeout=240)


def _same(got, want, where):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif want is None:
        assert got is None, (where, "torch's DDP leaves it None", got)
    else:
        assert got is not None, (where, "torch's DDP has a value")
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=where)
        else:
            assert torch.equal(got, want), (where, got, want)


def _like_torch(case, rung):
    for r, out in enumerate(_ladder()):
        assert out[case, "torch"][0] == "ok", (r, out[case, "torch"])
        assert out[case, rung][0] == "ok", (r, case, rung, out[case, rung])
        _same(out[case, rung][1], out[case, "torch"][1], f"rank {r} {case} {rung}")


LADDER = sorted(RUNGS)


@pytest.mark.parametrize("rung", LADDER)
def test_unused_on_one_rank_then_the_other_then_nobody_as_torch(rung):
    _like_torch("alternating", rung)
    for r, out in enumerate(_ladder()):
        assert out["alternating", rung][1]["grads"][2]["c.weight"] is None, r  # zero_grad made it None; nobody used


@pytest.mark.parametrize("rung", LADDER)
def test_the_first_parameter_used_by_one_rank_then_nobody_as_torch(rung):
    _like_torch("first_param", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_no_zero_grad_leftover_grads_accumulate_as_torch(rung):
    _like_torch("accumulate", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_unused_everywhere_stale_grad_on_rank0_nan_on_rank1_parts_the_replicas_and_is_named(rung):
    # the unused parameter's stale .grad (5.0 on rank 0, NaN on rank 1) is left alone by every wrapper, as by torch's,
    # and the optimizer steps it: the replicas part. Torch's DDP goes on without a word; ours name the parting at the
    # drift check's next due step (0, 1, 2, 4, ...), on every rank (issue 43)
    res = _ladder()
    for r, out in enumerate(res):
        assert out["stale one rank", "torch"][0] == "ok", (r, out["stale one rank", "torch"])
        kind, *error = out["stale one rank", rung]
        assert kind == "err" and error[0] == "RuntimeError", (r, rung, error)
        assert "differs across ranks" in error[1] and "first.weight" in error[1], (r, rung, error)
    torchs = [out["stale one rank", "torch"][1]["grads"][1]["first.weight"] for out in res]
    assert torch.equal(torchs[0], torch.full((3, 3), 5.0)) and torchs[1].isnan().all()  # what parts them


@pytest.mark.parametrize("rung", LADDER)
def test_buffers_of_several_dtypes_no_batchnorm_submodule_twice_as_torch(rung):
    _like_torch("bufs", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_eval_no_grad_forward_on_rank0_only_between_steps_no_broadcast_no_desync(rung):
    _like_torch("bufs eval rank0", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_eval_mode_grad_on_forward_without_backward_on_both_ranks_as_torch(rung):
    _like_torch("bufs eval grad-on both", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_broadcast_buffers_false_several_dtypes_as_torch(rung):
    _like_torch("bufs own", rung)


@pytest.mark.parametrize("rung", LADDER)
def test_two_forwards_one_backward_gives_the_average(rung):
    # torch's DDP refuses this without static_graph; the right result is the plain average of each rank's gradient
    res = _ladder()
    local = []
    for r in range(2):
        torch.manual_seed(0)
        m = Alternating()
        x1 = torch.randn(4, 3, generator=torch.Generator().manual_seed(20 + r))
        x2 = torch.randn(4, 3, generator=torch.Generator().manual_seed(30 + r))
        (m(x1).pow(2).sum() + m(x2).sum()).backward()
        local.append({k: None if p.grad is None else p.grad for k, p in m.named_parameters()})
    want = {k: None if local[0][k] is None else (local[0][k] + local[1][k]) / 2 for k in local[0]}
    for r, out in enumerate(res):
        assert out["two forwards", rung][0] == "ok", (r, out["two forwards", rung])
        _same(out["two forwards", rung][1], want, f"rank {r}")


# ---------------------------------------------------------------------------------------------------------------
# launch 2: ranks that disagree, on the ladder (each case in its own group state may break the next: one per launch)

def _job_buffers_differ(rung):
    torch.set_num_threads(1)
    r = dist.get_rank()
    out = {}
    _run(out, "build", lambda: RUNGS[rung](Bufs(), timeout=T, broadcast_buffers=(r == 0)) and "built")
    return out


@pytest.mark.parametrize("rung", LADDER)
def test_broadcast_buffers_differing_across_ranks_raises_on_every_rank(rung):
    res = launch(_job_buffers_differ, 2, (rung,), timeout=60)
    for r, out in enumerate(res):
        assert out["build"][0] == "err", (r, out["build"])
        message = out["build"][2]
        assert message.startswith(f"rank {r}") and "broadcast_buffers" in message, (r, message)
        assert "\n" not in message.strip(), message


def _job_ladder_extra_backward(rung):
    torch.set_num_threads(1)
    r = dist.get_rank()
    out = {}

    def go():
        model = RUNGS[rung](Alternating(), timeout=T)
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
        for step in range(3):
            loss = model(x).pow(2).sum()
            loss.backward(retain_graph=True)
            if r == 1 and step == 1:
                loss.backward()
        return "no error"
    _run(out, "extra", go)
    return out


@pytest.mark.parametrize("rung", ["naive", "bucketed"])
def test_ladder_one_extra_backward_on_one_rank_raises_on_every_rank(rung):
    res = launch(_job_ladder_extra_backward, 2, (rung,), timeout=60)
    for r, out in enumerate(res):
        assert out["extra"][0] == "err", (r, out["extra"])
        assert out["extra"][2].startswith(f"rank {r}"), (r, out["extra"])


def _job_eval_grad_on_one_rank(rung):
    torch.set_num_threads(1)
    r = dist.get_rank()
    out = {}
    _run(out, "eval", lambda: _bufs(functools.partial(RUNGS[rung], timeout=T), r, eval_between=(False, True),
                                    no_grad_eval=False))
    return out


@pytest.mark.parametrize("rung", ["naive", "overlapped"])
def test_grad_on_forward_without_backward_on_one_rank_with_buffers_raises_naming_the_step(rung):
    res = launch(_job_eval_grad_on_one_rank, 2, (rung,), timeout=90)
    for r, out in enumerate(res):
        assert out["eval"][0] == "err", (r, out["eval"])
        message = out["eval"][2]
        assert message.startswith(f"rank {r}") and "step" in message and "no answer" not in message, (r, message)


# ---------------------------------------------------------------------------------------------------------------
# launch 3: the drop-in's extra backward

def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(model, x, extra=lambda step, r: False, steps=3, no_sync_steps=()):
    r = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if step not in no_sync_steps or step == 0:
            opt.zero_grad()
        ctx = model.no_sync() if step in no_sync_steps else __import__("contextlib").nullcontext()
        with ctx:
            loss = model(x).pow(2).sum()
            loss.backward(retain_graph=extra(step, r))
            if extra(step, r):
                loss.backward()
        if step not in no_sync_steps:
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


DROPIN_CASES = {
    "first step": dict(extra=lambda s, r: r == 1 and s == 0),
    "last step": dict(extra=lambda s, r: r == 0 and s == 2),
    "all ranks": dict(extra=lambda s, r: s == 1),
    "find_unused": dict(extra=lambda s, r: r == 1 and s == 1),
    "in no_sync": dict(extra=lambda s, r: r == 1 and s == 0, no_sync_steps=(0,)),
}


def _job_dropin(case):
    torch.set_num_threads(1)
    r = dist.get_rank()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
    kw = dict(DROPIN_CASES[case])
    out = {}
    extra = {"find_unused_parameters": True} if case == "find_unused" else {}
    _run(out, "ours", lambda: _train(DistributedDataParallel(_net(), timeout=T, **extra), x, **kw))
    if case in ("all ranks", "in no_sync"):
        _run(out, "torch", lambda: _train(TorchDDP(_net()), x, **kw))
    return out


@pytest.mark.parametrize("case", ["first step", "find_unused"])
def test_dropin_extra_backward_on_one_rank_raises_on_every_rank_naming_the_step(case):
    res = launch(_job_dropin, 2, (case,), timeout=90)
    for r, out in enumerate(res):
        assert out["ours"][0] == "err", (r, case, out["ours"])
        message = out["ours"][2]
        assert message.startswith(f"rank {r}") and "step" in message and "\n" not in message.strip(), (r, message)


def test_dropin_extra_backward_after_the_peers_last_step_raises_not_hangs():
    # rank 1 has finished: it cannot know; rank 0's extra allreduce has no partner and must raise in one line
    res = launch(_job_dropin, 2, ("last step",), timeout=90)
    assert res[1]["ours"][0] == "ok", res[1]["ours"]
    assert res[0]["ours"][0] == "err", res[0]["ours"]
    assert res[0]["ours"][2].startswith("rank 0") and "\n" not in res[0]["ours"][2].strip(), res[0]["ours"]


def test_dropin_extra_backward_on_every_rank_keeps_the_ranks_equal():
    # torch's DDP lets a second backward accumulate local grads; whatever the drop-in does, ranks must not diverge
    res = launch(_job_dropin, 2, ("all ranks",), timeout=90)
    kinds = {out["ours"][0] for out in res}
    assert len(kinds) == 1, [out["ours"] for out in res]
    if kinds == {"ok"}:
        torch.testing.assert_close(res[0]["ours"][1], res[1]["ours"][1], rtol=0, atol=1e-12)


def test_dropin_extra_backward_inside_no_sync_on_one_rank_is_accumulation_as_torch():
    res = launch(_job_dropin, 2, ("in no_sync",), timeout=90)
    for r, out in enumerate(res):
        assert out["torch"][0] == "ok", out["torch"]
        assert out["ours"][0] == "ok", (r, out["ours"])
        torch.testing.assert_close(out["ours"][1], out["torch"][1], rtol=0, atol=1e-12)
