"""The contribution guard of a replica group (`runners/ft_group_train.py`): a non-finite step is discarded, not taken.

A group of one rank in this process (its own gloo world of one, a coordinator here): the loss goes
NaN on one call, the step is voted down and taken again, and the parameters equal the one-process
reference on the same batches (`ft_reference.py`); a group NaN on every call is removed in one line.
"""
import datetime
import math
import socket

import pytest
import torch
import torch.distributed as dist

from manualdp.runners.ft_group_train import train_group_rank
from manualdp.runners.ft_reference import reference_run
from manualdp.spmd.ft import Coordinator
from manualdp.spmd.ft.group import GroupManager
from manualdp.spmd.ft.guard import STRIKES, Removed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    """A coordinator and the default process group of one rank: a replica group of one, in this process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    with Coordinator(0) as coordinator:
        yield coordinator
    dist.destroy_process_group()


def data():
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def nan_on(calls: set[int]):
    """Cross-entropy per example, NaN on the given calls (0: the first)."""
    seen = [0]

    def loss(out, y):
        value = torch.nn.functional.cross_entropy(out, y, reduction="none")
        seen[0] += 1
        return value * math.nan if seen[0] - 1 in calls else value
    return loss


def test_a_non_finite_step_of_a_group_is_discarded_and_taken_again_equal_to_the_reference(one_rank_group):
    torch.set_num_threads(1)
    loader, net, lines = data(), model(), []
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5)
    try:
        history = train_group_rank(net, loader, loader, 1, 0.1, manager, loss_fn=nan_on({1}), progress=False,
                                   log=lines.append)
    finally:
        manager.close()
    steps = history.config["fault_tolerant"]["steps"]
    assert [(r["step"], r["committed"]) for r in steps] == [(0, True), (1, False), (1, True), (2, True)], steps
    assert any("step 1: its contribution is non-finite (NaN or Inf)" in line for line in lines), lines
    ref = model()
    reference_run(ref, list(loader), [["A"]] * 3, lr=0.1)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_a_group_non_finite_step_after_step_is_removed_in_one_line(one_rank_group):
    torch.set_num_threads(1)
    loader, net = data(), model()
    before = [p.detach().clone() for p in net.parameters()]
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5)
    try:
        with pytest.raises(Removed) as info:
            train_group_rank(net, loader, loader, 1, 0.1, manager, loss_fn=nan_on(set(range(100))), progress=False,
                             log=None)
    finally:
        manager.close()
    text = str(info.value)
    assert "\n" not in text and f"non-finite {STRIKES} steps in a row" in text and "'A'" in text, text
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_train_group_rank_refuses_a_guard_that_is_not_a_bool():
    loader = data()
    with pytest.raises(TypeError, match="guard must be True or False, got 'off'"):
        train_group_rank(model(), loader, loader, 1, 0.1, object.__new__(GroupManager), guard="off", progress=False)


@pytest.mark.parametrize("guard", [True, False])
def test_the_python_api_fails_a_step_whose_average_is_not_finite_unless_the_guard_is_off(one_rank_group, guard):
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5,
                           guard=guard)
    try:
        manager.start_step()
        ok = manager.average(torch.tensor([1.0, math.nan]))
        assert ok is not guard  # the guard fails the step: a loop of one's own never applies a NaN average
        assert manager.should_commit(ok) is not guard and manager.step == (0 if guard else 1)
        manager.start_step()
        grad = torch.tensor([1.0, 2.0])
        assert manager.average(grad) and manager.should_commit(True)  # a finite one commits
        assert torch.equal(grad, torch.tensor([1.0, 2.0])) and manager.step == (1 if guard else 2)
    finally:
        manager.close()
    with pytest.raises(TypeError, match="guard must be True or False, got 'on'"):
        GroupManager("B", "127.0.0.1", one_rank_group.port, guard="on")


# dtype: a share whose average over two groups sending it (the share itself) fits, but whose sum does not
HUGE_SHARES = {torch.float16: 40000.0, torch.bfloat16: 2e38, torch.float32: 2e38, torch.float64: 1e308}


@pytest.mark.parametrize("dtype", list(HUGE_SHARES))
def test_finite_shares_whose_sum_overflows_across_groups_commit_their_average(one_rank_group, dtype):
    manager = GroupManager("A", "127.0.0.1", one_rank_group.port, min_groups=1, timeout=20, quorum_timeout=5)
    try:
        manager.start_step()
        lane = manager._lane  # made to stand for a lane of two groups sending the same share
        # its header says a share is large (`share.may_not_sum`): the lane keeps it before the sum
        lane.size, lane.sum = 2, lambda t, ids, keep: (keep and keep(t), t.add_(t.clone()))
        share = torch.tensor([HUGE_SHARES[dtype], -1.0, 0.5], dtype=dtype)
        grad = share.clone()
        assert not torch.isfinite(share + share).all()  # sum then divide overflows
        assert manager.average(grad) and manager.should_commit(True)  # before: discarded, the same batch retaken
        assert torch.equal(grad, share) and manager.step == 1, grad  # two shares alike: their average is the share
    finally:
        manager.close()
