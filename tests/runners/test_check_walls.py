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


def refused_by_the_hook(mine: pathlib.Path, other: pathlib.Path, body: str, tries: str) -> list:
    """What the audit hook refused (`Walls.refused`) in a Python that may write `mine` and read `other` (not write
    there), ran `body`, then each of the calls `tries` (a tuple of lambdas), their errors caught."""
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(walls.__file__)!r})
        import ctypes, os, shutil, socket, stat, walls
        w = walls.Walls([{str(mine)!r}], [{str(other)!r}])
        w.audit(programs=True)
        mine_fd, other_fd = os.open({str(mine)!r}, os.O_RDONLY), os.open({str(other)!r}, os.O_RDONLY)
    """) + textwrap.dedent(body) + textwrap.dedent(f"""
        for op in {tries}:
            try:
                op()
            except OSError:
                pass
        print(w.refused)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    return eval(done.stdout)


def test_the_audit_hook_reads_a_path_relative_to_a_descriptor_against_its_folder(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    (mine / "tree" / "deep").mkdir(parents=True)
    (mine / "tree" / "deep" / "f").write_text("x")
    other.mkdir()
    (other / "keep").write_text("keep")
    body = f"""
        os.chdir("/")  # where the names below, read against the working folder, are other paths
        shutil.rmtree({str(mine / 'tree')!r})  # opens, lists and deletes relative to each folder's descriptor
        os.mkdir("made", dir_fd=mine_fd)
        os.rename("made", "moved", src_dir_fd=mine_fd, dst_dir_fd=mine_fd)
    """
    tries = ('(lambda: os.remove("keep", dir_fd=other_fd), lambda: os.mkdir("d", dir_fd=other_fd), '
             'lambda: os.rename("moved", "moved", src_dir_fd=mine_fd, dst_dir_fd=other_fd))')
    assert refused_by_the_hook(mine, other, body, tries) == [
        ("delete", f"{other}/keep"), ("make the folder", f"{other}/d"), ("rename", f"{other}/moved")]
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


@pytest.mark.parametrize("answer, named", [
    ("allreduce_utimes_ctypes", "it tried to call libc's utimes through ctypes, whose calls the grader cannot judge: "
                                "an answer may write only in its own folder"),
    ("allreduce_unix_socket_outside", "it tried to bind a socket at {folder}/sock, outside its own folder"),
    ("allreduce_mkfifo_outside", "it tried to make a FIFO at {folder}/fifo, outside its own folder")])
def test_an_attempt_outside_that_the_answer_caught_or_ignored_is_named(answer, named, graded):
    folder, check = graded
    (folder / "victim.txt").write_text("keep")
    os.utime(folder / "victim.txt", (0, 0))
    status, out = check(ANSWERS / f"{answer}.py")
    assert status == 1 and named.format(folder=folder) in out, out
    assert sorted(os.listdir(folder)) == ["victim.txt"] and os.stat(folder / "victim.txt").st_mtime == 0


def test_the_audit_hook_names_binds_fifos_nodes_and_libc_lookups_outside_and_allows_its_own(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    body = f"""
        os.chdir({str(mine)!r})
        libc = ctypes.CDLL(None, use_errno=True)
        libc.open, libc.close, libc.getpid  # no path changed by these alone: the kernel's walls judge their calls
        os.mkfifo("fifo")
        os.mknod("node", stat.S_IFREG | 0o600)
        socket.socket(socket.AF_UNIX).bind("sock")
        socket.socket(socket.AF_UNIX).bind("\\0manualdp-abstract-probe")  # an abstract socket: no file anywhere
    """
    tries = (f'(lambda: os.mkfifo({str(other / "fifo")!r}), lambda: os.mkfifo("f", dir_fd=other_fd), '
             f'lambda: os.mknod({str(other / "node")!r}), '
             f'lambda: socket.socket(socket.AF_UNIX).bind({str(other / "sock")!r}), lambda: libc.utimes, '
             'lambda: ctypes.CDLL("libc.so.6")["chmod"])')
    judged = "whose calls the grader cannot judge"
    assert refused_by_the_hook(mine, other, body, tries) == [
        ("make a FIFO at", f"{other}/fifo"), ("make a FIFO at", f"{other}/f"), ("make a node at", f"{other}/node"),
        ("bind a socket at", f"{other}/sock"), (f"call libc's utimes through ctypes, {judged}", ""),
        (f"call libc's chmod through ctypes, {judged}", "")]
    assert sorted(os.listdir(mine)) == ["fifo", "node", "sock"] and os.listdir(other) == []
