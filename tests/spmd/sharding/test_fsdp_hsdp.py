"""HSDP: `fully_shard` on a 2-D mesh (replicate, shard) at 4 ranks (2 x 2), against torch's HSDP, the same script.

The script is torchtitan's `apply_fsdp` on a 2-D mesh (each block, `[norm, output]`, the root). One spawned run
holds the plain case and the refusals (the README suite's one 4-rank test); another, in the soak, holds mixed
precision, `set_requires_all_reduce` with gradient accumulation, `set_gradient_divide_factor`, and a DCP
checkpoint saved on the 2 x 2 mesh and loaded on a 1 x 4 mesh and on a 1-D mesh of 4.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import fully_shard

from .test_fsdp_list_and_assign import VOCAB, Titan, _apply_fsdp, _batch, _case, _full

SHARD_FNS = {"ours": fully_shard, "torch": torch_fully_shard}


def _mesh(shape=(2, 2)):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def _train(shard_fn, rank, n, mesh, steps=3, micro=1, between=None, sgd=False, lr=0.5, **kwargs):
    """torchtitan's shape on `mesh`: Adam (or SGD, which sees the gradients' scale), `micro` micro-batches a step
    (`between(model, i)` before each)."""
    torch.manual_seed(0)
    model = Titan()
    _apply_fsdp(shard_fn, model, mesh=mesh, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if sgd else torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        for i in range(micro):
            if between is not None:
                between(model, i)
            x = _batch(rank, n, micro * step + i)
            loss = nn.functional.cross_entropy(model(x)[:, :-1].float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    placements = {k: tuple(v.placements) for k, v in model.named_parameters()}
    return {"losses": losses, "full": _full(model), "placements": placements, "model": model}


def _plain(shard_fn, rank, n):
    got = _train(shard_fn, rank, n, _mesh())
    del got["model"]
    return got


def _refusals():
    out = {}
    for name, mesh in (("3-D mesh", init_device_mesh("cpu", (1, 2, 2))),):
        try:
            fully_shard(nn.Linear(4, 4), mesh=mesh)
        except Exception as e:  # the parent raises it again inside pytest.raises, checking its type and words
            out[name] = e
    return out


def _job():
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {impl: _case(_plain, fn, rank, n) for impl, fn in SHARD_FNS.items()}
    out["refused"] = _refusals()
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_job, 4, timeout=300.0)


def _accumulate(model, i):
    model.set_requires_all_reduce(i == 1)  # torchtitan: all-reduce across replicas at the last micro-batch only


def _divide(factor):
    def between(model, i):
        for m in model.modules():
            if isinstance(m, TorchFSDPModule):  # ours are torch's FSDPModule too
                m.set_gradient_divide_factor(factor)
    return between


def _settings(shard_fn, rank, n):
    """Mixed precision, all-reduce skipped at the first of two micro-batches, divide factors: (losses, full)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {"bf16": _train(shard_fn, rank, n, _mesh(), mp_policy=bf16),
            "accumulate": _train(shard_fn, rank, n, _mesh(), micro=2, between=_accumulate, sgd=True),
            "divide 2": _train(shard_fn, rank, n, _mesh(), between=_divide(2.0), sgd=True),
            "4x1": _train(shard_fn, rank, n, _mesh((4, 1)), sgd=True),  # replicas only: DDP's shape
            "1x4": _train(shard_fn, rank, n, _mesh((1, 4)), sgd=True)}  # shards only
    if shard_fn is torch_fully_shard:  # torch's sums need PREMUL_SUM, which gloo lacks: the sum is 4 times the
        # mean (exactly), so SGD at 4 times the rate is the same run bitwise
        runs["divide 1"] = _train(shard_fn, rank, n, _mesh(), sgd=True, lr=2.0)
    else:
        runs["divide 1"] = _train(shard_fn, rank, n, _mesh(), between=_divide(1.0), sgd=True)
    for run in runs.values():
        del run["model"]
    return runs


def _reshard(shard_fn, rank, n, folder):
    """A DCP checkpoint saved on the 2 x 2 mesh, loaded on a 1 x 4 mesh and on a 1-D mesh of 4, and back."""
    import torch.distributed.checkpoint as dcp
    saved = _train(shard_fn, rank, n, _mesh(), sgd=True)
    dcp.save(saved["model"].state_dict(), checkpoint_id=f"{folder}/{shard_fn is fully_shard}")
    out = {}
    for shape in ((1, 4), (4,)):
        model = Titan()
        _apply_fsdp(shard_fn, model, mesh=_mesh(shape))
        state = model.state_dict()
        dcp.load(state, checkpoint_id=f"{folder}/{shard_fn is fully_shard}")
        model.load_state_dict(state)
        out[shape] = all(torch.equal(v, saved["full"][k]) for k, v in _full(model).items())
    model = Titan()  # torch's utilities: a full state dict into a fresh 2 x 2 model
    _apply_fsdp(shard_fn, model, mesh=_mesh())
    set_model_state_dict(model, dict(saved["full"]), options=StateDictOptions(full_state_dict=True))  # it cuts in place
    out["full"] = all(torch.equal(v, saved["full"][k]) for k, v in _full(model).items())
    return out


class Pair(nn.Module):
    """Two same-shaped units; replica 1 applies them in the other order (each replica agrees within itself)."""

    def __init__(self, swapped):
        super().__init__()
        self.a, self.b, self.swapped = nn.Linear(4, 4), nn.Linear(4, 4), swapped

    def forward(self, x):
        first, second = (self.b, self.a) if self.swapped else (self.a, self.b)
        return second(torch.tanh(first(x)))


def _replicas_apart(rank):
    """Replica 1 runs the units in another order: every rank raises, naming the unit, instead of mixing them."""
    torch.manual_seed(0)
    model = Pair(swapped=rank >= 2)
    mesh = _mesh()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.ones(2, 4)).sum().backward()
    except Exception as e:  # the parent asserts on the message
        return f"{type(e).__name__}: {e}"
    return "trained"


def _soak_job(folder):
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {impl: {"settings": _case(_settings, fn, rank, n), "reshard": _case(_reshard, fn, rank, n, folder)}
           for impl, fn in SHARD_FNS.items()}
    out["replicas apart"] = _replicas_apart(rank)  # last: it leaves the ranks out of step
    return out


@pytest.fixture(scope="module")
def soak_results(tmp_path_factory):
    return launch(_soak_job, 4, args=(str(tmp_path_factory.mktemp("hsdp")),), timeout=600.0)


def _equal(ours, theirs, what):
    assert isinstance(ours, dict) and isinstance(theirs, dict), (what, ours, theirs)
    assert ours["losses"] == theirs["losses"], what
    assert list(ours["full"]) == list(theirs["full"]), what
    for k, v in theirs["full"].items():
        assert torch.equal(ours["full"][k], v), f"{what}: {k}"


def test_hsdp_on_a_2x2_mesh_equals_torchs_bitwise_and_refuses_a_3d_mesh_in_one_line(results):
    for r, got in enumerate(results):
        _equal(got["ours"], got["torch"], f"rank {r}")
        assert set(got["ours"]["placements"].values()) == {(Replicate(), Shard(0))} == set(
            got["torch"]["placements"].values())
        assert len(set(got["ours"]["losses"])) > 1, "it trains"
        with pytest.raises(ValueError, match=r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh") as e:
            raise got["refused"]["3-D mesh"]
        assert "mesh has 3 dimensions; pass a 1-D mesh" in str(e.value) and "\n" not in str(e.value), e.value
    assert results[0]["ours"]["losses"] != results[2]["ours"]["losses"], "the replicas see other data"


@pytest.mark.soak
def test_hsdp_mixed_precision_all_reduce_switch_divide_factor_and_other_shapes_equal_torchs(soak_results):
    for r, got in enumerate(soak_results):
        ours, theirs = got["ours"]["settings"], got["torch"]["settings"]
        assert isinstance(ours, dict), ours
        for case in ("bf16", "accumulate", "divide 2", "divide 1"):
            _equal(ours[case], theirs[case], f"rank {r} {case}")
        assert ours["divide 1"]["full"]["layers.0.weight"].ne(ours["divide 2"]["full"]["layers.0.weight"]).any()
        for case in ("4x1", "1x4"):  # sums of four in another order than gloo's: to float32 rounding
            for k, v in theirs[case]["full"].items():
                torch.testing.assert_close(ours[case]["full"][k], v, rtol=0, atol=1e-5, msg=f"rank {r} {case} {k}")
        torch.testing.assert_close(ours["4x1"]["full"], ours["1x4"]["full"], rtol=0, atol=1e-5,
                                   msg="both shapes train the same model")


@pytest.mark.soak
def test_an_hsdp_checkpoint_loads_on_a_1x4_and_a_1d_mesh_and_a_full_state_dict_on_2x2(soak_results):
    for r, got in enumerate(soak_results):
        for impl in ("ours", "torch"):
            assert got[impl]["reshard"] == {(1, 4): True, (4,): True, "full": True}, f"rank {r} {impl}"


@pytest.mark.soak
def test_replicas_that_run_units_in_another_order_all_raise_naming_the_unit(soak_results):
    for r, got in enumerate(soak_results):
        message = got["replicas apart"]
        assert message.startswith(f"RuntimeError: rank {r} (replica {r // 2}): fully_shard's all-reduce across "
                                  f"replicas of unit {3 - r // 2} (FSDPLinear {'ba'[r // 2]})"), message
        assert "replica 0: unit 3, all-reduce 1" in message and "replica 1: unit 2" in message, message


STOP_TIMEOUT = 6.0  # the world group's timeout in the stopped-rank test: torch's mesh sub-groups get 30 minutes


def _stopped_rank():
    """2 x 2, world group timeout `STOP_TIMEOUT`: rank 2 SIGSTOPs itself before step 1's backward (a helper wakes
    it 4 timeouts later); each other rank returns (seconds until it raised, its error), rank 2 "woken"."""
    import datetime
    import os
    import signal
    import subprocess
    import time

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=STOP_TIMEOUT))
    torch.manual_seed(0)
    model = Titan()
    _apply_fsdp(fully_shard, model, mesh=_mesh())
    for step in range(2):
        x = _batch(rank, n, step)
        loss = nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if step == 1 and rank == 2:
            subprocess.Popen(["sh", "-c", f"sleep {4 * STOP_TIMEOUT}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            return "woken"
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as e:  # the parent asserts on the message
            return time.monotonic() - start, f"{type(e).__name__}: {e}"
    return "finished"


@pytest.mark.soak
def test_a_stopped_rank_on_a_2x2_mesh_is_named_within_the_world_groups_timeout():
    """Issue 46 F04: the mesh's sub-groups waited torch's default 30 minutes; now the world group's timeout."""
    got = launch(_stopped_rank, 4, timeout=120.0, init=False)
    assert got[2] == "woken"
    for r in (0, 1, 3):
        assert isinstance(got[r], tuple), f"rank {r}: {got[r]}"
        seconds, line = got[r]
        assert seconds < 3 * STOP_TIMEOUT and "\n" not in line, f"rank {r} after {seconds:.1f} s: {line}"
        assert f"rank {r}" in line, f"rank {r}: {line}"
    for r in (0, 3):  # rank 2's peers: rank 0 across the replicas, rank 3 in its shard group
        assert "rank 2" in got[r][1].replace(f"rank {r}", ""), f"rank {r}: {got[r][1]}"
