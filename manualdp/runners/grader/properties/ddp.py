"""`class DDP(module)` (chapter 4), on 2 ranks: it trains `Twice` as torch's DDP does, fed the same data; the rank
job of the file's DDP (`ddp_job`, in ranks the sandbox's child starts) and of torch's (`torch_ddp_job`, in ranks of
the grader's own). `Twice`, `train_steps` and `ddp_mismatch` hold manualdp's own rungs in tests/ too."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .common import Mismatch, rank_error, show

__all__ = ["Twice", "batches", "first_difference", "train_steps", "ddp_mismatch", "ddp_job", "torch_ddp_job"]


class Twice(nn.Module):
    """A model that tests a DDP: `shared` is applied twice in one forward, `frozen` takes no gradient."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.shared, self.frozen, self.out = (nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                                        nn.Linear(8, 4))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))
        return self.out(self.frozen(h))


def batches(steps: int = 3, batch: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches every rank and torch's DDP train on (float64: equal to 1e-12)."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def train_steps(models: dict, steps: int = 3) -> dict:
    """Train every `name: (wrapper, module)` on this rank's shard of the same batches; returns, per name, the
    parameters after construction and, per step, the gradients when backward returned and the parameters after.

    A wrapper with `finish_gradient_synchronization()` (a rung that syncs after backward) has it
    called between backward and the optimizer step.
    """
    from ....spmd.launch import shard

    rank, n = dist.get_rank(), dist.get_world_size()
    named = {k: [(p_name, p) for p_name, p in net.named_parameters()] for k, (_, net) in models.items()}
    opts = {k: torch.optim.SGD([p for _, p in named[k] if p.requires_grad], lr=0.1, momentum=0.9) for k in models}
    out = {k: {"start": {p_name: p.detach().clone() for p_name, p in named[k]}, "steps": []} for k in models}
    for X, y in batches(steps):
        Xs, ys = shard(X, y, rank, n)
        for k, (model, _) in models.items():
            opts[k].zero_grad()
            # the loss of a shard: summed, over the global batch, times n because DDP averages over ranks
            (nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n).backward()
            if hasattr(model, "finish_gradient_synchronization"):
                model.finish_gradient_synchronization()
            grads = {p_name: p.grad.detach().clone() for p_name, p in named[k]
                     if p.requires_grad and p.grad is not None}
            opts[k].step()
            out[k]["steps"].append({"grads": grads, "params": {p_name: p.detach().clone() for p_name, p in named[k]}})
    return out


def first_difference(mine: dict, theirs: dict, atol: float) -> str | None:
    """The first tensor of `theirs` (torch's) that `mine` lacks or misses by more than `atol`; else None."""
    for p_name, ref in theirs.items():
        got = mine.get(p_name)
        if got is None:
            return f"{p_name} has no gradient where torch's is {show(ref.flatten()[:3])}..."
        if got.shape != ref.shape:
            return f"{p_name} has shape {tuple(got.shape)} where torch's has {tuple(ref.shape)}"
        diff = (got - ref).abs()
        if diff.max() > atol:
            i = int(diff.flatten().argmax())
            a, b = got.flatten()[i].item(), ref.flatten()[i].item()
            ratio = f" (yours / torch's = {a / b:.3g})" if b else ""
            return f"{p_name}, element {i}, is {a:.6g} where torch's is {b:.6g}{ratio}"
    return None


def ddp_mismatch(results: list[dict], name: str, ref: str = "torch", atol: float = 1e-12) -> None:
    """Raise `Mismatch` at the first rank and step where `name` differs from `ref` (torch's DDP): the parameters
    after construction, the gradients when backward returned, the parameters after the step."""
    n = len(results)
    for r, res in enumerate(results):
        diff = first_difference(res[name]["start"], res[ref]["start"], atol)
        if diff:
            raise Mismatch(f"{name} on {n} ranks: right after construction, rank {r}'s parameters differ from torch's "
                           f"DDP's, which starts every rank from rank 0's: {diff}")
    for step in range(len(results[0][ref]["steps"])):
        for r, res in enumerate(results):
            mine, theirs = res[name]["steps"][step], res[ref]["steps"][step]
            for what, key in (("the gradients when backward returned", "grads"),
                              ("the parameters after the step", "params")):
                diff = first_difference(mine[key], theirs[key], atol)
                if diff:
                    hint = (f" Rank {r} holds {n} times the average: divide the sum by the world size."
                            if f"= {n:.3g})" in diff else "")
                    raise Mismatch(f"{name} on {n} ranks, step {step}, rank {r}: {what} differ from torch's DDP's "
                                   f"on the same data: {diff}.{hint}")
            params, first = mine["params"], results[0][name]["steps"][step]["params"]
            drift = [p_name for p_name in params if not torch.equal(params[p_name], first[p_name])]
            if drift:
                raise Mismatch(f"{name} on {n} ranks, step {step}: rank {r}'s {drift[0]} is not bitwise identical "
                               "to rank 0's: the replicas drift apart")


def ddp_job(path: str, name: str = "DDP", steps: int = 3) -> dict:
    """One rank of the ddp check: the class `name` of the file at `path` trains `Twice` (`train_steps`).

    Returns {name: results}, or {"error": ...} when the student's code raises. Torch's DDP trains in
    ranks of the grader's own (`torch_ddp_job`), where the student's code cannot patch it.
    """
    import importlib.util

    from .. import intact

    train, model = train_steps, Twice  # bound before the file loads: it may rebind the module's names
    writable = [os.getcwd(), tempfile.gettempdir()]  # its folders, before the file can move
    try:
        spec = importlib.util.spec_from_file_location("exercise", path)
        module = importlib.util.module_from_spec(spec)
        before = intact.snapshot()
        spec.loader.exec_module(module)
        # every rank builds other weights: a DDP must start every rank from rank 0's, as torch's does
        net = model(seed=dist.get_rank()).double()
        out = train({name: (getattr(module, name)(net), net)}, steps)
        intact.check(before)
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": rank_error(e, path, writable) + _why_none(e)}


def _why_none(e: Exception) -> str:
    """The likeliest reason a DDP meets None: the frozen layer, whose parameters backward never gives a .grad."""
    if not isinstance(e, (AttributeError, TypeError)) or "NoneType" not in str(e):
        return ""
    return (". The model has a frozen layer (`frozen`, requires_grad=False, as a fine-tuned model's embeddings are): "
            "backward gives its weight and bias no gradient, so their .grad is None. Skip parameters that do not "
            "require a gradient, as torch's DDP does")


def torch_ddp_job(steps: int = 3) -> dict:
    """One rank of torch's DDP training `Twice` as `ddp_job` trains a student's: {"torch": results}."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    net = Twice(seed=dist.get_rank()).double()
    return train_steps({"torch": (TorchDDP(net), net)}, steps)
