import json
import os
import re
import subprocess
import sys
import threading

import pytest
from manualdp.runners.cli import main

SMALL = ["--no-progress", "--num-train", "2048", "--num-test", "512", "--batch-size", "64"]


def _manualdp(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "manualdp", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_train_end_to_end(tmp_path):
    out = _manualdp("train", *SMALL, "--epochs", "2", "--devices", "3", "--algorithm", "ring", "--bucket-mb", "0.1",
                    "--json", str(tmp_path / "h.json"), "--plot", str(tmp_path / "h.png"))
    assert out.returncode == 0, out.stderr
    assert re.search(r"^test acc: \d\.\d\d, [\d.]+ sec/epoch on 3 simulated CPU devices$", out.stdout, re.M)
    assert len(re.findall(r"^epoch \d: loss [\d.]+, train acc [\d.]+, test acc [\d.]+, .* samples/s$",
                          out.stdout, re.M)) == 2
    history = json.loads((tmp_path / "h.json").read_text())
    assert len(history["test_acc"]) == 2
    assert history["test_acc"][-1] > 0.5  # 10 classes: chance is 0.1
    assert history["config"]["algorithm"] == "ring" and history["config"]["devices"] == ["cpu"] * 3
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_through_the_cli_equals_one_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _manualdp("train", *SMALL, "--epochs", "2", "--json", str(tmp_path / "a.json"))
    first = _manualdp("train", *SMALL, "--epochs", "1", "--checkpoint-dir", ckpt, "--checkpoint-every", "5")
    second = _manualdp("train", *SMALL, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume",
                       "--json", str(tmp_path / "b.json"))
    for out in (straight, first, second):
        assert out.returncode == 0, out.stderr
    assert "resumed from" in second.stdout
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["train_loss"] == b["train_loss"] and a["test_acc"] == b["test_acc"]


def test_missing_fashion_mnist_is_a_one_line_error(tmp_path):
    out = _manualdp("train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("manualdp train: error:") and str(tmp_path) in out.stderr


@pytest.mark.parametrize("argv", [["explain", "halving_doubling", "--devices", "5", "--size", "40"]])
def test_explain_is_reachable_from_the_cli(argv):
    out = _manualdp(*argv)
    assert out.returncode == 0, out.stderr
    assert "fold-in" in out.stdout and "fold-out" in out.stdout  # 5 is not a power of two


def test_nonfinite_gradient_stops_with_a_one_line_error():
    out = _manualdp("train", *SMALL, "--epochs", "1", "--lr", "1e30")  # diverges within a few steps
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert re.match(r"manualdp train: error: non-finite gradient in parameter '[\w.]+' at step \d+", last)



# ---------------------------------------------------------------- edge cases found in review

@pytest.mark.parametrize("argv, words", [
    (["train", "--plot", "curves.pdf"], ["--plot", "must end in .png"]),
    (["train", "--json", "."], ["--json", "is a directory"]),
    (["train", "--devices", "4", "--batch-size", "2"], ["--batch-size 2", "4 devices"]),
])
def test_cli_refuses_before_training(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for w in words:
        assert w in err


def test_cli_refuses_a_checkpoint_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SystemExit):
        main(["train", "--checkpoint-dir", str(f)])
    assert "is not a folder" in capsys.readouterr().err


def test_cpu_threads_default_to_one_for_simulated_devices_and_share_cores_under_torchrun(monkeypatch):
    from manualdp.runners.cli import cpu_threads

    assert cpu_threads(None, 1) == 1
    assert cpu_threads(3, 1) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads(None, 4) == 4  # two ranks on this machine share its 8 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert cpu_threads(None, 16) == 1


# ---------------------------------------------------------------- traces and outputs (issue 20)

TINY = ["--no-progress", "--num-train", "256", "--num-test", "64", "--batch-size", "64", "--epochs", "1"]


def test_trace_to_a_fifo_with_plot_trace_ends_and_plots_the_events_it_wrote(tmp_path):
    fifo, png = str(tmp_path / "trace.fifo"), tmp_path / "trace.png"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    try:
        out = _manualdp("train", *TINY, "--trace", fifo, "--plot-trace", str(png), timeout=60)
    finally:
        if reader.is_alive():  # the run never opened the FIFO: let the reader go
            with open(fifo, "w"):
                pass
        reader.join(10)
    assert out.returncode == 0, out.stderr
    events = json.loads(got[0])["traceEvents"]
    assert {e["name"] for e in events} >= {"forward", "backward", "step"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_to_stdout_with_plot_trace_ends_and_plots(tmp_path):
    png = tmp_path / "trace.png"
    out = _manualdp("train", *TINY, "--trace", "/dev/stdout", "--plot-trace", str(png), timeout=60)
    assert out.returncode == 0, out.stderr
    trace = json.JSONDecoder().raw_decode(out.stdout[out.stdout.index('{\n  "traceEvents"'):])[0]
    assert any(e["name"] == "backward" for e in trace["traceEvents"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("first, second, how", [
    ("--json", "--trace", "same"), ("--plot", "--plot-trace", "same"), ("--json", "--trace", "relative"),
    ("--trace", "--json", "symlink"), ("--json", "--checkpoint-dir", "same"),
])
def test_outputs_naming_one_file_are_refused_before_training(tmp_path, monkeypatch, capsys, first, second, how):
    monkeypatch.chdir(tmp_path)
    name = "out.png"
    os.mkdir("sub")
    other = {"same": name, "relative": os.path.join("sub", "..", name), "symlink": "link.png"}[how]
    if how == "symlink":
        os.symlink(os.path.join(str(tmp_path), name), other)
    argv = ["train", first, name, second, other] + (["--trace", "t.json"] if second == "--plot-trace" else [])
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and first in err and second in err and "same file" in err
    assert not os.path.exists(name)  # refused before anything was written


def test_distinct_outputs_and_dev_null_twice_are_accepted(tmp_path):
    from manualdp.runners.cli import build_parser, check_train_args

    distinct = build_parser().parse_args(
        ["train", "--json", str(tmp_path / "a.json"), "--trace", str(tmp_path / "b.json")])
    assert check_train_args(distinct) is None
    null = build_parser().parse_args(["train", "--json", os.devnull, "--trace", os.devnull])
    assert check_train_args(null) is None
