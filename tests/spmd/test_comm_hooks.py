"""Comm hooks: what a hook hands back is checked, ranks agree on the hook, and each hook computes what it says.

One spawned job (2 ranks, gloo on 127.0.0.1, killed after a timeout) runs every scenario and
returns tensors or the error it met; the assertions run here, in the parent. Scenarios that
break their process group's worker (a refused hook) run on a group of their own.
"""
import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import PeerError, launch
from manualdp.spmd import comm_hooks as hooks
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 120.0
N = 2  # ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batches(rank, steps=3):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (5,), generator=g))
            for _ in range(steps)]


def _train(model, batches):
    """SGD on `batches`; the flat parameters after every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
        rows.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return rows


def _error_of(fn):
    """What `fn()` raised: its type, message and how long it took; None if it returned."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start,
                "peer_error": isinstance(e, PeerError)}
    return None


def _one_step(model):
    X, y = _batches(dist.get_rank(), steps=1)[0]
    nn.functional.cross_entropy(model(X), y).backward()


# ---------------------------------------------------------------- hooks that hand back the wrong thing

def one_element_hook(state, bucket):
    return hooks._done(bucket.buffer()[:1].clone())


def twice_the_size_hook(state, bucket):
    return hooks._done(torch.cat([bucket.buffer(), bucket.buffer()]))


def integer_hook(state, bucket):
    return hooks._done(bucket.buffer().long())


def tensor_not_future_hook(state, bucket):
    return bucket.buffer()


def never_done_hook(state, bucket):
    return torch.futures.Future()


# ---------------------------------------------------------------- scenarios (run on every rank)

def _bad_results():
    """Each bad hook on both ranks, each on a group of its own: every rank raises, naming hook and value."""
    out = {}
    for hook in (one_element_hook, twice_the_size_hook, integer_hook, tensor_not_future_hook):
        group = dist.new_group(backend="gloo")
        model = DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb=None, timeout=20)
        model.register_comm_hook(None, hook)
        out[hook.__name__] = {"error": _error_of(lambda: _one_step(model)),
                              "buckets": [b.grads.numel() for b in model._buckets]}
    return out


def _never_done():
    """A future that never completes ends at the wrapper's timeout."""
    group = dist.new_group(backend="gloo")
    model = DistributedDataParallel(_mlp(), process_group=group, timeout=1.0)
    model.register_comm_hook(None, never_done_hook)
    return _error_of(lambda: _one_step(model))


def _one_rank_hook():
    """A hook registered on rank 0 only: every rank raises at the first step, naming both."""
    group = dist.new_group(backend="gloo")
    model = DistributedDataParallel(_mlp(), process_group=group, timeout=20)
    if dist.get_rank() == 0:
        model.register_comm_hook(group, hooks.allreduce_hook)
    mismatch = _error_of(lambda: _one_step(model))
    # Registering once training has started is refused: the ranks compared their hooks already.
    late = DistributedDataParallel(_mlp(), timeout=20)
    _one_step(late)
    return {"mismatch": mismatch, "late": _error_of(lambda: late.register_comm_hook(None, hooks.allreduce_hook))}


class _WithEmpty(nn.Module):
    """An MLP with zero-size parameters beside it: an empty layer, an empty matrix each way."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.none_in = nn.Linear(0, 3).double()  # weight 3x0
        self.rows = nn.Parameter(torch.zeros(0, 5, dtype=torch.float64))
        self.cols = nn.Parameter(torch.zeros(5, 0, dtype=torch.float64))

    def forward(self, x):
        empty = self.none_in(x[:, :0]).sum() + self.rows.sum() + self.cols.sum()
        return self.body(x) + empty


def _powersgd_zero_size():
    """PowerSGD on a model with zero-size parameters: full rank equals torch's DDP, rank 1 runs."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = _WithEmpty()
    ours = DistributedDataParallel(copy.deepcopy(module), bucket_cap_mb=None)
    ours.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=16), hooks.powerSGD_hook)
    low = DistributedDataParallel(copy.deepcopy(module))
    low.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=1), hooks.powerSGD_hook)
    theirs = TorchDDP(copy.deepcopy(module))
    return {"full": _train(ours, _batches(rank)), "torch": _train(theirs, _batches(rank)),
            "rank1": _train(low, _batches(rank))[-1]}


VALUES = [1 + 2**-9, 1e30, 1e-8, 3.0]  # bf16 rounds 1+2^-9 to 1, fp16 keeps it; fp16 overflows 1e30, flushes 1e-8


def _compressed():
    """The compression hooks on a bucket of VALUES, the same on both ranks: the mean is each value rounded."""
    out = {}
    for hook in (hooks.bf16_compress_hook, hooks.fp16_compress_hook):
        buffer = torch.tensor(VALUES, dtype=torch.float32)
        bucket = hooks.GradBucket(0, buffer, [buffer], [0, len(VALUES)], True)
        out[hook.__name__] = hook(None, bucket).wait().clone()
    return out


def _powersgd_steps(rank):
    """Each rank's gradients for two steps: a 4x3 matrix and a 3-vector, flat; and the first Q."""
    g = torch.Generator().manual_seed(7)
    grads = torch.randn(N, 2, 15, generator=g, dtype=torch.float64)
    return grads[rank], torch.randn(3, 1, generator=g, dtype=torch.float64)


def _powersgd():
    """Two PowerSGD steps (rank 1, error feedback, warm start) on one bucket: each output and each error."""
    steps, q0 = _powersgd_steps(dist.get_rank())
    params = [torch.empty(4, 3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)]
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1)
    state.qs[(0, 0)] = q0.clone()
    out = []
    for grads in steps:
        buffer = grads.clone()
        result = hooks.powerSGD_hook(state, hooks.GradBucket(0, buffer, params, [0, 12, 15], True)).wait()
        out.append({"result": result.clone(), "error": state.errors[0].clone()})
    return out


def _on_torch_ddp():
    """manualdp's hooks registered on torch's DDP, against torch's DDP without a hook (or with torch's)."""
    rank = dist.get_rank()
    cases = {"allreduce": (None, hooks.allreduce_hook, None),
             "fp16": (None, hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
             "powersgd_full_rank": (hooks.PowerSGDState(None, matrix_approximation_rank=16), hooks.powerSGD_hook, None),
             "noop": (None, hooks.noop_hook, "local")}
    out = {}
    for name, (state, ours, reference) in cases.items():
        model = TorchDDP(_mlp())
        model.register_comm_hook(state, ours)
        if reference == "local":
            peer = _mlp()
        else:
            peer = TorchDDP(_mlp())
            if reference is not None:
                peer.register_comm_hook(None, reference)
        out[name] = {"ours": _train(model, _batches(rank)), "reference": _train(peer, _batches(rank))}
    return out


def _job():
    scenarios = {"bad_results": _bad_results, "never_done": _never_done, "one_rank_hook": _one_rank_hook,
                 "zero_size": _powersgd_zero_size, "compressed": _compressed, "powersgd": _powersgd,
                 "torch_ddp": _on_torch_ddp}
    return run_scenarios(scenarios)


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, N, timeout=JOB_TIMEOUT)


def _get(rank, name):
    value = _results()[rank][name]
    assert not (isinstance(value, str) and value.startswith("ERROR")), value
    return value


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("hook, kind, says", [
    ("one_element_hook", "ValueError", "got 1 elements"),
    ("twice_the_size_hook", "ValueError", "got {twice} elements"),
    ("integer_hook", "TypeError", "got a torch.int64 tensor"),
    ("tensor_not_future_hook", "TypeError", "must return a torch.futures.Future, got Tensor"),
])
def test_a_hooks_result_is_checked_and_the_error_names_the_hook_and_the_value(hook, kind, says):
    for rank in range(N):
        case = _get(rank, "bad_results")[hook]
        error, size = case["error"], case["buckets"][0]
        assert error is not None, f"rank {rank}: {hook} was accepted"
        assert error["type"] == kind, error
        assert f"test_comm_hooks.{hook}" in error["message"], error
        assert says.format(twice=2 * size) in error["message"], error
        if kind == "ValueError":
            assert f"the bucket's {size} elements" in error["message"], error


def test_a_future_that_never_completes_ends_at_the_wrappers_timeout():
    for rank in range(N):
        error = _get(rank, "never_done")
        assert error is not None and error["peer_error"], error
        assert "never_done_hook" in error["message"] and "never completed" in error["message"], error
        assert "within 1 s" in error["message"], error
        assert 0.9 < error["seconds"] < 30, error


def test_a_hook_on_one_rank_only_is_named_on_every_rank_before_any_bucket_moves():
    for rank in range(N):
        value = _get(rank, "one_rank_hook")
        error = value["mismatch"]
        assert error is not None and error["type"] == "ValueError", error
        assert "(per rank: manualdp.spmd.comm_hooks.allreduce_hook, none (manualdp's allreduce))" in error["message"], error
        late = value["late"]
        assert late is not None and late["type"] == "RuntimeError" and "before training" in late["message"], late


def test_powersgd_copes_with_zero_size_parameters():
    finals = []
    for rank in range(N):
        value = _get(rank, "zero_size")
        for step, (ours, theirs) in enumerate(zip(value["full"], value["torch"])):
            assert torch.allclose(ours, theirs, rtol=0, atol=1e-9), f"rank {rank} step {step}"
        assert torch.isfinite(value["rank1"]).all()
        finals.append(value["rank1"])
    assert torch.equal(finals[0], finals[1])


def test_bf16_hook_rounds_through_bfloat16_and_fp16_through_float16():
    values = torch.tensor(VALUES, dtype=torch.float32)
    bf16, fp16 = values.to(torch.bfloat16).float(), values.to(torch.float16).float()
    assert not torch.equal(bf16, fp16)  # so the values tell the two apart
    for rank in range(N):
        got = _get(rank, "compressed")
        assert torch.equal(got["bf16_compress_hook"], bf16), got
        assert torch.equal(got["fp16_compress_hook"], fp16), got


def _reference_powersgd():
    """PowerSGD by hand, over both ranks at once: per step, each rank's output and error."""
    data = [_powersgd_steps(r) for r in range(N)]
    q = data[0][1]
    errors = [torch.zeros(15, dtype=torch.float64) for _ in range(N)]
    out = []
    for step in range(2):
        fed = [data[r][0][step] + errors[r] for r in range(N)]  # error feedback: last step's residual added
        ms = [f[:12].view(4, 3) for f in fed]
        p = sum(m @ q for m in ms) / N  # the average of P
        p = p / p.norm()
        q = sum(m.t() @ p for m in ms) / N  # the average of Q
        result = torch.cat([(p @ q.t()).reshape(-1), sum(f[12:] for f in fed) / N])  # the vector goes exactly
        errors = [torch.cat([f[:12] - result[:12], torch.zeros(3, dtype=torch.float64)]) for f in fed]  # what P Qᵀ missed
        out.append({"result": result, "error": errors})
    return out


def test_powersgd_equals_a_step_by_hand_with_averaged_q_and_error_feedback():
    reference = _reference_powersgd()
    for rank in range(N):
        for step, (got, want) in enumerate(zip(_get(rank, "powersgd"), reference)):
            assert torch.allclose(got["result"], want["result"], rtol=0, atol=1e-12), f"rank {rank} step {step}"
            assert torch.allclose(got["error"], want["error"][rank], rtol=0, atol=1e-12), f"rank {rank} step {step}"
    first = reference[0]["error"][0]
    assert first[:12].abs().max() > 1e-3 and torch.equal(first[12:], torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("name", ["allreduce", "fp16", "powersgd_full_rank", "noop"])
def test_manualdps_hooks_run_on_torchs_ddp(name):
    tolerance = 1e-3 if name == "fp16" else 1e-9
    finals = []
    for rank in range(N):
        value = _get(rank, "torch_ddp")[name]
        for step, (ours, reference) in enumerate(zip(value["ours"], value["reference"])):
            assert torch.allclose(ours, reference, rtol=0, atol=tolerance), f"rank {rank} step {step}"
        finals.append(value["ours"][-1])
    assert torch.equal(finals[0], finals[1]) != (name == "noop")  # noop: each rank trains on its own data
