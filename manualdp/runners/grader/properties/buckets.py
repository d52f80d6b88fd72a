"""`class BucketedDDP(module, bucket_cap_mb)` (chapter 5, rung 4 written by hand), on 2 ranks: gradients averaged as
one process's on the whole batch, buckets within the cap, sent during backward. The rank job (`buckets_job`, in
ranks the sandbox's child starts) records, for each step, when each gradient was ready and each `all_reduce` it made;
`buckets_mismatch`, in the grader's process, judges those records against `reference_steps`, one process's run."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .common import Mismatch, rank_error
from .ddp import first_difference, batches

__all__ = ["CAP_BYTES", "Buckets", "buckets_job", "reference_steps", "buckets_mismatch"]

CAP_BYTES = 800  # the bucket cap: 100 float64 elements, three buckets of `Buckets` in reverse parameter order
STEPS = 3
ATOL = 1e-12


class Buckets(nn.Module):
    """A model that tests a bucketed DDP: `shared` applied twice, `frozen` takes no gradient, `unused` is never
    called (no rank ever gives it a gradient), in 8 gradients of 4 to 64 elements."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.shared, self.frozen = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))
        return self.out(self.frozen(h))


def _loss(model, X, y, rows: int, n: int) -> torch.Tensor:
    # a shard's loss: summed, over the global batch, times n because the DDP averages over the ranks
    return nn.functional.cross_entropy(model(X), y, reduction="sum") / rows * n


class _Watched:
    """An all_reduce's handle that notes when it is waited on: a wait during backward stops backward there."""

    def __init__(self, work, events: list, on: list) -> None:
        self._work, self._events, self._on = work, events, on

    def wait(self, *args, **kwargs):
        if self._on[0]:
            self._events.append(("wait",))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _recording(events: list, on: list) -> None:
    """Record every `dist.all_reduce` made while `on[0]`: its elements, bytes and whether it was asynchronous; and
    every wait on its handle."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if not on[0]:
            return real(tensor, *args, **kwargs)
        asynchronous = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        events.append(("send", tensor.numel(), tensor.numel() * tensor.element_size(), asynchronous))
        work = real(tensor, *args, **kwargs)
        return _Watched(work, events, on) if work is not None else None

    dist.all_reduce = dist.distributed_c10d.all_reduce = all_reduce


def _train(cls, net: nn.Module, events: list, on: list) -> dict:
    from ....spmd.launch import shard

    rank, n = dist.get_rank(), dist.get_world_size()
    for name, p in net.named_parameters():  # before the answer's hooks: ours fire first for each gradient
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: on[0] and events.append(("ready", name)))
    model = cls(net, bucket_cap_mb=CAP_BYTES / 2 ** 20)
    named = list(net.named_parameters())
    opt = torch.optim.SGD([p for _, p in named if p.requires_grad], lr=0.1, momentum=0.9)
    out = {"start": {k: p.detach().clone() for k, p in named}, "steps": []}
    for X, y in batches(STEPS):
        Xs, ys = shard(X, y, rank, n)
        opt.zero_grad(set_to_none=True)
        del events[:]
        on[0] = True
        _loss(model, Xs, ys, len(X), n).backward()
        events.append(("backward returned",))
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        on[0] = False
        grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in named}
        opt.step()
        out["steps"].append({"grads": grads, "params": {k: p.detach().clone() for k, p in named},
                             "events": list(events)})
    return out


def buckets_job(path: str, name: str = "BucketedDDP") -> dict:
    """One rank of the buckets check: the file's class `name` wraps `Buckets` and trains it `STEPS` steps, every
    `all_reduce` and every gradient's arrival recorded; {name: results}, or {"error": ...} when the file raises."""
    import importlib.util

    writable = [os.getcwd(), tempfile.gettempdir()]  # its folders, before the file can move
    events, on, put_back = [], [False], None
    try:
        _recording(events, on)  # before the file is loaded: `from torch.distributed import all_reduce` sees it too
        from .. import intact
        from ..own import write_it_yourself

        put_back = write_it_yourself(["torch_ddp"])  # a file that wraps torch's DDP has written nothing of rung 4
        train, model = _train, Buckets  # bound before the file loads: it may rebind the module's names
        spec = importlib.util.spec_from_file_location("exercise", path)
        module = importlib.util.module_from_spec(spec)
        before = intact.snapshot()
        spec.loader.exec_module(module)
        # every rank builds other weights: a DDP must start every rank from rank 0's, as torch's does
        out = {name: train(getattr(module, name), model(seed=dist.get_rank()).double(), events, on)}
        intact.check(before)
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": rank_error(e, path, writable)}
    finally:  # torch's DDP as it was: a process that runs this job in the middle of others (a test's) keeps it
        if put_back is not None:
            put_back()


def reference_steps(n: int) -> list[dict]:
    """One process trains `Buckets` (rank 0's weights) on the whole of each batch: per step, the gradients (the
    ranks' average), each rank's own gradient (before averaging), and the parameters after the step."""
    from ....spmd.launch import shard

    net = Buckets(seed=0).double()
    named = list(net.named_parameters())
    trained = [(k, p) for k, p in named if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in trained], lr=0.1, momentum=0.9)
    steps = []
    for X, y in batches(STEPS):
        own = []
        for r in range(n):
            Xs, ys = shard(X, y, r, n)
            got = torch.autograd.grad(_loss(net, Xs, ys, len(X), n), [p for _, p in trained], allow_unused=True)
            own.append({k: g for (k, _), g in zip(trained, got)})
        opt.zero_grad(set_to_none=True)
        _loss(net, X, y, len(X), 1).backward()
        grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in named}
        opt.step()
        steps.append({"grads": grads, "own": own, "params": {k: p.detach().clone() for k, p in named}})
    return steps


def _cap_hint(numel: int, nbytes: int, largest: int) -> str | None:
    """What is wrong with one send's size, or None: a bucket over the cap that holds more than one gradient."""
    if nbytes <= CAP_BYTES or numel <= largest:  # one gradient larger than the cap goes alone, as in torch's DDP
        return None
    return (f"an all_reduce of {numel} elements ({nbytes} bytes) is over the bucket cap of {CAP_BYTES} bytes "
            f"(bucket_cap_mb={CAP_BYTES / 2 ** 20:.6g}): start a new bucket when the next gradient would not fit")


def _gradient_slip(n: int, where: str, k: str, got, want, own) -> str | None:
    """What is wrong with one parameter's gradient on one rank, in words, or None."""
    if want is None:
        if got is None:
            return None
        if k.startswith("frozen."):
            return (f"{k} does not require grad (the model's frozen layer), yet has a .grad: leave parameters with "
                    "requires_grad=False out of the buckets")
        return (f"{k} is used by no rank (the model never calls `unused`), yet has a .grad: as torch's DDP, leave the "
                "gradient of a parameter no rank used as it was (None), so that the optimizer skips it; send zeros "
                "in its place in the bucket")
    if got is None:
        first = want.flatten()[0].item()
        return f"{k} has no .grad where the average is {first:.6g}...: copy each bucket's average back"
    if got.shape != want.shape:
        return f"{k}'s .grad has shape {tuple(got.shape)} where the parameter's is {tuple(want.shape)}"
    diff = (got - want).abs()
    if diff.max() <= ATOL:
        return None
    i = int(diff.flatten().argmax())
    a, b = got.flatten()[i].item(), want.flatten()[i].item()
    told = f"{k}, element {i}, is {a:.6g} where the average is {b:.6g}"
    if own is not None and (got - own).abs().max() <= ATOL:
        return (f"{told}: {where}'s own gradient, not the average. Its bucket was never sent, or its average never "
                "copied back (after the handle's wait()). A bucket that waits for all of its gradients never fills "
                "when one of them gets none (the model never calls `unused`): when backward ends, send what is left, "
                "the missing gradients as zeros")
    if b and abs(a / b * n - 1) < 1e-6:
        return f"{told}: yours is 1/{n} of the average: it was divided by the world size twice"
    if b and abs(a / b / n - 1) < 1e-6:
        return f"{told}: yours is {n} times the average: divide each bucket's sum by the world size"
    return told


def _holds_gradients(numel: int, ready: list[str], sizes: dict) -> bool:
    """Whether `numel` elements are the gradients of some of the parameters in `ready` (a bucket, not a decoy)."""
    sums = {0}
    for k in ready:
        sums |= {t + sizes[k] for t in sums}
    return numel in sums - {0}


def _timing_slip(events: list, sizes: dict) -> str | None:
    """What is wrong with when and how the buckets went out on one rank in one step, or None; `sizes` gives each
    parameter's number of elements."""
    largest = max(sizes.values())
    sends = [i for i, e in enumerate(events) if e[0] == "send"]
    if not sends:
        return ("no torch.distributed.all_reduce was made during the step: send each bucket with "
                "dist.all_reduce(flat, async_op=True), which the grader watches")
    for i in sends:
        hint = _cap_hint(events[i][1], events[i][2], largest)
        if hint:
            return hint
    ended = events.index(("backward returned",))
    if any(events[i][3] is False for i in sends if i < ended):
        return ("an all_reduce during backward was made with async_op=False: backward stops until it ends; pass "
                "async_op=True, keep the handle, and wait on it in finish_gradient_synchronization()")
    if ("wait",) in events[:ended]:
        return ("a handle was waited on during backward: backward stops there until the bucket has travelled; wait "
                "on the handles in finish_gradient_synchronization()")
    last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
    early = [i for i in sends if i < last_ready
             and _holds_gradients(events[i][1], [e[1] for e in events[:i] if e[0] == "ready"], sizes)]
    if not early:
        first = sends[0]
        if first < last_ready:  # something went out early, but not the gradients ready by then
            what = (f"before the last gradient was ready only an all_reduce of {events[first][1]} elements went out, "
                    "which holds no bucket of the gradients ready by then")
        elif first > ended:
            what = "every bucket was sent after backward returned"
        else:
            what = "every bucket was sent after the last gradient was ready"
        return (f"no overlap: {what}; send each bucket from a gradient hook (register_post_accumulate_grad_hook) as "
                "soon as its last gradient has arrived, while backward computes the others")
    return None


def buckets_mismatch(results: list[dict], name: str) -> None:
    """Raise `Mismatch` at the first step and rank where `name` differs from one process on the whole batch
    (`reference_steps`), sends a bucket over the cap, blocks backward, or sends no bucket before backward ends."""
    n = len(results)
    reference = reference_steps(n)
    net = Buckets(seed=0).double()
    sizes = {k: p.numel() for k, p in net.named_parameters()}
    start = {k: p.detach() for k, p in net.named_parameters()}
    for r, res in enumerate(results):
        diff = first_difference(res[name]["start"], start, ATOL)
        if diff:
            raise Mismatch(f"{name} on {n} ranks: right after construction, rank {r}'s parameters differ from rank "
                           f"0's: {diff.replace('torch', 'rank 0')}. Broadcast rank 0's parameters at construction, "
                           "as torch's DDP does")
    for step, want in enumerate(reference):
        for r, res in enumerate(results):
            mine = res[name]["steps"][step]
            at = f"{name} on {n} ranks, step {step}, rank {r}"
            for k, ref in want["grads"].items():
                slip = _gradient_slip(n, f"rank {r}", k, mine["grads"].get(k), ref, want["own"][r].get(k))
                if slip:
                    raise Mismatch(f"{at}: the gradients when finish_gradient_synchronization() returned differ from "
                                   f"the average (one process's gradient of the whole batch): {slip}")
            diff = first_difference(mine["params"], want["params"], ATOL)
            if diff:
                raise Mismatch(f"{at}: the parameters after the optimizer step differ from one process's: "
                               f"{diff.replace('torch', 'one process')}")
            slip = _timing_slip(mine["events"], sizes)
            if slip:
                again = (" (step 0 went out in time: do the buckets' counts start again after each step?)"
                         if step and slip.startswith("no overlap") else "")
                raise Mismatch(f"{at}: {slip}{again}")
        sent = [[e[1] for e in res[name]["steps"][step]["events"] if e[0] == "send"] for res in results]
        if any(s != sent[0] for s in sent):
            raise Mismatch(f"{name} on {n} ranks, step {step}: the ranks sent their buckets in other orders (elements "
                           f"per all_reduce: {sent}): send bucket k+1 only after bucket k, on every rank")
