"""What chapters 5 to 7 of the book run on each rank: short scenes for `manualdp.spmd.launch`.

    from manualdp.runners.chapters import real_ddp
    from manualdp.spmd import launch
    results = launch(real_ddp, 2)   # one dict per rank

`launch` starts fresh processes, which import the function they run: a function defined in a
notebook or a chapter's page cannot be sent, so the code the chapters run on each rank lives
here. Each scene trains a tiny model over gloo on the CPU in a second or two, and returns
what the chapter prints and checks.
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, TensorDataset

from ..spmd import DistributedDataParallel as DDP
from ..spmd import PowerSGDState, SyncBatchNorm, full_state_dict, fully_shard, shard
from ..spmd.collectives import allreduce
from ..spmd.comm_hooks import bf16_compress_hook, fp16_compress_hook, powerSGD_hook
from ..spmd.transport.p2p import traffic
from ..spmd.transport.peers import PeerError
from ..spmd.sharding.zero import ZeroRedundancyOptimizer
from ..support.trace import COMM, Trace
from .loop import train_spmd

__all__ = ["TwoHeads", "real_ddp", "sharded", "lose_a_peer"]


class TwoHeads(nn.Module):
    """A trunk and two heads; `forward(x, use_b)` leaves head `b` out unless `use_b`."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _batches(k: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(k)]


# ---------------------------------------------------------------- chapter 5: what a real DDP does

def unused_parameters() -> dict:
    """Rank 0 leaves head b out: refused by default, trained like torch's DDP with find_unused_parameters."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TwoHeads().double()
    strict = DDP(copy.deepcopy(net), algorithm="ring")
    x = _batches(1, rank)[0]
    strict(x, use_b=rank == 1).sum().backward()  # this step goes through; the next forward raises
    try:
        strict(x, use_b=rank == 1)
        refused = None
    except RuntimeError as e:
        refused = str(e).splitlines()[-1]
    ours = DDP(copy.deepcopy(net), find_unused_parameters=True, algorithm="ring")
    theirs = TorchDDP(copy.deepcopy(net), find_unused_parameters=True)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for X in _batches(3, rank):
            opt.zero_grad()
            model(X, use_b=rank == 1).pow(2).sum().backward()
            opt.step()
    return {"refused": refused, "differs_from_torch": (_flat(ours) - _flat(theirs)).abs().max().item()}


def uneven_inputs() -> dict:
    """Rank r has 2 + 2r batches: under Join the rank out of data shadows the other's steps, as with torch's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ours, theirs = DDP(copy.deepcopy(net), algorithm="ring"), TorchDDP(copy.deepcopy(net))
    for model, join in ((ours, ours.join()), (theirs, Join([theirs]))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with join:
            for X in _batches(2 + 2 * rank, rank):
                opt.zero_grad()
                model(X).pow(2).sum().backward()
                opt.step()
    return {"batches": 2 + 2 * rank, "params": _flat(ours),
            "differs_from_torch": (_flat(ours) - _flat(theirs)).abs().max().item()}


def one_number_hook(state, bucket):
    """A wrong comm hook: its future holds one number, not the bucket's average."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer()[:1].clone())
    return future


def comm_hooks() -> dict:
    """One step per comm hook: the bytes this rank sent, per dtype, and the averaged gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    X = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    hooks = {"none": None, "fp16": (None, fp16_compress_hook), "bf16": (None, bf16_compress_hook),
             "powersgd": (PowerSGDState(matrix_approximation_rank=1), powerSGD_hook),
             "one number": (None, one_number_hook)}
    out = {"shapes": [tuple(p.shape) for p in net.parameters()]}
    for name, hook in hooks.items():
        # The wrong hook gets a group of its own: after a failed call, a group's worker fails every later one.
        group = dist.new_group() if name == "one number" else None
        model = DDP(copy.deepcopy(net), algorithm="ring", process_group=group)
        if hook is not None:
            model.register_comm_hook(*hook)
        before = traffic().sent()
        try:
            model(X).pow(2).sum().backward()
        except (TypeError, ValueError) as e:  # what the wrapper checks of a hook's result
            out[name] = str(e)
            continue
        sent = {dtype: n - before.get(dtype, 0) for dtype, n in traffic().sent().items()}
        out[name] = {"sent": {k: v for k, v in sent.items() if v and "float" in k},
                     "grads": torch.cat([p.grad.reshape(-1) for p in model.parameters()])}
    return out


def sync_batchnorm() -> dict:
    """Each rank normalises its half of a batch around 1e4 with the statistics of the whole batch; eval stays local."""
    rank = dist.get_rank()
    X = 1e4 + torch.randn(8, 3, generator=torch.Generator().manual_seed(0))  # float32, the global batch
    bn = SyncBatchNorm(3)
    mine, _ = shard(X, X, rank, dist.get_world_size())
    out = {"X": X, "out": bn(mine).detach(), "running_mean": bn.running_mean.clone(),
           "running_var": bn.running_var.clone()}
    bn.eval()
    if rank == 0:  # evaluates alone: a forward that pooled over the ranks would wait for rank 1 until the timeout
        out["eval"] = bn(X[:2]).detach()
    return out


def desync() -> dict:
    """Two ways ranks fall out of step, and how each is named on every rank."""
    rank = dist.get_rank()
    out = {}
    try:
        allreduce(torch.ones(6 if rank == 0 else 9), "ring")  # one rank calls with another size
    except ValueError as e:
        out["call check"] = str(e)
    torch.manual_seed(0)
    wide = DDP(nn.Sequential(nn.Linear(6, 4)), algorithm="ring", debug=True)
    narrow = DDP(nn.Linear(6, 3), algorithm="ring", debug=True)
    try:
        for model in ([wide, narrow] if rank == 0 else [narrow, wide]):  # opposite orders
            model(torch.randn(2, 6)).sum().backward()
    except RuntimeError as e:
        out["debug"] = str(e)
    return out


def real_ddp() -> dict:
    """Chapter 5: every scene, in order (the desync last: it leaves the ranks out of step)."""
    return {"unused": unused_parameters(), "join": uneven_inputs(), "hooks": comm_hooks(),
            "syncbn": sync_batchnorm(), "desync": desync()}


# ---------------------------------------------------------------- chapter 6: sharding

def sharded(width: int = 128) -> dict:
    """ZeRO-1 and ZeRO-2 (bytes of gradient and optimizer state per rank), then ZeRO-3 (`fully_shard`) against
    one process trained on the global batch, with every all-gather and reduce-scatter of its step on a timeline."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    X = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).double()  # the global batch
    mine, _ = shard(X, X, rank, n)
    out = {"model_bytes": sum(p.numel() * p.element_size() for p in net.parameters())}
    for stage in (1, 2):
        model = DDP(copy.deepcopy(net), algorithm="ring")
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=1e-3, bucket_cap_mb=0.01)
        with model.no_sync() if stage == 2 else nullcontext():  # stage 2 reduce-scatters in backward itself
            model(mine.float()).pow(2).sum().backward()
        out[f"zero{stage}"] = {"gradient_bytes": opt.gradient_bytes()}
        opt.step()
        out[f"zero{stage}"]["state_bytes"] = opt.state_bytes()
    # ZeRO-3, in float64: each layer a unit, then the root
    reference, model, trace = copy.deepcopy(net).double(), copy.deepcopy(net).double(), Trace(pid=rank)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, recorder=trace)
    fully_shard(model, recorder=trace)
    out["zero3"] = {"full_bytes": sum(p.numel() * 8 for p in reference.parameters()),
                    "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (reference(X).pow(2).sum() / len(X)).backward()  # one process, the global batch
    opt.step()
    opt, start = torch.optim.SGD(model.parameters(), lr=0.1), trace.now_us()
    (model(mine).pow(2).sum() * n / len(X)).backward()  # scaled as for DDP, which averages over the ranks
    opt.step()
    out["zero3"]["timeline"] = [(e["name"], (e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in trace.events
                                if e["cat"] == COMM and e["ts"] >= start]
    full = full_state_dict(model)  # a collective: every rank gets the whole model
    out["zero3"]["differs"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return out


# ---------------------------------------------------------------- chapter 7: when things go wrong

class _Dies(nn.CrossEntropyLoss):
    """A loss with which rank 1 leaves at its third call: its process ends in the middle of step 2, as a killed one."""

    def __init__(self):
        super().__init__(reduction="sum")
        self.calls = 0

    def forward(self, out, y):
        self.calls += 1
        if self.calls == 3 and dist.get_rank() == 1:
            raise SystemExit("rank 1 left in step 2")
        return super().forward(out, y)


def lose_a_peer(timeout: float = 1.0) -> dict:
    """Rank 1 hangs in an allreduce, then dies in the middle of training; how each rank saw it, in one line each."""
    rank, out = dist.get_rank(), {}
    group = dist.new_group()  # the hang first, on a group of its own: a group that lost a peer is unusable
    if rank == 1:
        time.sleep(2 * timeout)  # hangs: a deadlock, a stuck device, a machine swapping
    else:
        try:
            allreduce(torch.ones(4), "ring", group, timeout=timeout)
        except PeerError as e:
            out["hangs"] = str(e)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 4, (64,), generator=g))
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    try:
        train_spmd(net, DataLoader(data, batch_size=8), [], 1, 0.1, loss_fn=_Dies(), algorithm="ring",
                   timeout=10 * timeout, progress=False, log=None)
    except PeerError as e:
        out["dies"] = str(e)
    except SystemExit as e:
        out["dies"] = f"left: {e}"
    return out
