"""The quorum's process group (`quorum_group.py`): formed after a failed rendezvous, kept while the members' steps
commit, re-formed after a discarded one.

In this process a group of one (< 2 s); a group of two processes after a failed rendezvous in one
of them is a soak test (about 20 s: two processes that import torch, a rendezvous that must time out).
"""
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from manualdp.spmd.ft import Coordinator, Manager
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.quorum_group import drop_group, form_group

CHILD = """
import sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from manualdp.spmd.ft.quorum_group import form_group
port, rank, fail_first = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
store = dist.TCPStore("127.0.0.1", port, is_master=False)
if fail_first:
    try:  # a group of 2 whose other member never comes
        form_group(store, 1, 0, 2, timeout=0.5)
        raise SystemExit("the group of a missing member formed")
    except RuntimeError:
        pass
form_group(store, 2, rank, 2, timeout=20)
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()), flush=True)
# torch 2.13's gloo may abort a process that exits holding a group ("terminate called without an active
# exception", bench/test_exit.py): what this test checks is written, so the child ends here
import os
os._exit(0)
"""


@pytest.mark.soak
def test_a_group_forms_after_a_failed_rendezvous_in_one_member():
    # torch 2.13 names the rendezvous keys by a per-process counter that a failed init_process_group leaves one up:
    # the member that failed waited on other keys than its peer until the deadline
    coordinator = Coordinator(0)
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(coordinator.port), str(r), str(1 - r)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert [o.strip().splitlines()[-1] for o in outs] == ["2", "2"], outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.close()


def test_a_group_forms_after_a_failed_rendezvous_under_the_names_a_new_process_gives_it(coordinator):
    store = connect("127.0.0.1", coordinator.port, 10, namespace="failed-rendezvous")
    with pytest.raises(RuntimeError):
        form_group(store, 1, 0, 2, timeout=0.5)  # a group of 2 whose other member never comes
    assert not dist.is_initialized()
    try:
        form_group(store, 2, 0, 1, timeout=10)
        # a peer that never failed names its first group "0", and meets in the store under that name: so must we
        assert dist.group.WORLD.group_name == "0"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        drop_group()
    assert not dist.is_initialized()


def test_a_replica_keeps_its_group_while_its_steps_commit_and_forms_a_new_one_after_a_discarded_step(coordinator):
    with Manager("solo", "127.0.0.1", coordinator.port, timeout=10) as manager:
        first = manager.start_step()
        group = dist.group.WORLD
        t = torch.full((4,), 3.0)
        assert manager.average(t) and t.tolist() == [3.0] * 4  # the mean over a quorum of one
        assert manager.should_commit(True) and manager.step == 1
        second = manager.start_step()
        assert second.round > first.round and second.group == first.group and dist.group.WORLD is group  # kept
        assert not manager.should_commit(False) and manager.step == 1
        assert not dist.is_initialized()  # a group whose step failed is left, never reused
        third = manager.start_step()
        assert third.group == third.round > second.group and dist.is_initialized()  # a new one, named by its round
        assert dist.get_world_size() == 1 and dist.group.WORLD is not group
        assert manager.should_commit(True) and manager.step == 2
    assert not dist.is_initialized()
