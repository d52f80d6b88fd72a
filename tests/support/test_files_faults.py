"""Outputs go to what the user named: symlinks, FIFOs, devices and /dev/stdout are not replaced."""
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from manualdp.support.files import atomic_write, write_json_atomic, writes_in_place


def test_a_symlink_gets_its_target_written_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json_atomic(link, {"a": 1})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "new.json")
    write_json_atomic(link, [1])
    assert link.is_symlink() and json.loads((tmp_path / "new.json").read_text()) == [1]


def test_a_fifo_is_written_in_place_and_its_reader_gets_everything(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    write_json_atomic(fifo, {"x": [1, 2]})
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert json.loads(got[0]) == {"x": [1, 2]}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]


def test_dev_null_stays_a_character_device(tmp_path):
    # A private null device where we may make one: a failing test must not break the machine's /dev/null.
    null = tmp_path / "null"
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        null = "/dev/null"
    write_json_atomic(null, {"x": 1})
    with atomic_write(null) as f:
        f.write(b"bytes")
    assert stat.S_ISCHR(os.stat(null).st_mode)


@pytest.mark.parametrize("redirect", ["pipe", "file"])
def test_stdout_prints_and_is_not_replaced(tmp_path, redirect):
    # A private link shaped like /dev/stdout: a failing test must not replace the machine's.
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    code = ("import sys; from manualdp.support.files import write_json_atomic; print('before', flush=True); "
            "write_json_atomic(sys.argv[1], {'x': 1}); print('after')")
    if redirect == "pipe":
        out = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True, text=True, timeout=60).stdout
    else:
        with open(tmp_path / "out.txt", "w") as f:
            subprocess.run([sys.executable, "-c", code, str(link)], stdout=f, timeout=60, check=True)
        out = (tmp_path / "out.txt").read_text()
    assert out.startswith("before\n") and out.rstrip().endswith("after")
    assert json.loads(out[len("before\n"):out.rindex("after")]) == {"x": 1}
    assert link.is_symlink() and writes_in_place("/dev/stdout") and writes_in_place("/dev/stderr")


def test_json_is_standard_nan_and_inf_are_null(tmp_path):
    write_json_atomic(tmp_path / "h.json", {"loss": [1.0, float("nan"), float("inf")]})
    text = (tmp_path / "h.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"loss": [1.0, None, None]}


@pytest.mark.parametrize("bad", ["", "dir"])
def test_empty_path_or_a_directory_is_refused_and_nothing_is_written(tmp_path, bad):
    target = tmp_path if bad == "dir" else ""
    with pytest.raises((ValueError, IsADirectoryError)):
        write_json_atomic(target, {})
    assert os.listdir(tmp_path) == []
