"""The grader's sandbox (`runners/grader/sandbox.py`), the slower half of tests/runners/test_sandbox.py:
`manualdp check` of an answer that kills or stops its parent fails in one paragraph that says how the answer ended,
and leaves no process and no folder; and how the child ended (exit 137, SIGTERM, a stopped group, a killed group) is
told as it happened. With namespaces of its own where `unshare` works here, and in the fallback (MANUALDP_NAMESPACES=0).
"""
import time

import pytest
import torch

from manualdp.runners.grader import sandbox
from manualdp.runners.grader.sandbox import Child, Stopped
from tests.runners.test_sandbox import MODES, answer, graded, leftovers, namespaced

HOSTILE = {  # answer -> (its body, what `manualdp check` says with namespaces, in the fallback)
    "kills_its_parent": ("os.kill(os.getppid(), signal.SIGKILL); os._exit(3)", "exit status 3", "killed by SIGKILL"),
    "stops_its_parent": ("os.kill(os.getppid(), signal.SIGSTOP); time.sleep(0.1); os._exit(0)", "exit status 0",
                         r"stopped \(SIGSTOP\?\)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", HOSTILE)
def test_an_answer_that_signals_its_parent_fails_in_one_paragraph(name, mode, tmp_path):
    body, with_namespaces, in_fallback = HOSTILE[name]
    graded(tmp_path, name, body, mode, with_namespaces if namespaced(mode) else in_fallback)


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
            assert child.start()["ok"]
            with pytest.raises(Stopped, match=told):
                child.call([torch.ones(2)])
    assert leftovers(tmp_path) == [] and list(tmp_path.glob("manualdp-check-*")) == []
