"""The ladder's rungs off their happy path, at 2 and 3 ranks: ranks that do different things end right or in one
clear error on every rank, never in a gloo abort, a hang or a wrong number.

- two same-shaped layers applied a, b on one rank and b, a on the others: rung 3 pairs its
  allreduces by parameter, so every rung's gradients are the average (before: rung 3 paired
  them by the order they were ready, 0.08 off);
- a layer used on the last rank only: every rung averages it, the others counting zero
  (before: rung 3 made gloo abort);
- a rank that skips a backward pass, or runs one more: every rank raises naming the step
  (before: the skipping rank returned normally with gradients of two steps mixed); also with
  BatchNorm, whose buffers every training forward copies from rank 0 (before: the copy paired
  with the peers' step check, and every rank waited out its timeout);
- a rung over a rung, or two rungs over one module: refused at construction in one line
  (before: no error, gradients averaged twice).
One launch per world size runs every case; the assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}  # about 100 B: a bucket per layer


class Pair(nn.Module):
    """Two same-shaped layers and a third used on some ranks only; `swap` applies the two in the other order."""

    def __init__(self, swap: bool = False, extra: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.swap, self.extra = swap, extra

    def forward(self, x):
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        y = second(torch.tanh(first(x)))
        return self.c(y) if self.extra else y


class PairNorm(Pair):
    """`Pair` with a BatchNorm after it: buffers that each forward pass with grad copies from rank 0."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(super().forward(x))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}


def _try(out, name, fn):
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out[name] = ("err", type(e).__name__, str(e))


def _steps(model, x, skip: int | None = None, again: int | None = None, steps: int = 3):
    """Train `steps` steps; at step `skip` run forward but no backward, at step `again` run backward twice."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        if step == skip:
            continue
        loss.backward(retain_graph=step == again)
        if step == again:
            loss.backward()
        opt.step()
    return _grads(model)


def _job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    last = r == n - 1
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    out = {"x": x}
    for name, make in RUNGS.items():
        # the layers in another order on the last rank; then a layer used there only
        _try(out, f"{name} order", lambda: _steps(make(Pair(swap=last), timeout=20), x, steps=1))
        _try(out, f"{name} used on one rank", lambda: _steps(make(Pair(extra=last), timeout=20), x, steps=1))
        # one rank skips a backward pass, or runs one more: every rank raises
        _try(out, f"{name} skip", lambda: _steps(make(Pair(), timeout=20), x, skip=1 if last else None))
        _try(out, f"{name} one more", lambda: _steps(make(Pair(), timeout=20), x, again=1 if last else None))
        _try(out, f"{name} skip, buffers", lambda: _steps(make(PairNorm(), timeout=20), x, skip=1 if last else None))
        # a rung over a rung, two rungs over one module
        inner = make(Pair(), timeout=20)
        _try(out, f"{name} over a rung", lambda: make(inner, timeout=20) and None)
        net = Pair()
        first = make(net, timeout=20)  # kept: a rung no one holds is gone, and its module plain again
        _try(out, f"{name} twice over one module", lambda: NaiveDDP(net, timeout=20) and None)
        del first
        # after all that, the rung still trains right
        _try(out, f"{name} after", lambda: _steps(make(Pair(), timeout=20), x, steps=2))
    return out


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=240)


def _expected(xs, swap_last: bool, extra_last: bool):
    """The average over the ranks of each rank's gradients, computed in one process."""
    n = len(xs)
    total = {}
    for r, x in enumerate(xs):
        last = r == n - 1
        model = Pair(swap=swap_last and last, extra=extra_last and last)
        model(x).pow(2).sum().backward()
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            total[name] = total.get(name, 0) + g
    return {name: g / n for name, g in total.items()}


def _raised(res, name, *parts):
    for r, out in enumerate(res):
        assert out[name][0] == "err", (r, name, out[name])
        _, kind, message = out[name]
        assert message.startswith(f"rank {r}: "), (r, name, kind, message)
        for part in parts:
            assert part in message, (r, name, part, message)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_same_shaped_layers_in_another_order_on_one_rank_average_right(n, rung):
    res = _results(n)
    expected = _expected([out["x"] for out in res], swap_last=True, extra_last=False)
    for r, out in enumerate(res):
        assert out[f"{rung} order"][0] == "ok", (r, out[f"{rung} order"])
        got = out[f"{rung} order"][1]
        for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_layer_used_on_one_rank_only_is_averaged_with_zeros_elsewhere(n, rung):
    res = _results(n)
    expected = _expected([out["x"] for out in res], swap_last=False, extra_last=True)
    for r, out in enumerate(res):
        assert out[f"{rung} used on one rank"][0] == "ok", (r, out[f"{rung} used on one rank"])
        got = out[f"{rung} used on one rank"][1]
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_rank_that_skips_a_backward_or_runs_one_more_raises_on_every_rank(n, rung):
    res = _results(n)
    _raised(res, f"{rung} skip", "called differently across ranks", "step 2..3 (per rank: " + ", ".join(
        ["2"] * (n - 1) + ["3"]) + ")")
    _raised(res, f"{rung} one more", "called differently across ranks", "step 2..3 (per rank: " + ", ".join(
        ["3"] * (n - 1) + ["2"]) + ")")
    # the skipping rank's next forward copies buffers while the others check their backward pass's step
    _raised(res, f"{rung} skip, buffers", "called differently across ranks", "step 2..3 (per rank: " + ", ".join(
        ["2"] * (n - 1) + ["3"]) + ")")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_rung_over_a_rung_or_two_rungs_over_one_module_are_refused(n, rung):
    res = _results(n)
    _raised(res, f"{rung} over a rung", "is already averaged by a", "wrap a module once")
    _raised(res, f"{rung} twice over one module", "NaiveDDP: parameter a.weight of Pair is already averaged by a")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_after_the_refusals_the_rung_trains_alike_on_every_rank(n, rung):
    res = _results(n)
    for r, out in enumerate(res):
        assert out[f"{rung} after"][0] == "ok", (r, out[f"{rung} after"])
        for name, g in out[f"{rung} after"][1].items():
            assert torch.equal(g, res[0][f"{rung} after"][1][name]), (r, name)
