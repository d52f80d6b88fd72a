"""A parameter replaced (or resized) on one rank only after wrapping a rung of the ladder: every rank raises in one line
naming the parameter and the rank (before: that rank raised alone and its peers waited out the timeout)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"NaiveDDP": NaiveDDP, "FlatDDP": FlatDDP, "OverlappedDDP": OverlappedDDP, "BucketedDDP": BucketedDDP}


def _job(at, every):
    torch.set_num_threads(1)
    out = {}
    for name, make in RUNGS.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        model = make(net, timeout=20, drift_check_every=every)
        try:
            for step in range(3):
                if dist.get_rank() == 1 and step == at:
                    net[2].weight = nn.Parameter(torch.zeros(2, 3) if at else net[2].weight.detach().clone())
                model(torch.randn(4, 4)).sum().backward()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[name] = f"{type(e).__name__}: {e}"
        del model
    return out


@pytest.mark.parametrize("n,at,every", [(2, 0, 0), (2, 1, 1), (3, 1, 0)])
def test_a_parameter_replaced_on_one_rank_after_wrapping_a_rung_raises_on_every_rank_naming_it(n, at, every):
    for rank, out in enumerate(launch(_job, n, (at, every), timeout=180)):
        for name in RUNGS:
            message = out[name]
            assert message is not None and message.startswith(f"ValueError: rank {rank}: {name}: "), message
            assert "parameter 2.weight on rank 1 is not the one the wrapper was built with" in message, message
