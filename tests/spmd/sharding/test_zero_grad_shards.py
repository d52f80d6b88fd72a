"""ZeRO-2 across processes reduce-scatters during backward: it equals plain DDP and holds 1/N of the gradient.

One spawned job per world size (gloo on 127.0.0.1, one thread per rank, killed after a
timeout) returns what each rank saw and measured; the assertions run here, in the parent.
The model has 8 linear layers and a side branch that some steps use on some ranks only, on
no rank, or in one of a step's two backward passes; its buckets hold about one layer each.
"""
import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch, shard
from manualdp.spmd.sharding.zero_grad_shards import ShardedAway
from manualdp.spmd.sharding.zero import ZeroRedundancyOptimizer

STEPS = 4
CAP_MB = 2200 / 2**20  # a hidden layer's weight and bias (2176 bytes in float64), not two
SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)  # weight decay moves a parameter stepped with a zero gradient


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(6, 16)] + [nn.Linear(16, 16) for _ in range(6)] + [nn.Linear(16, 4)]
        self.body = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1]).double()
        self.side = nn.Linear(6, 4).double()
        self.use_side = True

    def forward(self, x):
        return self.body(x) + (self.side(x) if self.use_side else 0)


def _flat(net):
    return torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])


def _model_bytes():
    return sum(p.numel() * p.element_size() for p in _Net().parameters())


def _uses_side(step, half, rank):
    """Steps 0: every rank; 1: rank 0 only; 2: no rank; 3: the first backward pass of the step only."""
    return (step == 0) or (step == 1 and rank == 0) or (step == 3 and half == 0)


def _accumulation_job(rank, n):
    """Two backward passes a step, against plain DDP (torch's) whose first pass runs under no_sync."""
    nets = {"plain": _Net(), "zero2": _Net()}
    models = {"plain": TorchDDP(nets["plain"], find_unused_parameters=True),
              "zero2": DistributedDataParallel(nets["zero2"])}
    opts = {"plain": torch.optim.SGD(models["plain"].parameters(), **SGD),
            "zero2": ZeroRedundancyOptimizer(models["zero2"].parameters(), torch.optim.SGD, stage=2,
                                             bucket_cap_mb=CAP_MB, **SGD)}
    g = torch.Generator().manual_seed(7)
    steps = []
    for step in range(STEPS):
        halves = [(torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g))
                  for _ in range(2)]
        for key, model in models.items():
            opts[key].zero_grad()
            for half, (X, y) in enumerate(halves):
                nets[key].use_side = _uses_side(step, half, rank)
                Xs, ys = shard(X, y, rank, n)
                with model.no_sync() if key == "zero2" or half == 0 else contextlib.nullcontext():
                    (nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n).backward()
            opts[key].step()
        steps.append({key: _flat(net) for key, net in nets.items()})
    return {"steps": steps, "buckets": len(opts["zero2"].grad_shards.buckets)}


def _memory_job(rank, n):
    """Gradient bytes held during and after backward: ZeRO-2, and ZeRO-1 (whose DDP averages every gradient)."""
    out = {}
    X, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 4, (10,))
    for stage in (1, 2):
        net = _Net()
        model = DistributedDataParallel(net)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage, bucket_cap_mb=CAP_MB, lr=1e-2)
        during = []  # registered after the optimizer's hooks: each runs once that parameter is handed over
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(lambda p: during.append(opt.gradient_bytes()))
        for _ in range(2):  # the second step reuses what the first one left
            opt.zero_grad()
            during.clear()
            with model.no_sync() if stage == 2 else contextlib.nullcontext():
                nn.functional.cross_entropy(model(X), y).backward()
            after = opt.gradient_bytes()
            # at stage 2 each .grad is a stand-in without storage (ShardedAway): it holds no bytes
            grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters()
                        if p.grad is not None and not isinstance(p.grad, ShardedAway))
            opt.step()
        buckets = opt.grad_shards.buckets if stage == 2 else []
        out[stage] = {"after": after, "during": max(during), "module_grads": grads,
                      "bucket": max(((b.hi - b.lo) * 8 for b in buckets), default=0), "buckets": len(buckets)}
    return out


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("failed in backward")


def _refusals_job(rank, n):
    out = {}
    # A backward that fails half-way, after some buckets went out: the next zero_grad (or step) says so.
    net = _Net()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, stage=2, bucket_cap_mb=CAP_MB, lr=0.1)
    net.body[6].register_forward_hook(lambda module, args, output: _FailsInBackward.apply(output))
    try:
        nn.functional.cross_entropy(net(torch.randn(4, 6, dtype=torch.float64)), torch.tensor([0, 1, 2, 3])).backward()
    except ValueError:
        pass
    try:
        opt.zero_grad()
    except RuntimeError as e:
        out["part-way"] = str(e)
    # A backward outside no_sync(): DDP averages into .grad, which no backward handed over; all ranks raise.
    net = _Net()
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    nn.functional.cross_entropy(model(torch.randn(4, 6, dtype=torch.float64)), torch.tensor([0, 1, 2, 3])).backward()
    before = _flat(net)
    try:
        opt.step()
    except RuntimeError as e:
        out["loose"] = (str(e), torch.equal(_flat(net), before))
    # Ranks that cut different buckets all raise, naming the buckets.
    try:
        ZeroRedundancyOptimizer(_Net().parameters(), torch.optim.SGD, stage=2, lr=0.1,
                                bucket_cap_mb=CAP_MB if rank else 1.0)
    except ValueError as e:
        out["caps"] = str(e)
    return out


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    return {"accumulation": _accumulation_job(rank, n), "memory": _memory_job(rank, n),
            "refusals": _refusals_job(rank, n)}


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=180.0)


@pytest.mark.parametrize("n", [2, 3])
def test_zero2_with_buckets_accumulation_and_unused_parameters_equals_plain_ddp(n):
    results = [r["accumulation"] for r in _results(n)]
    assert results[0]["buckets"] >= 6
    for step in range(STEPS):
        for r in range(n):
            got = results[r]["steps"][step]
            torch.testing.assert_close(got["zero2"], got["plain"], rtol=0, atol=1e-10, msg=f"step {step} rank {r}")
            assert torch.equal(got["zero2"], results[0]["steps"][step]["zero2"]), "ranks differ after the all-gather"
    side = slice(-28, None)  # the side branch, which no rank used in step 2: skipped, not moved by weight decay
    assert torch.equal(results[0]["steps"][2]["zero2"][side], results[0]["steps"][1]["zero2"][side])
    assert not torch.equal(results[0]["steps"][3]["zero2"][side], results[0]["steps"][2]["zero2"][side])
    assert not torch.equal(results[0]["steps"][-1]["zero2"], _flat(_Net()))


@pytest.mark.parametrize("n", [2, 3])
def test_zero2_holds_one_nth_of_the_gradient_after_backward_and_at_most_two_buckets_more_during_it(n):
    model = _model_bytes()
    shard = -(-model // 8 // n) * 8  # 1/N of the model's float64 elements, rounded up: the chunks are uneven at 3
    for r, result in enumerate(_results(n)):
        two, one = result["memory"][2], result["memory"][1]
        bucket = two["bucket"]
        assert two["buckets"] >= 6 and shard + 2 * bucket < model  # the bounds below say something
        assert two["module_grads"] == 0  # every .grad was freed once copied into its bucket
        assert two["after"] <= shard + bucket, f"rank {r}: {two['after']} bytes of gradient after backward"
        # The shard and two bucket buffers, reused: not a buffer per bucket, nor a gradient kept.
        assert two["during"] <= shard + 2 * bucket, f"rank {r}: {two['during']} bytes during backward"
        # ZeRO-1 (and ZeRO-2 before it freed gradients) holds the whole averaged gradient.
        assert one["after"] == one["module_grads"] == model


@pytest.mark.parametrize("n", [2, 3])
def test_zero2_refuses_a_grad_no_backward_handed_over_different_buckets_and_a_half_done_backward(n):
    for r, result in enumerate(_results(n)):
        message, untouched = result["refusals"]["loose"]
        assert f"{n} rank(s) hold a .grad" in message and "no_sync()" in message and untouched
        assert "ZeroRedundancyOptimizer differs across ranks: buckets" in result["refusals"]["caps"]
        assert "failed part-way, after 3 of 8 gradient buckets were sent" in result["refusals"]["part-way"]


def test_bucket_cap_mb_is_checked_by_name():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ZeroRedundancyOptimizer(_Net().parameters(), torch.optim.SGD, stage=2, bucket_cap_mb=0, lr=0.1)
