"""`manualdp train` fails before the work, in one line: numbers that cannot work, outputs that cannot be written."""
import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import cpu_devices, train
from manualdp.runners.cli import main
from manualdp.support import checkpoint as ck

SMALL = ["--no-progress", "--num-train", "256", "--num-test", "128", "--batch-size", "64"]


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("manualdp train: error:") or "error:" in lines[-1]
    return lines[-1]


@pytest.mark.parametrize("argv, words", [
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--lr", "1e308"], ["--lr", "1e308", "float32"]),
    (["--seed", str(2**40)], ["--seed", str(2**40)]),
    (["--timeout", "1e15"], ["--timeout", "1e15"]),
    (["--devices", "100000"], ["--devices", "100000"]),
    (["--json", ""], ["--json", "empty"]),
    (["--plot", ""], ["--plot"]),
    (["--checkpoint-dir", ""], ["--checkpoint-dir", "empty"]),
    (["--checkpoint-dir", "/sys/manualdp-ckpt"], ["--checkpoint-dir", "/sys", "cannot write"]),
    (["--json", "/sys/h.json"], ["--json", "cannot write"]),
    (["--num-train", str(10**12)], ["--num-train", "GiB"]),
])
def test_numbers_and_outputs_that_cannot_work_are_refused_before_training(argv, words, capsys):
    last = _refused(["train", *SMALL[:1], *argv], capsys)
    for w in words:
        assert w in last, last


def test_a_full_disk_is_found_before_training(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    last = _refused(["train", "--checkpoint-dir", str(tmp_path / "c"), "--json", str(tmp_path / "h.json")], capsys)
    assert "--json" in last and "MiB free" in last and not os.listdir(tmp_path)


def test_devices_under_torchrun_is_an_error_not_ignored(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    last = _refused(["train", "--devices", "5"], capsys)
    assert "--devices 5 under torchrun" in last and "2 ranks" in last


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_an_explicit_nonfinite_check_with_zero2_under_torchrun_is_refused_not_dropped(monkeypatch, capsys, nonfinite):
    monkeypatch.setenv("WORLD_SIZE", "2")
    last = _refused(["train", "--zero", "2", "--nonfinite", nonfinite], capsys)
    assert f"--nonfinite {nonfinite} needs the averaged gradients" in last and "--zero 1" in last


@pytest.mark.parametrize("algorithm", ["tree", "naive", "halving_doubling"])
def test_zero3_with_an_algorithm_it_does_not_run_is_refused_not_mislabelled(tmp_path, capsys, algorithm):
    out = tmp_path / "f.json"
    last = _refused(["train", *SMALL, "--zero", "3", "--algorithm", algorithm, "--json", str(out)], capsys)
    assert f"--algorithm {algorithm} with --zero 3" in last and "ring only" in last and not out.exists()


def test_zero3_records_ring_and_stops_at_the_first_nonfinite_gradient_as_without_zero(tmp_path, capsys):
    """`--zero 3` used to record the algorithm it did not run, and let `--lr 1e30` end with rc 0 and loss NaN."""
    run = [*SMALL, "--model", "mlp", "--epochs", "1"]
    assert main(["train", *run, "--zero", "3", "--algorithm", "ring", "--json", str(tmp_path / "f.json")]) == 0
    import json
    assert json.loads((tmp_path / "f.json").read_text())["config"]["algorithm"] == "ring"
    capsys.readouterr()
    lines = {}
    for zero in ([], ["--zero", "3"]):
        assert main(["train", *run, "--lr", "1e30", *zero]) == 1
        lines[bool(zero)] = capsys.readouterr().err.strip().splitlines()
    want = ("manualdp train: error: non-finite gradient in parameter '1.weight' at step 1 "
            "(--nonfinite skip skips such steps)")
    assert lines[True] == lines[False] == [want]


def test_zero3_under_torchrun_refuses_an_algorithm_it_does_not_run(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    last = _refused(["train", "--zero", "3", "--algorithm", "tree"], capsys)
    assert "--zero 3" in last and "ring" in last


def _manualdp(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "manualdp", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_resume_with_changed_options_is_one_line_naming_each(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _manualdp("train", *SMALL, "--epochs", "1", "--checkpoint-dir", ckpt)
    assert first.returncode == 0, first.stderr
    second = _manualdp("train", *SMALL[:-1], "32", "--epochs", "2", "--seed", "1", "--model", "mlp",
                       "--checkpoint-dir", ckpt, "--resume")
    assert second.returncode == 1 and "Traceback" not in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    for w in ("configuration changed", "batch_size 64 -> 32", "seed 0 -> 1", "model 'lenet' -> 'mlp'"):
        assert w in last, last
    assert "num_epochs" not in last.split("configuration changed")[1].split(";")[0]


def test_a_write_error_during_the_run_keeps_the_finished_epochs(tmp_path, monkeypatch):
    real, calls = ck.atomic_write, []

    def filling(path, mode="wb"):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, mode)
    monkeypatch.setattr(ck, "atomic_write", filling)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                      batch_size=8)
    with pytest.raises(OSError) as e:
        train(nn.Linear(4, 2), data, data, cpu_devices(2), 3, 0.1, checkpoint_dir=str(tmp_path / "c"), progress=False,
              log=None)
    assert "No space left on device" in str(e.value) and "ckpt-00000008-epoch.pt" in str(e.value)
    assert len(e.value.history.train_loss) == 2


def test_explain_says_its_limit_at_once_and_stays_fast_below_it():
    import time

    from manualdp.runners.explain import MAX_DEVICES, explain
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"at most {MAX_DEVICES}.*got 1000"):
        explain("ring", 1000)
    with pytest.raises(ValueError, match="--state"):
        explain("ring", 100, show_state=True)
    assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    text = explain("ring", MAX_DEVICES)
    assert text.count(" -> dev") == 2 * (MAX_DEVICES - 1) * MAX_DEVICES
    assert time.perf_counter() - start < 30.0


def test_an_error_line_is_one_write_so_ranks_sharing_stderr_never_run_their_lines_together(monkeypatch):
    # print() wrote the newline apart; under torchrun two ranks' refusals came out as one line
    # about 3 runs in 8 (bench/faults.py's bad MANUALDP_LINK case).
    from manualdp.runners import cli

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)
    cli._error("rank 1: something went wrong")
    assert stderr.writes == ["manualdp train: error: rank 1: something went wrong\n"]
