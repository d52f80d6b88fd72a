"""Issue 35, tried by someone who did not write it: the spmd collectives, the ladder's rungs, the book's ZeRO-3,
the command line, `figures.py --out`, `allreduce.execute` and the checkpoint lock, off their happy path.

Cases the authors' tests do not cover (../shared/ADVERSARY.md's classes). Each rank-launched group runs in one
launch per world size (2 and 3); the assertions run here, in the parent. A case that fails the bar (the right
result, or one clear line on every rank) is marked xfail(strict=True) with what it does instead.
"""
import copy
import functools
import gc
import io
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp import cpu_devices, replicate
from manualdp.allreduce import execute
from manualdp.schedule import get_schedule
from manualdp.spmd import (BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, all_gather, allreduce, broadcast, launch,
                           reduce, reduce_scatter)
from manualdp.support.checkpoint import lock_checkpoint_dir
from manualdp.zero3 import Zero3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001),
         "bucketed_big": functools.partial(BucketedDDP, bucket_cap_mb=25)}


def _try(out, name, fn, *tensors):
    before = [t.clone() for t in tensors]
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out[name] = ("err", type(e).__name__, str(e), all(torch.equal(t, b) for t, b in zip(tensors, before)))


def _raised_everywhere(res, name, *parts, unchanged=True):
    for r, out in enumerate(res):
        assert out[name][0] == "err", (r, name, out[name])
        _, kind, message, same = out[name]
        assert message.startswith(f"rank {r}: "), (r, name, kind, message)
        assert "\n" not in message.strip(), (r, name, message)
        for part in parts:
            assert part in message, (r, name, part, message)
        if unchanged:
            assert same, (r, name, "the refused call changed the tensor")


# ---------------------------------------------------------------------------------------------------------------
# The spmd collectives


def _collectives_job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    last = r == n - 1
    out = {}
    # dtypes the fingerprint has no slot for, of one element size: bool on one rank, float8 on the others
    t = torch.tensor([True, False, True, True]) if last else \
        torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.float8_e4m3fn)
    _try(out, "broadcast bool against float8", lambda: broadcast(t, 0, timeout=20), t)
    t = torch.tensor([True, False, True, True]) if last else \
        torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.float8_e5m2)
    _try(out, "all_gather bool against float8", lambda: all_gather(t, timeout=20), t)
    # complex against int64? both 8 bytes, complex has no slot; but int64 has one: must differ
    t = torch.arange(6, dtype=torch.int64) if last else torch.zeros(6, dtype=torch.complex64)
    _try(out, "broadcast int64 against complex64", lambda: broadcast(t, 0, timeout=20), t)
    # the step argument differs
    t = torch.arange(12.0)
    _try(out, "allreduce step", lambda: allreduce(t, "ring", timeout=20, step=5 if last else 4), t)
    # whatever came before, the group pairs messages right again
    t = torch.arange(12.0) + r
    _try(out, "after", lambda: (allreduce(t, "ring", timeout=20), t.clone())[1])
    # values, compared with torch's all_reduce on the same ranks
    g = torch.Generator().manual_seed(r)
    cases = {
        "fp16": torch.randn(37, generator=g).half(),
        "bf16": torch.randn(37, generator=g).bfloat16(),
        "int64 huge": torch.full((9,), 2 ** 60 // n, dtype=torch.int64) + r,
        "nan inf": torch.tensor([float("nan") if r == 0 else 1.0, float("inf"), -float("inf") if last else 2.0, 1e38]),
        "zero-dim": torch.tensor(3.0 + r),
        "one element": torch.tensor([3.0 + r]),
        "non-contiguous": torch.arange(24.0).view(4, 6).t()[:, 1:] + r,
        "float64 tiny": torch.full((5,), 1e-310, dtype=torch.float64) * (r + 1),
    }
    for algorithm in ("ring", "tree", "recursive_doubling", "auto"):
        for name, x in cases.items():
            mine, ref = x.clone(), x.clone()
            if ref.dtype == torch.bfloat16 or ref.dtype == torch.float16:
                ref = ref.float()
            dist.all_reduce(ref)
            _try(out, f"value {name} {algorithm}", lambda: (allreduce(mine, algorithm, timeout=20), mine)[1])
            out[f"ref {name}"] = ref
    # same number of elements, another shape: summed elementwise, as torch's all_reduce does
    t = (torch.arange(12.0).view(3, 4) if last else torch.arange(12.0).view(4, 3)) + r
    ref = t.clone().view(-1)
    dist.all_reduce(ref)
    _try(out, "another shape same size", lambda: (allreduce(t, "ring", timeout=20), torch.equal(t.view(-1), ref))[1])
    # fewer elements than ranks: reduce_scatter and all_gather of 1 element, a 0-dim broadcast and reduce
    x = torch.tensor([1.0 + r])
    _try(out, "reduce_scatter one element", lambda: reduce_scatter(x, timeout=20).clone())
    out["reduce_scatter one element x"] = x.clone()
    x = torch.tensor([1.0 + r, 2.0 + r])
    _try(out, "all_gather two elements", lambda: (all_gather(x, timeout=20), x.clone())[1])
    x = torch.tensor(5.0 + r)
    _try(out, "broadcast zero-dim", lambda: (broadcast(x, n - 1, timeout=20), x.clone())[1])
    x = torch.arange(10.0).view(2, 5).t() + r  # non-contiguous
    _try(out, "reduce non-contiguous", lambda: (reduce(x, 0, timeout=20), x.clone())[1])
    x = torch.arange(10.0).view(2, 5).t() + r
    _try(out, "broadcast non-contiguous", lambda: (broadcast(x, 0, timeout=20), x.clone())[1])
    x = torch.tensor([True, r == 0, False, True])
    _try(out, "broadcast bool", lambda: (broadcast(x, n - 1, timeout=20), x.clone())[1])
    x = torch.tensor([True, r == 0, False, True])
    _try(out, "allreduce bool", lambda: allreduce(x, "ring", timeout=20), x)
    # call counts: the last rank calls allreduce once more before a broadcast; then all catch up
    a, b = torch.ones(8), torch.ones(8)

    def extra():
        if last:
            allreduce(a, "ring", timeout=20)
        broadcast(b, 0, timeout=20)
    _try(out, "one allreduce more before a broadcast", extra, b)
    t = torch.arange(12.0) + r
    _try(out, "after counts", lambda: (allreduce(t, "ring", timeout=20), t.clone())[1])
    # last (it leaves the pairs closed): one rank calls with group=None, the others a new group of the same ranks
    sub = dist.new_group(list(range(n)))
    t = torch.arange(12.0)
    _try(out, "allreduce another group object", lambda: allreduce(t, "ring", group=sub if last else None, timeout=4), t)
    return out


@functools.lru_cache(maxsize=None)
def _collectives(n):
    return launch(_collectives_job, n, timeout=150)


@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_and_all_gather_bool_against_float8_raise_on_every_rank(n):
    res = _collectives(n)
    _raised_everywhere(res, "broadcast bool against float8", "dtype")
    _raised_everywhere(res, "all_gather bool against float8", "dtype")


@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_int64_against_complex64_raises_on_every_rank(n):
    _raised_everywhere(_collectives(n), "broadcast int64 against complex64", "dtype")


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_with_another_step_raises_on_every_rank(n):
    _raised_everywhere(_collectives(n), "allreduce step", "step 4..5")


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_on_another_group_object_of_the_same_ranks_ends_in_an_error_and_the_group_recovers(n):
    res = _collectives(n)
    for r, out in enumerate(res):
        assert out["allreduce another group object"][0] == "err", (r, out["allreduce another group object"])
        assert "\n" not in out["allreduce another group object"][2].strip()
    total = sum(torch.arange(12.0) + r for r in range(n))
    for r, out in enumerate(res):
        assert out["after"][0] == "ok" and torch.equal(out["after"][1], total), (r, out["after"])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling", "auto"])
@pytest.mark.parametrize("case", ["fp16", "bf16", "int64 huge", "nan inf", "zero-dim", "one element",
                                  "non-contiguous", "float64 tiny"])
def test_allreduce_values_equal_torchs_all_reduce(n, algorithm, case):
    res = _collectives(n)
    for r, out in enumerate(res):
        got = out[f"value {case} {algorithm}"]
        assert got[0] == "ok", (r, got)
        ref = out[f"ref {case}"]
        # half precision: the sum of n values in another order differs by at most a few ulps of the half type
        tol = {"fp16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}.get(case, dict(rtol=0, atol=0))
        torch.testing.assert_close(got[1].to(ref.dtype), ref, equal_nan=True, **tol, msg=f"rank {r}")
        assert got[1].shape == ref.shape and torch.equal(got[1], res[0][f"value {case} {algorithm}"][1]) or \
            torch.isnan(got[1]).any(), (r, "ranks differ")


@pytest.mark.parametrize("n", [2, 3])
def test_another_shape_of_the_same_size_sums_elementwise_as_torch(n):
    for r, out in enumerate(_collectives(n)):
        assert out["another shape same size"] == ("ok", True), (r, out["another shape same size"])


@pytest.mark.parametrize("n", [2, 3])
def test_fewer_elements_than_ranks_zero_dim_and_non_contiguous_collectives_are_right(n):
    res = _collectives(n)
    whole = torch.tensor([sum(1.0 + r for r in range(n))])
    gathered = []
    for r, out in enumerate(res):
        for name in ("reduce_scatter one element", "all_gather two elements", "broadcast zero-dim",
                     "reduce non-contiguous", "broadcast non-contiguous", "broadcast bool"):
            assert out[name][0] == "ok", (r, name, out[name])
        gathered.append(out["reduce_scatter one element x"])
        assert torch.equal(out["broadcast zero-dim"][1], torch.tensor(5.0 + n - 1)), r
        assert torch.equal(out["broadcast non-contiguous"][1], torch.arange(10.0).view(2, 5).t()), r
        assert torch.equal(out["broadcast bool"][1], torch.tensor([True, n == 1, False, True])), r
        assert torch.equal(out["all_gather two elements"][1], res[0]["all_gather two elements"][1]), r
    # the rank that owns the one element holds the sum
    assert any(torch.equal(x, whole) for x in gathered), gathered
    assert torch.equal(res[0]["reduce non-contiguous"][1], sum(torch.arange(10.0).view(2, 5).t() + r
                                                               for r in range(n)))


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_of_bool_is_refused_in_one_line_on_every_rank(n):
    for r, out in enumerate(_collectives(n)):
        assert out["allreduce bool"][0] == "err" and "bool" in out["allreduce bool"][2], (r, out["allreduce bool"])


@pytest.mark.parametrize("n", [2, 3])
def test_one_allreduce_more_on_one_rank_raises_on_every_rank_and_the_group_recovers(n):
    res = _collectives(n)
    for r, out in enumerate(res):
        got = out["one allreduce more before a broadcast"]
        assert got[0] == "err" and got[2].startswith(f"rank {r}: "), (r, got)


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_on_another_group_object_of_the_same_ranks_is_a_peer_error_on_every_rank(n):
    for r, out in enumerate(_collectives(n)):
        got = out["allreduce another group object"]
        assert got[0] == "err" and got[1] == "PeerError" and got[2].startswith(f"rank {r}: "), (r, got)


# ---------------------------------------------------------------------------------------------------------------
# The ladder's rungs on models that are not a plain stack, and between steps


class Odd(nn.Module):
    """A tied weight, a layer unused forever, a 0- and a 1-element parameter, a non-contiguous weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.unused = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0))
        self.scale = nn.Parameter(torch.tensor([1.5]))
        self.t = nn.Parameter(torch.randn(4, 4).t())  # non-contiguous

    def forward(self, x):
        h = torch.tanh(self.emb(x)) @ self.t
        return self.head(h) * self.scale + self.empty.sum()


class Mixed(nn.Module):
    """A float64 layer between float32 ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x)).double()).float())


class Loop(nn.ModuleDict):
    """A ModuleDict root with a parameter of its own, its layers called in a loop, one of them twice."""

    def __init__(self):
        super().__init__({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        for name in ("a", "b", "a"):
            x = torch.tanh(self[name](x))
        return x * self.w


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 4)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


def _ref_grads(net, x, backwards=1):
    """Every rank's gradients of `net` (rank 0's weights) averaged by torch's all_reduce: what DDP must give."""
    net = copy.deepcopy(net)
    for p in net.parameters():
        dist.broadcast(p.data, 0)
    for _ in range(backwards):
        net(x).pow(2).sum().backward()
    out = {}
    for name, p in net.named_parameters():
        if p.grad is None:  # unused (alike on every rank here): torch's DDP leaves its .grad None
            out[name] = None
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g / dist.get_world_size()
    return out


def _gap(model, ref):
    """The largest difference between the wrapped model's gradients and the reference (inf where one is missing)."""
    gap = 0.0
    for name, p in model.module.named_parameters():
        if ref[name] is None:
            if p.grad is not None:
                return float("inf")
            continue
        if p.grad is None or p.grad.dtype != ref[name].dtype:
            return float("inf")
        if p.numel():
            gap = max(gap, (p.grad.double() - ref[name].double()).abs().max().item())
    return gap


def _one_step(model, x, backwards=1):
    for _ in range(backwards):
        model(x).pow(2).sum().backward()
    return model


def _ladder_job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    last = r == n - 1
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    out = {}
    for name, make in RUNGS.items():
        for kind, cls in (("odd", Odd), ("mixed", Mixed), ("loop", Loop)):
            net = cls()
            ref = _ref_grads(net, x.double() if kind == "mixed_all" else x)
            _try(out, f"{name} {kind}", lambda: _gap(_one_step(make(net, timeout=20), x), ref))
        # the model in half precision
        net = Loop().half()
        ref = _ref_grads(net, x.half())
        _try(out, f"{name} fp16", lambda: _gap(_one_step(make(net, timeout=20), x.half()), ref))
        # gradient accumulation: two backward passes without zero_grad
        net = Loop()
        ref = _ref_grads(net, x, backwards=2)
        _try(out, f"{name} accumulate", lambda: _gap(_one_step(make(net, timeout=20), x, backwards=2), ref))
        # different weights at start on every rank: the replicas start from rank 0's
        torch.manual_seed(100 + r)
        net = nn.Linear(4, 4)
        _try(out, f"{name} other weights at start", lambda: (make(net, timeout=20), net.weight.detach().clone())[1])
        # an evaluation forward under no_grad on one rank only, between steps: changes nothing
        net = Loop()
        ref = _ref_grads(net, x)
        model = make(net, timeout=20)

        def evaluate_then_step():
            if r == 0:
                with torch.no_grad():
                    model(x)
            return _gap(_one_step(model, x), ref)
        _try(out, f"{name} no_grad forward on one rank", evaluate_then_step)
        # a validation forward with grad enabled and no backward on one rank only: every rank raises at the next step
        model = make(Loop(), timeout=20)

        def validate_then_step():
            if r == 0:
                model(x)
            _one_step(model, x)
        _try(out, f"{name} forward without backward on one rank", validate_then_step)
        # clip_grad_norm_ on the wrapped model's parameters, after backward
        net = Loop()
        ref = _ref_grads(net, x)
        total = torch.sqrt(sum(g.pow(2).sum() for g in ref.values()))
        model = make(net, timeout=20)

        def clip():
            _one_step(model, x)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            return abs(norm.item() - total.item()), _gap(model, {k: g * min(1.0, 0.1 / (total.item() + 1e-6))
                                                                  for k, g in ref.items()})
        _try(out, f"{name} clip_grad_norm_", clip)
        # pickle the inner module and a parameter after wrapping (torch.save(model.module), a common habit)
        net = Loop()
        model = make(net, timeout=20)
        _try(out, f"{name} pickle the module", lambda: len(pickle.dumps(net)) > 0)
        _try(out, f"{name} torch.save the module", lambda: torch.save(net, io.BytesIO()))
        _try(out, f"{name} deepcopy the wrapper", lambda: type(copy.deepcopy(model)).__name__)
        # wrap again once the first rung is gone
        del model
        gc.collect()
        ref = _ref_grads(net, x)
        _try(out, f"{name} wrap again after the first is gone", lambda: _gap(_one_step(make(net, timeout=20), x), ref))
        # the rung gone, the plain module's backward gives this rank's own gradients (torch's DDP removes its hooks)
        net = Loop()
        local = copy.deepcopy(net)
        model = make(net, timeout=20)
        del model
        gc.collect()

        def plain_backward():
            net(x).pow(2).sum().backward()
            return max((p.grad - q.grad).abs().max().item() for p, q in zip(net.parameters(), local.parameters()))
        for p in local.parameters():  # rank 0's weights, as the rung broadcast them
            dist.broadcast(p.data, 0)
        local.zero_grad()
        local(x).pow(2).sum().backward()
        _try(out, f"{name} plain backward after the rung is gone", plain_backward)
        # a model with one more layer, or in another dtype, on the last rank: refused on every rank
        _try(out, f"{name} another model", lambda: make(Mixed() if last else Loop(), timeout=20) and None)
        _try(out, f"{name} another dtype", lambda: make(Loop().double() if last else Loop(), timeout=20) and None)
        # BatchNorm: after two steps on different data, do the replicas' running statistics agree (torch's DDP: yes)
        model = make(Norm(), timeout=20)
        for _ in range(2):
            _one_step(model, x)
        out[f"{name} bn"] = model.module.bn.running_mean.clone()
    # torch's DDP on the same ranks, for BatchNorm
    model = nn.parallel.DistributedDataParallel(Norm())
    for _ in range(2):
        _one_step(model, x)
    out["torch bn"] = model.module.bn.running_mean.clone()
    return out


def _unused_job(rung):
    """AdamW with weight decay over a model with a layer no rank ever uses: torch leaves that layer alone."""
    torch.set_num_threads(1)
    r = dist.get_rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    mine = train(RUNGS[rung](Odd(), timeout=20))
    theirs = train(nn.parallel.DistributedDataParallel(Odd(), find_unused_parameters=True))
    return {k: (mine[k] - theirs[k]).abs().max().item() if mine[k].numel() else 0.0 for k in mine}


@functools.lru_cache(maxsize=None)
def _ladder(n):
    return launch(_ladder_job, n, timeout=240)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
@pytest.mark.parametrize("kind", ["odd", "mixed", "loop", "fp16", "accumulate", "no_grad forward on one rank"])
def test_rungs_average_like_torch_on_models_that_are_not_a_plain_stack(n, rung, kind):
    tol = 1e-2 if kind == "fp16" else 1e-5  # fp16: the sum of 3 halves in another order is an ulp (0.004 near 3) off
    for r, out in enumerate(_ladder(n)):
        got = out[f"{rung} {kind}"]
        assert got[0] == "ok" and got[1] <= tol, (r, got)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_rungs_start_from_rank0s_weights_and_refuse_another_model_or_dtype(n, rung):
    res = _ladder(n)
    for r, out in enumerate(res):
        got = out[f"{rung} other weights at start"]
        assert got[0] == "ok" and torch.equal(got[1], res[0][f"{rung} other weights at start"][1]), r
    _raised_everywhere(res, f"{rung} another model", unchanged=False)
    _raised_everywhere(res, f"{rung} another dtype", unchanged=False)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_forward_with_grad_and_no_backward_on_one_rank_raises_on_every_rank(n, rung):
    _raised_everywhere(_ladder(n), f"{rung} forward without backward on one rank", "step", unchanged=False)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_clip_grad_norm_sees_the_averaged_gradients(n, rung):
    for r, out in enumerate(_ladder(n)):
        got = out[f"{rung} clip_grad_norm_"]
        assert got[0] == "ok" and got[1][0] < 1e-5 and got[1][1] < 1e-6, (r, got)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_the_wrapped_module_can_be_pickled_and_saved_between_steps(n, rung):
    for r, out in enumerate(_ladder(n)):
        assert out[f"{rung} pickle the module"] == ("ok", True), (r, out[f"{rung} pickle the module"])
        assert out[f"{rung} torch.save the module"][0] == "ok", (r, out[f"{rung} torch.save the module"])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_batchnorm_running_statistics_follow_rank0s_as_with_torchs_ddp(n, rung):
    # torch's DDP copies rank 0's buffers to every rank before each training forward, which then updates them
    # with this rank's batch: after two steps each rank holds rank 0's statistics of step 1 moved by its own batch
    # (before: the rungs copied them at construction only, and each rank's drifted on its own)
    res = _ladder(n)
    assert not torch.equal(res[-1]["torch bn"], res[0]["torch bn"])  # the ranks' batches differ
    for r, out in enumerate(res):
        torch.testing.assert_close(out[f"{rung} bn"], out["torch bn"], rtol=0, atol=1e-7, msg=f"rank {r}")


@pytest.mark.parametrize("n", [2])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_deepcopy_of_a_rung_works_or_is_refused_in_one_clear_line(n, rung):
    for r, out in enumerate(_ladder(n)):
        got = out[f"{rung} deepcopy the wrapper"]
        assert got[0] == "ok" or ("rank" in got[2] and rung.rstrip("_big") in got[2].lower()), (r, got)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_module_whose_rung_is_gone_is_a_plain_module_again(n, rung):
    for r, out in enumerate(_ladder(n)):
        again = out[f"{rung} wrap again after the first is gone"]
        assert again[0] == "ok", (r, again)
        got = out[f"{rung} plain backward after the rung is gone"]
        assert got[0] == "ok" and got[1] == 0.0, (r, got)


@functools.lru_cache(maxsize=None)
def _unused(n, rung):
    return launch(_unused_job, n, (rung,), timeout=120)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_adamw_over_a_layer_no_rank_uses_matches_torchs_ddp(n, rung):
    for r, gaps in enumerate(_unused(n, rung)):
        assert max(gaps.values()) < 1e-6, (r, gaps)


# ---------------------------------------------------------------------------------------------------------------
# The book's ZeRO-3 (single controller)


class Tiny(nn.Module):
    """A 1-element and a 0-element parameter, and a layer no device ever uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.unused = nn.Linear(6, 5), nn.Linear(3, 3)
        self.one, self.empty = nn.Parameter(torch.tensor([2.0])), nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.a(x) * self.one + self.empty.sum()


def _zbatches(steps=3, size=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(steps)]


def _one_device(net, make, batches):
    opt = make(net.parameters())
    for X, y in batches:
        opt.zero_grad()
        (nn.functional.cross_entropy(net(X), y, reduction="sum") / len(X)).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("n", [2, 3])
def test_zero3_with_adamw_leaves_a_layer_nobody_uses_alone_and_handles_0_and_1_element_parameters(n):
    batches = _zbatches()
    want = _one_device(Tiny(), functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.1), batches)
    zero = Zero3(replicate(Tiny(), cpu_devices(n)), torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    for X, y in batches:
        zero.train_batch(X, y)
    for got, w in zip(zero.full_parameters(), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_zero3_stop_and_resume_is_bitwise_and_another_device_count_is_refused(n):
    batches = _zbatches()
    zero = Zero3(replicate(Tiny(), cpu_devices(n)), torch.optim.Adam, lr=0.1)
    zero.train_batch(*batches[0])
    state = copy.deepcopy(zero.state_dict())
    zero.train_batch(*batches[1])
    again = Zero3(replicate(Tiny(), cpu_devices(n)), torch.optim.Adam, lr=0.1)
    again.load_state_dict(pickle.loads(pickle.dumps(state)))
    again.train_batch(*batches[1])
    assert all(torch.equal(a, b) for a, b in zip(zero.full_parameters(), again.full_parameters()))
    other = Zero3(replicate(Tiny(), cpu_devices(n + 1)), torch.optim.Adam, lr=0.1)
    with pytest.raises(ValueError, match="this many devices"):
        other.load_state_dict(state)


def test_zero3_refuses_a_batch_smaller_than_the_devices_replicas_of_other_dtypes_and_a_unit_named_twice():
    zero = Zero3(replicate(Tiny(), cpu_devices(3)), torch.optim.SGD, lr=0.1)
    X, y = _zbatches(1)[0]
    with pytest.raises(ValueError, match="smaller than the 3 devices"):
        zero.train_batch(X[:1], y[:1])
    with pytest.raises(ValueError, match="smaller than the 3 devices"):
        zero.train_batch(X[:0], y[:0])
    with pytest.raises(ValueError, match="same length"):
        zero.train_batch(X, y[:5])
    replicas = replicate(Tiny(), cpu_devices(2))
    replicas[1].double()
    with pytest.raises(ValueError, match="replicas\\[1\\]"):
        Zero3(replicas, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="named twice"):
        Zero3(replicate(Tiny(), cpu_devices(2)), torch.optim.SGD, units=["a", "a"], lr=0.1)


@pytest.mark.parametrize("n", [2, 3])
def test_zero3_skips_an_inf_example_when_asked_and_changes_nothing(n):
    zero = Zero3(replicate(Tiny(), cpu_devices(n)), torch.optim.SGD, lr=0.1)
    before = [p.clone() for p in zero.full_parameters()]
    X, y = _zbatches(1)[0]
    X[0, 0] = float("inf")
    result = zero.train_batch(X, y, nonfinite="skip")
    assert result.skipped and all(torch.equal(a, b) for a, b in zip(before, zero.full_parameters()))


def test_zero3_in_half_precision_equals_one_device_in_half_precision():
    batches = [(X.half(), y) for X, y in _zbatches(1)]
    want = _one_device(Tiny().half(), functools.partial(torch.optim.SGD, lr=0.1), batches)
    zero = Zero3(replicate(Tiny().half(), cpu_devices(2)), torch.optim.SGD, lr=0.1)
    zero.train_batch(*batches[0])
    for got, w in zip(zero.full_parameters(), want):
        torch.testing.assert_close(got, w, rtol=0, atol=2e-3)


# ---------------------------------------------------------------------------------------------------------------
# manualdp.allreduce.execute with the book's schedules


ALGORITHMS = ["ring", "tree", "recursive_doubling", "halving_doubling"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", ["fp16", "0-dim", "empty", "non-contiguous", "nan"])
def test_execute_sums_values_off_the_happy_path(algorithm, case):
    make = {"fp16": lambda i: torch.full((5,), 0.1 * (i + 1)).half(),
            "0-dim": lambda i: torch.tensor(float(i)),
            "empty": lambda i: torch.ones(0),
            "non-contiguous": lambda i: torch.arange(12.0).view(3, 4).t() + i,
            "nan": lambda i: torch.tensor([float("nan") if i == 0 else 1.0, 1.0])}[case]
    tensors = [make(i) for i in range(3)]
    want = sum(t.float() for t in tensors)
    execute(get_schedule(algorithm, 3), tensors)
    for t in tensors:
        torch.testing.assert_close(t.float(), want, rtol=1e-3, atol=1e-3, equal_nan=True)


@pytest.mark.parametrize("algorithm", ["tree"])
def test_execute_refuses_a_bool_tensor_at_any_index(algorithm):
    tensors = [torch.ones(4), torch.ones(4, dtype=torch.bool), torch.ones(4)]
    with pytest.raises((TypeError, ValueError), match="bool"):
        execute(get_schedule(algorithm, 3), tensors)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_execute_refuses_tensors_of_other_sizes_before_changing_any(algorithm):
    tensors = [torch.ones(8), torch.ones(1), torch.ones(8)]
    before = [t.clone() for t in tensors]
    with pytest.raises((TypeError, ValueError)):
        execute(get_schedule(algorithm, 3), tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


# ---------------------------------------------------------------------------------------------------------------
# The command line, explain --plot and figures.py --out


SMALL = ["--no-progress", "--num-train", "256", "--num-test", "128", "--batch-size", "64", "--epochs", "1"]


def _cli(*argv, module=True, timeout=120):
    cmd = [sys.executable, *(["-m", "manualdp"] if module else []), *argv]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def odd(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/nonexistent/x", tmp_path / "dangling")
    os.symlink("/dev/null", tmp_path / "null.png")
    os.symlink("/dev/null", tmp_path / "null.json")
    (tmp_path / "afile").write_text("hi")
    (tmp_path / "exists.json").write_text("old")
    return tmp_path


@pytest.mark.parametrize("argv, words", [
    (["--json", "{t}/h.json", "--checkpoint-dir", "{t}/h.json"], "name the same file"),
    (["--json", "{t}/dangling"], "does not exist"),
    (["--checkpoint-dir", "{t}/afile"], "not a folder"),
    (["--checkpoint-dir", "{t}/fifo"], "not a folder"),
    (["--json", "/proc/self/x.json"], "cannot write"),
    (["--zero", "3", "--json", "{t}/dangling"], "does not exist"),
])
def test_train_refuses_outputs_that_cannot_work_in_one_line(odd, argv, words):
    rc, out, err = _cli("train", *SMALL, *[a.format(t=odd) for a in argv])
    assert rc == 2 and "Traceback" not in err and words in err.strip().splitlines()[-1], (rc, err)
    assert sorted(os.listdir(odd)) == ["afile", "dangling", "exists.json", "fifo", "null.json", "null.png"]


def test_train_over_an_existing_json_and_into_a_symlink_to_dev_null(odd):
    rc, out, err = _cli("train", *SMALL, "--zero", "3", "--devices", "3", "--json", str(odd / "exists.json"))
    assert rc == 0 and (odd / "exists.json").read_text().startswith("{"), err
    rc, out, err = _cli("train", *SMALL, "--json", str(odd / "null.json"))
    assert rc == 0 and os.path.islink(odd / "null.json"), err


@pytest.mark.parametrize("algorithm, plot, words", [("zero3", "{t}/dangling.png", None),
                                                     ("ring", "/dev/stdout", "must end in .png"),
                                                     ("zero3", "/proc/x.png", "cannot write"),
                                                     ("ring", "{t}/null.png", None)])
def test_explain_plot_paths(odd, algorithm, plot, words):
    if not os.path.exists(odd / "dangling.png"):
        os.symlink("/nonexistent/x.png", odd / "dangling.png")
    plot = plot.format(t=odd)
    rc, out, err = _cli("explain", algorithm, "--devices", "2", "--plot", plot)
    assert "Traceback" not in err
    if words is None:  # a symlink to a missing folder is refused, one to /dev/null written through
        assert (rc == 2 and "does not exist" in err) if "dangling" in plot else rc == 0, (rc, err)
    else:
        assert rc == 2 and words in err.strip().splitlines()[-1], (rc, err)


def test_figures_out_a_symlink_to_a_file_or_dev_stdout_is_one_line(odd):
    for out_ in (str(odd / "afile"), "/dev/stdout"):
        rc, out, err = _cli(os.path.join("book", "figures.py"), "--out", out_, "--fast", "bytes.png", module=False)
        last = err.strip().splitlines()[-1]
        assert rc == 2 and "Traceback" not in err and last.startswith(f"python book/figures.py: error: --out "), err
        assert "not a folder" in last or "cannot write" in last, (out_, rc, err)


def test_figures_out_a_dangling_symlink_is_one_line(odd):
    rc, out, err = _cli(os.path.join("book", "figures.py"), "--out", str(odd / "dangling"), "--fast", "bytes.png",
                        module=False)
    assert rc == 2 and "Traceback" not in err, (rc, err)


def test_figures_out_a_folder_where_a_figure_name_is_a_folder_is_one_line_before_work(odd):
    (odd / "figs" / "bytes.png").mkdir(parents=True)
    rc, out, err = _cli(os.path.join("book", "figures.py"), "--out", str(odd / "figs"), "--fast", "bytes.png",
                        module=False)
    assert rc == 2 and "Traceback" not in err, (rc, err)


def test_torchrun_zero3_with_an_output_in_a_missing_folder_is_one_line_per_rank(odd):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "manualdp", "train", *SMALL,
                        "--zero", "3", "--json", str(odd / "dangling" / "t.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [l for l in p.stderr.splitlines() if l.startswith("manualdp train: error:")]
    assert p.returncode != 0 and len(lines) == 2 and "does not exist" in lines[0], p.stderr[-2000:]
    assert not any("manualdp" in l and "File \"" in l for l in p.stderr.splitlines()), p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint lock


def test_the_lock_is_refused_to_a_second_taker_in_the_same_process_under_any_name(tmp_path):
    d = tmp_path / "ckpt"
    release = lock_checkpoint_dir(str(d))
    try:
        for name in (str(d) + "/", str(d) + "/.", str(tmp_path / "x" / ".." / "ckpt")):
            (tmp_path / "x").mkdir(exist_ok=True)
            with pytest.raises(ValueError, match="in use by process"):
                lock_checkpoint_dir(name)
    finally:
        release()
    release()  # a second release does nothing
    again = lock_checkpoint_dir(str(d))  # and the lock can be taken again
    again()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "x"]


def test_the_lock_of_a_path_that_is_a_file_or_empty_is_an_error_naming_it(tmp_path):
    (tmp_path / "afile").write_text("hi")
    with pytest.raises((ValueError, OSError), match="afile"):
        lock_checkpoint_dir(str(tmp_path / "afile"))
    with pytest.raises((ValueError, OSError)):
        lock_checkpoint_dir("")
    assert sorted(os.listdir(tmp_path)) == ["afile"]
