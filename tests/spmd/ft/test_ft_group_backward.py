"""One backward too many on one rank of a replica group (`GroupManager.watch`, `group_backward.py`).

In this process: the count of backward passes through a module, and the refusals. The process test
(soak: one group of 2 ranks, `group_worker.py`): the last rank runs one backward more in step 1; the
step is discarded, named in one line on both ranks, taken again, and every committed step equals
the one-process reference (where the extra gradient, summed in the group, would have been taken).
"""
import pytest
import torch

from manualdp.spmd.ft.group import GroupManager
from manualdp.spmd.ft.group_backward import BackwardCount
from tests.spmd.ft.test_ft_group_train import check_against_reference, groups, log, records, wait  # noqa: F401


def test_backward_passes_through_a_module_are_counted_once_each():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    count = BackwardCount(net)
    x = torch.randn(5, 3)
    net(x).sum().backward()
    assert count.count == 1
    (net(x).sum() + net(x).sum()).backward()  # a module used twice in one backward: one pass
    net(x).sum().backward()
    assert count.count == 3
    count.reset()
    assert count.count == 0
    count.remove()
    net(x).sum().backward()
    assert count.count == 0


def test_watch_refuses_what_is_not_a_module_with_trainable_parameters():
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        BackwardCount(torch.nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(TypeError, match="module"):
        object.__new__(GroupManager).watch("net")


@pytest.mark.soak
def test_a_rank_with_one_backward_too_many_has_its_step_discarded_and_named(groups):  # noqa: F811
    ranks = groups.start("A", 2, steps=4, min_groups=1, twice_at=1, watch=True)
    assert wait(ranks, timeout=180) == [0, 0], [log(out)[-2000:] for _, out in ranks]
    for rank, (_, out) in enumerate(ranks):
        line = next((x for x in log(out).splitlines() if "ran backward from" in x), None)
        assert line == (f"replica group 'A', rank {rank}: step 1 discarded on every member group: the group's ranks "
                        f"ran backward from 1 to 2 times since start_step() (this rank {rank + 1}); every rank must "
                        f"run the same backward passes per step"), log(out)[-2000:]
    runs = [records(out) for _, out in ranks]
    assert all(sorted(run) == [0, 1, 2, 3] for run in runs)
    check_against_reference(runs, 4)
