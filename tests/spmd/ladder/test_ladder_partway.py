"""The ladder's rungs after a backward pass that stopped part-way, at 2 ranks: one clear error, no silent wrong step.

- a backward pass that raises on every rank after its first gradient hook fired (a hook on an activation's
  gradient raises): the next forward pass with grad raises on every rank, naming the rung, and the step after
  it is averaged (before: the end-of-backward callback never ran, and every later step left each rank its own
  gradient, with no error);
- a step check refused on every rank (one rank ran one forward pass more): each of the two steps after raises
  again or averages, never leaves the ranks different gradients in silence (before, with `_queued` cleared
  after `sync_gradients` in naive.py, a planted bug: every later step was silently unaveraged).
One launch runs every case; the assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}  # about 100 B: a bucket per layer


def _boom(grad):
    """A gradient hook that raises: backward stops there."""
    raise RuntimeError("boom in backward")


class Net(nn.Module):
    """Two layers; with `boom` set, backward raises after the second layer's gradients are in, before the first's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.boom = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.boom:  # on h's gradient: after b's gradients are in (their hooks fired), before a's
            h.register_hook(_boom)
        return self.b(h)


def _try(out, name, fn):
    try:
        out[name] = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        out[name] = ("err", type(e).__name__, str(e))


def _step(model, x):
    """One step's gradients: forward, backward, and each parameter's .grad."""
    model.module.zero_grad()
    model(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def _job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    out = {"x": x}
    for name, make in RUNGS.items():
        # a backward pass that raises part-way on every rank; then a forward that must raise; then a plain step
        net = Net()
        model = make(net, timeout=20)
        net.boom = True
        _try(out, f"{name} boom", lambda: _step(model, x))
        net.boom = False
        _try(out, f"{name} next forward", lambda: _step(model, x))
        _try(out, f"{name} after", lambda: _step(model, x))
        out[f"{name} steps"] = model.steps
        # a step check refused on every rank (the last rank ran one forward more); then two more steps
        model = make(Net(), timeout=20)
        _try(out, f"{name} first", lambda: _step(model, x))
        if r == n - 1:
            model(x)
        _try(out, f"{name} refused", lambda: _step(model, x))
        for k in (1, 2):
            _try(out, f"{name} refused, then {k}", lambda: _step(model, x))
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240)


def _expected(xs):
    """The average over the ranks of each rank's gradients, computed in one process."""
    total = {}
    for x in xs:
        net = Net()
        net(x).pow(2).sum().backward()
        for name, p in net.named_parameters():
            total[name] = total.get(name, 0) + p.grad
    return {name: g / len(xs) for name, g in total.items()}


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_after_a_backward_that_failed_part_way_the_next_forward_raises_then_the_rung_trains_on(rung):
    res = _results()
    expected = _expected([out["x"] for out in res])
    for r, out in enumerate(res):
        boom = out[f"{rung} boom"]
        assert boom[0] == "err" and "boom in backward" in boom[2], (r, boom)
        assert out[f"{rung} next forward"][0] == "err", (r, out[f"{rung} next forward"])
        _, kind, message = out[f"{rung} next forward"]
        assert kind == "RuntimeError" and "\n" not in message, (r, kind, message)
        cls = getattr(RUNGS[rung], "func", RUNGS[rung]).__name__  # BucketedDDP under its partial
        assert message.startswith(f"rank {r}: {cls}: the previous backward pass failed part-way"), (r, message)
        assert out[f"{rung} after"][0] == "ok", (r, out[f"{rung} after"])
        for name, g in expected.items():
            torch.testing.assert_close(out[f"{rung} after"][1][name], g, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")
        assert out[f"{rung} steps"] == 2, (r, out[f"{rung} steps"])  # the forward that raised is not a step


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_after_a_refused_step_check_each_step_raises_or_averages_never_differs_in_silence(rung):
    res = _results()
    for r, out in enumerate(res):
        assert out[f"{rung} first"][0] == "ok", (r, out[f"{rung} first"])
        assert out[f"{rung} refused"][0] == "err", (r, out[f"{rung} refused"])
        assert "called differently across ranks" in out[f"{rung} refused"][2], (r, out[f"{rung} refused"])
    for k in (1, 2):
        got = [out[f"{rung} refused, then {k}"] for out in res]
        if all(g[0] == "err" for g in got):
            continue
        assert all(g[0] == "ok" for g in got), (k, got)  # one rank trains on while another raised: out of step
        for r, g in enumerate(got):
            for name, grad in g[1].items():
                assert torch.equal(grad, got[0][1][name]), (k, r, name)
