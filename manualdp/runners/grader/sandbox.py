"""Run a student's file in a child process that cannot hang, fool or outlive the grader.

The child (`sandbox_child`) is a fresh interpreter in a session of its own, in a temporary folder of its own (its
TMPDIR too, so that what it leaves there goes with the folder), with capped memory, under an init of its own that
tells the grader how it ended. Where `unshare` can, it runs in user and pid namespaces of its own: it sees and
signals its own processes only, so that an answer that kills or stops its parent, or its process group, never
reaches the grader. Elsewhere (no `unshare`, user namespaces disabled, or MANUALDP_NAMESPACES=0) such an answer
kills or stops the init, not the grader, and the child dies with the grader; but an answer that looks the grader's
pid up (in /proc) can still kill or stop it, and `os.kill(-1, ...)` reaches every process of the user. In neither
can the child open the grader's /proc/PID/fd or mem (to print a verdict of its own into the grader's output, or
write into its memory): namespaces keep it out of the grader's user namespace, and in the fallback the grader is not
dumpable while a child runs and the child holds no CAP_SYS_PTRACE. Still open: a terminal the grader prints to (the
child writes to it as the same user), and, in the fallback for a user other than root, the other processes of that
user (a `| tee` that reads the grader's output). The grader keeps the inputs, the expected values and the verdict;
it sends the child inputs only, and reads back what the child's function left in them and returned, loaded with
`weights_only=True` (tensors and plain values: nothing that runs code here). Every call has a deadline. A call that
does not return in time, or a child that dies, raises `Stopped` naming what happened; then the child's whole session
is killed, and a later call starts a new child. On disk it may write in its own folder only, and read only what it
must (Python, its libraries, its answer's folder), behind the walls of `walls.py` that the machine allows: a read-only
mount namespace (with the namespaces above), Landlock (a kernel that has it), and always an audit hook, the fallback
where neither holds; the grader fails an answer that tried, naming the operation, the path and the walls in force.
All its files together may hold `DISK_BYTES` (and `DISK_FILES` files): the grader looks at its folders while it
waits and after each reply, and kills a child over the cap. The operating system's side of all this (the namespaces,
the grader not dumpable, the child's session found and killed, its folder removed) is in `processes.py`.
"""
from __future__ import annotations

import io
import os
import re
import select
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time

from .processes import (ENDED, UNSHARE, die_with_parent, exit_status, hide_grader, kill_session, namespaces,
                        process_state, remove_folder, session, signal_name, usage)

__all__ = ["Stopped", "Raised", "Opaque", "Child"]

STARTUP = 120.0  # seconds for a fresh interpreter to import torch on a busy machine
DISK_BYTES = 256 << 20  # what the child may keep on disk, all its files together (and in /dev/shm, in a namespace)
DISK_FILES = 10_000  # and how many files and folders
WATCH = 0.25  # seconds between two looks at what the child keeps on disk
SOCKETS = 70  # the longest TMPDIR for multiprocessing's sockets (TMPDIR/pymp-*/listener-*: 32 more, in 104 bytes)


class Stopped(BaseException):
    """The student's code did not return: it ran past its deadline, exited, or was killed.

    A BaseException, so that hypothesis stops at once instead of shrinking by calling it again."""


class Raised(Exception):
    """The student's function raised `kind` (a name) with `message`, `at` a file and line."""

    def __init__(self, kind: str, message: str, at: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.at = kind, message, at


class Opaque:
    """What the child returned that is not a tensor or a plain value: its repr only."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _restore(obj):
    """The child's plain form (`sandbox_child._plain`) back as objects: Opaque, Schedule."""
    if isinstance(obj, dict):
        if set(obj) == {"__object__"}:
            return Opaque(obj["__object__"])
        if set(obj) == {"__schedule__"}:
            from ...transfers import Schedule, Transfer

            n, chunks, rounds = obj["__schedule__"]
            try:
                rounds = tuple(tuple(Transfer(*t) for t in rnd) for rnd in _restore(rounds))
            except TypeError:  # not rounds of transfers: told by the property, as a list
                return _restore(rounds)
            return Schedule("yours", n, chunks, rounds, ("",) * len(rounds))
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_restore(x) for x in obj)
    return obj


class Child:
    """The student's file at `path`, loaded in a child process; `call(*args)` runs its `name` there (`name`: a
    function's name, or a list of names, the first being the one `call` runs), `job` a job of the grader's with them.

    Args:
        timeout: seconds each call may take (and importing the file).
        deadline: `time.monotonic()` after which no call may run, the bound on the whole check.
        memory_mb: the child's address-space cap.
    """

    def __init__(self, path: str, name: str | list[str], timeout: float, deadline: float, memory_mb: int):
        self.path, self.names = os.path.abspath(path), [name] if isinstance(name, str) else list(name)
        self.timeout, self.deadline, self.memory_mb = timeout, deadline, memory_mb
        self.proc: subprocess.Popen | None = None
        self.folder: str | None = None
        self.tmp: str | None = None  # the child's TMPDIR
        self.walls = ""  # the walls in force around it, in words (`walls.Walls.named`)
        self.disk_bytes = DISK_BYTES

    # ------------------------------------------------------------ the child's life

    def start(self) -> dict:
        """Start a child and load the file in it: its answer to `load` (`ok`, `missing`, `import_raised`...)."""
        if self.folder is None:  # a restarted child keeps its folders, and what the last one wrote there
            self.folder = tempfile.mkdtemp(prefix="manualdp-check-")
            self.tmp = os.path.join(self.folder, "tmp")  # its temporary files, removed with it
            if len(self.tmp) > SOCKETS and os.access("/tmp", os.W_OK):  # too long for the sockets of multiprocessing
                self.tmp = tempfile.mkdtemp(prefix="manualdp-tmp-", dir="/tmp")
        try:
            os.makedirs(self.tmp, exist_ok=True)
        except OSError:  # the last child put something else there: its own doing
            pass
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", TMPDIR=self.tmp, TMP=self.tmp,
                   TEMP=self.tmp, TORCHINDUCTOR_CACHE_DIR=os.path.join(self.tmp, "torchinductor"))  # not in /tmp
        wanted = ["mount"] * namespaces() + ["landlock"] * (os.environ.get("MANUALDP_LANDLOCK") != "0")
        command = [sys.executable, "-m", "manualdp.runners.grader.sandbox_child", str(self.memory_mb << 20),
                   str(self.disk_bytes), ",".join(wanted) or "none"]
        self.proc = subprocess.Popen(
            [*UNSHARE, *command] if namespaces() else command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=self.folder, env=env, start_new_session=True, close_fds=True,
            preexec_fn=die_with_parent())  # killed when the thread that started it ends
        hide_grader(+1)  # before the child, which imports torch first, can run the file
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self._recv(max(STARTUP, self.timeout), "starting Python and importing torch")
        self._send({"op": "load", "path": self.path, "names": self.names}, self.timeout, "importing the file")
        loaded = self._recv(self.timeout, "importing the file")
        self.walls = loaded.get("walls", "") if isinstance(loaded, dict) else ""
        return loaded

    def restart(self) -> dict:
        """End the child and start a new one in the same folder (what a resume in a new process finds); `start`'s
        answer."""
        self._end_process()
        return self.start()

    def close(self) -> None:
        """Kill the child and everything it started, and remove its folder."""
        self._end_process()
        if self.folder is not None:
            remove_folder(self.folder)
            remove_folder(self.tmp)
            self.folder = self.tmp = None

    def _end_process(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
            hide_grader(-1)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ calls

    def call(self, *args) -> tuple:
        """`name(*args)` in the child: `(before, after, out)`: the arguments as the caller held them before the
        call, as they are after it, and what it returned; raise `Raised` or `Stopped`."""
        return self._called(self.request({"op": "call", "args": args}, self.timeout, ""))

    def job(self, job: str, *args) -> tuple:
        """As `call`, for a job of the grader's (`jobs.JOBS`) that calls the file's functions."""
        return self._called(self.request({"op": "job", "job": job, "args": args}, self.timeout, ""))

    def _called(self, reply: dict) -> tuple:
        if "raised" in reply:
            raise Raised(reply["raised"], reply["message"], reply["at"])
        if "error" in reply:
            raise Raised("an output the grader cannot read", reply["error"], "")
        return reply["before"], reply["after"], reply["out"]

    def request(self, req: dict, timeout: float, doing: str) -> dict:
        """Send `req` to a live child (starting one if needed) and return its answer within `timeout` s."""
        if self.proc is None:
            loaded = self.start()
            if not loaded.get("ok"):
                raise Stopped(f"the file no longer loads in a new child: {loaded}")
        self._send(req, timeout, doing)
        return self._recv(timeout, doing)

    def _send(self, obj, timeout: float, doing: str) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        data = memoryview(struct.pack(">Q", buf.getbuffer().nbytes) + buf.getvalue())
        end = self._end(timeout)
        fd = self.proc.stdin.fileno()
        while data:
            if not select.select([], [fd], [], max(0.0, end - time.monotonic()))[1]:
                self._stop(timeout, doing)
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                self._stop(timeout, doing)

    def _recv(self, timeout: float, doing: str) -> dict:
        import torch

        end = self._end(timeout)
        head = self._read(8, end, timeout, doing)
        body = self._read(struct.unpack(">Q", head)[0], end, timeout, doing)
        try:
            reply = _restore(torch.load(io.BytesIO(body), weights_only=True))
        except Exception as e:  # noqa: BLE001 (a reply forged or garbled by the student's code)
            self.close()
            raise Stopped(f"sent the grader a reply it cannot read ({type(e).__name__}): does your code write to "
                          "file descriptors it did not open, or patch torch.save?") from None
        self._watch_disk()  # also after a call too short for a look while it ran
        if isinstance(reply, dict) and "refused" in reply:  # even where its code caught the error
            self.close()
            what, path = (list(reply["refused"]) + ["", ""])[:2]
            walls = reply.get("walls") or self.walls
            where = f" {path}, outside its own folder" if path else ""  # none: a call the walls cannot judge
            raise Stopped(f"it tried to {what}{where}: an answer may write only in its own "
                          f"folder and read only what it imports (refused by the grader's walls: {walls})")
        return reply

    def _end(self, timeout: float) -> float:
        return min(time.monotonic() + timeout, self.deadline)

    def _read(self, n: int, end: float, timeout: float, doing: str) -> bytes:
        fd, parts = self.proc.stdout.fileno(), []
        while n:
            while not select.select([fd], [], [], min(WATCH, max(0.0, end - time.monotonic())))[0]:
                self._watch_disk()
                if time.monotonic() >= end:
                    self._stop(timeout, doing)
            part = os.read(fd, min(n, 1 << 20))
            if not part:
                self._stop(timeout, doing)
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    def _watch_disk(self) -> None:
        """Kill the child and raise Stopped if its folders hold more than the cap on all its files together."""
        inside = os.path.dirname(self.tmp) == self.folder  # counted with its folder
        used, files = usage([self.folder] if inside else [self.folder, self.tmp], DISK_FILES)
        if used > self.disk_bytes or files > DISK_FILES:
            self.close()
            raise Stopped(f"it wrote more than the grader allows on disk: {self.disk_bytes >> 20} MiB and "
                          f"{DISK_FILES:,} files in all, its files together (it holds {used >> 20} MiB in {files:,} "
                          "files and folders); its folder is removed")

    def _stop(self, timeout: float, doing: str) -> None:
        """The child did not answer: say why (ran out of time, stopped, exited, killed), kill it, raise Stopped."""
        pid = self.proc.pid
        stopped = "T" in {process_state(p) for p in [pid, *session(pid)]}  # the file runs under its init (and unshare)
        code = self._ended(0.5)
        total = time.monotonic() >= self.deadline - 0.01
        printed = self._printed()
        self.close()
        if code is None and stopped:
            why = "stopped (SIGSTOP?): it never answered"
        elif code is None:
            why = (f"did not return within the {timeout:g} s it may take" if not total else
                   "was still running when the whole check ran out of time (--total)")
            why += ": does it loop forever, or wait for something that never comes?"
        elif code < 0:
            why = f"was killed by {signal_name(-code)}"
            if -code == signal.SIGXFSZ:
                why += " (it printed or wrote more than 64 MiB into one file)"
        else:
            why = (f"ended the process (exit status {code}) instead of returning: does it call sys.exit, os._exit "
                   "or exit()? The grader calls your function; it must return")
        raise Stopped(f"{why}{f' (while {doing})' if doing else ''}{printed}")

    def _ended(self, wait: float) -> int | None:
        """How the child that ran the file ended (as Popen's returncode), as its init told on stderr, else as the
        process started here ended; None if that still runs after `wait` seconds."""
        code = exit_status(self.proc.pid, wait)
        if code is None:
            return None
        try:
            told = self.proc.stderr.read(1 << 20) or b""  # the init and unshare have ended: no more is coming
        except OSError:
            told = b""
        codes = re.findall(rf"^{ENDED} (-?\d+)$", told.decode(errors="replace"), re.M)
        return int(codes[-1]) if codes else code

    def _printed(self) -> str:
        """The last line the child printed, if any: often the reason it died."""
        try:  # without blocking: the student's code may have put a FIFO, or a link to one, in its place
            fd = os.open(os.path.join(self.folder, "output.txt"), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return ""
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2000))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except (OSError, TypeError):
            return ""
        return f". Its last printed line: {lines[-1][:200]!r}" if lines else ""
