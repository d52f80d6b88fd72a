"""The grader's sandbox (`runners/grader/sandbox.py`): an answer that kills the grader it finds in /proc fails in one
paragraph and leaves no process and no folder; the child cannot open the grader's /proc/PID/fd or mem, leaves nothing
in TMPDIR (not even a folder it made read-only), sends numpy's numbers back as numbers, and tells where each graded
function was defined. In namespaces of its own where `unshare` works here, and in the fallback (MANUALDP_NAMESPACES=0,
as where it does not). The answers that kill or stop their parent, and the ways a child ends, are told in
bench/test_sandbox_soak.py.
"""
import ctypes
import inspect
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from manualdp import cost
from manualdp.runners.grader import processes, sandbox
from manualdp.runners.grader.sandbox import Child

MODES = {"namespaces": "1", "fallback": "0"}  # MANUALDP_NAMESPACES
FIND_THE_GRADER = """
for pid in filter(str.isdigit, os.listdir("/proc")):  # the `manualdp check` that grades this file, found in /proc
    try:
        if __file__.encode() in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0"):
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
os._exit(4)
"""


def answer(body: str) -> str:
    """A file whose `allreduce` runs `body`."""
    return "import os, signal, time\n\n\ndef allreduce(tensors):\n" + textwrap.indent(body.strip(), "    ") + "\n"


def namespaced(mode: str) -> bool:
    """Whether `manualdp check` in `mode` runs the child in namespaces here."""
    return mode == "namespaces" and sandbox.namespaces()


def leftovers(folder: pathlib.Path) -> list[int]:
    """The processes whose working folder lies under `folder`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                found.append(int(pid))
        except OSError:
            continue
    return found


def graded(tmp_path: pathlib.Path, name: str, body: str, mode: str, expected: str | None) -> None:
    """`manualdp check allreduce` of the answer that runs `body`, in `mode`: it says `expected` in one FAIL paragraph
    and leaves no process and no folder (`expected` None: the grader itself is killed, its child with it)."""
    path = tmp_path / f"{name}.py"
    path.write_text(answer(body))
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:  # short, unlike pytest's: `sandbox.SOCKETS`
        proc = subprocess.Popen([sys.executable, "-m", "manualdp", "check", "allreduce", str(path), "--timeout", "3",
                                 "--total", "30", "--examples", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, start_new_session=True,
                                env=dict(os.environ, TMPDIR=tmp, MANUALDP_NAMESPACES=MODES[mode]))
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the grading hung: {proc.communicate()}")
        time.sleep(0.3)
        assert leftovers(pathlib.Path(tmp)) == [], (out, err)
        if expected is None:  # the fallback's limit: the grader is killed, its child with it, its folder stays
            assert proc.returncode == -signal.SIGKILL and out == "", (out, err)
            return
        assert os.listdir(tmp) == [], (out, err)
    assert "\n\n" not in out.strip() and "Traceback" not in out + err, (out, err)  # one paragraph
    out = " ".join(out.split())  # as read: its line breaks are wrapping
    assert proc.returncode == 1 and out.startswith(f"FAIL allreduce ({path}): "), (out, err)
    assert re.search(expected, out), out


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_that_kills_the_grader_it_finds_fails_in_one_paragraph(mode, tmp_path):
    graded(tmp_path, "kills_the_grader", FIND_THE_GRADER, mode, "exit status 4" if namespaced(mode) else None)


def test_without_unshare_or_when_told_the_child_runs_without_namespaces(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare` on it
    assert sandbox.namespaces.__wrapped__() is False
    monkeypatch.setenv("MANUALDP_NAMESPACES", "0")
    assert sandbox.namespaces.__wrapped__() is False


PROBE = '''
import os, shutil, tempfile

import numpy as np
import torch

from math import sqrt
from manualdp.cost import cost  # the library's own, as a cheat would take it


@torch.no_grad()  # torch's wrapper, whose own code lies in torch: the function it wraps is the file's
def scaled(x):
    return x * 2


def probe(what, grader=0):
    if what == "litter":  # what a careless answer leaves: folders, a fixed file, and a folder it locks
        for _ in range(3):
            tempfile.mkdtemp()
        with open(os.path.join(tempfile.gettempdir(), "fixed.txt"), "w") as f:
            f.write("left")
        os.makedirs("locked/in/side")
        open("locked/in/side/file", "w").close()
        for folder, mode in (("locked/in/side", 0o500), ("locked/in", 0), ("locked", 0o500)):
            os.chmod(folder, mode)
        return tempfile.gettempdir()
    if what == "numbers":
        return [np.float64(0.25), np.int64(3), np.bool_(True), np.array(2.0), np.float32(0.5), np.uint8(7)]
    tried = {}  # what = "grader": open its stdout (to print a PASS of our own) and its memory
    for name, flags in (("fd/1", os.O_RDONLY), ("mem", os.O_RDONLY)):  # writing: refused before (test_sandbox_fs)
        try:
            os.close(os.open(f"/proc/{grader}/{name}", flags))
            tried[name] = "opened"
        except OSError as e:
            tried[name] = type(e).__name__
    return tried
'''
PR_GET_DUMPABLE = 3


@pytest.fixture(scope="module", params=MODES)
def probed(request):
    """A child, in each mode, that loaded PROBE's `probe`, `scaled`, the library's `cost` and math's `sqrt`: its
    answer to `load`, and what each of `probe`'s requests returned; then the child is closed. The grader's TMPDIR is
    short (not pytest's), so that the child's lies in its folder (`sandbox.SOCKETS`)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp, pytest.MonkeyPatch.context() as m:
        path = pathlib.Path(tmp, "probe.py")
        path.write_text(PROBE)
        on = namespaced(request.param)
        m.setattr(sandbox, "namespaces", lambda: on)
        m.setattr(sandbox.tempfile, "tempdir", str(pathlib.Path(tmp, "tmp")))
        pathlib.Path(tmp, "tmp").mkdir()
        with Child(str(path), ["probe", "scaled", "cost", "sqrt"], 10, time.monotonic() + 120, 2048) as child:
            loaded = child.start()
            got = {what: child.call(what, os.getpid())[2] for what in ("litter", "numbers", "grader")}
            got["folder"], got["child tmp"] = child.folder, child.tmp
            got["dumpable"] = ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        got["dumpable after"] = ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        got["left"] = sorted(os.listdir(pathlib.Path(tmp, "tmp"))), leftovers(pathlib.Path(tmp))
        yield {"loaded": loaded, "path": str(path), **got}


def test_load_tells_the_file_and_module_each_function_was_defined_in(probed):
    loaded = dict(probed["loaded"])
    assert loaded.pop("walls").endswith("an audit hook")  # and which others hold: test_sandbox_fs.py
    assert loaded == {"ok": True,
                                "defined_in": {"probe": probed["path"], "scaled": probed["path"],
                                               "cost": inspect.getfile(cost.cost), "sqrt": None},
                                "module": {"probe": "exercise", "scaled": "exercise", "cost": "manualdp.cost",
                                           "sqrt": math.__name__}}


def test_numpy_numbers_come_back_as_numbers(probed):
    numbers = probed["numbers"]
    assert numbers == [0.25, 3, True, 2.0, 0.5, 7] and list(map(type, numbers)) == [float, int, bool, float, float, int]


def test_the_child_leaves_nothing_in_tmpdir(probed):
    in_folder = os.path.join(probed["folder"], "tmp")
    if len(in_folder) <= sandbox.SOCKETS:  # as here, unless the machine's TMPDIR is long
        assert probed["litter"] == in_folder
    else:  # else in a folder of its own in /tmp, which goes with it
        assert probed["litter"].startswith("/tmp/manualdp-tmp-")
    assert probed["litter"] == probed["child tmp"] and not os.path.exists(probed["litter"])
    assert probed["left"] == ([], [])  # even what it locked is gone


def test_the_child_cannot_open_the_graders_stdout_or_memory_in_proc(probed):
    assert probed["grader"] == {"fd/1": "PermissionError", "mem": "PermissionError"}
    assert (probed["dumpable"], probed["dumpable after"]) == (0, 1)  # not dumpable while a child runs; then again


LOCKED = """
import ctypes, importlib.util, os, shutil, sys
spec = importlib.util.spec_from_file_location("processes", sys.argv[2])  # not torch, which the package imports
processes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(processes)

header, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
if ctypes.CDLL(None).capget(header, caps) == 0:  # as root, drop what makes modes no matter: as any other user
    for i in range(3):
        caps[i] &= ~0b110  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    assert ctypes.CDLL(None).capset(header, caps) == 0
folder = sys.argv[1]
os.makedirs(f"{folder}/a/b/c")
open(f"{folder}/a/b/c/file", "w").close()
os.symlink("/", f"{folder}/a/root")
for path, mode in ((f"{folder}/a/b/c", 0o500), (f"{folder}/a/b", 0), (f"{folder}/a", 0o500)):
    os.chmod(path, mode)
shutil.rmtree(folder, ignore_errors=True)
assert os.path.exists(f"{folder}/a/b"), "rmtree removed a locked folder: nothing to test"
processes.remove_folder(folder)
print(os.path.lexists(folder), oct(os.stat("/").st_mode))
"""


def test_a_folder_the_child_locked_is_removed_all_the_same(tmp_path):
    done = subprocess.run([sys.executable, "-c", LOCKED, str(tmp_path / "folder"), processes.__file__],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["False", oct(os.stat("/").st_mode)], done
