import json
import os
import stat

import pytest

from manualdp.support.files import atomic_write, write_json_atomic


def test_written_file_gets_the_mode_a_plain_open_gives(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    with open(tmp_path / "b.json", "w") as f:
        f.write("{}")
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == stat.S_IMODE(os.stat(tmp_path / "b.json").st_mode)
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_a_failure_inside_the_block_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["t.bin"]


@pytest.mark.parametrize("path, mode, error", [(3, "wb", TypeError), ("x", "a", ValueError)])
def test_bad_arguments(path, mode, error, tmp_path):
    with pytest.raises(error):
        with atomic_write(path, mode):
            pass
