"""The rungs where autograd or the user steps aside: a custom autograd.Function that returns no gradient for a
parameter it used (an unused parameter, as in torch's DDP and the drop-in; before: rung 3 crashed in `copy_()` on
None), and a parameter replaced after wrapping (refused at the next forward pass, as the drop-in does; before: never
averaged, silently).
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}


class NoWeightGrad(torch.autograd.Function):
    """x * w, whose backward returns a gradient for x only: w is used, but gets none."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w, None


class Scaled(nn.Module):
    """A linear layer, then a scale `w` applied by `NoWeightGrad` where `no_grad_for_w`, or plainly."""

    def __init__(self, no_grad_for_w: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.w = nn.Linear(4, 3), nn.Parameter(torch.randn(3))
        self.no_grad_for_w = no_grad_for_w

    def forward(self, x):
        y = self.lin(x)
        return NoWeightGrad.apply(y, self.w) if self.no_grad_for_w else y * self.w


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    out = {"x": x}
    for name, make in RUNGS.items():
        for case, none_here in (("everywhere", True), ("rank 1", rank == 1)):
            model = make(Scaled(none_here), timeout=20)
            try:
                model(x).pow(2).sum().backward()
                out[name, case] = _grads(model.module)
            except Exception as e:  # noqa: BLE001 - what each rank saw is the result
                out[name, case] = f"{type(e).__name__}: {e}"
        model = make(Scaled(False), timeout=20)
        model(x).pow(2).sum().backward()
        model.module.lin.weight = nn.Parameter(model.module.lin.weight.detach().clone())  # replaced after wrapping
        try:
            model(x).pow(2).sum().backward()
            out[name, "replaced"] = None
        except RuntimeError as e:
            out[name, "replaced"] = str(e)
    return out


def _expected(xs, none_on):
    """Each parameter's gradient averaged over the ranks that produced one (the others count zero); None if none."""
    total = {}
    for r, x in enumerate(xs):
        model = Scaled(r in none_on)
        model(x).pow(2).sum().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] = total.get(n, 0) + p.grad / len(xs)
    return {n: total.get(n) for n, _ in Scaled(False).named_parameters()}


def test_a_parameter_that_autograd_gives_no_gradient_counts_as_unused_and_a_replaced_one_is_refused():
    results = launch(_job, 2, timeout=180)
    xs = [out["x"] for out in results]
    for case, none_on in (("everywhere", {0, 1}), ("rank 1", {1})):
        want = _expected(xs, none_on)
        for name in RUNGS:
            for rank, out in enumerate(results):
                got = out[name, case]
                assert isinstance(got, dict), (name, case, rank, got)
                for n, g in want.items():
                    if g is None:  # no rank produced one: .grad stays None, as with torch's DDP
                        assert got[n] is None, (name, case, n)
                    else:
                        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-6, msg=f"{name} {case} {n}")
    for name in RUNGS:
        for rank, out in enumerate(results):
            message = out[name, "replaced"]
            assert message is not None and f"rank {rank}: " in message, (name, message)
            assert ("parameter lin.weight on ranks 0 and 1 is not the one the wrapper was built "
                    "with") in message, message
