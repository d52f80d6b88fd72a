"""`fp16_compress_hook(process_group, bucket)` (chapter 5), on 2 and 3 ranks: torch's DDP with the file's comm
hook steps as with torch's own, held to a comm hook's contract; the rank job of the file's hook (`hook_job`, in ranks
the sandbox's child starts) and of torch's (`torch_hook_job`, in ranks of the grader's own)."""
from __future__ import annotations

import math
import traceback

import torch
import torch.distributed as dist
from torch import nn

from .common import Mismatch

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
        from ..own import write_it_yourself

        put_back = write_it_yourself([name])  # torch's own hook raises, naming itself, if the file's only calls it
        try:
            spec = importlib.util.spec_from_file_location("exercise", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            out = {name: _hooked_steps(_held_to_the_contract(getattr(module, name), name, broken))}
        finally:
            put_back()  # this process may run torch's own hook next (`torch_hook_job`)
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
