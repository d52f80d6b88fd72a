"""ZeRO across processes: corners that planted bugs slipped past (issue 20); each test fails with one of them.

One spawned job on 2 ranks returns what each rank saw; the assertions run here, in the parent.
"""
import functools

import torch
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.sharding.zero import ZeroRedundancyOptimizer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _loss(model):
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g)
    return nn.functional.cross_entropy(model(X), y)


def _zero_grad_job():
    """Stage 2: the gradient bytes held after zero_grad(), which drops the shards, and zero_grad(False), which keeps them."""
    model = DistributedDataParallel(_net())
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    held = {}
    for set_to_none in (False, True):
        with model.no_sync():
            _loss(model).backward()
        held["backward"] = opt.gradient_bytes()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        held[set_to_none] = opt.gradient_bytes()
    return held


def _resume_job():
    """A rank's shard saved after a scheduler's step, loaded into a new optimizer: its lr, and the next step."""
    out = {}
    for stage in (1, 2):
        nets = [_net(), _net()]
        models = [DistributedDataParallel(net) for net in nets]
        first = ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.1)
        _step(models[0], first, stage)
        scheduler.step()
        again = ZeroRedundancyOptimizer(models[1].parameters(), torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
        nets[1].load_state_dict(nets[0].state_dict())
        again.load_state_dict(first.state_dict())
        for model, opt in zip(models, (first, again)):
            _step(model, opt, stage)
        out[stage] = {"lr": [g["lr"] for g in again.param_groups], "equal": torch.equal(
            torch.cat([p.detach().reshape(-1) for p in nets[0].parameters()]),
            torch.cat([p.detach().reshape(-1) for p in nets[1].parameters()]))}
    return out


def _step(model, opt, stage):
    opt.zero_grad()
    if stage == 2:
        with model.no_sync():
            _loss(model).backward()
    else:
        _loss(model).backward()
    opt.step()


def _job():
    return {"zero_grad": _zero_grad_job(), "resume": _resume_job()}


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, timeout=120.0)


def test_zero_grad_drops_the_gradient_shards_and_set_to_none_false_keeps_them():
    for r, result in enumerate(_results()):
        held = result["zero_grad"]
        assert held["backward"] > 0, f"rank {r} holds no gradient shard after backward"
        assert held[False] == held["backward"], f"rank {r}: zero_grad(set_to_none=False) should keep the shards"
        assert held[True] == 0, f"rank {r} holds {held[True]} bytes of gradient after zero_grad()"


def test_a_loaded_shard_brings_back_the_schedulers_learning_rate_at_both_stages():
    for r, result in enumerate(_results()):
        for stage in (1, 2):
            assert result["resume"][stage]["lr"] == [0.1 * 0.1], f"rank {r}, stage {stage}"
            assert result["resume"][stage]["equal"], f"rank {r}, stage {stage}: the resumed step differs"
