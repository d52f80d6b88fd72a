"""A replica that leaves its quorum's group lets go of gloo's connections: no gloo thread is left for the exit.

What the collectives keep of a group (the next call's header receives, posted early; the works kept until the
next call) held gloo's connections and its network thread past `destroy_process_group`, until the interpreter's
exit, where that thread's end raced Python's and aborted a replica whose work was done (CI's soak: replica a of
test_ft_overflow's three exited -6, "terminate called without an active exception").
"""
import os

import pytest
import torch

from manualdp.spmd.collectives import allreduce
from manualdp.spmd.ft.quorum_group import drop_group
from manualdp.spmd.launch import launch


def gloo_threads() -> int:
    """How many of this process's threads are gloo's network loops (named by gloo)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def _threads_around_a_drop() -> tuple[int, int]:
    """A checked allreduce on the default group (headers posted early from 3 ranks on), then the group dropped as a
    quorum's is: gloo's threads before and after."""
    t = torch.ones(5)
    allreduce(t, "ring")
    allreduce(t, "ring")  # a second call: its header receives and its works are what the state keeps
    before = gloo_threads()
    drop_group()
    return before, gloo_threads()


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_dropped_quorum_group_leaves_no_gloo_thread_behind(ranks):
    got = launch(_threads_around_a_drop, ranks, timeout=120)
    assert all(before >= 1 for before, _ in got), got  # the group had one
    assert [after for _, after in got] == [0] * ranks, got  # was: 1 on every rank, alive until the exit
