"""The grader's walls on disk (`runners/grader/walls.py`): an answer that deletes or writes outside its folder (another
folder, $HOME, the grader's working folder, /tmp), at import or in its function, fails naming the operation and the
path, and the files outside are untouched; so with a program it runs or libc called through ctypes, which only the
kernel's walls stop. In each set of walls: a read-only mount namespace with Landlock (here), Landlock alone
(MANUALDP_NAMESPACES=0), the audit hook alone (MANUALDP_LANDLOCK=0 too). A cap on all its files together, and a
folder or a named pipe given as the answer.
"""
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from manualdp.runners.grader import check, sandbox, walls
from manualdp.runners.grader.sandbox import Child, Stopped

RIGHT = """
def allreduce(tensors):
    total = sum(t.clone() for t in tensors)
    for t in tensors:
        t.copy_(total)
"""
WALLS = {  # MANUALDP_NAMESPACES, MANUALDP_LANDLOCK, and the walls then named where the machine has them all
    "namespaces": ("1", "1", "a read-only mount namespace, Landlock, an audit hook"),
    "landlock": ("0", "1", "Landlock, an audit hook"),
    "audit": ("0", "0", "an audit hook"),
}
HARM = """
import os, shutil
for harm in ({victim!r}, {home!r}, {cwd!r}, {tmp!r}):
    try:
        if harm.endswith("victim.txt"):
            os.remove(harm)
        else:
            with open(harm, "w") as f:
                f.write("written by the answer")
    except OSError:  # caught: the grader must fail it all the same
        pass
try:
    shutil.rmtree({other!r})
except OSError:
    pass
"""


def machine_has(mode: str) -> bool:
    """Whether this machine holds every wall of `mode`: user namespaces and Landlock (its ABI)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.syscall.restype = ctypes.c_long
    landlock = libc.syscall(walls.SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1
    return {"namespaces": sandbox.namespaces() and landlock, "landlock": landlock, "audit": True}[mode]


@pytest.fixture
def places(tmp_path):
    """A victim in another folder, a $HOME, the grader's working folder, and a name in /tmp: (paths, env)."""
    other, home, cwd = tmp_path / "other", tmp_path / "home", tmp_path / "cwd"
    for folder in (other, home, cwd):
        folder.mkdir()
    (other / "victim.txt").write_text("keep")
    stamp = f"manualdp-harm-{os.getpid()}-{time.monotonic_ns()}"
    paths = {"other": str(other), "victim": str(other / "victim.txt"), "home": str(home / ".bashrc"),
             "cwd": str(cwd / "planted.py"), "tmp": f"/tmp/{stamp}"}
    yield paths
    pathlib.Path(paths["tmp"]).unlink(missing_ok=True)


def run_check(tmp_path: pathlib.Path, source: str, mode: str, home: str, cwd: str, **env: str) -> tuple[int, str]:
    """`manualdp check allreduce` of `source` in `mode`'s walls: (exit status, output as one line)."""
    path = tmp_path / "answer.py"
    path.write_text(source)
    names, landlock, _ = WALLS[mode]
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:  # short, unlike pytest's: `sandbox.SOCKETS`
        done = subprocess.run([sys.executable, "-m", "manualdp", "check", "allreduce", str(path), "--examples", "2",
                               "--timeout", "30", "--total", "120"], capture_output=True, text=True, cwd=cwd,
                              timeout=300, env=dict(os.environ, TMPDIR=tmp, HOME=home, MANUALDP_NAMESPACES=names,
                                                    MANUALDP_LANDLOCK=landlock, **env))
        assert os.listdir(tmp) == [], done  # its folder is removed
    return done.returncode, " ".join(done.stdout.split())


def untouched(paths: dict) -> None:
    assert pathlib.Path(paths["victim"]).read_text() == "keep"
    for name in ("home", "cwd", "tmp"):
        assert not os.path.exists(paths[name]), name


def judged(tmp_path, places, mode: str, source: str, first: str) -> None:
    """`source` fails, naming `first` (operation and path) and `mode`'s walls, and leaves every place untouched."""
    code, out = run_check(tmp_path, source, mode, os.path.dirname(places["home"]), os.path.dirname(places["cwd"]))
    assert code == 1 and out.startswith("FAIL allreduce") and f"it tried to {first}, outside its own folder" in out
    if machine_has(mode):
        assert out.endswith(f"(refused by the grader's walls: {WALLS[mode][2]})"), out
    untouched(places)


def test_an_answer_that_deletes_and_writes_outside_at_import_fails_naming_it(tmp_path, places):
    judged(tmp_path, places, "namespaces", HARM.format(**places) + RIGHT, f"delete {places['victim']}")


@pytest.mark.soak
@pytest.mark.parametrize("mode", ["landlock", "audit"])
def test_the_fallback_walls_fail_it_too(mode, tmp_path, places):
    judged(tmp_path, places, mode, HARM.format(**places) + RIGHT, f"delete {places['victim']}")


def test_an_answer_that_writes_into_home_in_its_function_fails_naming_it(tmp_path, places):
    source = RIGHT + f"    open({places['home']!r}, 'a').write('x')\n"
    judged(tmp_path, places, "namespaces", source, f"write {places['home']}")


BYPASS = """
import ctypes, os
libc = ctypes.CDLL(None)
fd = libc.open({home!r}.encode(), os.O_WRONLY | os.O_CREAT, 0o644)  # no audit event: only the kernel's walls stop
os.system("rm -f {victim} ; touch {cwd} {tmp}")                       # these two, and the answer ignores it
libc.unlink({victim!r}.encode())  # a lookup of a path-changing libc function: the audit hook names it
"""


@pytest.mark.soak
@pytest.mark.parametrize("mode", ["namespaces", "landlock"])
def test_ctypes_and_programs_cannot_touch_files_outside_behind_the_kernels_walls(mode, tmp_path, places):
    if not machine_has(mode):
        pytest.fail(f"this machine lacks the walls of {mode}: run it where it has them")
    code, out = run_check(tmp_path, BYPASS.format(**places) + RIGHT, mode, os.path.dirname(places["home"]),
                          os.path.dirname(places["cwd"]))
    untouched(places)  # the kernel's walls stopped the open and the program
    assert code == 1 and out.startswith("FAIL allreduce") and "it tried to call libc's unlink through ctypes" in out


@pytest.mark.soak
def test_the_audit_hook_alone_refuses_running_a_program(tmp_path, places):
    source = f"import os\nos.system('rm -f {places['victim']}')\n" + RIGHT
    judged(tmp_path, places, "audit", source, "run rm -f " + places["victim"])


# ------------------------------------------------------------ what it may keep on disk

MANY = """
import os


def allreduce(tensors, forever=False):
    for i in range(100_000 if forever else 12):  # each file far under the cap on one file
        with open(f"part{i}.bin", "wb") as f:
            f.write(os.urandom(1 << 20))
"""


@pytest.mark.parametrize("forever", [False, True], ids=["in-one-call", "while-it-runs"])
def test_many_files_each_under_the_per_file_cap_fail_naming_the_total_cap(forever, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "DISK_BYTES", 8 << 20)
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:
        monkeypatch.setattr(sandbox.tempfile, "tempdir", tmp)
        path = tmp_path / "many.py"
        path.write_text(MANY)
        with Child(str(path), "allreduce", 60, time.monotonic() + 120, 2048) as child:
            assert child.start()["ok"]
            folder = child.folder
            with pytest.raises(Stopped, match=r"more than the grader allows on disk: 8 MiB and 10,000 files in all"):
                child.call([], forever)
            assert not os.path.exists(folder)  # removed at once
        assert os.listdir(tmp) == []


def test_usage_counts_every_file_below_and_stops_counting_past_the_most(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for i, folder in enumerate([tmp_path, tmp_path / "a", tmp_path / "a" / "b"]):
        (folder / f"f{i}").write_bytes(b"x" * 5000)
    os.sync()
    used, files = sandbox.usage([str(tmp_path)], 100)
    assert files == 5 and used >= 3 * 5000
    assert sandbox.usage([str(tmp_path)], 1)[1] <= 5


# ------------------------------------------------------------ what is given as the answer

def test_a_folder_or_a_named_pipe_given_as_the_answer_is_told_in_one_line(tmp_path, capsys):
    folder, pipe = tmp_path / "answer_dir", tmp_path / "pipe.py"
    folder.mkdir()
    os.mkfifo(pipe)
    told = {}
    for name, path in (("folder", folder), ("pipe", pipe), ("missing", tmp_path / "nope.py")):
        assert check.main(["allreduce", f"{path}/" if name == "folder" else str(path)]) == 1
        told[name] = " ".join(capsys.readouterr().out.split())
    assert told["folder"] == (f"FAIL allreduce ({folder}/): {folder}/ is a folder, not a Python file: give the file "
                              "that defines what the exercise asks for")
    assert told["pipe"] == f"FAIL allreduce ({pipe}): {pipe} is not a regular file (a named pipe): give a Python file"
    assert told["missing"].endswith("nope.py: no such file")


def test_the_audit_hook_names_each_operation_it_refuses(tmp_path):
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(walls.__file__)!r})
        import os, shutil, walls
        w = walls.Walls([{str(tmp_path / 'mine')!r}], [])
        w.audit(programs=True)
        for op in (lambda: open({str(tmp_path / 'x')!r}, "w"), lambda: os.remove({str(tmp_path / 'y')!r}),
                   lambda: os.rename({str(tmp_path / 'mine' / 'a')!r}, {str(tmp_path / 'b')!r}),
                   lambda: os.mkdir({str(tmp_path / 'd')!r}), lambda: shutil.rmtree({str(tmp_path)!r}),
                   lambda: os.system("true"), lambda: open({str(tmp_path / 'mine' / 'ok')!r}, "w").close()):
            try:
                op()
            except OSError:
                pass
        print(w.refused)
    """)
    (tmp_path / "mine").mkdir()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    t = str(tmp_path)
    assert eval(done.stdout) == [("write", f"{t}/x"), ("delete", f"{t}/y"), ("rename", f"{t}/b"),
                                 ("make the folder", f"{t}/d"), ("delete the tree", t), ("run", "true")]
    assert (tmp_path / "mine" / "ok").exists()


LEAK = """
def allreduce(tensors):
    raise RuntimeError("LEAK " + open({secret!r}).read())
"""


def test_a_checkout_of_manualdp_is_listed_not_read_so_its_git_stays_out(tmp_path):
    root = os.path.dirname(os.path.realpath(os.path.join(os.path.dirname(walls.__file__), "..", "..")))
    secret = os.path.join(root, ".git", "config") if os.path.isdir(os.path.join(root, ".git")) else os.path.join(
        root, "pyproject.toml")
    assert os.path.isfile(secret)
    # the checkout on PYTHONPATH, as in a clone: its root must not become readable for it
    code, out = run_check(tmp_path, LEAK.format(secret=secret), "namespaces", str(tmp_path), str(tmp_path),
                          PYTHONPATH=root)
    assert code == 1 and f"it tried to read {secret}, outside its own folder" in out and "LEAK" not in out, out


def test_the_audit_hook_alone_resolves_a_link_in_the_answers_folder_before_it_judges(tmp_path, tmp_path_factory):
    secret = tmp_path_factory.mktemp("secret") / "shadow"
    secret.write_text("the secret")
    (tmp_path / "shadow_link").symlink_to(secret)
    code, out = run_check(tmp_path, LEAK.format(secret=str(tmp_path / "shadow_link")), "audit", str(tmp_path),
                          str(tmp_path))
    assert code == 1 and f"it tried to read {secret}, outside its own folder" in out and "LEAK" not in out, out
