"""The README's commands run as written (with flags that make them quick), and ARCHITECTURE.md names every file.

Every shell command in a ```bash block of README.md must have an entry in FAST: how the test
runs it quickly and what its output must say. A command without one fails, so keep the
README's commands few.
"""
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL = 'python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" -e ".[test]" && manualdp train'
SMALL = "--epochs 1 --num-train 256 --num-test 64 --batch-size 32 --no-progress"

# README command -> (what the test runs, in the repository root; a line its output must hold; seconds)
FAST = {
    INSTALL: (f"manualdp train {SMALL}", "on 2 simulated CPU devices", 300),  # and test_the_install_*
    "python -m pytest -q": ("python -m pytest -q --collect-only", " tests collected", 300),
    "manualdp train --help": ("manualdp train --help", "usage: manualdp train", 60),
    "torchrun --standalone --nproc-per-node 2 -m manualdp train --model lenet":
        (f"torchrun --standalone --nproc-per-node 2 -m manualdp train --model lenet {SMALL}", "on 2 processes", 300),
    "python bench/compare_ddp.py --model lenet":
        ("python bench/compare_ddp.py --model lenet --rounds 2 --steps 1 --warmup 1 --batch-size 16",
         "ratio manualdp/DDP (samples/s)", 300),
    "python bench/scaling.py":
        ("python bench/scaling.py --models mlp --world-sizes 1 2 --rounds 2 --steps 1 --warmup 1 --batch-size 16 "
         "--no-progress", "ratio: manualdp/DDP samples/s", 300),
    "python bench/allreduce.py --spmd":
        ("python bench/allreduce.py --spmd --min-bytes 4096 --max-bytes 4096 --iters 2 --warmup 1",
         "gloo all_reduce", 300),
    "head -c 32 /dev/urandom | base64 > run.token":
        ("cd $TMP && head -c 32 /dev/urandom | base64 > run.token && wc -l run.token", "1 run.token", 30),
    # the coordinator serves until Ctrl-C: a free port, then SIGINT after a few seconds
    "manualdp coordinator --port 29510 --token-file run.token":
        ("cd $TMP && head -c 32 /dev/urandom | base64 > run.token && "
         "timeout -s INT 15 manualdp coordinator --port 0 --token-file run.token; true",
         "coordinator listening on 127.0.0.1:", 60),
    # one replica alone (--min-replicas 1) on a coordinator started here, with a secret and a checkpoint folder
    "manualdp train --fault-tolerant 127.0.0.1:29510 --token-file run.token --replica-id a --checkpoint-dir ckpt":
        ("cd $TMP && head -c 32 /dev/urandom | base64 > run.token && "
         "PORT=$(python -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); "
         "print(s.getsockname()[1])') "
         "&& { manualdp coordinator --port $PORT --token-file run.token > coordinator.log 2>&1 & C=$!; } && sleep 3 && "
         f"manualdp train --fault-tolerant 127.0.0.1:$PORT --token-file run.token --replica-id a --checkpoint-dir ckpt "
         f"--min-replicas 1 {SMALL}; rc=$?; kill $C; ls ckpt/a; exit $rc", "steps.jsonl", 300),
    # without CUDA it says so and exits 0; on a GPU machine the test hides the GPUs (the full run takes long)
    "bash bench/gpu.sh": ("CUDA_VISIBLE_DEVICES= OUT=$TMP/gpu bash bench/gpu.sh", "no CUDA device here", 120),
}


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """The shell commands of the ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()))
    return out


def run(command: str, tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    """`command` in bash, in the repository root, with this interpreter's environment first on PATH."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               TMP=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started: torchrun and its ranks too
        out, _ = proc.communicate()
        pytest.fail(f"`{command}` took more than {timeout} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out)


def test_the_parser_finds_commands_and_drops_comments():
    text = "x\n```bash\npython a.py --x   # why\n# alone\nfoo \\\n    --bar\n```\n```text\nnot me\n```\n"
    assert commands(text) == ["python a.py --x", "foo --bar"]


def test_the_readme_has_the_two_commands_first():
    found = commands(README.read_text())
    assert found[:2] == [INSTALL, "python -m pytest -q"], found[:2]


@pytest.mark.parametrize("command", commands(README.read_text()), ids=lambda c: c[:50])
def test_every_readme_command_runs(command, tmp_path):
    assert command in FAST, (f"README.md has a command that tests/test_readme.py does not run: {command!r}; "
                             "add a quick variant to FAST, or take the command out of the README")
    quick, expected, timeout = FAST[command]
    result = run(quick, tmp_path, timeout)
    assert result.returncode == 0, f"`{quick}` exited {result.returncode}:\n{result.stdout[-3000:]}"
    assert expected in result.stdout, f"`{quick}` did not print {expected!r}:\n{result.stdout[-3000:]}"


def test_every_quick_variant_is_of_a_readme_command():
    stale = sorted(set(FAST) - set(commands(README.read_text())))
    assert not stale, f"FAST runs commands that README.md no longer has: {stale}"


def test_the_install_and_test_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    venv, activate, pip, train = INSTALL.split(" && ")
    assert venv.startswith("python3 -m venv ") and "python3 -m venv" in ci
    assert activate.startswith(". ") and activate.endswith("/bin/activate")
    assert re.search(r"^\. \S+/bin/activate$", ci, re.M)
    installed = [word for line in ci.splitlines() if "pip install" in line for word in shlex.split(line)]
    for requirement in shlex.split(pip)[2:]:
        assert requirement in installed, f"README installs {requirement!r}; .ci/run does not"
    assert ci.strip().splitlines()[-2:] == ["python -m pytest -q", "bash bench/soak_tests.sh"]
    assert train == "manualdp train"


def test_the_install_command_resolves_in_a_fresh_environment(tmp_path):
    """The README's install, into a new virtual environment, as far as pip's dry run (no GBs copied)."""
    venv, activate, pip, _ = INSTALL.split(" && ")
    env_dir = tmp_path / "venv"
    quick = " && ".join([venv.replace(".venv", str(env_dir)), activate.replace(".venv", str(env_dir)),
                         pip.replace("pip install", "pip install --dry-run")])
    result = run(quick, tmp_path, 600)
    assert result.returncode == 0, result.stdout[-3000:]
    would = re.search(r"^Would install (.*)$", result.stdout, re.M)
    assert would, result.stdout[-3000:]
    assert "manualdp-0.1.0" in would.group(1).split() and re.search(r"\btorch-2\.13\.0\b", would.group(1))


def test_the_swap_in_the_readme_is_one_import():
    from manualdp.spmd.ddp.wrapper import DistributedDataParallel as ours

    (block,) = [b for b in blocks(README.read_text(), "python") if "DistributedDataParallel" in b]
    namespace = {}
    exec("\n".join(line for line in block.splitlines() if line.startswith(("from ", "import "))), namespace)
    assert namespace["DistributedDataParallel"] is ours
    call = re.search(r"^model = DistributedDataParallel\((.*)\)$", block, re.M).group(1)
    kwargs = eval(f"dict({call.split(', ', 1)[1]})")
    inspect.signature(ours).bind(object(), **kwargs)  # the README's arguments are the wrapper's
    import torch
    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)
    mine = list(inspect.signature(ours).parameters)
    assert mine[:12] == theirs[:12], "torch's positional arguments, in torch's order"


# ---------------------------------------------------------------- ARCHITECTURE.md's map, and the pages' links

PACKAGE = ROOT / "manualdp"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"


def named_files(text: str) -> set[str]:
    return set(re.findall(r"`([\w/.]+\.py)`", text))


def test_architecture_names_every_file_of_the_package():
    named = named_files(ARCHITECTURE.read_text())
    files = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    missing = [f for f in files if f not in named]
    assert not missing, f"ARCHITECTURE.md does not name these files of manualdp/: {missing}"


def test_every_file_architecture_names_exists():
    everything = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    for name in sorted(named_files(ARCHITECTURE.read_text())):
        found = (PACKAGE / name).exists() or (ROOT / name).exists() or any(f.endswith("/" + name) for f in everything)
        assert found, f"ARCHITECTURE.md names {name}, which does not exist"


@pytest.mark.parametrize("page", ["README.md", "ARCHITECTURE.md", "bench/README.md"])
def test_the_links_of_a_page_lead_somewhere(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (path.parent / target).exists(), f"{page} links to {target}, which does not exist"


# ---------------------------------------------------------------- bench/'s tests, and what CI runs

def test_bench_readme_names_every_test_file_of_bench_and_the_soak_runs_each_but_the_gpus():
    tests = sorted(p.name for p in (ROOT / "bench").glob("test_*.py"))
    text = (ROOT / "bench" / "README.md").read_text()
    part = text[text.index("## Which files are tests"):]
    part = part[:part.index("\n## ")]
    assert sorted(re.findall(r"^\| `(test_\w+\.py)` \|", part, re.M)) == tests, (
        "bench/README.md's table of test files and bench/test_*.py differ")
    soak = (ROOT / "bench" / "soak_tests.sh").read_text()
    run = set(re.findall(r"bench/(test_\w+\.py)", soak))
    assert run == set(tests) - {"test_gpu.py"}, "bench/soak_tests.sh must run every test file of bench/ but test_gpu.py"
    assert re.search(r"^python -m pytest -q -m soak tests/", soak, re.M), (
        "the soak runs the soak-marked tests of tests/")
