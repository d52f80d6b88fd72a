"""`manualdp coordinator`'s first line: the replica command it prints works as printed, with its `--token-file`."""
import os
import pathlib
import shlex
import signal
import subprocess
import sys

from manualdp.runners.cli import build_parser
from manualdp.runners.ft_train import replica_command
from manualdp.spmd.ft.coordinator import connect, load_token

ROOT = pathlib.Path(__file__).resolve().parents[3]
SECRET = "a-secret-of-the-run-" + "x" * 24


def printed_args(line: str, cwd: pathlib.Path):
    """The printed replica command's arguments as `manualdp` parses them (NAME given), read from `cwd`."""
    command = shlex.split(line.split("replicas: ", 1)[1].replace("NAME", "a"))
    assert command[0] == "manualdp", line
    here = os.getcwd()
    os.chdir(cwd)  # the user copies the line into another shell, perhaps in another folder
    try:
        args = build_parser().parse_args(command[1:])
        return args, load_token(args.token_file)
    finally:
        os.chdir(here)


def test_the_coordinators_first_line_names_the_token_file_and_works_as_printed(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "my token").write_text(SECRET + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MANUALDP_FT_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "manualdp", "coordinator", "--port", "0", "--token-file",
                             "my token"], cwd=tmp_path / "run", env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        args, token = printed_args(line, tmp_path)
        assert token == SECRET, line
        host, port = args.fault_tolerant
        store = connect(host, port, 10, token)  # the coordinator takes the replica the line starts
        store.set("hello", b"1")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_without_a_token_file_the_line_has_none():
    assert replica_command("127.0.0.1", 29510) == "manualdp train --fault-tolerant 127.0.0.1:29510 --replica-id NAME"
    assert replica_command("h", 1, "/a b/t").endswith("--replica-id NAME --token-file '/a b/t'")
