"""`manualdp check`'s walls judge what an answer did, not how it named it: a path relative to a folder's descriptor
(`dir_fd=`, as shutil.rmtree's) is read against that folder, so a right answer that removes a tree of its own from
another working folder passes, and a careless one that removes a folder beside its own still fails naming it."""
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest

from manualdp.runners.cli import main
from manualdp.runners.grader import sandbox, walls

ANSWERS = pathlib.Path(__file__).resolve().parents[1] / "answers"


@pytest.fixture
def graded(monkeypatch, capsys):
    """A `manualdp check allreduce` in a short temporary folder of its own: (folder, check(answer) -> status, text)."""
    with tempfile.TemporaryDirectory(prefix="walls-") as tmp:  # short, unlike pytest's: `sandbox.SOCKETS`
        monkeypatch.setattr(sandbox.tempfile, "tempdir", tmp)

        def check(answer: pathlib.Path) -> tuple[int, str]:
            status = main(["check", "allreduce", str(answer), "--examples", "2", "--timeout", "60", "--total", "180"])
            return status, " ".join(capsys.readouterr().out.split())

        yield pathlib.Path(tmp), check


def test_a_right_answer_that_removes_a_tree_of_its_own_from_another_folder_passes(graded):
    folder, check = graded
    status, out = check(ANSWERS / "allreduce_chdir_rmtree_own.py")
    assert (status, out[:5]) == (0, "PASS "), out
    assert os.listdir(folder) == []  # its folder removed, nothing left


def test_a_careless_answer_that_removes_a_folder_beside_its_own_fails_naming_it(graded):
    folder, check = graded
    victim = folder / "victim"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "keep.txt").write_text("keep")
    status, out = check(ANSWERS / "allreduce_chdir_rmtree_sibling.py")
    assert status == 1 and f"it tried to delete the tree {victim}, outside its own folder" in out, out
    assert (victim / "deep" / "keep.txt").read_text() == "keep"


def test_the_audit_hook_reads_a_path_relative_to_a_descriptor_against_its_folder(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    (mine / "tree" / "deep").mkdir(parents=True)
    (mine / "tree" / "deep" / "f").write_text("x")
    other.mkdir()
    (other / "keep").write_text("keep")
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(walls.__file__)!r})
        import os, shutil, walls
        w = walls.Walls([{str(mine)!r}], [{str(other)!r}])  # it may read `other`, not write there
        w.audit(programs=True)
        os.chdir("/")  # where the names below, read against the working folder, are other paths
        shutil.rmtree({str(mine / 'tree')!r})  # opens, lists and deletes relative to each folder's descriptor
        mine_fd, other_fd = os.open({str(mine)!r}, os.O_RDONLY), os.open({str(other)!r}, os.O_RDONLY)
        os.mkdir("made", dir_fd=mine_fd)
        os.rename("made", "moved", src_dir_fd=mine_fd, dst_dir_fd=mine_fd)
        for op in (lambda: os.remove("keep", dir_fd=other_fd), lambda: os.mkdir("d", dir_fd=other_fd),
                   lambda: os.rename("moved", "moved", src_dir_fd=mine_fd, dst_dir_fd=other_fd)):
            try:
                op()
            except OSError:
                pass
        print(w.refused)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert eval(done.stdout) == [("delete", f"{other}/keep"), ("make the folder", f"{other}/d"),
                                 ("rename", f"{other}/moved")]
    assert not (mine / "tree").exists() and (mine / "moved").is_dir() and (other / "keep").read_text() == "keep"
