"""The checkpoint lock: one run per folder, whatever the folder is called, and one winner of a stale lock."""
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import warnings

import pytest

from manualdp.support import checkpoint
from manualdp.support.checkpoint import lock_checkpoint_dir, lock_path

DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a running process


def _held_by_me():
    return pytest.raises(ValueError, match=f"in use by process {os.getpid()}")


def test_a_symlink_to_a_locked_folder_is_locked(tmp_path):
    real = tmp_path / "ckpt"
    release = lock_checkpoint_dir(str(real))
    try:
        os.symlink(real, tmp_path / "link")
        with _held_by_me():
            lock_checkpoint_dir(str(tmp_path / "link"))
    finally:
        release()
    assert not os.path.exists(lock_path(str(real)))


def test_a_relative_path_to_a_locked_folder_is_locked(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    os.symlink(tmp_path / "a" / "b", tmp_path / "up")
    monkeypatch.chdir(tmp_path)
    release = lock_checkpoint_dir("a/ckpt")
    try:
        # "up/.." is "a", not ".": only resolving the symlink sees that this is the same folder
        for name in ["up/../ckpt", str(tmp_path / "a" / "ckpt"), "a/./ckpt/"]:
            with _held_by_me():
                lock_checkpoint_dir(name)
    finally:
        release()


def _race(folder, barrier, wins, trials):
    warnings.simplefilter("ignore")
    for trial in range(trials):
        barrier.wait()  # the parent has written a stale lock
        try:
            release = lock_checkpoint_dir(folder)
        except ValueError as e:
            assert "in use" in str(e), e
            release = None
        with wins.get_lock():
            wins[trial] += release is not None
        barrier.wait()  # everyone has tried
        if release is not None:
            release()
        barrier.wait()  # the winner has let go


def test_of_processes_taking_one_stale_lock_at_once_exactly_one_wins(tmp_path):
    procs, trials = 4, 20
    folder = str(tmp_path / "ckpt")
    ctx = mp.get_context("fork")  # the children touch files only; fork keeps the test fast
    barrier, wins = ctx.Barrier(procs + 1, timeout=60), ctx.Array("i", trials)
    workers = [ctx.Process(target=_race, args=(folder, barrier, wins, trials)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        for _ in range(trials):
            with open(lock_path(folder), "w") as f:
                json.dump({"pid": DEAD_PID, "host": os.uname().nodename}, f)
            barrier.wait()
            barrier.wait()
            barrier.wait()
            assert not os.path.exists(lock_path(folder))
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert [w.exitcode for w in workers] == [0] * procs
    assert list(wins) == [1] * trials


def test_a_lock_whose_owner_is_a_zombie_is_taken_over(tmp_path):
    folder = str(tmp_path / "ckpt")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # never waited for until the end: a zombie
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with open(lock_path(folder), "w") as f:
            json.dump({"pid": zombie.pid, "host": os.uname().nodename}, f)
        with pytest.warns(UserWarning, match="stale lock"):
            release = lock_checkpoint_dir(folder)
        assert json.load(open(lock_path(folder)))["pid"] == os.getpid()
        release()
    finally:
        zombie.wait()
    assert not os.path.exists(lock_path(folder))


def test_a_live_owner_keeps_its_lock_and_nothing_is_left_beside_the_folder(tmp_path):
    folder = str(tmp_path / "ckpt")
    release = lock_checkpoint_dir(folder)
    with _held_by_me():
        lock_checkpoint_dir(folder)
    release()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# ---------------------------------------------------------------- planted bugs slipped past these (issue 20)

def _write_lock(folder, pid):
    with open(lock_path(folder), "w") as f:
        json.dump({"pid": pid, "host": socket.gethostname()}, f)


def test_release_leaves_alone_a_lock_that_another_run_holds_now(tmp_path):
    """Our lock was taken over (we looked dead to another run): releasing ours must not free theirs."""
    folder = str(tmp_path / "ckpt")
    release = lock_checkpoint_dir(folder)
    os.remove(lock_path(folder))
    _write_lock(folder, os.getppid())  # a live process: the other run
    release()
    with open(lock_path(folder)) as f:
        assert json.load(f)["pid"] == os.getppid()


def test_a_stale_lock_removed_by_another_process_while_we_wait_for_it_is_looked_at_again(tmp_path, monkeypatch):
    """While we wait for flock on a stale lock, another process removes it: we must not remove what is there now."""
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    _write_lock(folder, DEAD_PID)
    real_flock, calls = checkpoint.fcntl.flock, []

    def flock(fd, op):
        if not calls:  # the other process got the flock first and removed the stale lock
            os.remove(lock_path(folder))
        calls.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(checkpoint.fcntl, "flock", flock)
    release = lock_checkpoint_dir(folder)
    with open(lock_path(folder)) as f:
        assert json.load(f)["pid"] == os.getpid()
    release()
    assert not os.path.exists(lock_path(folder))


# ---------------------------------------------------------------- taking a stale lock is atomic (issue 35)

def _take_and_hold(folder, barrier, took, trials):
    """Per trial: race for a stale lock; then, while the parent rewrites the held lock to name a dead run, the
    loser tries again; then the winner lets go."""
    warnings.simplefilter("ignore")
    me = int(mp.current_process().name.rsplit("-", 1)[-1]) % 2
    for trial in range(trials):
        barrier.wait()  # the parent has written a stale lock
        try:
            release = lock_checkpoint_dir(folder)
        except ValueError as e:
            assert "in use" in str(e), e
            release = None
        took[2 * trial + me] = release is not None
        barrier.wait()  # both have tried; the parent rewrites the winner's lock in place, naming a dead run
        barrier.wait()
        if release is None:
            try:
                lock_checkpoint_dir(folder)()
                took[2 * trial + me] = 2  # took a lock that a live run holds
            except ValueError as e:
                assert "in use" in str(e), e
        barrier.wait()
        if release is not None:
            release()
        barrier.wait()  # the winner has let go


def test_two_processes_taking_a_stale_lock_50_times_one_wins_and_keeps_it_whatever_the_file_says(tmp_path):
    """Exactly one wins each race; and the winner keeps the lock though its file is rewritten to name a dead
    run (by a user, a stale copy, a harness): the `flock` it holds, not the file's words, says it lives. (Taking
    over by the file's words alone, a second process took a held lock.)"""
    procs, trials = 2, 50
    folder = str(tmp_path / "ckpt")
    ctx = mp.get_context("fork")  # the children touch files only; fork keeps the test fast
    barrier, took = ctx.Barrier(procs + 1, timeout=60), ctx.Array("i", procs * trials)
    workers = [ctx.Process(target=_take_and_hold, args=(folder, barrier, took, trials), name=f"racer-{k}")
               for k in range(procs)]
    for w in workers:
        w.start()
    stale = json.dumps({"pid": DEAD_PID, "host": socket.gethostname()})
    try:
        for _ in range(trials):
            with open(lock_path(folder), "w") as f:
                f.write(stale)
            barrier.wait()
            barrier.wait()
            with open(lock_path(folder), "r+") as f:  # in place: the same file, now naming a dead run
                f.truncate()
                f.write(stale)
            barrier.wait()
            barrier.wait()
            barrier.wait()
            assert not os.path.exists(lock_path(folder))
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert [w.exitcode for w in workers] == [0] * procs
    wins = [took[2 * t] + took[2 * t + 1] for t in range(trials)]
    assert wins == [1] * trials, f"trials where a held lock was taken again, or not one process won: {wins}"
