"""The sandbox's side of the operating system: what keeps the grader apart from the child that runs a student's file
(`sandbox.py` says what each guard is for), and how the child's processes are found, told and ended.

User, mount and pid namespaces of its own (`UNSHARE`, `namespaces`), the grader not dumpable while a child runs
(`hide_grader`), a child that dies with its parent (`die_with_parent`), the line the child's init ends with
(`ENDED`); every process of the child's session (`session`), killed (`kill_session`), how the child ended
(`exit_status`, `signal_name`), and its folder measured (`usage`) and removed even where it locked it
(`remove_folder`). Standard library only: the child imports this too.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable

__all__ = ["UNSHARE", "ENDED", "usage", "hide_grader", "die_with_parent", "namespaces", "signal_name", "remove_folder",
           "exit_status", "process_state", "session", "kill_session"]

UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child"]  # its namespaces
ENDED = "manualdp-sandbox-ended"  # the init's last line on stderr: ENDED, the child's returncode (as Popen's)
PR_SET_PDEATHSIG, PR_GET_DUMPABLE, PR_SET_DUMPABLE = 1, 3, 4


@functools.cache
def _prctl() -> Callable[..., int]:
    """libc's prctl (Linux), or a function that does nothing."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda *args: -1


_children = {"running": 0, "dumpable": 1}  # the children this process runs now, and its dumpable flag before them
_children_lock = threading.Lock()


def hide_grader(more: int) -> None:
    """Count a child started (+1) or ended (-1). While any runs, this process is not dumpable (PR_SET_DUMPABLE 0):
    a process of the same user without CAP_SYS_PTRACE (the child in the fallback) can then open neither its
    /proc/PID/fd, to print a verdict of its own into the grader's output, nor its /proc/PID/mem. Core dumps and
    ptrace of the grader are off meanwhile too."""
    with _children_lock:
        _children["running"] += more
        if more > 0 and _children["running"] == 1:
            _children["dumpable"] = _prctl()(PR_GET_DUMPABLE, 0, 0, 0, 0)
            _prctl()(PR_SET_DUMPABLE, 0, 0, 0, 0)
        elif more < 0 and _children["running"] == 0 and _children["dumpable"] > 0:
            _prctl()(PR_SET_DUMPABLE, _children["dumpable"], 0, 0, 0)


def die_with_parent() -> Callable[[], object]:
    """A function that has the kernel SIGKILL the process that calls it when that process's parent ends (Linux's
    PR_SET_PDEATHSIG; elsewhere it does nothing): taken before a fork, so that the forked process only calls it."""
    return functools.partial(_prctl(), PR_SET_PDEATHSIG, signal.SIGKILL)


@functools.cache
def namespaces() -> bool:
    """Whether children run in namespaces of their own (`UNSHARE`): where it works, tried once per process, and
    MANUALDP_NAMESPACES is not 0."""
    if os.environ.get("MANUALDP_NAMESPACES") == "0":
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def signal_name(number: int) -> str:
    """The name of signal `number` (SIGKILL), or "signal N" for one Python does not know."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def remove_folder(folder: str) -> None:
    """Remove `folder`, also where the child made folders in it read-only (which a user other than root cannot
    empty): each folder in it is given u+rwx first. The child and everything it started are dead by now, so that
    nothing swaps a folder for a link between `lstat` and `chmod`."""
    shutil.rmtree(folder, ignore_errors=True)
    if not os.path.lexists(folder):
        return
    todo = [folder]
    while todo:
        path = todo.pop()
        try:
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                os.chmod(path, mode | stat.S_IRWXU)
                todo.extend(e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    shutil.rmtree(folder, ignore_errors=True)


def usage(folders: list[str], most_files: int) -> tuple[int, int]:
    """(bytes on disk, files and folders) under `folders`, links not followed; the count stops past `most_files`."""
    used = count = 0
    todo = list(folders)
    while todo and count <= most_files:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            used, count = used + info.st_blocks * 512, count + 1
            if stat.S_ISDIR(info.st_mode):
                todo.append(entry.path)
    return used, count


def exit_status(pid: int, wait: float) -> int | None:
    """How the child ended (as Popen's returncode: negative for a signal), or None if it still runs after `wait`
    seconds; it is not reaped, so that its pid cannot be reused before its session is killed."""
    end = time.monotonic() + wait
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() >= end:
            return None
        time.sleep(0.02)


def process_state(pid: int) -> str:
    """The process state letter in /proc (R, S, T, Z...), or '' where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def session(sid: int) -> list[int]:
    """Every process in session `sid`, or descended from it, that /proc lists (forks that left the group too)."""
    found, parents = set(), {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[pid] = int(fields[1])
        if int(fields[3]) == sid:
            found.add(pid)
    grew = True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in found or ppid == sid} - found
        found |= more
        grew = bool(more)
    found.discard(os.getpid())
    return sorted(found)


def kill_session(sid: int) -> None:
    """SIGKILL the child, its process group, and every process of its session or tree (found while the child
    still lives, so that a fork that left the group is found by its parent), until none is left."""
    for _ in range(20):
        left = [pid for pid in [sid, *session(sid)] if process_state(pid) not in ("Z", "")]
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
