"""Two defaults of torch's DDP that every rung keeps, at 2 ranks against torch's DDP on the same data.

- A parameter that no rank used keeps its `.grad` as it was: None stays None, so AdamW's weight
  decay leaves it alone, and a `.grad` left from before is neither zeroed nor averaged (torch's
  reducer: "if a parameter is globally unused, we keep its grad untouched"). Before, the rungs gave
  it zeros (0.0093 off torch's DDP with `find_unused_parameters=True` after two AdamW steps).
- BatchNorm's running statistics: rank 0's buffers are copied to every rank before each training
  forward (`broadcast_buffers=True`, torch's default), then moved by this rank's batch. Before, the
  rungs copied them at construction only, and each rank's drifted on its own.
"""
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0001)}  # about 100 B: a bucket per layer


class Unused(nn.Module):
    """A layer no rank uses, one that the last rank alone uses, and BatchNorm."""

    def __init__(self, last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 4)
        self.unused, self.sometimes = nn.Linear(4, 4), nn.Linear(4, 4)
        self.last = last

    def forward(self, x):
        y = self.b(torch.tanh(self.bn(self.a(x))))
        return self.sometimes(y) if self.last else y


def _train(model, x, stale: float):
    """Two AdamW steps; before the second, `unused.weight.grad` holds `stale` (no zero_grad lets that happen)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    grads = []
    for step in range(2):
        opt.zero_grad()
        if step == 1:
            model.module.unused.weight.grad = torch.full((4, 4), stale)
        model(x).pow(2).sum().backward()
        grads.append({k: None if p.grad is None else p.grad.clone() for k, p in model.module.named_parameters()})
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"grads": grads, "state": state}


def _job():
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    stale = float(r + 1)  # another value on every rank: averaged, it would change
    out = {name: _train(make(Unused(r == n - 1), timeout=20), x, stale) for name, make in RUNGS.items()}
    out["torch"] = _train(TorchDDP(Unused(r == n - 1), find_unused_parameters=True), x, stale)
    out["own buffers"] = _train(NaiveDDP(Unused(r == n - 1), broadcast_buffers=False, timeout=20), x, stale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames broadcast_buffers
        out["torch own buffers"] = _train(TorchDDP(Unused(r == n - 1), find_unused_parameters=True,
                                                   broadcast_buffers=False), x, stale)
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=120)


def _same(got, want, where):
    assert got.keys() == want.keys(), where
    for k in want:
        if want[k] is None:
            assert got[k] is None, (where, k, "torch's DDP leaves it None")
        else:
            assert got[k] is not None, (where, k)
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{where}: {k}")


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_a_parameter_no_rank_used_keeps_its_grad_and_adamw_leaves_it_as_torchs_ddp(rung):
    for r, out in enumerate(_results()):
        for step in range(2):
            _same(out[rung]["grads"][step], out["torch"]["grads"][step], f"rank {r} step {step}")
        assert out[rung]["grads"][0]["unused.weight"] is None
        assert torch.equal(out[rung]["grads"][1]["unused.weight"], torch.full((4, 4), r + 1.0)), r  # untouched
        assert out[rung]["grads"][0]["sometimes.weight"] is not None, r  # one rank used it: the average everywhere
        _same(out[rung]["state"], out["torch"]["state"], f"rank {r} after two AdamW steps")


def test_batchnorm_follows_rank0s_buffers_before_each_forward_as_torchs_ddp():
    res = _results()
    assert not torch.equal(res[0]["torch"]["state"]["bn.running_mean"], res[1]["torch"]["state"]["bn.running_mean"])
    for r, out in enumerate(res):  # the state's buffers were compared above; here without the broadcast
        _same(out["own buffers"]["state"], out["torch own buffers"]["state"], f"rank {r}, broadcast_buffers=False")
    own, copied = res[1]["own buffers"]["state"], res[1]["naive"]["state"]
    assert not torch.equal(own["bn.running_mean"], copied["bn.running_mean"])
