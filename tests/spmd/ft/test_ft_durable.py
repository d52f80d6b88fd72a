"""Durable commits in one process: the store's committed step, each replica's checkpoint, the run's end (durable.py).

Each test hosts its own coordinator (a fresh store: a coordinator started again is one), and
its replicas are `Manager`s of this process, one at a time, on a quorum of one.
"""
import json
import os

import pytest
import torch
from torch import nn

from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager
import collections

from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.durable import (Checkpoints, Floor, RunFinished, committed_step, mark_finished,
                                      record_committed)
from manualdp.spmd.ft.keys import COMMITTED
from manualdp.spmd.ft.manager import CoordinatorLost

FAST = {"timeout": 3, "quorum_timeout": 1, "heartbeat_interval": 0.05, "heartbeat_timeout": 0.5}


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)


def replica(rid: str, port: int, **kw) -> tuple[Manager, FaultTolerantDDP]:
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    return (m := Manager(rid, "127.0.0.1", port, **FAST, **kw)), FaultTolerantDDP(
        net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), m)


def train(manager: Manager, ft: FaultTolerantDDP, steps: int) -> None:
    while manager.step < steps:
        ft.start_step()
        X, y = batch(manager.step)
        ((ft(X) - y) ** 2).sum().backward()
        ft.step()


def die(manager: Manager) -> None:
    """As a SIGKILL looks to the others: the heartbeat stops where it was, nothing more is written."""
    manager._heartbeat.stop(leave=False)
    manager._leave_group()


def parameters(ft: FaultTolerantDDP) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ft.module.parameters()]


def reference(steps: int) -> list[torch.Tensor]:
    """The parameters after `steps` steps of one replica that nothing happened to."""
    with Coordinator(0) as c:
        whole, ft = replica("a", c.port)
        train(whole, ft, steps)
        whole.close()
    return parameters(ft)


def test_newcomers_never_start_the_run_again_below_its_committed_step():
    """The 413-for-320 bug: every holder dead, a newcomer formed a quorum at step 0 and the run began again."""
    with Coordinator(0) as c:
        a, ft = replica("a", c.port)
        train(a, ft, 3)  # steps 0, 1 and 2 committed; 0 and 1 marked durable at the starts of 1 and 2
        die(a)
        b, ft_b = replica("b", c.port)
        try:
            with pytest.raises(TimeoutError, match=r"^replica 'b': step 1 was committed but no live replica or "
                                                   r"checkpoint holds it \(a quorum of b would start at step 0"):
                ft_b.start_step()
            assert b.step == 0 and committed_step(b.store) == 2
        finally:
            b.close()


def test_a_run_whose_replicas_and_coordinator_all_died_goes_on_from_disk_bitwise(tmp_path):
    expected = reference(5)
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 3)
        die(a)
    with Coordinator(0) as c:  # a coordinator started again: an empty store, the disk holds the run
        b, ft_b = replica("b", c.port, checkpoint_dir=str(tmp_path))
        ft_b.start_step()
        assert b.resumed == {"path": str(tmp_path / "a" / "ckpt-00000002.pt"), "step": 2}
        assert committed_step(b.store) == 2  # the store learns the disk's step
        X, y = batch(b.step)
        ((ft_b(X) - y) ** 2).sum().backward()
        ft_b.step()
        train(b, ft_b, 5)
        b.finish()
    for got, want in zip(parameters(ft_b), expected):
        assert torch.equal(got, want)
    logged = [json.loads(line) for rid in "ab" for line in (tmp_path / rid / "steps.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in logged) == [0, 1, 2, 3, 4]  # every step once: step 2 (a's, never durable) no more


def test_a_replica_started_after_the_run_ended_is_told_so_by_the_store_and_by_the_disk(tmp_path):
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 2)
        a.finish()
        late, ft_late = replica("late", c.port)
        with pytest.raises(RunFinished, match=r"^replica 'late': the run ended at step 2: nothing left to train$"):
            ft_late.start_step()
        late.close()
    assert json.loads((tmp_path / "a" / "finished.json").read_text())["step"] == 2
    with Coordinator(0) as c:
        again, ft_again = replica("a", c.port, checkpoint_dir=str(tmp_path))
        with pytest.raises(RunFinished, match=r"the run ended at step 2 \(.* says so\): nothing left to train"):
            ft_again.start_step()
        again.close()


def test_a_member_of_the_last_quorum_saves_its_end_though_another_marked_the_run_finished(tmp_path):
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 2)
        mark_finished(a.store, 2)  # the last quorum's other member was quicker
        a.finish()
    assert (tmp_path / "a" / "ckpt-00000002.pt").exists() and (tmp_path / "a" / "finished.json").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()] == [0, 1]


def test_a_closed_manager_refuses_every_call_in_one_line():
    with Coordinator(0) as c:
        a, ft = replica("a", c.port)
        train(a, ft, 1)
        a.close()
        for call, args in (("start_step", ()), ("average", (torch.zeros(2),)), ("should_commit", (True,))):
            with pytest.raises(RuntimeError, match=rf"^replica 'a': {call}\(\) on a Manager that has closed"):
                getattr(a, call)(*args)


def test_a_lost_coordinator_is_named_in_one_line_after_the_state_is_saved(tmp_path):
    c = Coordinator(0)
    a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
    try:
        train(a, ft, 2)  # step 1 committed, not yet saved
        c.close()
        with pytest.raises(CoordinatorLost, match=rf"^replica 'a': lost the coordinator at 127\.0\.0\.1:{c.port} "
                                                  r"\(.*\); start it again, then this replica with the same "
                                                  r"command: it goes on from step 2 in "):
            ft.start_step()
        assert os.path.exists(tmp_path / "a" / "ckpt-00000002.pt")
    finally:
        a.close()


def test_the_committed_mark_only_rises_and_a_malformed_value_counts_as_none():
    with Coordinator(0) as c:
        store = torch.distributed.PrefixStore("t", torch.distributed.TCPStore("127.0.0.1", c.port, is_master=False))
        assert committed_step(store) == 0
        record_committed(store, 3)
        record_committed(store, 2)
        assert committed_step(store) == 3
        store.set(COMMITTED, "x")
        assert committed_step(store) == 0
        record_committed(store, 1)
        assert committed_step(store) == 1


def test_checkpoints_newest_intact_of_any_replica_and_of_this_run_only(tmp_path):
    a, b = Checkpoints(str(tmp_path), "a"), Checkpoints(str(tmp_path), "b")
    run = {"lr": 0.1}
    assert a.newest(run) is None
    a.save(1, run, {"w": torch.ones(1)})
    b.save(3, run, {"w": torch.full((1,), 3.0)})
    a.save(2, run, {"w": torch.full((1,), 2.0)})
    (tmp_path / "b" / "ckpt-00000009.pt.x.tmp").write_bytes(b"half")  # a write killed half-way
    assert a.newest(run)["step"] == 3 and torch.equal(a.newest(run)["state"]["w"], torch.full((1,), 3.0))
    (tmp_path / "b" / "ckpt-00000003.pt").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert a.newest(run)["step"] == 2
    with pytest.raises(ValueError, match=r"checkpoint .*ckpt-00000002\.pt belongs to another run "
                                         r"\(lr 0\.1 here 0\.2\)"), pytest.warns(UserWarning):
        a.newest({"lr": 0.2})
    with pytest.raises(ValueError, match=r"checkpoint_dir .* exists and is not a folder"):
        Checkpoints(str(tmp_path / "a" / "ckpt-00000002.pt"), "a")


def logged(folder) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "steps.jsonl").read_text().splitlines()]


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_and_the_history_holds_each_step_once(tmp_path):
    """Case 1 of issue 42's adversary: steps.jsonl held the step taken again twice."""
    expected = reference(5)
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 5)
        die(a)
    assert logged(tmp_path / "a") == [0, 1, 2, 3]  # durable up to 4 steps: the last one at the start of step 4
    newest = tmp_path / "a" / "ckpt-00000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # cut short, as a disk that filled
    with Coordinator(0) as c:
        again, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        with pytest.warns(UserWarning, match="skipping checkpoint"):
            ft.start_step()
        assert again.resumed["step"] == 3
        X, y = batch(again.step)
        ((ft(X) - y) ** 2).sum().backward()
        ft.step()
        train(again, ft, 5)
        again.finish()
    assert logged(tmp_path / "a") == [0, 1, 2, 3, 4]  # step 3 taken again: its line replaced, never twice
    for got, want in zip(parameters(ft), expected):
        assert torch.equal(got, want)


def test_a_history_without_an_intact_checkpoint_is_refused_in_one_line_never_started_again_from_0(tmp_path):
    """Case 2 of issue 42's adversary: every checkpoint damaged, the run began again at step 0."""
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 4)
        die(a)
    for path in (tmp_path / "a").glob("ckpt-*.pt"):
        path.write_bytes(b"damaged")
    with Coordinator(0) as c:
        again, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        try:
            with pytest.raises(ValueError, match=rf"^checkpoint_dir '{tmp_path}': .*steps.jsonl says 3 steps were "
                                                 r"committed, but no checkpoint there is intact: restore one, or "
                                                 r"start afresh in another folder$"), pytest.warns(UserWarning):
                ft.start_step()
            assert again.step == 0
        finally:
            again.close()


def test_the_history_is_cut_back_to_a_step_taken_again_and_drops_a_line_cut_short(tmp_path):
    first = Checkpoints(str(tmp_path), "a")
    for step in range(4):
        first.log_step({"step": step, "round": step + 1})
    with open(tmp_path / "a" / "steps.jsonl", "a") as f:
        f.write('{"step": 4, "ro')  # a kill in the middle of a line
    again = Checkpoints(str(tmp_path), "a")
    again.log_step({"step": 2, "round": 9})
    again.log_step({"step": 3, "round": 10})
    lines = [json.loads(line) for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["round"]) for r in lines] == [(0, 1), (1, 2), (2, 9), (3, 10)]


def test_the_floor_allows_a_quorum_at_the_committed_step_and_not_one_below(tmp_path):
    """B2 of issue 42: a quorum one step below the committed mark must wait, not start."""
    with Coordinator(0) as c:
        store = connect("127.0.0.1", c.port, 5)
        record_committed(store, 3)
        floor = Floor(store, "a", timeout=60)
        assert floor.allows(3, ["a"]) and floor.allows(4, ["a"])
        assert not floor.allows(2, ["a"]) and not floor.allows(0, ["a"])
        assert floor.allows(2, None)  # no quorum yet: only the end is checked


def test_a_finished_mark_of_another_run_does_not_end_this_one(tmp_path):
    """B7 of issue 42: finished.json names its run; another run's (other settings) in the folder ends nothing."""
    Checkpoints(str(tmp_path), "a").mark_finished(5, {"lr": 0.1, "seed": 0})
    other = Checkpoints(str(tmp_path), "b")
    assert other.finished_at({"lr": 0.2, "seed": 0}) is None and other.finished_at({"lr": 0.1, "seed": 0}) == 5
    with Coordinator(0) as c:
        store = connect("127.0.0.1", c.port, 5)
        other.refuse_if_finished(store, {"lr": 0.2, "seed": 0})  # not this run's end: nothing raised
        with pytest.raises(RunFinished, match="the run ended at step 5"):
            other.refuse_if_finished(store, {"lr": 0.1, "seed": 0})


def test_a_replica_folder_held_by_another_live_process_is_refused_in_one_line(tmp_path):
    """Case 40 of issue 42's adversary: two runs given one --checkpoint-dir overwrote each other mid-run."""
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from manualdp.spmd.ft.history import "
                               "lock_folder; lock_folder(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "a")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=r"^checkpoint folder .*/a' is in use by another live process \(a second "
                                             r"run given the same --checkpoint-dir, or this replica started twice\)"):
            Checkpoints(str(tmp_path), "a")
        Checkpoints(str(tmp_path), "b")  # another replica's folder is free
    finally:
        holder.kill()
        holder.wait(timeout=10)
    Checkpoints(str(tmp_path), "a")  # the kernel let go of the lock with the process


def test_a_replicas_own_folder_given_as_the_runs_is_refused_with_a_hint_for_fault_tolerance(tmp_path, capsys):
    """Case 7 of issue 42's adversary: the hint said "resume=True, --resume", which --fault-tolerant refuses."""
    from manualdp.runners.cli import main
    Checkpoints(str(tmp_path), "a").save(3, {}, {"w": torch.ones(1)})
    with pytest.raises(SystemExit) as e:
        main(["train", "--fault-tolerant", "127.0.0.1:1", "--replica-id", "c", "--model", "mlp",
              "--checkpoint-dir", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--resume" not in err[0]
    assert "holds checkpoints itself (a replica's folder" in err[0] and "give the run's folder" in err[0]


class Killed(BaseException):
    """A SIGKILL between two lines of the replica's code."""


def test_a_kill_after_the_save_before_the_history_line_loses_no_step_of_the_history(tmp_path, monkeypatch):
    """The chaos bench's step 131: saved in a checkpoint that others went on from, logged in no history."""
    with Coordinator(0) as c:
        a, ft = replica("a", c.port, checkpoint_dir=str(tmp_path))
        train(a, ft, 2)  # steps 0 and 1 committed; 0 saved and logged at the start of step 1
        monkeypatch.setattr(a._disk, "log_step", lambda record: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            ft.start_step()  # saves ckpt-2, holding step 1, and is killed before it logs step 1
        assert os.path.exists(tmp_path / "a" / "ckpt-00000002.pt") and logged(tmp_path / "a") == [0]
        die(a)
    with Coordinator(0) as c:
        b, ft_b = replica("b", c.port, checkpoint_dir=str(tmp_path))
        train(b, ft_b, 4)
        b.finish()
    assert b.resumed["step"] == 2
    assert logged(tmp_path / "a") + logged(tmp_path / "b") == [0, 1, 2, 3]  # step 1 once, from the checkpoint


def test_every_store_call_on_a_lost_coordinator_raises_coordinator_lost_in_one_line():
    """The chaos bench's c-17: torch's raw "Failed to recv, got 0 bytes" reached the user."""
    from manualdp.spmd.ft.signed_store import StoreLost

    c = Coordinator(0)
    store = connect("127.0.0.1", c.port, 3)
    store.set("x", "1")
    c.close()
    calls = [lambda: store.get("x"), lambda: store.check(["x"]), lambda: store.set("x", "2"),
             lambda: store.peek("x"), lambda: store.append("x", "3"), lambda: store.compare_set("x", "", "4")]
    for call in calls:
        with pytest.raises(StoreLost, match=rf"^lost the coordinator at 127\.0\.0\.1:{c.port} \(.+\); start it again"
                                            r", then this replica with the same command$") as info:
            call()
        assert isinstance(info.value, CoordinatorLost) and "\n" not in str(info.value)


def test_a_coordinator_lost_in_the_training_loops_own_store_call_is_named_by_the_replica(tmp_path):
    from manualdp.runners.ft_train import train_replica

    net = nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8).long()),
                                         batch_size=4)
    c = Coordinator(0)
    with Manager("a", "127.0.0.1", c.port, **FAST, checkpoint_dir=str(tmp_path)) as manager:
        c.close()  # before the loop reads the refusals: a store call outside the Manager's own
        with pytest.raises(CoordinatorLost, match=rf"^replica 'a': lost the coordinator at 127\.0\.0\.1:{c.port} "
                                                  r"\(.+\); start it again, then this replica"):
            train_replica(net, loader, loader, 1, 0.1, manager, progress=False, log=None)
