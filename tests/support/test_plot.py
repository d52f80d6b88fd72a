"""plot_history: a valid PNG, written atomically; bad input leaves nothing behind."""
import os
import struct

import pytest
from matplotlib.figure import Figure

from manualdp.support.plot import plot_history
from manualdp import History

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def history(n=3):
    return History(train_loss=[2.0 / (i + 1) for i in range(n)], train_acc=[0.3 + 0.2 * i for i in range(n)],
                   test_acc=[0.25 + 0.2 * i for i in range(n)])


def png_size(path):
    raw = open(path, "rb").read()
    assert raw[:8] == PNG_MAGIC and raw[12:16] == b"IHDR" and raw.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", raw[16:24])


@pytest.mark.parametrize("n", [1, 4])
def test_writes_a_png(tmp_path, n):
    path = tmp_path / "curves.png"
    plot_history(history(n), path)
    width, height = png_size(path)
    assert width > height > 100  # two panels side by side
    assert os.listdir(tmp_path) == ["curves.png"]


def test_replaces_existing_file_and_accepts_json_dict(tmp_path):
    path = tmp_path / "h.png"
    path.write_bytes(b"old")
    h = history()
    h.to_json(str(tmp_path / "h.json"))
    plot_history(History.from_json(str(tmp_path / "h.json")).__dict__, str(path))
    png_size(path)
    assert sorted(os.listdir(tmp_path)) == ["h.json", "h.png"]


def test_history_plot_method(tmp_path):
    history().plot(str(tmp_path / "m.png"))
    png_size(tmp_path / "m.png")


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "h.png"
    path.write_bytes(b"old")

    def broken(self, f, **kwargs):
        f.write(PNG_MAGIC + b"half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot_history(history(), path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["h.png"]


@pytest.mark.parametrize("make_path,error,message", [
    (lambda d: d / "missing" / "h.png", ValueError, "does not exist"),
    (lambda d: d / "h.pdf", ValueError, "end in .png"),
    (lambda d: d / "dir.png", ValueError, "is a directory"),
    (lambda d: "", TypeError, "path"),
    (lambda d: 3, TypeError, "path"),
])
def test_bad_path(tmp_path, make_path, error, message):
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(error, match=message):
        plot_history(history(), make_path(tmp_path))
    assert os.listdir(tmp_path) == ["dir.png"]


@pytest.mark.parametrize("bad,error,message", [
    (History(), ValueError, "non-zero number of epochs"),
    (History(train_loss=[1.0, 0.5], train_acc=[0.5], test_acc=[0.5]), ValueError, "same"),
    ({"train_loss": [1.0], "train_acc": [0.5]}, TypeError, "test_acc"),
    (History(train_loss=[1.0], train_acc=["0.5"], test_acc=[0.5]), TypeError, "train_acc"),
    (object(), TypeError, "train_loss"),
])
def test_bad_history(tmp_path, bad, error, message):
    with pytest.raises(error, match=message):
        plot_history(bad, tmp_path / "h.png")
    assert os.listdir(tmp_path) == []
