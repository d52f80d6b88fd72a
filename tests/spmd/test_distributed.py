"""manualdp.distributed: the p2p allreduce and the DDP-compatible wrapper, against torch's own.

Multi-process checks run in one spawned job per world size (2, 3, 4 ranks, gloo on
127.0.0.1, one thread each, killed after a timeout); each job returns tensors and the
assertions run here, in the parent.
"""
import copy
import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.allreduce import run_schedule
from manualdp.distributed import DistributedDataParallel, allreduce, plan
from manualdp.spmd.transport.group import group_state
from manualdp.spmd.transport.p2p import run_allreduce
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.spmd import launch, shard
from manualdp.split import split_batch

JOB_TIMEOUT = 120.0
SIZES = [(0, None), (1, None), ("n-1", None), ("n+1", None), (1001, None), (30011, 1000)]  # (numel, segment_bytes)
DTYPES = [torch.float32, torch.float64, torch.int64]


# ---------------------------------------------------------------- in one process

@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), n=st.integers(1, 9), numel=st.integers(0, 60),
       segment=st.integers(1, 8))
def test_plan_messages_match_and_compute_the_single_controller_sum(algorithm, n, numel, segment):
    schedule = get_schedule(algorithm, n)
    plans = [plan(schedule, r, numel, segment) for r in range(n)]
    g = torch.Generator().manual_seed(numel)
    inputs = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(n)]
    flats = [x.clone() for x in inputs]
    for rnd in range(len(schedule.rounds)):
        sent = {}  # (src, dst) -> the slices src sends, in order
        for r in range(n):
            for m in plans[r][rnd].sends:
                assert 0 < m.hi - m.lo <= segment
                sent.setdefault((r, m.peer), []).append((m.lo, m.hi, flats[r][m.lo:m.hi].clone()))
        for r in range(n):
            assert plans[r][rnd].scratch == sum(m.hi - m.lo for m in plans[r][rnd].recvs if m.reduce)
            here = plans[r][rnd]  # what a rank receives and also sends in a round (partners swap) is added only
            for k, m in enumerate(here.recvs):  # once every send of it has gone: they are among the first sends_before
                overlapping = [j for j, x in enumerate(here.sends) if m.lo < x.hi and x.lo < m.hi]
                if overlapping:
                    assert m.reduce and here.sends_before[k] > max(overlapping), (algorithm, n, r, rnd, m)
            for m in plans[r][rnd].recvs:
                lo, hi, data = sent[(m.peer, r)].pop(0)  # FIFO per direction, as isend/irecv match
                assert (lo, hi) == (m.lo, m.hi)
                if m.reduce:
                    flats[r][lo:hi].add_(data)
                else:
                    flats[r][lo:hi].copy_(data)
        assert all(not rest for rest in sent.values()), "a send without its receive"
    expected = [x.clone() for x in inputs]
    run_schedule(schedule, expected)
    for got, want in zip(flats, expected):
        assert torch.equal(got, want)


def test_a_swap_adds_each_segment_once_its_own_send_has_gone_and_plan_stays_linear_in_segments(deadline):
    # Recursive doubling at two ranks, 8 elements in segments of 2: segment k is added once sends 0..k have gone,
    # while the later ones are still going out.
    (swap,) = plan(get_schedule("recursive_doubling", 2), 0, 8, 2)
    assert [(m.lo, m.hi) for m in swap.sends] == [(m.lo, m.hi) for m in swap.recvs] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert swap.sends_before == (1, 2, 3, 4)
    assert all(r.sends_before == () for r in plan(get_schedule("ring", 2), 0, 8, 2))  # nothing sent is received
    with deadline(30):  # one-element segments: comparing every pair of them took 87 s for the ring of four
        for algorithm in ("ring", "recursive_doubling"):
            plan(get_schedule(algorithm, 4), 0, 1 << 16, 1)


@pytest.mark.parametrize("call, error, words", [
    (lambda: allreduce([torch.ones(2)]), TypeError, "tensor must be a torch.Tensor"),
    (lambda: allreduce(torch.ones(2, dtype=torch.bool)), TypeError, "torch.bool"),
    (lambda: allreduce(torch.ones(2, dtype=torch.uint16)), TypeError, "torch.uint16, which torch cannot add on cpu"),
    (lambda: allreduce(torch.zeros(2, dtype=torch.float8_e4m3fn)), TypeError, "float8_e4m3fn, which torch cannot add"),
    (lambda: allreduce(torch.ones(1).expand(3)), ValueError, "stride 0"),
    (lambda: allreduce(torch.ones(2), "rings"), ValueError, "'rings'"),
    (lambda: allreduce(torch.ones(2), segment_bytes=0), ValueError, "segment_bytes"),
    (lambda: allreduce(torch.ones(2)), RuntimeError, "not initialised"),
    (lambda: plan(get_schedule("ring", 2), 2, 10, 1), ValueError, "rank must be an int >= 0 and <= 1, got 2"),
    (lambda: plan(get_schedule("ring", 2), 0, -1, 1), ValueError, "numel"),
    (lambda: plan(get_schedule("ring", 2), 0, 10, 0), ValueError, "segment_numel"),
    (lambda: plan("ring", 0, 10, 1), TypeError, "schedule must be a Schedule"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2).parameters()), TypeError, "module must be an nn.Module"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), algorithm="fast"), ValueError, "'fast'"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers="yes"), TypeError, "broadcast_buffers"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False)), ValueError, "no parameters"),
    (lambda: DistributedDataParallel(nn.Sequential(nn.LazyLinear(2))), ValueError, "uninitialized .* forward pass"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1]), ValueError, "device_ids"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2)), RuntimeError, "not initialised"),
])
def test_bad_input_is_a_clear_error(call, error, words):
    assert not dist.is_initialized()
    with pytest.raises(error, match=words):
        call()


def test_bad_input_leaves_the_tensor_unchanged():
    x = torch.arange(4.0)
    with pytest.raises(ValueError):
        allreduce(x, "nope")
    assert torch.equal(x, torch.arange(4.0))


@given(batch=st.integers(1, 40), n=st.integers(1, 6))
def test_shard_is_split_batch_shard(batch, n):
    X, y = torch.randn(batch, 3), torch.arange(batch)
    if batch < n:
        with pytest.raises(ValueError, match="smaller than"):
            shard(X, y, 0, n)
        return
    Xs, ys = split_batch(X, y, ["cpu"] * n)
    for r in range(n):
        a, b = shard(X, y, r, n)
        assert torch.equal(a, Xs[r]) and torch.equal(b, ys[r])


# ---------------------------------------------------------------- helpers that run on every rank

def _input(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _numel(size, n):
    return {"n-1": n - 1, "n+1": n + 1}.get(size, size)


def _allreduce_checks():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in sorted(ALGORITHMS):
        for size, segment_bytes in SIZES:
            for dtype in DTYPES:
                x = _input(rank, _numel(size, n), dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                kw = {"segment_bytes": segment_bytes} if segment_bytes else {}
                allreduce(x, algorithm, **kw)
                out[(algorithm, size, dtype)] = (x, ref)
        # The executor NCCL would use (one group per round), run here on gloo.
        x = _input(rank, 1001, torch.float64)
        run_allreduce(x, algorithm, group_state(), segment_bytes=800, early=False)
        out[(algorithm, "grouped")] = x
        x = _input(rank, 35, torch.float32).view(7, 5).t()  # not contiguous
        ref = x.contiguous()
        dist.all_reduce(ref)
        allreduce(x, algorithm)
        out[(algorithm, "transposed")] = (x.clone(), ref)
    if n >= 3:  # a group whose rank 0 is global rank 1: group ranks must be mapped to global ones
        group = dist.new_group([1, 2])
        for algorithm in sorted(ALGORITHMS):
            x = _input(rank, 101, torch.float64)
            if rank in (1, 2):
                allreduce(x, algorithm, group)
            out[(algorithm, "group")] = x
    return out


def _mlp(dtype=torch.float64):
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)


def _bn_net(dtype=torch.float64):
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _batches(steps, batch=13, seed=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g, dtype=dtype), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _shard_loss(model, X, y, rank, n):
    Xs, ys = shard(X, y, rank, n)
    return nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n


def _equivalence(algorithm, bucket_cap_mb, steps=3):
    """Ours, torch's DDP and one process on the global batch, step by step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # every rank starts elsewhere: construction must fix that
    ours = DistributedDataParallel(_mlp(), bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    out = {"init": _flat(ours.parameters()), "buckets": len(ours._buckets), "steps": []}
    theirs = TorchDDP(copy.deepcopy(ours.module))
    single = copy.deepcopy(ours.module)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs, single)]
    for X, y in _batches(steps):
        for opt in opts:
            opt.zero_grad()
        _shard_loss(ours, X, y, rank, n).backward()
        _shard_loss(theirs, X, y, rank, n).backward()
        (nn.functional.cross_entropy(single(X), y, reduction="sum") / len(X)).backward()
        grads = _flat(p.grad for p in ours.parameters())
        for opt in opts:
            opt.step()
        out["steps"].append({"ours": _flat(ours.parameters()), "theirs": _flat(theirs.parameters()),
                             "single": _flat(single.parameters()), "grads": grads})
    return out


def _no_sync():
    """Two micro-batches, the first under no_sync, then one step: ours against torch's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = DistributedDataParallel(_mlp(), bucket_cap_mb=0.0005)
    theirs = TorchDDP(copy.deepcopy(ours.module), bucket_cap_mb=0.0005)
    out = {"local": [], "ours": [], "theirs": []}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for first, second in zip(_batches(2, seed=7), _batches(2, seed=8)):
            opt.zero_grad()
            with model.no_sync():
                _shard_loss(model, *first, rank, n).backward()
            if key == "ours":
                out["local"].append(_flat(p.grad for p in model.parameters()))
            _shard_loss(model, *second, rank, n).backward()
            opt.step()
        out[key] = _flat(model.parameters())
    return out


class _TwoHeads(nn.Module):
    """Head `b` is used on rank 0 only; head `never` on no rank."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b, self.never = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _unused():
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = DistributedDataParallel(_TwoHeads().double(), bucket_cap_mb=0.0002, find_unused_parameters=True)
    theirs = TorchDDP(copy.deepcopy(ours.module), find_unused_parameters=True)
    out = {}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for X, y in _batches(3):
            Xs, ys = shard(X, y, rank, n)
            opt.zero_grad()
            (nn.functional.cross_entropy(model(Xs, rank == 0), ys, reduction="sum") / len(X) * n).backward()
            opt.step()
        out[key] = _flat(model.parameters())
        out[key + "_never_grad"] = model.module.never.weight.grad
        out[key + "_b_grad"] = model.module.b.weight.grad  # used on rank 0 only
    return out


def _buffers():
    """BatchNorm: buffers follow rank 0 before every forward, as with torch's DDP."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    ours = DistributedDataParallel(_bn_net(), bucket_cap_mb=0.0005)
    after_init = _flat(ours.buffers())
    theirs = TorchDDP(copy.deepcopy(ours.module), bucket_cap_mb=0.0005)
    out = {"init": after_init}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for X, y in _batches(3, batch=16):
            opt.zero_grad()
            _shard_loss(model, X, y, rank, n).backward()
            opt.step()
        out[key] = _flat(model.parameters())
        out[key + "_buffers"] = _flat(model.module.buffers())
    return out


def _mismatch():
    """Models that differ on rank 1: every rank must raise, none may hang."""
    rank = dist.get_rank()
    messages = []
    for model in (nn.Linear(6, 5 if rank == 1 else 4),  # same count, other shape
                  nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 if rank == 0 else 2)])):  # more parameters
        try:
            DistributedDataParallel(model)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    x = torch.ones(3) * (rank + 1)
    allreduce(x)  # the group still works afterwards
    messages.append(x)
    return messages


def _after_wrapper_is_gone():
    """A module whose wrapper was deleted trains locally again: its hooks went with the wrapper."""
    import gc
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = _mlp()
    DistributedDataParallel(module)
    gc.collect()
    X, y = _batches(1, seed=rank)[0]
    nn.functional.cross_entropy(module(X), y).backward()
    return _flat(p.grad for p in module.parameters())


def _job(n):
    out = {"allreduce": _allreduce_checks()}
    algorithm = {2: "ring", 3: "tree", 4: "naive"}[n]
    out["equivalence"] = _equivalence(algorithm, bucket_cap_mb=0.0005)
    if n == 2:
        out["equivalence_one_bucket"] = _equivalence("tree", bucket_cap_mb=25)
        out["no_sync"] = _no_sync()
        out["unused"] = _unused()
        out["buffers"] = _buffers()
        out["mismatch"] = _mismatch()
        out["gone"] = _after_wrapper_is_gone()
    return out


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, (n,), timeout=JOB_TIMEOUT)


# ---------------------------------------------------------------- across processes

@pytest.mark.parametrize("n", [2, 3, 4])
def test_spmd_allreduce_equals_all_reduce_and_the_single_controller(n):
    results = _results(n)
    for algorithm in sorted(ALGORITHMS):
        for size, _ in SIZES:
            for dtype in DTYPES:
                key = (algorithm, size, dtype)
                inputs = [_input(r, _numel(size, n), dtype) for r in range(n)]
                run_schedule(get_schedule(algorithm, n), inputs)  # the single-controller executor
                for r in range(n):
                    got, ref = results[r]["allreduce"][key]
                    assert torch.equal(got, results[0]["allreduce"][key][0]), f"{key}: rank {r} differs from rank 0"
                    assert torch.equal(got, inputs[r]), f"{key}: differs from the single-controller executor"
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for r in range(n):
            got, ref = results[r]["allreduce"][(algorithm, "transposed")]
            torch.testing.assert_close(got, ref)
        inputs = [_input(r, 1001, torch.float64) for r in range(n)]
        run_schedule(get_schedule(algorithm, n), inputs)
        for r in range(n):
            assert torch.equal(results[r]["allreduce"][(algorithm, "grouped")], inputs[r]), "grouped executor"


@pytest.mark.parametrize("n", [3, 4])
def test_spmd_allreduce_in_a_subgroup(n):
    results = _results(n)
    for algorithm in sorted(ALGORITHMS):
        expected = _input(1, 101, torch.float64) + _input(2, 101, torch.float64)
        for r in range(n):
            got = results[r]["allreduce"][(algorithm, "group")]
            if r in (1, 2):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
            else:
                assert torch.equal(got, _input(r, 101, torch.float64)), "a rank outside the group was changed"


@pytest.mark.parametrize("n, key", [(2, "equivalence"), (2, "equivalence_one_bucket"), (3, "equivalence"),
                                    (4, "equivalence")])
def test_parameters_equal_torch_ddp_and_one_process_after_every_step(n, key):
    results = [r[key] for r in _results(n)]
    if key == "equivalence":
        assert results[0]["buckets"] >= 3, "the cap should force several buckets"
    for r in range(n):
        assert torch.equal(results[r]["init"], results[0]["init"]), "construction must broadcast rank 0's parameters"
    for step in range(len(results[0]["steps"])):
        for r in range(n):
            got = results[r]["steps"][step]
            torch.testing.assert_close(got["ours"], got["theirs"], rtol=0, atol=1e-12)
            torch.testing.assert_close(got["ours"], got["single"], rtol=0, atol=1e-10)
            assert torch.equal(got["grads"], results[0]["steps"][step]["grads"]), "gradients differ across ranks"
            assert torch.equal(got["ours"], results[0]["steps"][step]["ours"]), "parameters differ across ranks"
    first = results[0]["steps"][0]
    assert not torch.equal(first["ours"], results[0]["init"]), "training did not move the parameters"


def test_no_sync_accumulates_like_torch_ddp():
    results = [r["no_sync"] for r in _results(2)]
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
    assert torch.equal(results[0]["ours"], results[1]["ours"])
    # Inside no_sync nothing is exchanged: the ranks' gradients are still their own.
    assert not torch.allclose(results[0]["local"][0], results[1]["local"][0])


def test_unused_parameters_behave_like_torch_ddp():
    results = [r["unused"] for r in _results(2)]
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
        # used by no rank: no gradient at all, so SGD leaves it alone (DDP: the same)
        assert results[r]["ours_never_grad"] is None and results[r]["theirs_never_grad"] is None
        # used by rank 0 only: both ranks get the average, rank 1 counting as zero
        torch.testing.assert_close(results[r]["ours_b_grad"], results[r]["theirs_b_grad"], rtol=0, atol=1e-12)
        assert results[r]["ours_b_grad"].abs().sum() > 0
    assert torch.equal(results[0]["ours"], results[1]["ours"])


def test_buffers_are_broadcast_like_torch_ddp():
    results = [r["buffers"] for r in _results(2)]
    assert torch.equal(results[0]["init"], results[1]["init"])
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
        torch.testing.assert_close(results[r]["ours_buffers"], results[r]["theirs_buffers"], rtol=0, atol=1e-12)


def test_a_model_that_differs_across_ranks_fails_on_every_rank():
    results = [r["mismatch"] for r in _results(2)]
    for r in range(2):
        shape_msg, count_msg, after = results[r]
        assert shape_msg is not None and "differs across ranks" in shape_msg and "(5, 6)" in shape_msg
        assert count_msg is not None and "differs across ranks" in count_msg and "parameters and buffers" in count_msg
        assert torch.equal(after, torch.full((3,), 3.0))


def test_deleting_the_wrapper_removes_its_hooks():
    local = [r["gone"] for r in _results(2)]
    assert not torch.allclose(local[0], local[1]), "gradients were still averaged after the wrapper was deleted"


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected")


def _failed_backward():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = DistributedDataParallel(net, bucket_cap_mb=None, timeout=10)
    x = torch.randn(3, 4)
    try:  # layer 1's gradients arrive (its bucket goes out), then backward raises
        net[1](_Boom.apply(net[0](x))).sum().backward()
    except RuntimeError as e:
        first = str(e)
    try:
        model(x)
        return first, "no error"
    except RuntimeError as e:
        return first, str(e)


def test_after_a_failed_backward_the_next_forward_says_the_ranks_are_out_of_step():
    for first, second in launch(_failed_backward, 2, timeout=JOB_TIMEOUT):
        assert first == "injected"
        assert "previous backward pass failed part-way" in second


def test_a_dtype_probe_that_runs_out_of_memory_is_raised_and_not_remembered(monkeypatch):
    from manualdp import validate
    validate._adds.cache_clear()
    zeros = torch.zeros

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CPU out of memory")
    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        validate.check_summable(torch.ones(2, dtype=torch.float16))
    monkeypatch.setattr(torch, "zeros", zeros)
    assert validate.check_summable(torch.ones(2, dtype=torch.float16)) is not None  # asked again, and it adds
