"""`manualdp check`'s walls judge what an answer did, not how it named it: a path relative to a folder's descriptor
(`dir_fd=`, as shutil.rmtree's) is read against that folder, so a right answer that removes a tree of its own from
another working folder passes, and a careless one that removes a folder beside its own still fails naming it. A
write outside that only the kernel's walls saw (torch.save, ctypes, a program) is named in the verdict too."""
import errno
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from manualdp.runners.cli import main
from manualdp.runners.grader import sandbox, walls
from manualdp.runners.grader.properties.ddp import ddp_job
from manualdp.runners.grader.tried import outside

from .test_check_ddp_frozen import one_rank  # noqa: F401 (a fixture: one gloo rank in this process)
from .test_sandbox_fs import machine_has

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


@pytest.mark.parametrize("answer, written", [("torch_save", "cache.pt"), ("ctypes", "log.txt"),
                                             ("program", "stamp")])
def test_a_write_outside_that_only_the_kernel_refused_is_named_in_the_verdict(answer, written, graded):
    if not (sandbox.namespaces() or machine_has("landlock")):
        pytest.fail("this machine has neither user namespaces nor Landlock: run it where it has one")
    folder, check = graded
    status, out = check(ANSWERS / f"allreduce_{answer}_outside.py")
    named = rf"it tried to write (or read )?{re.escape(str(folder / written))}, outside its own folder"
    assert status == 1 and re.search(named, out), out
    assert not (folder / written).exists()


def test_only_a_refused_path_outside_the_folders_is_named_and_an_error_raised_from_one_counts(tmp_path):
    mine = str(tmp_path / "mine")
    refused = OSError(errno.EROFS, "Read-only file system", "/srv/x")
    try:
        try:
            raise refused
        except OSError as e:
            raise RuntimeError("the cache failed") from e
    except RuntimeError as e:
        wrapped = e
    assert outside(wrapped, [mine]) == ("write", "/srv/x")
    assert outside(OSError(errno.EACCES, "Permission denied", "/srv/x"), [mine]) == ("write or read", "/srv/x")
    assert outside(OSError(errno.EACCES, "Permission denied", f"{mine}/x"), [mine]) is None  # its own: not the walls
    assert outside(OSError(errno.ENOENT, "No such file or directory", "/srv/x"), [mine]) is None
    assert outside(RuntimeError("shape mismatch"), [mine]) is None
    said = b"cp: cannot create regular file '/srv/y': Permission denied"
    told = subprocess.CalledProcessError(1, ["cp"], stderr=said)
    assert outside(told, [mine]) == ("write or read", "/srv/y")
    assert outside(subprocess.CalledProcessError(1, ["cp"]), [mine], "touch: cannot touch '/srv/z': Read-only file "
                   "system\n") == ("write", "/srv/z")


RANK_WRITES_OUTSIDE = """
import errno, os


class DDP:  # as the kernel's walls answer a rank's write outside its folder (torch.save, ctypes)
    def __init__(self, module):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/srv/weights.pt")
"""


def test_a_rank_that_tried_to_write_outside_its_folder_is_told_so(one_rank, tmp_path):
    answer = tmp_path / "ddp_writes_outside.py"
    answer.write_text(RANK_WRITES_OUTSIDE)
    error = ddp_job(str(answer), steps=1)["error"]
    assert error.startswith("rank 0: it tried to write /srv/weights.pt, outside its own folder"), error
