"""HSDP's drift check (issue 43) at 4 ranks (2 x 2): replicas of a shard that parted are named on every rank.

- rank (1, 0) steps a stale `.grad` once more after step 2 (its replica parts from replica 0): every rank of the mesh
  raises one line at the next due step, naming the replica and the parameter (before: every rank trained on); so does
  rank (1, 1) changing its shard by hand, and on a 4 x 1 mesh rank 2 (replica 2); `drift_check_every=0` turns the
  check off, and an interval that differs on one rank is refused at `fully_shard` on every rank (a difference within
  one shard group no longer leaves the other group's ranks waiting in the replicas' agreement);
- a normal run (mixed precision, gradient accumulation with `set_requires_all_reduce(False)`, a forward with grad and
  no backward on replica 1 only): no false alarm, and the check ran at every due step (a step: a backward that
  all-reduced across the replicas);
- a 1-D mesh replicates nothing: no check, no collective, though every rank's shards differ.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from manualdp.spmd import launch
from manualdp.spmd.ladder.drift import due
from manualdp.spmd.sharding import fsdp_drift
from manualdp.spmd.sharding.fsdp import fully_shard
from tests.helpers import error_of

from .test_fsdp_list_and_assign import VOCAB, Titan, _apply_fsdp, _batch

PARTED_AFTER = 3  # rank (1, 0) steps a stale .grad again after its third step


def _loss(model, x):
    return nn.functional.cross_entropy(model(x)[:, :-1].float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _run(mesh, steps, micro=1, stale_on=None, edit_on=None, every=None, validate_on=(), **kwargs):
    """`steps` optimizer steps of `micro` forwards each (all-reduce at the last only); returns the forwards run.
    `stale_on`, `edit_on`: the rank that steps a stale .grad again, or adds to its shard of layers.1's weight, after
    step `PARTED_AFTER`; `validate_on`: the ranks that run a forward with grad and no backward before step 1."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Titan()
    _apply_fsdp(fully_shard, model, mesh=mesh, **({} if every is None else {"drift_check_every": every}), **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    forwards = 0
    for step in range(steps):
        if step == 1 and rank in validate_on:
            model(_batch(rank, n, 99))  # a validation pass on one replica: not a step, no false alarm
        for i in range(micro):
            if micro > 1:
                model.set_requires_all_reduce(i == micro - 1)
            _loss(model, _batch(rank, n, micro * step + i)).backward()
            forwards += 1
        opt.step()
        if step + 1 == PARTED_AFTER and rank == stale_on:
            opt.step()  # the stale .grad stepped again on one replica only
        if step + 1 == PARTED_AFTER and rank == edit_on:
            with torch.no_grad():
                model.layers[1].weight.to_local()[0, 0] += 1  # a user's code changes one replica's shard
        opt.zero_grad()
    return forwards


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    calls = []
    compare = fsdp_drift._compare
    fsdp_drift._compare = lambda root, number: (calls.append(number), compare(root, number))[1]
    out = {"parted": error_of(lambda: _run(mesh, 6, stale_on=2)),  # global rank 2: replica 1, shard 0
           "edited": error_of(lambda: _run(mesh, 6, edit_on=3)),  # global rank 3: replica 1, shard 1
           "off": error_of(lambda: _run(mesh, 6, stale_on=2, every=0)),
           # four replicas of one shard (DDP's shape): replica 2 named against replica 0
           "4x1": error_of(lambda: _run(init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard")), 6,
                                        edit_on=2))}
    out["bad every"] = error_of(lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, drift_check_every=-1))
    # one rank's interval alone would leave its peers waiting in a check it skips: refused at fully_shard, on every rank
    out["one rank off"] = error_of(lambda: _run(mesh, 1, every=0 if rank == 3 else 100))
    calls.clear()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["normal"] = error_of(lambda: out.__setitem__("forwards", _run(mesh, 5, micro=2, mp_policy=bf16,
                                                                      validate_on=(2, 3))))
    out["checked"] = list(calls)
    calls.clear()
    flat = init_device_mesh("cpu", (4,))
    out["1-D"] = error_of(lambda: _run(flat, 3, stale_on=2))
    out["1-D checked"] = list(calls)
    out["rank"] = rank
    return out


def _expect(message, rank, name, shard, shards=2, replica=1):
    checked = next(s for s in range(PARTED_AFTER + 1, 100) if due(s, 100))  # the first check after it parted
    assert message is not None and "\n" not in message, message
    assert message.startswith(f"RuntimeError: rank {rank} (replica {rank // shards}, shard {rank % shards}): "
                              f"fully_shard's HSDP replicas parted before step {checked}: parameter {name}'s shard "
                              f"{shard} differs between replica 0 and replica {replica} "), message


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 4, timeout=300.0)


def test_a_replica_that_stepped_a_stale_grad_is_named_on_every_rank_at_the_next_due_step():
    for out in _results():  # Adam's second step moves every parameter: the first of the tree is named
        _expect(out["parted"], out["rank"], "tok_embeddings.weight", 0)


def test_a_shard_changed_by_hand_on_one_replica_is_named_on_every_rank():
    for out in _results():
        _expect(out["edited"], out["rank"], "layers.1.weight", 1)


def test_at_four_replicas_of_one_shard_the_replica_that_parted_is_named():
    for out in _results():
        _expect(out["4x1"], out["rank"], "layers.1.weight", 0, shards=1, replica=2)


def test_the_check_turned_off_trains_on_and_a_bad_or_disagreeing_interval_is_refused_naming_it():
    for out in _results():
        assert out["off"] is None, out["off"]
        assert out["bad every"].startswith("ValueError: drift_check_every must be"), out["bad every"]
        message = out["one rank off"]  # rank 3's value differs from its shard group's (2) and its replicas' (1)
        assert message.startswith("ValueError: rank ") and "\n" not in message, message
        if out["rank"] == 0:  # its groups agree: it learns that rank 2's shard group did not
            assert "shard group (mesh dim 1) agreed no..yes (per rank: yes, no)" in message, message
        else:
            assert "drift_check_every 0..100 (per rank: " in message, message


def test_a_normal_run_with_mixed_precision_accumulation_and_a_validation_pass_on_one_replica_raises_nothing():
    for out in _results():
        assert out["normal"] is None, out["normal"]
        # a step: a backward that all-reduced across the replicas (the last of each step's 2 micro-batches)
        assert out["checked"] == [s for s in range(out["forwards"] // 2) if due(s, 100)]
        assert len(out["checked"]) >= 4


def test_a_1d_mesh_has_no_drift_check():
    for out in _results():
        assert out["1-D"] is None and out["1-D checked"] == [], out
