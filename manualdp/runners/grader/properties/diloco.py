"""`manualdp check diloco FILE.py`: grade DiLoCo's outer step (chapter 8) against the formula.

FILE.py defines `outer_step(theta, replicas, buffer, lr, momentum) -> (new_theta, new_buffer)`:
`theta` the parameters every replica started the block from, `replicas` each replica's
parameters after its H steps, `buffer` the outer momentum buffer (zeros before the first
block), `lr` and `momentum` the outer learning rate and momentum coefficient (torch's
names). The formula (`manualdp.spmd.ft.DiLoCo`):

    delta = (1/|M|) sum_i (theta - theta_i)
    b     = momentum * b + delta
    theta = theta - lr * (delta + momentum * b)

As the other exercises, FILE.py runs only in a sandboxed child (`sandbox.Child`), which `check.check_diloco`
loads; this process draws the inputs with hypothesis (`strategies`), computes the expected values and judges
what comes back (`outer_step_property`).
"""
from __future__ import annotations

import torch

from ..sandbox import Raised, Stopped
from .common import Mismatch, apart, hint_for

__all__ = ["expected_outer_step", "outer_step_property", "outer_step_sizes_property", "strategies", "SIZES"]


def expected_outer_step(theta, replicas, momentum, lr, mu):
    """The formula, as `DiLoCo.combine` applies it with torch's Nesterov SGD."""
    return _nesterov(theta, torch.stack([theta - t for t in replicas]).mean(0), momentum, lr, mu)


def _nesterov(theta, delta, momentum, lr, mu):
    b = mu * momentum + delta
    return theta - lr * (delta + mu * b), b


def outer_step_property(fn, theta, replicas, momentum, lr, mu) -> None:
    """`fn` (a sandbox child, or a function) returns the formula's theta and momentum, to float64 rounding, and
    changes no replica."""
    want_theta, want_b = expected_outer_step(theta, replicas, momentum, lr, mu)
    told = (f"outer_step(theta, replicas, buffer, lr={lr:g}, momentum={mu:g}) on {len(replicas)} replica(s) of shape "
            f"{tuple(theta.shape)}, theta {_show(theta)}, replicas [{', '.join(_show(t) for t in replicas)}], buffer "
            f"{_show(momentum)}")
    try:
        _, after, out = _call(fn, theta, replicas, momentum, lr, mu)
    except Raised as e:
        raise Mismatch(f"{told}: it raised {e.kind}: {e.message}" + (f" (at {e.at})" if e.at else "")
                       + hint_for(e.kind, e.message)) from None
    except Stopped as e:  # it did not return: name the call that did not
        raise Stopped(f"{told} {e}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise Mismatch(f"{told}: expected a pair of tensors (new theta, new buffer), got {str(out)[:200]}")
    for name, got, want in (("theta", out[0], want_theta), ("buffer", out[1], want_b)):
        if got.shape != want.shape or not _close(got, want):
            shown = apart(want, got, _show)
            raise Mismatch(f"{told}: expected new {name} {shown[0]}, got {shown[1]}",  # the slip named when read
                           hint=lambda: _slip(name, got, theta, replicas, momentum, lr, mu))
    if any(not torch.equal(a, b) for a, b in zip(after[1], replicas)):
        raise Mismatch(f"{told}: it changed the replicas' parameters; only return new tensors")


def _call(fn, theta, replicas, momentum, lr, mu) -> tuple:
    """`fn.call(...)` of a sandbox child; a plain function (tests/ call the answers so) is called here, on copies."""
    if hasattr(fn, "call"):
        return fn.call(theta, replicas, momentum, lr, mu)
    given = (theta.clone(), [t.clone() for t in replicas], momentum.clone(), lr, mu)
    return given, given, fn(*given)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to float64's rounding: a relative 1e-10 (an answer off by 1e-6 is refused)."""
    return torch.allclose(got.to(want.dtype), want, rtol=1e-10, atol=1e-12)


def _slips(theta, replicas, momentum, lr, mu) -> dict:
    """A slip a student makes -> (the theta and momentum it returns, what to write instead)."""
    n, fix = len(replicas), ("DiLoCo's outer step is Nesterov: b = momentum * b + delta, "
                             "then theta - lr * (delta + momentum * b)")
    delta = torch.stack([theta - t for t in replicas]).mean(0)
    b = mu * momentum + delta
    slips = {"heavy-ball momentum, theta - lr * b (which is also Nesterov's step taken with the buffer before its "
             "update)": ((theta - lr * b, b), fix),
             "SGD without momentum, theta - lr * delta": ((theta - lr * delta, b), fix),
             "the sum of the changes where DiLoCo averages them": (
                 _nesterov(theta, n * delta, momentum, lr, mu) if n > 1 else None,
                 f"divide the sum by the number of replicas ({n} here)"),
             "the old momentum buffer returned": ((theta - lr * (delta + mu * b), momentum),
                                                  "return the new buffer, momentum * b + delta")}
    for k in range(1, n):  # an average over the first k replicas only
        slips[f"the average of the first {k} replicas only, of {n}"] = (
            expected_outer_step(theta, replicas[:k], momentum, lr, mu), "average over every replica of the list")
    return slips


def _slip(name: str, got: torch.Tensor, theta, replicas, momentum, lr, mu) -> str:
    """Which slip an answer's `name` ("theta" or "buffer") shows, if one of `_slips` gives it."""
    for what, (out, fix) in _slips(theta, replicas, momentum, lr, mu).items():
        want = None if out is None else out[0 if name == "theta" else 1]
        if want is not None and got.shape == want.shape and _close(got, want):
            return f". Yours equals {what}: {fix}"
    return ""


def _show(t: torch.Tensor, digits: int = 4) -> str:
    return ("[" + ", ".join(f"{x:.{digits}g}" for x in t.reshape(-1)[:6].tolist())
            + (", ...]" if t.numel() > 6 else "]"))


def strategies() -> dict:
    """What hypothesis draws for `outer_step_property`: `inputs` (theta, replicas, momentum), `lr` and `mu`. The
    momentum buffer is a running one unless `fresh` is drawn, so that a failure shrinks to a non-zero buffer, where
    heavy-ball and Nesterov with the old buffer differ."""
    from hypothesis import strategies as st

    def tensors(draw_shape):
        return st.builds(_inputs, st.integers(0, 2**31 - 1), draw_shape, st.integers(1, 16), st.booleans())

    return {"inputs": tensors(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)),
            "lr": st.floats(0.01, 1.0), "mu": st.sampled_from([0.5, 0.0, 0.9]) | st.floats(0.0, 0.99)}


def _inputs(seed: int, shape: tuple, n: int, fresh: bool = False):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(shape, generator=g, dtype=torch.float64)
    replicas = [theta + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    return theta, replicas, torch.randn(shape, generator=g, dtype=torch.float64) * (not fresh)  # zeros, or a buffer


def outer_step_sizes_property(fn) -> None:
    """The sizes checked once, beside what hypothesis draws: 16 replicas, and a million elements on 2."""
    for seed, shape, n, lr, mu in SIZES:
        outer_step_property(fn, *_inputs(seed, shape, n), lr, mu)


SIZES = [(1, (3,), 16, 0.7, 0.9), (2, (10**6,), 2, 0.7, 0.9)]
"""(seed, shape, replicas, lr, mu) of the outer steps `outer_step_sizes_property` checks once."""
