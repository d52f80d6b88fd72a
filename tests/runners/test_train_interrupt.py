"""Ctrl-C on `manualdp train`: one line that says at which step it stopped and, when a checkpoint was written, how
`--resume` continues; exit status 130, as a shell gives a command that SIGINT ended; no traceback."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from manualdp.runners.cli import _interrupted


def train_until(tmp_path, ready, *options: str) -> subprocess.CompletedProcess:
    """`manualdp train` on the MLP for many epochs, interrupted with SIGINT once `ready(stderr so far)` holds."""
    command = [sys.executable, "-m", "manualdp", "train", "--cpu", "--devices", "2", "--model", "mlp",
               "--epochs", "1000", "--num-train", "512", "--num-test", "64", "--batch-size", "32", *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    errors = tmp_path / "stderr"
    with open(errors, "w") as err_file:
        # SIGINT as a terminal gives it: a shell that starts the tests in the background ignores it, and its
        # children would inherit that (Python then installs no handler, and Ctrl-C never arrives)
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 120
            while not ready(errors.read_text()) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None, f"manualdp train ended by itself: {errors.read_text()}"
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, errors.read_text())


@pytest.mark.soak
def test_ctrl_c_says_the_step_and_how_resume_continues_from_the_newest_checkpoint(tmp_path):
    ckpts = tmp_path / "ckpts"
    done = train_until(tmp_path, lambda _: ckpts.is_dir() and any(p.suffix == ".pt" for p in ckpts.iterdir()),
                       "--checkpoint-dir", str(ckpts), "--checkpoint-every", "4", "--no-progress")
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    found = re.fullmatch(rf"manualdp train: interrupted at step (\d+); `--resume` \(with --checkpoint-dir "
                         rf"{re.escape(str(ckpts))}\) continues from step (\d+), ckpt-(\d{{8}})(-epoch)?\.pt", last)
    assert found, last
    stopped, resumes, named = (int(found.group(i)) for i in (1, 2, 3))
    assert resumes == named and 4 <= resumes <= stopped and resumes % 4 == 0


@pytest.mark.soak
def test_ctrl_c_without_a_checkpoint_says_the_step_only(tmp_path):
    done = train_until(tmp_path, lambda err: re.search(r"\b[1-9]\d*/\d+ \[", err))  # the progress bar moved
    assert done.returncode == 130, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"manualdp train: interrupted at step (\d+)", last)
    assert found and int(found.group(1)) >= 1, last
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


def test_the_interrupted_line_without_a_step_or_a_checkpoint_folder(tmp_path, capsys):
    assert _interrupted(None, None) == 130
    assert capsys.readouterr().err == "\nmanualdp train: interrupted before the first step\n"
    assert _interrupted(3, str(tmp_path / "never-made")) == 130
    assert capsys.readouterr().err == "\nmanualdp train: interrupted at step 3\n"
    assert _interrupted(3, str(tmp_path)) == 130  # a folder without a checkpoint: nothing to resume from
    assert capsys.readouterr().err == "\nmanualdp train: interrupted at step 3\n"
