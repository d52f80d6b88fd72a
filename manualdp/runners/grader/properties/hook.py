"""`fp16_compress_hook(process_group, bucket)` (chapter 5), on 2 and 3 ranks: torch's DDP with the file's comm
hook steps as with torch's own, held to a comm hook's contract; the rank job of the file's hook (`hook_job`, in ranks
the sandbox's child starts) and of torch's (`torch_hook_job`, in ranks of the grader's own)."""
from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .common import Mismatch, rank_error

__all__ = ["LOSS_SCALE", "hook_job", "torch_hook_job", "hook_mismatch"]

LOSS_SCALE = 2.0 ** 13  # step 1's loss scale: each rank's gradient of the last bias is 4 rows x 8192 = 32768


def _hooked_steps(hook) -> dict:
    """Torch's DDP with `hook` on this rank: 2 steps of a small float32 MLP, several buckets; step 0 an ordinary
    loss, step 1 a sum scaled by `LOSS_SCALE` (as float16 training scales its loss), whose last-bias gradient is
    half of what float16 holds (65504) on each rank: the sum of the ranks' overflows, their average does not."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ....spmd.launch import shard

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    model = TorchDDP(net, bucket_cap_mb=0.0002)  # 200 bytes: a bucket per layer or two
    local: dict = {}  # this rank's gradients as the hook is handed them, by parameter name
    model.register_comm_hook(None, _recording(hook, {id(p): k for k, p in net.named_parameters()}, local))
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
        local.clear()
        loss.backward()
        out["steps"].append({"grads": {k: p.grad.detach().clone() for k, p in net.named_parameters()},
                             "params": None, "local": _over_the_ranks(local)})
        opt.step()
        out["steps"][-1]["params"] = {k: p.detach().clone() for k, p in net.named_parameters()}
    return out


def _recording(hook, names: dict, local: dict):
    """`hook`, with each bucket's gradients recorded in `local` (by parameter name) before `hook` sees them."""
    def recorded(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            local[names[id(p)]] = g.detach().clone()
        return hook(state, bucket)

    return recorded


def _over_the_ranks(local: dict) -> dict:
    """{name: (the ranks' gradients summed, their absolute values summed)}, in float64 over all ranks: what bounds
    a right float16 hook's error (`_float16_bound`)."""
    out = {}
    for k in sorted(local):
        both = torch.stack([local[k].double(), local[k].double().abs()])
        dist.all_reduce(both)
        out[k] = (both[0], both[1])
    return out


def hook_job(path: str, name: str) -> dict:
    """One rank of the hook check: the file's `name` registered on torch's DDP (`_hooked_steps`); {name: results},
    or {"error": ...} when the student's code raises. Torch's hook runs in the grader's own ranks (`torch_hook_job`)."""
    import importlib.util

    writable = [os.getcwd(), tempfile.gettempdir()]  # its folders, before the file can move
    broken: list[str] = []  # what the hook did that DDP cannot take, in words
    try:
        from .. import intact
        from ..own import write_it_yourself

        put_back = write_it_yourself([name])  # torch's own hook raises, naming itself, if the file's only calls it
        steps, held = _hooked_steps, _held_to_the_contract  # bound before the file loads: it may rebind them
        try:
            spec = importlib.util.spec_from_file_location("exercise", path)
            module = importlib.util.module_from_spec(spec)
            before = intact.snapshot()
            spec.loader.exec_module(module)
            out = {name: steps(held(getattr(module, name), name, broken))}
            intact.check(before)
        finally:
            put_back()  # this process may run torch's own hook next (`torch_hook_job`)
    except Exception as e:  # noqa: BLE001
        out = {"error": rank_error(e, path, writable)}
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


U16 = 2.0 ** -11  # float16's unit roundoff: round to nearest with 11 bits of mantissa
TINY16 = 2.0 ** -24  # float16's smallest subnormal: below 2^-14 its rounding error is absolute, up to half of this


def _float16_bound(mine: tuple, theirs: tuple, n: int) -> torch.Tensor:
    """How far two right float16 hooks' averages may lie apart, per element, given each run's (sum, sum of |x_i|) of
    the ranks' local gradients x_i. One hook: each share is rounded to float16 (u |x_i|), divided by n and rounded
    (u |x_i| / n after the first), and the n shares added in float16 in any order (n - 1 roundings, each at most
    u times the shares' |sum| so far): (n + 1) u sum|x_i| / n to first order, plus 3n - 1 subnormal roundings of at
    most 2^-25. Two hooks (yours and torch's) double it; and the exact averages themselves differ by how far the runs'
    local gradients differ (step 1 starts from step 0's parameters, which the two hooks moved differently)."""
    (sum_m, abs_m), (sum_t, abs_t) = mine, theirs
    rounding = (n + 1) * U16 * (abs_m + abs_t) / n + (3 * n - 1) * TINY16
    return (1 + 1e-6) * rounding + (sum_m - sum_t).abs() / n  # 1e-6: float32's rounding of the bound's terms


def hook_mismatch(results: list[dict], name: str) -> None:
    """Raise `Mismatch` at the first step and rank where `name`'s gradients (or parameters) differ from those with
    torch's fp16_compress_hook. On 2 ranks to 1e-6 relatively, so that a hook that does not round to float16 is told:
    there a right hook's float16 arithmetic is exact or has one order (x / 2, a + b). On more ranks the gradients to
    float16's rounding of the ranks' shares (`_float16_bound`): a right hook may divide, or add the shares, in another
    order than torch's; the parameters (lr times the gradients) and results built without the ranks' local gradients
    to 1% of the tensor's largest value."""
    n = len(results)
    tight = n <= 2
    for step in range(2):
        for r, res in enumerate(results):
            for what, key in (("the gradients when backward returned", "grads"),
                              ("the parameters after the step", "params")):
                mine, theirs = res[name]["steps"][step][key], res["torch"]["steps"][step][key]
                bounds = (res[name]["steps"][step].get("local"), res["torch"]["steps"][step].get("local"))
                for p_name, ref in theirs.items():
                    got = mine[p_name]
                    if tight:
                        close = torch.isclose(got, ref, rtol=1e-6, atol=1e-7)
                    elif key == "grads" and all(b and p_name in b for b in bounds):
                        close = (got.double() - ref.double()).abs() <= _float16_bound(bounds[0][p_name],
                                                                                      bounds[1][p_name], n)
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
