"""What belongs to a process group lives in its one `GroupState`, nowhere else (ARCHITECTURE.md, issue 21 item 3)."""
import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

import manualdp.spmd

SPMD = pathlib.Path(manualdp.spmd.__file__).parent
MUTABLE_CALLS = {"dict", "set", "list", "local", "defaultdict", "OrderedDict", "Counter", "deque",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
ALLOWED = {
    ("transport/group.py", "_STATES"),  # the one registry: process group -> its state
    ("transport/worker.py", "_threads"),  # the process's worker threads, for the exit drain: not any one group's
    ("ladder/rules.py", "_RUNGS"),  # parameter -> the rung averaging it, weakly: a second rung of any group must see it
    ("sharding/fsdp.py", "_classes"),  # module class -> its FSDP class, made once, as torch's: a type cache
    ("ft/history.py", "_HELD"),  # folder -> its lock file: a POSIX lock belongs to the process, not to a group
    ("ladder/drift.py", "_WEIGHTS"),  # device -> the digest's position weights, made once: a constant cache
}


def module_level_containers(source: str) -> list[str]:
    """Names bound at module level to an empty container ({}, set(), threading.local(), ...): filled as calls come.

    A table written out in full (a dict of names to hooks) is a constant, not state.
    """
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        call = value.func if isinstance(value, ast.Call) else None
        name = call.attr if isinstance(call, ast.Attribute) else call.id if isinstance(call, ast.Name) else None
        if (isinstance(value, ast.Dict) and not value.keys) or (name in MUTABLE_CALLS and not value.args):
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return found


def test_no_engine_module_keeps_state_at_module_level_but_the_registry():
    kept = [(str(path.relative_to(SPMD)), name) for path in sorted(SPMD.rglob("*.py"))  # the rooms' files too
            for name in module_level_containers(path.read_text())]
    assert [k for k in kept if k not in ALLOWED] == [], "state that belongs to a process group goes in GroupState"


def test_the_scan_sees_module_level_state():
    source = ("import threading\n_LINKS: dict = {}\n_SEEN = set()\n_SCRATCH = threading.local()\n"
              "NAMES = ('a', 'b')\nTABLE = {'a': 1}\nKNOWN = set(NAMES)\n__all__ = ['x']\ndef f():\n    local = {}\n")
    assert module_level_containers(source) == ["_LINKS", "_SEEN", "_SCRATCH"]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_at_world_size_one_the_worker_runs_calls_in_line(one_rank):
    import threading

    from manualdp.spmd.transport.group import group_state, group_worker

    state = group_state()
    assert group_state(dist.group.WORLD) is state and group_worker() is state.worker
    future = state.worker.submit(threading.current_thread)
    assert future.done() and future.result() is threading.current_thread()  # no thread of its own
    failed = state.worker.submit(lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)
    later = state.worker.submit(lambda: 1)  # the ranks are out of step for good, as on the thread
    assert isinstance(later.exception(), ZeroDivisionError)
    x = torch.ones(3)
    manualdp.spmd.allreduce(x)
    assert x.tolist() == [1.0, 1.0, 1.0] and state.traffic.sent() == {}


def test_a_new_process_group_gets_a_fresh_state(tmp_path):
    from manualdp.spmd.transport.group import group_state

    seen = []
    for i in range(3):  # a freed group's id may come back: its state must not
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{i}'}", rank=0, world_size=1)
        state = group_state()
        seen.append((state.calls, state))
        state.calls = 7
        dist.destroy_process_group()
    assert [calls for calls, _ in seen] == [0, 0, 0]
    assert len({id(state) for _, state in seen}) == 3


def test_at_world_size_one_auto_measures_nothing(one_rank, monkeypatch):
    from manualdp.spmd import DistributedDataParallel
    from manualdp.spmd.auto import tune

    monkeypatch.setattr(tune, "calibrate", lambda *a, **k: pytest.fail("calibrated with no peer to measure"))
    assert tune.link_for() == tune.Link(0.0, 0.0, 0.0)
    assert tune.resolve("auto", 1000, 4) in tune.ENGINE_ALGORITHMS
    net = torch.nn.Linear(3, 2)
    model = DistributedDataParallel(net, algorithm="auto")  # bench/scaling's world size 1
    model(torch.ones(4, 3)).sum().backward()
    assert torch.equal(net.weight.grad, torch.ones(4, 3).sum(0).expand(2, 3))

def test_the_groups_timeout_is_read_at_each_call_so_a_later_change_counts(one_rank):
    import datetime

    from torch.distributed.distributed_c10d import _set_pg_timeout  # torch's only way to change it afterwards

    from manualdp.spmd.transport.group import group_state
    from manualdp.spmd.transport.peers import group_timeout

    manualdp.spmd.allreduce(torch.ones(3))  # the group's state made, as a first call makes it
    state = group_state()
    assert state.timeout == group_timeout()
    _set_pg_timeout(datetime.timedelta(seconds=group_timeout() + 7), dist.group.WORLD)
    assert state.timeout == group_timeout() and group_timeout() is not None  # the new one, not the first
