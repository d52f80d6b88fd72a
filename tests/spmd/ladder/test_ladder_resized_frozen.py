"""A parameter resized through `.data`, or frozen, on one rank only after wrapping the drop-in or a rung: every rank
raises one line naming the parameter, the rank (and both shapes); frozen on every rank alike, training goes on.

Before: a bias's `.data` given shape (1,) on rank 1 trained on silently (the drop-in, `OverlappedDDP`,
`BucketedDDP`) or raised an unnamed "allreduce called differently" (`NaiveDDP`, `FlatDDP`); a weight frozen on
rank 1 trained on silently on the rungs and raised torch's seven-line "Expected to have finished reduction" on the
drop-in."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

WRAPPERS = {"DistributedDataParallel": DistributedDataParallel, "NaiveDDP": NaiveDDP, "FlatDDP": FlatDDP,
            "OverlappedDDP": OverlappedDDP, "BucketedDDP": BucketedDDP}


def _change(net, how, rank):
    if how == "resize" and rank == 1:
        net[0].bias.data = torch.zeros(1)  # broadcasts in forward: only the shape tells
    elif how == "freeze" and rank == 1 or how == "freeze everywhere":
        net[1].weight.requires_grad_(False)


def _job(how):
    torch.set_num_threads(1)
    out = {}
    for name, make in WRAPPERS.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        kwargs = {"find_unused_parameters": True} if name == "DistributedDataParallel" else {}
        model = make(net, timeout=20, **kwargs)
        try:
            for step in range(3):
                if step == 1:
                    _change(net, how, dist.get_rank())
                model(torch.randn(4, 4)).sum().backward()
            out[name] = [p.detach().clone() for p in net.parameters()]
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[name] = f"{type(e).__name__}: {e}"
        del model
    return out


@pytest.mark.parametrize("how,said", [
    ("resize", "parameter 0.bias on rank 1 has shape (1,), where the wrapper was built with (3,) (its .data set to "
               "a tensor of another shape after wrapping)"),
    ("freeze", "parameter 1.weight on rank 1 no longer requires grad (requires_grad flipped after wrapping)")])
def test_a_parameter_resized_or_frozen_on_one_rank_after_wrapping_raises_one_line_on_every_rank(how, said):
    for rank, out in enumerate(launch(_job, 2, (how,), timeout=240)):
        for name in WRAPPERS:
            message = out[name]
            assert isinstance(message, str), (name, message)
            assert message.startswith(f"ValueError: rank {rank}: {name}: {said}"), message
            assert "\n" not in message


def test_a_parameter_frozen_on_every_rank_after_wrapping_trains_on_alike():
    first, second = launch(_job, 2, ("freeze everywhere",), timeout=240)
    for name in WRAPPERS:
        assert not isinstance(first[name], str), first[name]
        for a, b in zip(first[name], second[name]):
            assert torch.equal(a, b), name
