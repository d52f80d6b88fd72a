"""Comm hooks that differ across ranks, or come between a forward and its backward, on the drop-in at 2 ranks.

- a hook registered at step 1 on rank 0 only: every rank raises one line naming the comm hook, which rank has it
  and at which step (was: the call check's "allreduce called differently: elements 2..38, dtype int64..float32",
  the hook not named). Torch's DDP trains on in this case, because the one hook averages too: we name it, since a
  hook that does anything else would part the ranks' gradients;
- a `functools.partial` hook whose bound scale differs per rank (a float, then a tensor): every rank raises naming
  both (was: compared by the function's name only, it trained with a rank-dependent scale, silently); the same
  partial on every rank trains as torch's DDP does;
- a hook registered between a forward pass and its backward: accepted, as torch's, and that backward is reduced by
  it (was: refused); with a hook that doubles, the parameters equal a one-process run on the whole batch whose
  loss is doubled from that step on.
One launch runs every case; the assertions run here, in the parent.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from tests.helpers import error_of

LR, STEPS = 0.1, 3


def _scaled(state, bucket, scale=1.0):
    """Torch's allreduce hook, scaled by `scale` first."""
    t = bucket.buffer() * scale / dist.get_world_size()
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


_average = functools.partial(_scaled, scale=1.0)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _x(rank, step):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def train(hook, *, at=0, ranks=(0, 1), mid=False, state=None):
    """STEPS steps; `hook` (with `state`) registered at step `at` on `ranks`, before the forward or (`mid`) between it
    and backward."""
    rank = dist.get_rank()
    model = DistributedDataParallel(_net(), timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def steps():
        for step in range(STEPS):
            registers = step == at and rank in ranks
            if registers and not mid:
                model.register_comm_hook(state, hook)
            opt.zero_grad()
            loss = model(_x(rank, step)).sum()
            if registers and mid:
                model.register_comm_hook(state, hook)
            loss.backward()
            opt.step()
    error = error_of(steps)
    return error, [p.detach().clone() for p in model.module.parameters()]


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    return {
        "rank 0 only": train(_average, at=1, ranks=(0,)),
        "partial float": train(functools.partial(_scaled, scale=1.0 + rank)),
        "partial tensor": train(functools.partial(_scaled, scale=torch.tensor([1.0, 2.0 + rank]))),
        "partial same": train(functools.partial(_scaled, scale=torch.tensor(1.0))),
        "between": train(functools.partial(_scaled, scale=2.0), at=1, mid=True),
    }


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=240)


def _reference(scale_from=STEPS, scale=1.0):
    """The parameters of one process trained on both ranks' batches (each rank's loss summed, the two averaged), the
    loss times `scale` from step `scale_from` on."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        factor = scale if step >= scale_from else 1.0
        (net(torch.cat([_x(0, step), _x(1, step)])).sum() * factor / 2).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def refused(results, case, *named):
    """Every rank's error in `case` is one line naming the comm hooks that differ, and each of `named`."""
    for rank, out in enumerate(results):
        error = out[case][0]
        assert error is not None and "\n" not in error, (rank, error)
        assert error.startswith(f"ValueError: rank {rank}: DistributedDataParallel's comm hook differs across ranks"), \
            (rank, error)
        for name in named:
            assert name in error, (rank, name, error)


def test_a_hook_registered_on_one_rank_only_is_named_with_its_rank_and_step_on_every_rank():
    refused(_results(), "rank 0 only", "(per rank: _scaled [code ",
            "](scale=1.0) before step 1, none (manualdp's allreduce))")


def test_partial_hooks_whose_bound_arguments_differ_are_named_on_every_rank():
    refused(_results(), "partial float", "scale=1.0", "scale=2.0")
    refused(_results(), "partial tensor", "scale=tensor(float32, [2], digest ")


def test_the_same_partial_hook_on_every_rank_trains_as_one_process():
    for rank, out in enumerate(_results()):
        error, params = out["partial same"]
        assert error is None, (rank, error)
        for got, want in zip(params, _reference()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_hook_registered_between_forward_and_backward_is_taken_and_reduces_that_backward():
    for rank, out in enumerate(_results()):
        error, params = out["between"]
        assert error is None, (rank, error)
        for got, want in zip(params, _reference(scale_from=1, scale=2.0)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
