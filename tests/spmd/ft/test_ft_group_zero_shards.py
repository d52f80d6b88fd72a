"""`spmd/ft/group_shards.py` on 2 ranks sharded by `fully_shard`: a rank's shard state as plain tensors (what a lane
sends and `--checkpoint-dir` keeps) loads back bitwise, Adam's moments included, and the gradients' local shards go
into one flat tensor and back."""
import io

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from manualdp.spmd.ft.group_shards import (flat_local_grads, load_local_model_state, load_local_optim_state,
                                           local_model_state, local_optim_state, put_local_grads)
from manualdp.spmd.launch import launch
from manualdp.spmd.sharding.fsdp import fully_shard


def _through_torch_load(state: dict) -> dict:
    """`state` saved and loaded as a lane sends it: `torch.load(weights_only=True)` refuses a DTensor's mesh."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def _job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # 7 and 3 rows: uneven over 2 ranks
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    params = list(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    flat = flat_local_grads(params)
    grads = [p.grad.to_local().clone() for p in params]
    opt.step()
    saved = _through_torch_load({"model": local_model_state(model), "optim": local_optim_state(opt)})
    before = [p.detach().to_local().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].to_local().clone() for p in params]
    model(torch.randn(4, 5)).sum().backward()
    opt.step()  # parameters and moments move on
    moved = not all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, params))
    load_local_model_state(model, saved["model"])
    load_local_optim_state(opt, saved["optim"])
    put_local_grads(params, flat)
    def same(old: list, new: list) -> bool:
        return all(isinstance(n, DTensor) and torch.equal(o, n.to_local()) for o, n in zip(old, new))
    return {"moved": moved, "flat": flat.numel(), "local": sum(p.to_local().numel() for p in params),
            "params": same(before, [p.detach() for p in params]),
            "moments": same(moments, [opt.state[p]["exp_avg"] for p in params]),
            "grads": same(grads, [p.grad for p in params])}


def test_a_ranks_shard_state_as_plain_tensors_loads_back_bitwise_and_its_gradients_go_flat_and_back():
    for rank, out in enumerate(launch(_job, 2, timeout=120)):
        assert out["moved"], rank  # the load has something to undo
        assert out["flat"] == out["local"] and out["params"] and out["moments"] and out["grads"], (rank, out)
