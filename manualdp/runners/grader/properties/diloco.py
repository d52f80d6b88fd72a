"""`manualdp check diloco FILE.py`: grade DiLoCo's outer step (chapter 8) against the formula.

FILE.py defines `outer_step(theta, replicas, momentum, lr, mu) -> (new_theta, new_momentum)`:
`theta` the parameters every replica started the block from, `replicas` each replica's
parameters after its H steps, `momentum` the outer momentum buffer (zeros before the first
block), `lr` and `mu` the outer learning rate and momentum. The formula (`manualdp.spmd.ft.DiLoCo`):

    delta = (1/|M|) sum_i (theta - theta_i)
    b     = mu * b + delta
    theta = theta - lr * (delta + mu * b)

As the other exercises, FILE.py runs only in a sandboxed child (`sandbox.Child`), which `check.check_diloco`
loads; this process draws the inputs with hypothesis (`strategies`), computes the expected values and judges
what comes back (`outer_step_property`).
"""
from __future__ import annotations

import torch

from ..sandbox import Raised, Stopped
from .common import Mismatch, apart, hint_for

__all__ = ["expected_outer_step", "outer_step_property", "strategies"]


def expected_outer_step(theta, replicas, momentum, lr, mu):
    """The formula, as `DiLoCo.combine` applies it with torch's Nesterov SGD."""
    delta = torch.stack([theta - t for t in replicas]).mean(0)
    b = mu * momentum + delta
    return theta - lr * (delta + mu * b), b


def outer_step_property(fn, theta, replicas, momentum, lr, mu) -> None:
    """`fn` (a sandbox child) returns the formula's theta and momentum, to float64 rounding, and changes no replica."""
    want_theta, want_b = expected_outer_step(theta, replicas, momentum, lr, mu)
    told = (f"outer_step(theta, replicas, momentum, lr={lr:g}, mu={mu:g}) on {len(replicas)} replica(s) of shape "
            f"{tuple(theta.shape)}, theta {_show(theta)}, replicas [{', '.join(_show(t) for t in replicas)}], momentum "
            f"{_show(momentum)}")
    try:
        _, after, out = fn.call(theta, replicas, momentum, lr, mu)
    except Raised as e:
        raise Mismatch(f"{told}: it raised {e.kind}: {e.message}" + (f" (at {e.at})" if e.at else "")
                       + hint_for(e.kind, e.message)) from None
    except Stopped as e:  # it did not return: name the call that did not
        raise Stopped(f"{told} {e}") from None
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise Mismatch(f"{told}: expected a pair of tensors (new theta, new momentum), got {str(out)[:200]}")
    for name, got, want in (("theta", out[0], want_theta), ("momentum", out[1], want_b)):
        if got.shape != want.shape or not torch.allclose(got.to(want.dtype), want, rtol=1e-10, atol=1e-12):
            shown = apart(want, got, _show)
            raise Mismatch(f"{told}: expected new {name} {shown[0]}, got {shown[1]}"
                           + (" (the momentum buffer must be mu * b + delta, before the Nesterov step uses it)"
                              if name == "theta" and mu > 0 else ""))
    if any(not torch.equal(a, b) for a, b in zip(after[1], replicas)):
        raise Mismatch(f"{told}: it changed the replicas' parameters; only return new tensors")


def _show(t: torch.Tensor, digits: int = 4) -> str:
    return ("[" + ", ".join(f"{x:.{digits}g}" for x in t.reshape(-1)[:6].tolist())
            + (", ...]" if t.numel() > 6 else "]"))


def strategies() -> dict:
    """What hypothesis draws for `outer_step_property`: `inputs` (theta, replicas, momentum), `lr` and `mu`."""
    from hypothesis import strategies as st

    def tensors(draw_shape):
        return st.builds(lambda seed, shape, n: _inputs(seed, shape, n), st.integers(0, 2**31 - 1), draw_shape,
                         st.integers(1, 5))

    return {"inputs": tensors(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)),
            "lr": st.floats(0.01, 1.0), "mu": st.sampled_from([0.0, 0.5, 0.9]) | st.floats(0.0, 0.99)}


def _inputs(seed: int, shape: tuple, n: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(shape, generator=g, dtype=torch.float64)
    replicas = [theta + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    return theta, replicas, torch.randn(shape, generator=g, dtype=torch.float64) * (seed % 2)  # zeros, or a buffer
