"""What a right answer does: the properties that hold manualdp's own code in tests/ and grade a student's.

    manualdp check split_batch FILE.py      (also allreduce, schedule, ddp: manualdp.runners.check)

Each property takes the function under test first, then the inputs that hypothesis draws from
`STRATEGIES`; it raises `Mismatch` (an AssertionError) with one readable paragraph: the call, what
was expected, and what came back. The tests call the properties with manualdp's functions, the
checker with a student's: one definition of right for both. This module needs hypothesis, a test
dependency (`pip install hypothesis`).
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

from ..cost import check_schedule
from ..devices import cpu_devices
from ..schedule import Schedule, Transfer
from ..split import shard_sizes
from .explain import trace

__all__ = ["Mismatch", "STRATEGIES", "split_property", "split_devices_property", "allreduce_property",
           "schedule_property", "as_schedule",
           "make_tensors", "Twice", "batches", "train_steps", "ddp_mismatch", "ddp_job",
           "torch_ddp_job"]

FLOATS = [torch.float32, torch.float64]
TORCH = os.path.dirname(torch.__file__)
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


class Mismatch(AssertionError):
    """A property does not hold: the message says for which input, what was expected and what came back."""


def _call(call: str, fn, *args) -> tuple:
    """`fn(*args)` as `(before, after, out)`: the arguments as the caller held them before the call (lists copied,
    so that a rebound slot shows), as they are after it, and what it returned. `fn` may be a `sandbox.Child`: the
    call runs there, and what comes back is the child's. An exception becomes a Mismatch that names the call."""
    from .sandbox import Child, Raised, Stopped

    if isinstance(fn, Child):
        try:
            return fn.call(*args)
        except Raised as e:
            raise Mismatch(f"{call} raised {e.kind}" + (f": {e.message}" if e.message else "")
                           + (f" (at {e.at})" if e.at else "")
                           + _hint(e.kind, e.message)) from None
        except Stopped as e:
            raise Stopped(f"{call} {e}") from None
    before = tuple(list(a) if isinstance(a, list) else a for a in args)
    try:
        return before, args, fn(*args)
    except Exception as e:  # noqa: BLE001 (a student's code may raise anything)
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not f.filename.startswith(TORCH)), frames[-1])  # the caller's line
        raise Mismatch(f"{call} raised {type(e).__name__}: {e} (at {frame.filename}, line {frame.lineno})"
                       + _hint(type(e).__name__, str(e))) from e


def _hint(kind: str, message: str) -> str:
    """What to write instead, for the slips a student makes most."""
    if kind == "IndexError" and "0-dim" in message:
        return (". A 0-dim tensor (shape ()) has no rows to slice, so d2l's `data[0][:] += ...` fails on it: write "
                "in place with `tensors[0].add_(...)` and `tensors[i].copy_(tensors[0])`, which work for every shape")
    if kind == "SystemExit":
        return ". The grader calls your function: it must return, not exit"
    if kind == "KeyboardInterrupt":
        return ". The grader calls your function: it must return, not raise KeyboardInterrupt"
    if kind == "RecursionError":
        return ". Does your function call itself without end?"
    if kind == "OSError" and "File too large" in message:
        return ". The grader lets your code print or write 64 MiB into one file"
    if kind == "MemoryError" or "can't allocate memory" in message:
        return ". The grader caps the memory your code may take (--memory)"
    return ""


def _show(t) -> str:
    """A tensor's values when they are few, rounded; else its repr, cut short."""
    if isinstance(t, torch.Tensor) and t.numel() <= 12:
        values = t.tolist()
        return repr(_rounded(values))
    return repr(t)[:200]


def _rounded(values):
    if isinstance(values, list):
        return [_rounded(v) for v in values]
    return round(values, 4) if isinstance(values, float) else values


def _devices(n: int) -> str:
    return f"{n} device{'s' * (n != 1)}"


def _listed(items: list) -> str:
    return ", ".join(str(i) for i in items[:-1]) + (" and " if len(items) > 1 else "") + str(items[-1])


# ---------------------------------------------------------------- split_batch(X, y, devices)

def split_property(split_batch, n: int, extra: int, features: int, dtype: torch.dtype) -> None:
    """Shard i holds the i-th near-equal slice of X and y (the first `batch % n` shards one row more), on
    devices[i], in memory of its own: writing into a shard leaves the caller's batch as it was."""
    batch = n + extra
    X = torch.arange(batch * features, dtype=dtype).reshape(batch, features)
    y = torch.arange(batch)
    X_kept, y_kept = X.clone(), y.clone()
    devices = cpu_devices(n)
    call = f"split_batch(X, y, devices) with X of shape {tuple(X.shape)}, y = torch.arange({batch}) and {_devices(n)}"
    _, (X, y, _), out = _call(call, split_batch, X, y, devices)  # X and y as the caller holds them after the call
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise Mismatch(f"{call}: expected a pair (X_shards, y_shards), got {_show(out)}")
    X_shards, y_shards = out
    for name, shards in (("X_shards", X_shards), ("y_shards", y_shards)):
        if not isinstance(shards, (tuple, list)) or not all(isinstance(s, torch.Tensor) for s in shards):
            raise Mismatch(f"{call}: expected {name} to be a list of tensors, got {_show(shards)}")
        if len(shards) != n:
            raise Mismatch(f"{call}: expected {n} shards in {name}, one per device; got {len(shards)}")
    sizes = shard_sizes(batch, n)
    expected = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(n)]
    got = [s.tolist() for s in y_shards]
    if got != expected:
        raise Mismatch(f"{call}: expected the shards of y to be {expected} (sizes {sizes}: near-equal, the first "
                       f"batch % n shards one longer); got {got}")
    for i, (s, rows) in enumerate(zip(X_shards, expected)):
        if s.shape != X_kept[rows].shape or not torch.equal(s.cpu(), X_kept[rows]):
            raise Mismatch(f"{call}: expected X_shards[{i}] to be rows {rows} of X, {X_kept[rows].tolist()}; "
                           f"got {_show(s)}")
    for name, shards in (("X_shards", X_shards), ("y_shards", y_shards)):
        for i, s in enumerate(shards):
            s.fill_(-1)
            if not (torch.equal(X, X_kept) and torch.equal(y, y_kept)):
                raise Mismatch(f"{call}: writing into {name}[{i}] changed the caller's batch: "
                               "the shard is a view of it. "
                               "Copy each shard (`.to(device, copy=True)`): on simulated devices, all of them `cpu`, "
                               "`.to(device)` returns the very same memory")


def split_devices_property(split_batch, n: int, extra: int, features: int, dtype: torch.dtype) -> None:
    """Shard i lives on devices[i]: told apart, on a machine with one CPU, by alternating cpu and meta (the grader's
    check; manualdp's own split_batch refuses meta, and tests/ holds it on real devices)."""
    if n == 1:
        return
    X = torch.arange((n + extra) * features, dtype=dtype).reshape(n + extra, features)
    y = torch.arange(n + extra)
    devices = [torch.device("cpu" if i % 2 == 0 else "meta") for i in range(n)]
    call = (f"split_batch(X, y, devices) with X of shape {tuple(X.shape)}, y = torch.arange({len(y)}) and "
            f"devices = [{', '.join(d.type for d in devices)}] (meta: a device that holds shapes but no values, so "
            "that the shards' devices differ)")
    _, _, out = _call(call, split_batch, X, y, devices)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(s, (tuple, list)) and len(s) == n and all(isinstance(t, torch.Tensor) for t in s)
                    for s in out)):
        raise Mismatch(f"{call}: expected a pair (X_shards, y_shards) of {n} tensors each, got {_show(out)}")
    for i, (a, b, d) in enumerate(zip(*out, devices)):
        if a.device != d or b.device != d:
            raise Mismatch(f"{call}: expected shard {i} on devices[{i}] = {d}; X's is on {a.device}, y's on "
                           f"{b.device}. Move shard i with `.to(devices[i], ...)`")


# ---------------------------------------------------------------- allreduce(tensors)

def make_tensors(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """`n` independent tensors with small values, so that integer sums do not overflow."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(0, 10, shape, generator=g).to(dtype) for _ in range(n)]


def allreduce_property(allreduce, n: int, shape: tuple, dtype: torch.dtype, seed: int, transpose: bool = False) -> None:
    """After `allreduce(tensors)`, every tensor the caller holds is the sum, and all are bitwise identical.

    The check reads the tensors the caller holds, never the list passed in: an allreduce that
    rebinds `tensors[i] = ...` fills that list, but the devices' own tensors keep their old values.
    """
    tensors = make_tensors(n, shape, dtype, seed)
    if transpose and len(shape) >= 2:
        tensors = [t.transpose(0, 1) for t in tensors]  # views: the sum must reach the viewed storage
    shape = tuple(tensors[0].shape)
    expected = torch.stack(tensors).sum(0).to(dtype)
    call = (f"allreduce(tensors) on {n} tensor{'s' * (n != 1)} of shape {shape} and dtype {str(dtype)[6:]}"
            + (" (transposed views)" if transpose and len(shape) >= 2 else "")
            + (f", holding {', '.join(_show(t) for t in tensors)}" if expected.numel() <= 6 else ""))
    (held,), (given,), _ = _call(call, allreduce, list(tensors))  # the tensors the devices hold; the list passed
    for i, t in enumerate(held):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != expected.shape:
            what = (f"a tensor of dtype {str(t.dtype)[6:]} and shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                    else _show(t))
            raise Mismatch(f"{call}: expected every device to hold the sum, of dtype {str(dtype)[6:]} and shape "
                           f"{shape}, in the very tensor it held; device {i} holds {what}. Write the sum into each "
                           "device's tensor in place (`tensors[i].copy_(...)` keeps its dtype and shape)")
        if t.dtype.is_floating_point:
            right = torch.allclose(t, expected, rtol=1e-5, atol=1e-5)
        else:
            right = torch.equal(t, expected)
        if not right:
            rebound = given[i] is not t
            raise Mismatch(f"{call}: expected every device to hold the sum {_show(expected)}; "
                           f"device {i} holds {_show(t)}"
                           + (". Your allreduce put a new tensor into the list (`tensors[i] = ...`): write into the "
                              "tensor the device holds (`tensors[i].copy_(...)`)" if rebound else ""))
        if not torch.equal(t, held[0]):
            raise Mismatch(f"{call}: devices 0 and {i} hold sums that are close but not bitwise identical "
                           f"({_show(held[0])} and {_show(t)}): every device must end with the very same bits "
                           "(copy one sum to the others rather than adding in another order)")


# ---------------------------------------------------------------- schedule(n)

def as_schedule(out, n: int, call: str) -> Schedule:
    """A `Schedule`, or rounds of `Transfer`s (or `(src, dst, chunk, reduce)` tuples), as a Schedule for `n` devices."""
    if isinstance(out, Schedule):
        if out.num_devices != n:
            raise Mismatch(f"{call}: expected a schedule for {n} devices, got one for {out.num_devices}")
        return out
    try:
        rounds = tuple(tuple(Transfer(*t) for t in rnd) for rnd in out)
    except TypeError as e:
        raise Mismatch(f"{call}: expected a list of rounds, each a list of Transfer(src, dst, chunk, reduce); "
                       f"got {_show(out)} ({e})") from None
    chunks = 1 + max((t.chunk for rnd in rounds for t in rnd if isinstance(t.chunk, int)), default=0)
    return Schedule("yours", n, chunks, rounds, ("",) * len(rounds))


def _holds(contributions: Counter, chunk: int, n: int) -> str:
    names = "abcdefghijklmnopqrstuvwxyz"
    return "+".join(f"{names[d] if n <= 26 else f'd{d}_'}{chunk}"
                    for d in sorted(contributions.elements())) or "nothing"


def schedule_property(schedule, n: int) -> Schedule:
    """`schedule(n)` is an allreduce: every transfer valid, and in the end every device holds, in every chunk,
    each device's contribution exactly once. Returns the schedule."""
    call = f"schedule({n})"
    sched = as_schedule(_call(call, schedule, n)[2], n, call)
    for r, rnd in enumerate(sched.rounds):
        for t in rnd:
            if not all(isinstance(v, int) for v in t[:3]) or not isinstance(t.reduce, bool):
                raise Mismatch(f"{call}: round {r} holds {t}; src, dst and chunk are ints and reduce a bool")
    try:
        check_schedule(sched)
    except ValueError as e:
        raise Mismatch(f"{call}: {e}") from None
    final = trace(sched)[-1]
    everyone = Counter(range(n))
    for d in range(n):
        for c in range(sched.num_chunks):
            if final[d][c] != everyone:
                missing = sorted((everyone - final[d][c]).elements())
                twice = sorted((final[d][c] - everyone).elements())
                what = "; ".join(p for p in (
                    f"it misses device{'s' * (len(missing) > 1)} {_listed(missing)}" if missing else "",
                    f"it counts device{'s' * (len(twice) > 1)} {_listed(twice)} twice" if twice else "") if p)
                raise Mismatch(f"{call}: after its {len(sched.rounds)} rounds, "
                               f"device {d} holds {_holds(final[d][c], c, n)} "
                               f"in chunk {c}, expected the sum of every device's chunk {c}, "
                               f"{_holds(everyone, c, n)}: {what}")
    return sched


# ---------------------------------------------------------------- class DDP(module), on 2 ranks

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
    from ..spmd.launch import shard

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


def _first_difference(mine: dict, theirs: dict, atol: float) -> str | None:
    for p_name, ref in theirs.items():
        got = mine.get(p_name)
        if got is None:
            return f"{p_name} has no gradient where torch's is {_show(ref.flatten()[:3])}..."
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
        diff = _first_difference(res[name]["start"], res[ref]["start"], atol)
        if diff:
            raise Mismatch(f"{name} on {n} ranks: right after construction, rank {r}'s parameters differ from torch's "
                           f"DDP's, which starts every rank from rank 0's: {diff}")
    for step in range(len(results[0][ref]["steps"])):
        for r, res in enumerate(results):
            mine, theirs = res[name]["steps"][step], res[ref]["steps"][step]
            for what, key in (("the gradients when backward returned", "grads"),
                              ("the parameters after the step", "params")):
                diff = _first_difference(mine[key], theirs[key], atol)
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

    try:
        spec = importlib.util.spec_from_file_location("exercise", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # every rank builds other weights: a DDP must start every rank from rank 0's, as torch's does
        net = Twice(seed=dist.get_rank()).double()
        return train_steps({name: (getattr(module, name)(net), net)}, steps)
    except Exception as e:  # noqa: BLE001
        frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), None)
        where = f" (at {path}, line {frame.lineno}: {frame.line})" if frame else ""
        return {"error": f"rank {dist.get_rank()}: {type(e).__name__}: {e}{where}"}


def torch_ddp_job(steps: int = 3) -> dict:
    """One rank of torch's DDP training `Twice` as `ddp_job` trains a student's: {"torch": results}."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    net = Twice(seed=dist.get_rank()).double()
    return train_steps({"torch": (TorchDDP(net), net)}, steps)


# ---------------------------------------------------------------- what hypothesis draws

SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
STRATEGIES = {
    "split_batch": dict(n=st.integers(1, 8), extra=st.integers(0, 40), features=st.integers(1, 4),
                        dtype=st.sampled_from(FLOATS)),
    "allreduce": dict(n=st.integers(1, 8), shape=st.one_of(SHAPES, st.integers(0, 10**5).map(lambda k: (k,))),
                      dtype=st.sampled_from(INTS + FLOATS), seed=st.integers(0, 2**31 - 1), transpose=st.booleans()),
    "schedule": dict(n=st.integers(1, 16)),
}
