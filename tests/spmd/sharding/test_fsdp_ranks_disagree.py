"""`fully_shard` when ranks do not run the same program: every rank raises one line naming the unit, or the result
is torch's; never a signal from gloo, a hang, or numbers mixed from two units."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard
from manualdp.spmd.sharding.fsdp_collectives import UnitMismatch


class Pair(nn.Module):
    """Two same-shaped layers (each a unit) that `order` applies in either order, and a third of another shape."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.c = nn.Linear(4, 6)
        self.head = nn.Linear(4, 2)

    def forward(self, x, order="ab", extra=None):
        for name in order:
            x = torch.tanh(getattr(self, name)(x))
        if extra == "c":
            x = x + self.c(x)[:, :4]
        return self.head(x)


def _pair():
    model = Pair()
    for m in (model.a, model.b, model.c):
        fully_shard(m)
    return fully_shard(model)


def _outcome(fn):
    try:
        fn()
        return None
    except (RuntimeError, ValueError) as e:  # UnitMismatch; the collectives' call check
        return f"{type(e).__name__}: {e}"


def _order_job():
    rank = dist.get_rank()
    model = _pair()
    X = torch.randn(3, 4)
    return _outcome(lambda: model(X, order="ab" if rank == 0 else "ba").sum().backward())


def _extra_job(extra):
    """Rank 1 runs one unit more: a same-shaped one (`b` again) or one of another shape (`c`)."""
    rank = dist.get_rank()
    model = _pair()
    X = torch.randn(3, 4)
    if extra == "b":
        return _outcome(lambda: model(X, order="ab" if rank == 0 else "abb").sum().backward())
    return _outcome(lambda: model(X, extra="c" if rank == 1 else None).sum().backward())


@pytest.mark.parametrize("job, args", [(_order_job, ()), (_extra_job, ("b",)), (_extra_job, ("c",))],
                         ids=["same-shaped units in another order", "one same-shaped unit more",
                              "one unit of another shape more"])
def test_ranks_that_run_other_units_all_raise_naming_the_unit(job, args):
    got = launch(job, 2, args=args, timeout=120.0)
    for rank, message in enumerate(got):
        assert message is not None, f"rank {rank} returned normally"
        assert f"rank {rank}" in message and ("unit" in message or "differ" in message), message


def _forward_more_job():
    """Rank 1 runs one forward more before backward: its second all-gather is for forward, rank 0's for backward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4), reshard_after_forward=True)
    X = torch.randn(3, 4)
    try:
        if rank == 1:
            model(X)
        model(X).sum().backward()
    except UnitMismatch as e:
        return str(e)
    return None


def test_a_forward_more_on_one_rank_is_named_by_the_all_gathers_tails_as_backward_against_forward():
    """The same unit, the same count: only the tail's backward bit differs, and the tails check (not the collectives'
    call check, one collective later) names it."""
    for rank, message in enumerate(launch(_forward_more_job, 2, timeout=120.0)):
        assert message is not None, f"rank {rank} raised no UnitMismatch"
        assert message.startswith(f"rank {rank}: fully_shard's all-gather of unit 1 (FSDPLinear) met other units or "
                                  "counts on other ranks (rank 0: unit 1, all-gather 2 (backward); rank 1: unit 1, "
                                  "all-gather 2 mod 64)"), message


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layer = nn.Linear(4, 4)
        self.spare = nn.Parameter(torch.randn(3, 4))  # in the unit, never used by forward

    def forward(self, x):
        return self.layer(x)


def _unused_job():
    rank, out = dist.get_rank(), {}
    for name, fn in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = Unused()
        fn(model.layer)
        fn(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        for step in range(2):
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step + rank))).sum().backward()
            opt.step()
            opt.zero_grad()
        out[name] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def test_a_parameter_forward_never_uses_is_not_decayed_as_torch_leaves_it():
    for got in launch(_unused_job, 2, timeout=120.0):
        assert torch.equal(got["ours"]["spare"], Unused().spare.detach())
        for k in got["torch"]:
            assert torch.equal(got["ours"][k], got["torch"][k]), k
