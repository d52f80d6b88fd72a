"""HSDP (issue 43) at 4 ranks: a replica that forgets `set_requires_all_reduce(True)` on its last micro-batch is named.

Gradient accumulation under HSDP keeps each micro-batch's reduce-scattered sums with `set_requires_all_reduce(False)`
and all-reduces them across the replicas at the last one. A replica that never sets it back to True leaves its peers
waiting in that all-reduce: before, they ended in a `PeerError` ("no answer ... it may have died or hung") after the
whole timeout while the forgetful replica trained on alone. Now its optimizer step (holding sums never all-reduced)
joins its peers' all-reduce, and every rank of the mesh raises one line at once naming the replica(s) that did not
all-reduce: on a 2 x 2 mesh replica 1 (also when it forgets only at the second step), replica 0 or replica 1 where
replica 0 accumulates 3 micro-batches and replica 1 runs 2, both replicas, and on a 4 x 1 mesh replica 2; also a
replica that sets it back on the root only (`recurse=False`: its root's all-reduce meets the others' of an inner unit,
which the call check refuses; the replicas then tell each other what they kept) or on all units but the root. A
replica that all-reduces at every micro-batch where the other accumulates is named at the next drift check or
all-reduce across the replicas (both count the all-reduces since the last optimizer step), and replicas that divide by
other factors by their tails. The group serves the next model after each: a run of uneven accumulation done right
trains on, no false alarm.
A spawned 4-rank run: in the soak.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from manualdp.spmd import launch
from manualdp.spmd.sharding.fsdp import FSDPModule, fully_shard
from tests.helpers import error_of

from .test_fsdp_list_and_assign import VOCAB, Titan, _apply_fsdp, _batch

pytestmark = pytest.mark.soak
TIMEOUT = 90.0  # a silent peer's wait: what a case that is not named ends in (below the default 300 s; none waits it)


def _run(mesh, forgets, micro=lambda replica: 2, steps=2, from_step=0, factor_on=None, instead=lambda model: None,
         always=(), **kwargs):
    """`steps` optimizer steps of `micro(replica)` micro-batches, all-reducing at the last one, except on the replicas
    in `forgets` from step `from_step` on: at the last micro-batch they call `instead(model)` in place of
    `set_requires_all_reduce(True)`; the replicas in `always` all-reduce at every micro-batch; replica `factor_on`
    divides the gradients by 8 (every unit); `kwargs` go to `fully_shard`."""
    rank, n = dist.get_rank(), dist.get_world_size()
    replica = mesh.get_local_rank(0)
    torch.manual_seed(0)
    model = Titan()
    _apply_fsdp(fully_shard, model, mesh=mesh, timeout=TIMEOUT, **kwargs)
    if replica == factor_on:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(8.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        count = micro(replica)
        for i in range(count):
            if i == count - 1 and replica in forgets and step >= from_step:
                instead(model)
            elif replica not in always:
                model.set_requires_all_reduce(i == count - 1)
            x = _batch(rank, n, 10 * step + i)
            nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _root_only(model):
    model.set_requires_all_reduce(True, recurse=False)  # the inner units keep their sums


def _inner_only(model):
    model.set_requires_all_reduce(True)
    model.set_requires_all_reduce(False, recurse=False)  # the root keeps its sums


def _job():
    torch.set_num_threads(1)
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    column = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    uneven = lambda replica: 3 if replica == 0 else 2  # noqa: E731
    return {"rank": dist.get_rank(),
            "right": error_of(lambda: _run(square, (), micro=uneven)),
            "replica 1": error_of(lambda: _run(square, (1,))),
            "at step 2": error_of(lambda: _run(square, (1,), steps=3, from_step=1)),
            "replica 0, uneven": error_of(lambda: _run(square, (0,), micro=uneven)),
            "replica 1, uneven": error_of(lambda: _run(square, (1,), micro=uneven)),
            "both": error_of(lambda: _run(square, (0, 1))),
            "4x1 replica 2": error_of(lambda: _run(column, (2,))),
            "root only": error_of(lambda: _run(square, (1,), instead=_root_only)),
            "inner only": error_of(lambda: _run(square, (1,), instead=_inner_only)),
            "every micro-batch": error_of(lambda: _run(square, (), always=(0,), drift_check_every=0)),
            "every micro-batch, drift check": error_of(lambda: _run(square, (), always=(0,))),
            "other factor": error_of(lambda: _run(square, (), factor_on=1)),
            "right after": error_of(lambda: _run(square, (), micro=uneven))}


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 4, timeout=900.0)


def _expect(message, rank, replica, named):
    assert message is not None and "\n" not in message, message
    assert message.startswith(f"RuntimeError: rank {rank} (replica {replica}): fully_shard's HSDP {named} did not "
                              "all-reduce "), message
    assert "call set_requires_all_reduce(True) before the last micro-batch's backward" in message, message


def test_a_replica_that_forgot_set_requires_all_reduce_true_is_named_on_every_rank():
    for out in _results():
        _expect(out["replica 1"], out["rank"], out["rank"] // 2, "replica 1")


def test_a_replica_that_forgot_at_the_second_step_only_is_named_on_every_rank():
    for out in _results():
        _expect(out["at step 2"], out["rank"], out["rank"] // 2, "replica 1")


def test_a_forgetful_replica_that_accumulates_more_micro_batches_than_its_peer_is_named():
    for out in _results():  # replica 1 waits in the all-reduce until replica 0's optimizer step joins it
        _expect(out["replica 0, uneven"], out["rank"], out["rank"] // 2, "replica 0")


def test_a_forgetful_replica_that_accumulates_fewer_micro_batches_than_its_peer_is_named():
    for out in _results():  # replica 1's optimizer step waits in the all-reduce until replica 0's last micro-batch
        _expect(out["replica 1, uneven"], out["rank"], out["rank"] // 2, "replica 1")


def test_replicas_that_all_forgot_are_all_named():
    for out in _results():
        _expect(out["both"], out["rank"], out["rank"] // 2, "replicas 0 and 1")


def test_at_four_replicas_of_one_shard_the_one_that_forgot_is_named():
    for out in _results():
        _expect(out["4x1 replica 2"], out["rank"], out["rank"], "replica 2")


def test_a_replica_that_set_it_on_the_root_only_is_named_on_every_rank():
    for out in _results():  # its root's all-reduce meets the others' of an inner unit: the call check, then its name
        _expect(out["root only"], out["rank"], out["rank"] // 2, "replica 1")
        assert "(unit 4 (FSDPLayerNorm norm): set_requires_all_reduce(False) left on it" in out["root only"]


def test_a_replica_that_left_it_off_on_the_root_only_is_named_on_every_rank():
    for out in _results():
        _expect(out["inner only"], out["rank"], out["rank"] // 2, "replica 1")
        assert "(unit 1 (FSDPTitan): its last micro-batch ran with set_requires_all_reduce(False))" in out["inner only"]


def test_a_replica_that_all_reduces_every_micro_batch_is_named_at_its_second_all_reduce_without_drift_check():
    for out in _results():  # its first met replica 1's all-reduce of step 0; its second meets replica 1's of step 1
        message, rank = out["every micro-batch"], out["rank"]
        assert message is not None and "\n" not in message, message
        assert message.startswith(f"RuntimeError: rank {rank} (replica {rank // 2}): fully_shard's HSDP replicas "
                                  "all-reduced unit "), message
        assert "a different number of times since their last optimizer step (replica 0: 2, replica 1: 1; " in message


def test_a_replica_that_all_reduces_every_micro_batch_is_named_at_the_drift_check():
    for out in _results():  # replica 1 stepped after replica 0's first all-reduce: the check names why they parted
        message, rank = out["every micro-batch, drift check"], out["rank"]
        assert message is not None and "\n" not in message, message
        assert message.startswith(f"RuntimeError: rank {rank} (replica {rank // 2}, shard {rank % 2}): fully_shard's "
                                  "HSDP replicas all-reduced a different number of times since their last optimizer "
                                  "step (replica 0 and replica 1, at step 1's drift check): every replica must "
                                  "all-reduce once per step "), message


def test_replicas_that_divide_by_other_factors_are_named_with_each_replica_s_tail():
    for out in _results():  # the replicas' tails of the all-reduce (unit, count, factor, asked) name the difference
        message, rank = out["other factor"], out["rank"]
        assert message is not None and "\n" not in message, message
        assert message.startswith(f"RuntimeError: rank {rank} (replica {rank // 2}): fully_shard's all-reduce across "
                                  "replicas of unit "), message
        assert ", divide factor 4.0; replica 1: unit " in message and ", divide factor 8.0; counts mod 64)" in message


def test_uneven_accumulation_done_right_raises_nothing_before_and_after_the_refusals():
    for out in _results():
        assert out["right"] is None, out["right"]
        assert out["right after"] is None, out["right after"]
