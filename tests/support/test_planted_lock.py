"""The checkpoint lock: interleavings that planted bugs slipped past (issue 20), played out in one process."""
import json
import os
import socket

from manualdp.support import checkpoint
from manualdp.support.checkpoint import lock_checkpoint_dir, lock_path

DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a running process


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
