"""What a right answer does: the properties that hold manualdp's own code in tests/ and grade a student's.

    manualdp check split_batch FILE.py      (also allreduce, schedule, ddp: manualdp.runners.check)

Each property takes the function under test first, then the inputs that hypothesis draws from
`STRATEGIES`; it raises `Mismatch` (an AssertionError) with one readable paragraph: the call, what
was expected, and what came back. The tests call the properties with manualdp's functions, the
checker with a student's: one definition of right for both. This module needs hypothesis, a test
dependency (`pip install hypothesis`).
"""
from __future__ import annotations

import copy
import math
import os
import random
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

from ...cost import check_schedule
from ...devices import cpu_devices
from ...schedule import Schedule, Transfer
from ...split import shard_sizes
from ..explain import trace
from .jobs import Resumed, resume_load, resume_run, resume_save, train_resumed

__all__ = ["Mismatch", "STRATEGIES", "apart", "hint_for", "split_property", "split_devices_property",
           "allreduce_property", "schedule_property", "as_schedule", "cost_property", "cost_sweep_property",
           "book_schedules", "schedules", "zero1_property", "resume_property", "resume_in_a_new_process_property",
           "resume_run", "hook_job", "torch_hook_job", "hook_mismatch",
           "make_tensors", "Twice", "batches", "train_steps", "ddp_mismatch", "ddp_job",
           "torch_ddp_job"]

FLOATS = [torch.float32, torch.float64]
TORCH = os.path.dirname(torch.__file__)
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


class Mismatch(AssertionError):
    """A property does not hold: the message says for which input, what was expected and what came back.

    `hint`, a function, adds to the message what costs time to find (which slip the answer made): called when the
    message is read, once, not for every failing input hypothesis tries while it shrinks."""

    def __init__(self, message: str = "", hint=None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        if self.hint is not None:
            self.args, self.hint = (self.args[0] + self.hint(),), None
        return super().__str__()


def _call(call: str, fn, *args, job: str | None = None) -> tuple:
    """`fn(*args)` as `(before, after, out)`: the arguments as the caller held them before the call (lists copied,
    so that a rebound slot shows), as they are after it, and what it returned. `fn` may be a `sandbox.Child`: the
    call runs there, and what comes back is the child's. An exception becomes a Mismatch that names the call.

    With `job` (a name of `jobs.JOBS`), the grader's job runs instead, given `fn`'s functions (a Child's,
    or a tuple of functions) and `args`."""
    from . import jobs
    from .sandbox import Child, Raised, Stopped

    if isinstance(fn, Child):
        try:
            return fn.job(job, *args) if job else fn.call(*args)
        except Raised as e:
            raise Mismatch(f"{call} raised {e.kind}" + (f": {e.message}" if e.message else "")
                           + (f" (at {e.at})" if e.at else "")
                           + hint_for(e.kind, e.message)) from None
        except Stopped as e:
            raise Stopped(f"{call} {e}") from None
    before = tuple(list(a) if isinstance(a, list) else a for a in args)
    try:
        return before, args, (getattr(jobs, jobs.JOBS[job])(*fn, *args) if job else fn(*args))
    except Exception as e:  # noqa: BLE001 (a student's code may raise anything)
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not f.filename.startswith(TORCH)), frames[-1])  # the caller's line
        raise Mismatch(f"{call} raised {type(e).__name__}: {e} (at {frame.filename}, line {frame.lineno})"
                       + hint_for(type(e).__name__, str(e))) from e


def hint_for(kind: str, message: str) -> str:
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


def _show(t, digits: int | None = None) -> str:
    """A tensor's values when they are few, rounded (to 4 decimals, or to `digits` significant digits); else its
    repr, cut short."""
    if isinstance(t, torch.Tensor) and t.numel() <= 12:
        values = t.tolist()
        return repr(_rounded(values, digits))
    return repr(t)[:200]


def _rounded(values, digits: int | None = None):
    if isinstance(values, list):
        return [_rounded(v, digits) for v in values]
    if not isinstance(values, float):
        return values
    return round(values, 4) if digits is None else float(f"{values:.{digits}g}")


def _seconds(x: float, digits: int = 6) -> str:
    """A number to `digits` significant digits (6 unless `apart` asks for more)."""
    return f"{x:.{digits}g}"


def apart(want, got, show=_show) -> tuple[str, str]:
    """`show(want)` and `show(got)`, given more significant digits (`show(x, digits)`, up to float64's 17) while they
    read alike, so that values that differ never read as equal (a float32 rounding, a sum in another order)."""
    a, b = show(want), show(got)
    for digits in range(5, 18):
        if a != b:
            break
        a, b = show(want, digits), show(got, digits)
    return a, b


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
    if not (torch.equal(X, X_kept) and torch.equal(y, y_kept)):
        raise Mismatch(f"{call}: the call changed the caller's X or y: split_batch must leave the batch as it was "
                       "(copy the rows into the shards; write nothing into X or y)")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise Mismatch(f"{call}: expected a pair (X_shards, y_shards), got {_show(out)}")
    X_shards, y_shards = out
    for name, shards in (("X_shards", X_shards), ("y_shards", y_shards)):
        if not isinstance(shards, (tuple, list)) or not all(isinstance(s, torch.Tensor) for s in shards):
            raise Mismatch(f"{call}: expected {name} to be a list of tensors, got {_show(shards)}")
        if len(shards) != n:
            raise Mismatch(f"{call}: expected {n} shards in {name}, one per device; got {len(shards)}")
    for name, shards, want in (("X_shards", X_shards, X_kept.dtype), ("y_shards", y_shards, y_kept.dtype)):
        for i, s in enumerate(shards):
            if s.dtype != want:
                raise Mismatch(f"{call}: expected {name}[{i}] to keep the batch's dtype, {str(want)[6:]}; got "
                               f"{str(s.dtype)[6:]}. Move the rows without converting them (`.to(device)` keeps the "
                               "dtype)")
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
        if t.dtype.is_floating_point:  # to each dtype's precision: a float64 sum taken in float32 is wrong
            tol = 1e-10 if t.dtype == torch.float64 else 1e-5
            right = torch.allclose(t, expected, rtol=tol, atol=tol)
        else:
            right = torch.equal(t, expected)
        if not right:
            rebound = given[i] is not t
            coarse = t.dtype == torch.float64 and torch.allclose(t, expected, rtol=1e-5, atol=1e-5)
            want, got = apart(expected, t)
            raise Mismatch(f"{call}: expected every device to hold the sum {want}; device {i} holds {got}"
                           + (f", off by up to {(t - expected).abs().max().item():.2g}: right to float32's precision "
                              "only. Sum in the tensors' own dtype, float64" if coarse else "")
                           + (". Your allreduce put a new tensor into the list (`tensors[i] = ...`): write into the "
                              "tensor the device holds (`tensors[i].copy_(...)`)" if rebound else ""))
        if not torch.equal(t, held[0]):
            raise Mismatch(f"{call}: devices 0 and {i} hold sums that are close but not bitwise identical "
                           f"({' and '.join(apart(held[0], t))}): every device must end with the very same bits "
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
    from ...spmd.launch import shard

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


# ---------------------------------------------------------------- cost(schedule, nbytes, alpha, beta, gamma)

def _describe(sched: Schedule) -> str:
    """A schedule as the grader names it: the book's by name, a random one transfer by transfer."""
    if sched.algorithm != "random":
        return f"{sched.algorithm}({sched.num_devices})"
    rounds = "; ".join(f"round {r}: " + (", ".join(f"{t.src}->{t.dst} chunk {t.chunk} {'add' if t.reduce else 'copy'}"
                                                   for t in rnd) or "nothing")
                       for r, rnd in enumerate(sched.rounds))
    chunks = f"{sched.num_chunks} chunk{'s' * (sched.num_chunks != 1)}"
    return f"a schedule of {sched.num_devices} devices and {chunks} ({rounds})"


def _slip_cost(sched: Schedule, nbytes: int, alpha: float, beta: float, gamma: float, slip: str) -> float:
    """The textbook model with one of a student's slips (`COST_SLIPS`), to name the slip an answer made."""
    from ...schedule import chunk_sizes

    sizes, n, total = chunk_sizes(nbytes, sched.num_chunks), sched.num_devices, 0.0
    for rnd in sched.rounds:
        sent, received, added = [0] * n, [0] * n, [0] * n
        out, into = [set() for _ in range(n)], [set() for _ in range(n)]
        count_out, count_in = [0] * n, [0] * n
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            received[t.dst] += sizes[t.chunk]
            added[t.dst] += sizes[t.chunk] if t.reduce or slip == "adds every chunk received" else 0
            out[t.src].add(t.dst)
            into[t.dst].add(t.src)
            count_out[t.src] += 1
            count_in[t.dst] += 1
        times = []
        for d in range(n):
            if slip == "a message per transfer":
                messages = max(count_out[d], count_in[d])
            else:
                messages = max(len(out[d]), len(into[d]))
            moved = {"bytes sent only": sent[d], "sent plus received": sent[d] + received[d]}.get(
                slip, max(sent[d], received[d]))
            times.append(alpha * messages + beta * moved + gamma * added[d])
        total += (sum(times) if slip == "every device's time added up" else max(times, default=0.0))
    return total


COST_SLIPS = {  # a slip -> what to write instead
    "bytes sent only": "a device's beta term is beta times the larger of the bytes it sends and the bytes it receives",
    "sent plus received": "the textbook's link is full duplex: a device sends and receives at once, so its beta term "
                          "is beta times the larger of the two, not their sum",
    "a message per transfer": "the chunks one device sends to one peer in a round travel as one message: count the "
                              "peers a device sends to (and receives from), not the transfers",
    "every device's time added up": "the devices work at once: a round lasts as long as its busiest device (the "
                                    "largest of their times), not all their times added up",
    "adds every chunk received": "gamma is for the bytes a device adds (transfers with reduce=True); a chunk that "
                                 "overwrites (reduce=False) is only copied",
}


def cost_property(cost_fn, sched: Schedule, nbytes: int, alpha: float, beta: float, gamma: float) -> None:
    """`cost_fn(schedule, nbytes, alpha, beta, gamma)` is `manualdp.cost.cost`'s textbook time, to 1e-9."""
    import math

    from ...cost import cost

    expected = cost(sched, nbytes, alpha, beta, gamma)
    call = (f"cost(schedule, nbytes={nbytes}, alpha={alpha:.3g}, beta={beta:.3g}, gamma={gamma:.3g}) for "
            f"{_describe(sched)}")
    _, _, out = _call(call, cost_fn, sched, nbytes, alpha, beta, gamma)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise Mismatch(f"{call}: expected a number of seconds, got {_show(out)}")
    if not math.isclose(out, expected, rel_tol=1e-9, abs_tol=1e-15):
        slips = [s for s in COST_SLIPS if math.isclose(out, _slip_cost(sched, nbytes, alpha, beta, gamma, s),
                                                      rel_tol=1e-9, abs_tol=1e-15)]
        want, got = apart(expected, out, _seconds)
        off = abs(out - expected) / abs(expected) if expected else math.inf
        raise Mismatch(f"{call}: expected {want} s (manualdp.cost.cost), got {got} s"
                       + (f". Yours counts {slips[0]}: {COST_SLIPS[slips[0]]}" if slips else "")
                       + (f", off by {off:.2g} relatively where 1e-9 is asked: is a sum rounded to float32 "
                          "somewhere?" if not slips and off < 1e-5 else ""))


COST_SWEEP = dict(nbytes=1_000_003, alpha=1e-5, beta=1e-9, gamma=2e-10)  # every term counts; uneven chunks


def _book_schedule(collective: str, algorithm: str, n: int) -> Schedule:
    """The book's schedule of `collective` by `algorithm` on `n` devices, named as `_describe` tells it."""
    from ...schedule import get_collective

    sched = get_collective(collective, algorithm, n)
    return Schedule(f"{collective} {algorithm}" if collective != "allreduce" else algorithm, sched.num_devices,
                    sched.num_chunks, sched.rounds, sched.phases)


def book_schedules(sizes=range(1, 17)) -> list[Schedule]:
    """Every schedule of the book (each algorithm of each collective, `COLLECTIVES`) on each of `sizes` devices."""
    from ...schedule import COLLECTIVES

    return [_book_schedule(c, a, n) for n in sizes for c in sorted(COLLECTIVES) for a in sorted(COLLECTIVES[c])]


def cost_sweep_property(cost_fn) -> None:
    """`cost_property` on every schedule of the book on every n from 1 to 16 (`COST_SWEEP`'s buffer and constants):
    each size the grader's report names is called, whatever hypothesis draws."""
    for sched in book_schedules():
        cost_property(cost_fn, sched, **COST_SWEEP)


@st.composite
def schedules(draw) -> Schedule:
    """The book's schedules on 1 to 16 devices, or a random valid one: 2 to 6 devices, 1 to 6 chunks, 0 to 4 rounds
    of up to 10 transfers (some to one peer, some adding, some overwriting)."""
    from ...cost import check_schedule
    from ...schedule import COLLECTIVES

    if draw(st.booleans()):
        collective = draw(st.sampled_from(sorted(COLLECTIVES)))
        algorithm = draw(st.sampled_from(sorted(COLLECTIVES[collective])))
        return _book_schedule(collective, algorithm, draw(st.integers(1, 16)))
    n, k = draw(st.integers(2, 6)), draw(st.integers(1, 6))
    rounds = []
    for _ in range(draw(st.integers(0, 4))):
        kept: list[Transfer] = []
        for src, dst, c, add in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                                                        st.integers(0, k - 1), st.booleans()), max_size=10)):
            if src == dst:
                continue
            try:  # keep the transfers that leave the round valid (`check_schedule`)
                check_schedule(Schedule("random", n, k, ((*kept, Transfer(src, dst, c, add)),), ("",)))
            except ValueError:
                continue
            kept.append(Transfer(src, dst, c, add))
        rounds.append(tuple(kept))
    return Schedule("random", n, k, tuple(rounds), ("",) * len(rounds))


# ---------------------------------------------------------------- zero1_step(params, grads, momenta, lr, momentum)

def zero1_property(zero1_step, n: int, numel: int, steps: int, lr: float, momentum: float, seed: int) -> None:
    """`steps` calls of `zero1_step` on `n` devices leave every device's parameters where plain data parallelism's
    SGD with momentum (the summed gradients, every device stepping the whole model) leaves them, bitwise identical on
    every device, and device i's momentum buffer that of its own chunk (`collectives.chunk`)."""
    from ...collectives import chunk

    g = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=g, dtype=torch.float64)
    params = [start.clone() for _ in range(n)]
    momenta = [torch.zeros_like(chunk(start, i, n)) for i in range(n)]
    plain, plain_buf = start.clone(), torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        grads = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(n)]
        total = torch.stack(grads).sum(0)
        plain_before = plain.clone()
        plain_buf.mul_(momentum).add_(total)  # torch's SGD (dampening 0): b = mu b + g, then p -= lr b
        plain.add_(plain_buf, alpha=-lr)
        call = (f"zero1_step(params, grads, momenta, lr={lr:g}, momentum={momentum:g}) on {_devices(n)}, "
                f"{numel} parameter{'s' * (numel != 1)}, step {step + 1} of {steps}"
                + (f": grads {', '.join(_show(t) for t in grads)}" if numel * n <= 8 else ""))
        kept = [t.clone() for t in params + momenta]
        held, given, out = _call(call, zero1_step, params, [t.clone() for t in grads], momenta, lr, momentum)
        params, momenta = list(held[0]), list(held[2])  # the tensors the devices hold, in place
        if out is not None and numel and all(isinstance(t, torch.Tensor) and torch.equal(t, k)
                                             for t, k in zip(params + momenta, kept)):
            raise Mismatch(f"{call}: your zero1_step returned a {type(out).__name__} and changed nothing in place: the "
                           "devices keep their own tensors, and the grader reads those, not what zero1_step returns. "
                           "Update params and momenta in place (`momenta[i].mul_(momentum).add_(...)`, "
                           "`params[i].copy_(...)`)")
        for i in range(n):
            for name, t, size in (("params", params[i], numel), ("momenta", momenta[i], chunk(start, i, n).numel())):
                if not isinstance(t, torch.Tensor) or t.shape != (size,) or t.dtype != torch.float64:
                    raise Mismatch(f"{call}: {name}[{i}] must stay a float64 tensor of {size} elements, updated in "
                                   f"place; it is {_show(t)}")
        for i in range(n):
            if given[0][i] is not params[i] or given[2][i] is not momenta[i]:
                raise Mismatch(f"{call}: your zero1_step put a new tensor into params or momenta (`momenta[i] = "
                               "...`): the devices keep their own tensors, so update them in place "
                               "(`momenta[i].mul_(momentum).add_(...)`, `params[i].copy_(...)`)")
        for i in range(n):
            lo, hi = _chunk_range(numel, i, n)
            want = plain_buf[lo:hi]
            if not torch.allclose(momenta[i], want, rtol=1e-10, atol=1e-12):
                shown = apart(want, momenta[i])
                raise Mismatch(f"{call}: expected device {i}'s momentum buffer, for elements {lo}..{hi - 1} (its "
                               f"chunk), to be {shown[0]}, got {shown[1]}: b = momentum * b + (the summed "
                               "gradient of that chunk)" + _averaged(momenta[i], want, n))
        for i in range(n):
            if not torch.allclose(params[i], plain, rtol=1e-10, atol=1e-12):
                bad = int((params[i] - plain).abs().argmax())
                owner = next(d for d in range(n) if _chunk_range(numel, d, n)[0] <= bad < _chunk_range(numel, d, n)[1])
                step_got, step_want = params[i][bad] - plain_before[bad], plain[bad] - plain_before[bad]
                stale = owner != i and params[i][bad] == plain_before[bad]
                hint = (_averaged(step_got, step_want, n) or
                        (". That element was not updated on this device: all-gather the updated chunks, so that "
                         "every device holds every chunk" if stale else ""))
                got, want = apart(params[i][bad].item(), plain[bad].item(), _seconds)
                raise Mismatch(f"{call}: expected every device's parameters to be plain data parallelism's; device "
                               f"{i}'s element {bad} (in device {owner}'s chunk) is {got}, expected {want}{hint}")
            if not torch.equal(params[i], params[0]):
                raise Mismatch(f"{call}: devices 0 and {i} hold parameters that are close but not bitwise identical: "
                               "each chunk must be stepped once, by its owner, and copied to the others")


def _averaged(got: torch.Tensor, want: torch.Tensor, n: int) -> str:
    """The hint for a step of 1/n of the right one: the gradients were averaged where they sum."""
    if n > 1 and want.numel() and torch.allclose(got * n, want, rtol=1e-9, atol=1e-12):
        return (f". Yours is 1/{n} of it: each device's gradient is its shard's part of the global batch's loss "
                "(summed and divided by the global batch), so their sum is the gradient; do not average them")
    return ""


def _chunk_range(numel: int, device: int, n: int) -> tuple[int, int]:
    from ...schedule import chunk_bounds, owned_chunk

    return chunk_bounds(numel, n)[owned_chunk(device, n)]


# ---------------------------------------------------------------- save_checkpoint / load_checkpoint

def _resume_as(optimizer: str, steps: int, stop_at: int, seed: int, reseed: int, keep: tuple[str, ...]) -> dict:
    """The parameters of a run resumed at `stop_at` that kept only `keep` of ("model", "optimizer", "rng")."""
    def save(path, model, opt, step):
        saved.update(step=step, model=copy.deepcopy(model.state_dict()), optimizer=copy.deepcopy(opt.state_dict()),
                     rng=torch.get_rng_state())

    def load(path, model, opt):
        if "model" in keep:
            model.load_state_dict(saved["model"])
        if "optimizer" in keep:
            opt.load_state_dict(saved["optimizer"])
        if "rng" in keep:
            torch.set_rng_state(saved["rng"])
        return saved["step"]

    saved: dict = {}
    resume_save(save, load, optimizer, steps, stop_at, seed)
    return resume_load(save, load, optimizer, steps, reseed)["params"]


KEPT = {"model": "the model", "optimizer": "the optimizer's state", "rng": "torch's random number generator"}
RESUME_SLIPS = {  # what a resume kept -> what it missed, and how to keep it
    ("model", "optimizer"): "torch's random number generator, which draws the batches and the dropout masks: save "
                            "torch.get_rng_state() and restore it with torch.set_rng_state()",
    ("model", "rng"): "the optimizer's state (momentum, Adam's moments and step count): save optimizer.state_dict() "
                      "and restore it with optimizer.load_state_dict()",
    ("model",): "the optimizer's state and torch's random number generator: save optimizer.state_dict() and "
                "torch.get_rng_state(), and restore both",
    (): "anything: load the model's state_dict too",
}


def _uninterrupted(optimizer: str, steps: int, seed: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = Resumed()
        train_resumed(model, optimizer, 0, steps)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def resume_in_a_new_process_property(child, optimizer: str = "sgd", steps: int = 4, stop_at: int = 2,
                                     seed: int | None = None, reseed: int | None = None) -> None:
    """As `resume_property`, with `load_checkpoint` in a new process (a `sandbox.Child` restarted in the same folder),
    given the file moved to a new name: what the resume needs must be in the file at the path it was given. The seeds
    are drawn here, at random (unless given), so that no answer can know the run's seed but from the file."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    reseed = random.SystemRandom().randrange(2**31) if reseed is None else reseed
    path, moved = "saved.pt", os.path.join("moved", "resumed.pt")
    call = (f"a run of {steps} steps ({'SGD with momentum 0.9' if optimizer == 'sgd' else 'Adam'}, torch.manual_seed"
            f"({seed})) stopped after step {stop_at} and saved by save_checkpoint({path!r}, ...), then resumed by "
            f"load_checkpoint({moved!r}, ...) in a new process (the same folder, the file moved there, nothing else "
            "kept)")
    _call(call, child, optimizer, steps, stop_at, seed, path, job="resume_save")
    if not os.path.exists(os.path.join(child.folder, path)):
        raise Mismatch(f"{call}: {_unsaved(path)}")
    os.makedirs(os.path.join(child.folder, os.path.dirname(moved)), exist_ok=True)
    os.replace(os.path.join(child.folder, path), os.path.join(child.folder, moved))
    loaded = child.restart()
    if not loaded.get("ok"):
        raise Mismatch(f"{call}: the file no longer loads in a new process: {loaded}")
    try:
        _, _, out = _call(call, child, optimizer, steps, reseed, moved, job="resume_load")
    except Mismatch as e:
        raise Mismatch(f"{e}. A new process starts with nothing but the file: does save_checkpoint write everything "
                       "the resume needs into it, and does load_checkpoint read the path it is given?") from None
    _judge_resume(call, out, optimizer, steps, stop_at, seed, reseed, new_process=True)


def resume_property(fns, optimizer: str, run: tuple[int, int], seed: int, reseed: int) -> None:
    """A run of `steps` stopped after `stop_at` (`run`) and resumed by the student's functions ends bitwise where the
    uninterrupted run does (computed here, in the grader's process)."""
    steps, stop_at = run
    call = (f"a run of {steps} steps ({'SGD with momentum 0.9' if optimizer == 'sgd' else 'Adam'}, dropout, batches "
            f"drawn with torch.randint, torch.manual_seed({seed})) stopped after step {stop_at}, saved by "
            f"save_checkpoint(path, model, optimizer, {stop_at}), then resumed in a new model and optimizer "
            f"(torch.manual_seed({reseed}), as a new process would seed it) by load_checkpoint(path, model, optimizer)")
    _, _, out = _call(call, fns, optimizer, steps, stop_at, seed, reseed, job="resume")
    if isinstance(out, dict) and "unsaved" in out:
        raise Mismatch(f"{call}: {_unsaved(out['unsaved'])}")
    _judge_resume(call, out, optimizer, steps, stop_at, seed, reseed)


def _unsaved(path: str) -> str:
    """What to say of a save_checkpoint that wrote nothing at the path it was given."""
    return (f"save_checkpoint({path!r}, ...) wrote nothing at {path!r}: write the checkpoint to the path it is given, "
            "the one load_checkpoint is then given (a new process, where a run resumes, starts with nothing but that "
            "file)")


def _judge_resume(call: str, out, optimizer: str, steps: int, stop_at: int, seed: int, reseed: int,
                  new_process: bool = False):
    """Raise `Mismatch` unless the resumed run `out` ({"step", "params"}) ends bitwise as the uninterrupted one."""
    full = _uninterrupted(optimizer, steps, seed)
    step = out.get("step") if isinstance(out, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        kind = "tensor" if isinstance(step, torch.Tensor) else type(step).__name__
        raise Mismatch(f"{call}: load_checkpoint returned {_show(step)}, a {kind}, not an int: return the step as a "
                       f"Python int ({stop_at} here, the number of steps done), which the loop goes on from"
                       + (": save the int itself, or return `int(...)` of the tensor" if kind == "tensor" else ""))
    if step != stop_at:
        raise Mismatch(f"{call}: load_checkpoint returned {_show(step)}, expected {stop_at}, the step that was saved "
                       "(the number of steps done): the loop goes on from the step it returns")
    got = out.get("params")
    if not isinstance(got, dict) or set(got) != set(full):
        keys = sorted(got)[:6] if isinstance(got, dict) else got
        raise Mismatch(f"{call}: the resumed model's state_dict has keys {keys}, expected {sorted(full)}")
    diff = next((k for k in full if not torch.equal(got[k], full[k])), None)
    if diff is None:
        return
    d = (got[diff] - full[diff]).abs()
    i = int(d.flatten().argmax())

    def hint() -> str:  # told once, for the example hypothesis reports, not for every one it tries while shrinking
        if new_process:
            return (". It resumed right in one process: does save_checkpoint keep part of the state in memory? "
                    "Everything the rest of the run needs must be in the file")
        slip = next((keep for keep in RESUME_SLIPS
                     if all(torch.equal(got[k], v)
                            for k, v in _resume_as(optimizer, steps, stop_at, seed, reseed, keep).items())), None)
        return ("" if slip is None else f". Your resume equals one that restored "
                f"{' and '.join(KEPT[k] for k in slip) or 'nothing'} but not {RESUME_SLIPS[slip]}")

    raise Mismatch(f"{call}: the parameters differ from the uninterrupted run's: {diff}, element {i}, is "
                   f"{got[diff].flatten()[i].item():.9g} where the uninterrupted run has "
                   f"{full[diff].flatten()[i].item():.9g}", hint)


# ---------------------------------------------------------------- fp16_compress_hook(process_group, bucket), on 2 ranks

LOSS_SCALE = 2.0 ** 13  # step 1's loss scale: each rank's gradient of the last bias is 4 rows x 8192 = 32768


def _hooked_steps(hook) -> dict:
    """Torch's DDP with `hook` on this rank: 2 steps of a small float32 MLP, several buckets; step 0 an ordinary
    loss, step 1 a sum scaled by `LOSS_SCALE` (as float16 training scales its loss), whose last-bias gradient is
    half of what float16 holds (65504) on each rank: the sum of the ranks' overflows, their average does not."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ...spmd.launch import shard

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    model = TorchDDP(net, bucket_cap_mb=0.0002)  # 200 bytes: a bucket per layer or two
    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)  # 4 rows a rank
    Xs, ys = shard(X, y, rank, n)
    out = {"steps": []}
    for step in range(2):
        opt.zero_grad()
        if step == 0:
            loss = nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n
        else:
            loss = model(0.1 * Xs).sum() * LOSS_SCALE
        loss.backward()
        out["steps"].append({"grads": {k: p.grad.detach().clone() for k, p in net.named_parameters()},
                             "params": None})
        opt.step()
        out["steps"][-1]["params"] = {k: p.detach().clone() for k, p in net.named_parameters()}
    return out


def hook_job(path: str, name: str) -> dict:
    """One rank of the hook check: the file's `name` registered on torch's DDP (`_hooked_steps`); {name: results},
    or {"error": ...} when the student's code raises. Torch's hook runs in the grader's own ranks (`torch_hook_job`)."""
    import importlib.util

    broken: list[str] = []  # what the hook did that DDP cannot take, in words
    try:
        spec = importlib.util.spec_from_file_location("exercise", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = {name: _hooked_steps(_held_to_the_contract(getattr(module, name), name, broken))}
    except Exception as e:  # noqa: BLE001
        frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), None)
        where = f" (at {path}, line {frame.lineno}: {frame.line})" if frame else ""
        out = {"error": f"rank {dist.get_rank()}: {type(e).__name__}: {e}{where}"}
    return {"error": f"rank {dist.get_rank()}: {broken[0]}"} if broken else out


def _held_to_the_contract(hook, name: str, broken: list[str]):
    """`hook` as DDP calls it, held to a comm hook's contract: it returns a `torch.futures.Future` whose value is one
    tensor of the bucket's dtype and shape. A breach is told in `broken`, and DDP is handed the bucket as it was, so
    that backward ends (torch's reducer crashes on None, and asserts on a future of a list)."""
    def held(state, bucket):
        buffer = bucket.buffer()
        dtype, shape = buffer.dtype, tuple(buffer.shape)
        fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future's base: what get_future() returns
            broken.append(f"{name} returned {_kind(fut)}, not a torch.futures.Future: DDP waits on the future a comm "
                          "hook returns (the allreduce's, `dist.all_reduce(..., async_op=True).get_future()`, turned "
                          "back into the bucket's tensor by `.then(...)`)")
            done = torch.futures.Future()
            done.set_result(buffer)
            return done

        def checked(f):
            value = f.value()
            if isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == shape:
                return value
            broken.append(f"the future {name} returned holds {_kind(value)}, where DDP needs the bucket's average "
                          f"as one tensor of the bucket's dtype and shape ({str(dtype)[6:]}, {shape}): turn the "
                          "allreduce's float16 result back into the bucket's float32 tensor with `.then(...)` "
                          "(`fut.then(lambda fut: buffer.copy_(fut.value()[0]))`)")
            return buffer

        return fut.then(checked)

    return held


def _kind(value) -> str:
    """What a hook or its future gave back, in words: None, a tensor's dtype and shape, a list of them."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {str(value.dtype)[6:]} and shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return f"a {type(value).__name__} of one item, {_kind(value[0])}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items" + (f", the first {_kind(value[0])}" if value else "")
    return "None" if value is None else f"a {type(value).__name__}"


def torch_hook_job() -> dict:
    """One rank of `_hooked_steps` with torch's own fp16_compress_hook: {"torch": results}."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return {"torch": _hooked_steps(fp16_compress_hook)}


def hook_mismatch(results: list[dict], name: str) -> None:
    """Raise `Mismatch` at the first step and rank where `name`'s gradients (or parameters) differ from those with
    torch's fp16_compress_hook. On 2 ranks to 1e-6 relatively, so that a hook that does not round to float16 is told:
    there a right hook's float16 arithmetic is exact or has one order (x / 2, a + b). On more ranks to float16's
    precision (1% of the tensor's largest value): a right hook may divide, or add the ranks' shares, in another order
    and round otherwise than torch's."""
    n = len(results)
    tight = n <= 2
    for step in range(2):
        for r, res in enumerate(results):
            for what, key in (("the gradients when backward returned", "grads"),
                              ("the parameters after the step", "params")):
                mine, theirs = res[name]["steps"][step][key], res["torch"]["steps"][step][key]
                for p_name, ref in theirs.items():
                    got = mine[p_name]
                    if tight:
                        close = torch.isclose(got, ref, rtol=1e-6, atol=1e-7)
                    else:
                        close = (got - ref).abs() <= 1e-2 * (ref.abs() + ref.abs().max())
                    if close.all():
                        continue
                    i = int((~close).flatten().nonzero()[0])
                    a, b = got.flatten()[i].item(), ref.flatten()[i].item()
                    scaled = " (the step with the loss scaled by 8192)" if step == 1 else ""
                    near = 1e-3 if tight else 1e-2  # how near a ratio of yours to torch's tells a slip
                    if not math.isfinite(a):
                        hint = (" The sum of the ranks' float16 gradients overflowed (float16 holds at most 65504): "
                                "divide by the world size before the allreduce, as torch's hook does")
                    elif b and abs(a / b - n) < near * n:
                        hint = f" Yours is {n} times torch's: divide the sum by the world size"
                    elif b and (k := next((k for k in range(2, n) if abs(a / b - n / k) < near * n / k), None)):
                        hint = (f" Yours is {n}/{k} times torch's: divide by the world size ({n} here, the group's "
                                f"size), not by {k}")
                    elif tight and abs(a - b) <= 1e-3 * abs(b):
                        hint = (" Close, but not torch's: its hook rounds each rank's gradient to float16 (11 bits "
                                "of mantissa) before the allreduce, and sends float16; does yours?")
                    else:
                        hint = ""
                    raise Mismatch(f"{name} on {n} ranks, step {step}{scaled}, rank {r}: {what} differ from those "
                                   f"with torch's fp16_compress_hook{'' if tight else ' beyond float16 rounding'}: "
                                   f"{p_name}, element {i}, is {a:.6g} where torch's is {b:.6g}.{hint}".rstrip("."))


# ---------------------------------------------------------------- what hypothesis draws

SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
STRATEGIES = {
    "split_batch": dict(n=st.integers(1, 8), extra=st.integers(0, 40), features=st.integers(1, 4),
                        dtype=st.sampled_from(FLOATS)),
    "allreduce": dict(n=st.integers(1, 8), shape=st.one_of(SHAPES, st.integers(0, 10**5).map(lambda k: (k,))),
                      dtype=st.sampled_from(INTS + FLOATS), seed=st.integers(0, 2**31 - 1), transpose=st.booleans()),
    "schedule": dict(n=st.integers(1, 16)),
    "cost": dict(sched=schedules(), nbytes=st.integers(0, 1 << 30) | st.integers(0, 64),
                 alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-8), gamma=st.floats(0, 1e-9)),
    "zero1": dict(n=st.integers(1, 8), numel=st.integers(0, 64), steps=st.integers(1, 3), lr=st.floats(0.001, 1.0),
                  momentum=st.sampled_from([0.0, 0.9]) | st.floats(0.0, 0.99), seed=st.integers(0, 2**31 - 1)),
    "checkpoint": dict(optimizer=st.sampled_from(["sgd", "adam"]),
                       run=st.integers(2, 8).flatmap(lambda steps: st.tuples(st.just(steps),
                                                                              st.integers(1, steps - 1))),
                       seed=st.integers(0, 2**31 - 1), reseed=st.integers(0, 2**31 - 1)),
}
