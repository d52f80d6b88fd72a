"""`zero1_step(params, grads, momenta, lr, momentum)` (chapter 6): one ZeRO-1 step leaves every device where plain
data parallelism's SGD with momentum does, device i holding its own chunk's momentum; and what hypothesis draws
for it (`DRAWN`)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .common import Mismatch, apart, called, n_devices, seconds, show

__all__ = ["zero1_property", "zero1_sizes_property", "DRAWN", "SIZES"]


def zero1_property(zero1_step, n: int, numel: int, steps: int, lr: float, momentum: float, seed: int) -> None:
    """`steps` calls of `zero1_step` on `n` devices leave every device's parameters where plain data parallelism's
    SGD with momentum (the summed gradients, every device stepping the whole model) leaves them, bitwise identical on
    every device, and device i's momentum buffer that of its own chunk (`collectives.chunk`)."""
    from ....collectives import chunk

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
        call = (f"zero1_step(params, grads, momenta, lr={lr:g}, momentum={momentum:g}) on {n_devices(n)}, "
                f"{numel} parameter{'s' * (numel != 1)}, step {step + 1} of {steps}"
                + (f": grads {', '.join(show(t) for t in grads)}" if numel * n <= 8 else ""))
        kept = [t.clone() for t in params + momenta]
        held, given, out = called(call, zero1_step, params, [t.clone() for t in grads], momenta, lr, momentum)
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
                                   f"place; it is {show(t)}")
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
                got, want = apart(params[i][bad].item(), plain[bad].item(), seconds)
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
    from ....schedule import chunk_bounds, owned_chunk

    return chunk_bounds(numel, n)[owned_chunk(device, n)]


DRAWN = dict(n=st.integers(1, 8), numel=st.integers(0, 64), steps=st.integers(1, 3), lr=st.floats(0.001, 1.0),
             momentum=st.sampled_from([0.0, 0.9]) | st.floats(0.0, 0.99), seed=st.integers(0, 2**31 - 1))
SIZES = [dict(n=3, numel=10**6 + 1, steps=2, lr=0.1, momentum=0.9, seed=1), dict(n=16, numel=37, steps=2, lr=0.1,
                                                                                  momentum=0.9, seed=2)]
"""Checked once by `zero1_sizes_property` (a million parameters once, not for every example hypothesis draws)."""


def zero1_sizes_property(zero1_step) -> None:
    """The sizes checked once, beside what hypothesis draws: a million parameters on 3 devices, and 16 devices."""
    for case in SIZES:
        zero1_property(zero1_step, **case)
