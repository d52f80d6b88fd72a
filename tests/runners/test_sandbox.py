"""The grader's sandbox (`runners/sandbox.py`) against answers that signal their parent, their process group, the
grader or themselves: one FAIL paragraph that says how the answer ended, and no process and no folder left; in
namespaces of its own where `unshare` works here, and in the fallback (MANUALDP_NAMESPACES=0, as where it does not).
"""
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from manualdp.runners import sandbox
from manualdp.runners.sandbox import Child, Stopped

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
HOSTILE = {  # answer -> (its body, what `manualdp check` says with namespaces, in the fallback (None: it is killed))
    "kills_its_parent": ("os.kill(os.getppid(), signal.SIGKILL); os._exit(3)", "exit status 3", "killed by SIGKILL"),
    "stops_its_parent": ("os.kill(os.getppid(), signal.SIGSTOP); time.sleep(0.1); os._exit(0)", "exit status 0",
                         r"stopped \(SIGSTOP\?\)"),
    "kills_the_grader": (FIND_THE_GRADER, "exit status 4", None),
}


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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", HOSTILE)
def test_an_answer_that_signals_its_parent_or_the_grader_fails_in_one_paragraph(name, mode, tmp_path):
    body, with_namespaces, in_fallback = HOSTILE[name]
    path = tmp_path / f"{name}.py"
    path.write_text(answer(body))
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "manualdp", "check", "allreduce", str(path), "--timeout", "3",
                             "--total", "30", "--examples", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path / "tmp"), MANUALDP_NAMESPACES=MODES[mode]))
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the grading hung: {proc.communicate()}")
    time.sleep(0.3)
    assert leftovers(tmp_path / "tmp") == [], (out, err)
    expected = with_namespaces if namespaced(mode) else in_fallback
    if expected is None:  # the fallback's limit: the grader is killed, its child with it, its folder stays
        assert proc.returncode == -signal.SIGKILL and out == "", (out, err)
        return
    assert list((tmp_path / "tmp").glob("manualdp-check-*")) == [], (out, err)
    assert "\n\n" not in out.strip() and "Traceback" not in out + err, (out, err)  # one paragraph
    out = " ".join(out.split())  # as read: its line breaks are wrapping
    assert proc.returncode == 1 and out.startswith(f"FAIL allreduce ({path}): "), (out, err)
    assert re.search(expected, out), out


ENDINGS = {  # what the file's function does -> how the grader tells it (the init's report, not a shell's 128 + n)
    "os._exit(137)": r"ended the process \(exit status 137\)",
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(9)": "was killed by SIGTERM",
    "os.kill(0, signal.SIGSTOP)": r"stopped \(SIGSTOP\?\): it never answered",  # unshare or its init too
    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)": "was killed by SIGKILL",  # its group's: not the grader's
}


@pytest.mark.parametrize("mode", MODES)
def test_how_the_child_ended_is_told_as_it_happened(mode, tmp_path, monkeypatch):
    on = namespaced(mode)
    monkeypatch.setattr(sandbox, "namespaces", lambda: on)
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    for body, told in ENDINGS.items():
        path = tmp_path / "answer.py"
        path.write_text(answer(body))
        with Child(str(path), "allreduce", 2, time.monotonic() + 60, 2048) as child:
            assert child.start() == {"ok": True}
            with pytest.raises(Stopped, match=told):
                child.call([torch.ones(2)])
    assert leftovers(tmp_path) == [] and list(tmp_path.glob("manualdp-check-*")) == []


def test_without_unshare_or_when_told_the_child_runs_without_namespaces(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare` on it
    assert sandbox.namespaces.__wrapped__() is False
    monkeypatch.setenv("MANUALDP_NAMESPACES", "0")
    assert sandbox.namespaces.__wrapped__() is False
