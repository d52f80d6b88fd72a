"""The fault table: kill, stop, damage and special-path cases, each classified.

Then last round's features (bench/faults_features.py): ZeRO resume, a changed optimizer, a
hostile tuner cache, traces to a FIFO, the checkpoint lock under another name, SyncBatchNorm
far from zero.

    python bench/faults.py                 # every case (a few minutes)
    python bench/faults.py --quick         # the in-process cases only (seconds): what the tests run
    python bench/faults.py --check-cost    # what the always-on rank checks cost per LeNet step
    python bench/faults.py --check-cost --model mlp --world-size 4

Each case returns what happened: `handled` (refused in one line, or resumed exactly),
`silent` (a wrong result with no error), `crash` (a traceback or an abort), `hang` (no end
within its limit) or `lost` (data destroyed: a device replaced, a checkpoint gone).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import check_output_paths, save_outputs
from bench.faults_features import FEATURE_CASES

__all__ = ["main", "run_cases", "CASES", "OUTCOMES"]

OUTCOMES = ("handled", "silent", "crash", "hang", "lost")
SMALL = ["--no-progress", "--num-train", "512", "--num-test", "128", "--batch-size", "64"]


# ---------------------------------------------------------------- special paths

def _special(kind: str, tmp: str) -> str:
    from manualdp.support.files import write_json_atomic
    if kind == "symlink":
        target, link = os.path.join(tmp, "t.json"), os.path.join(tmp, "l.json")
        open(target, "w").close()
        os.symlink(target, link)
        write_json_atomic(link, {"a": 1})
        ok = os.path.islink(link) and json.load(open(target)) == {"a": 1}
        return "handled" if ok else "lost"
    if kind == "fifo":
        fifo = os.path.join(tmp, "p")
        os.mkfifo(fifo)
        got: list = []
        reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
        reader.start()
        write_json_atomic(fifo, {"a": 1})
        reader.join(10)
        if reader.is_alive():
            return "hang"
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            return "lost"
        return "handled" if got and json.loads(got[0]) == {"a": 1} else "silent"
    if kind == "char-device":
        null = os.path.join(tmp, "null")  # a private /dev/null: a regression must not break the machine's
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        write_json_atomic(null, {"a": 1})
        return "handled" if stat.S_ISCHR(os.stat(null).st_mode) else "lost"
    if kind in ("stdout-pipe", "stdout-file"):
        link = os.path.join(tmp, "stdout")
        os.symlink("/proc/self/fd/1", link)
        code = (f"from manualdp.support.files import write_json_atomic; print('x', flush=True); "
                f"write_json_atomic({link!r}, [1]); print('y')")
        if kind == "stdout-pipe":
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        else:
            with open(os.path.join(tmp, "o"), "w") as f:
                subprocess.run([sys.executable, "-c", code], stdout=f, timeout=60)
            out = open(os.path.join(tmp, "o")).read()
        if not os.path.islink(link):
            return "lost"
        try:
            ok = out.startswith("x\n") and out.rstrip().endswith("y") and json.loads(out[2:out.rindex("y")]) == [1]
        except ValueError:
            ok = False
        return "handled" if ok else "silent"
    if kind == "empty":
        try:
            write_json_atomic("", {})
        except ValueError:
            return "handled"
        return "silent"
    raise ValueError(kind)


# ---------------------------------------------------------------- damaged and mismatched checkpoints

def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 3))


def _loader():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 5, generator=g), torch.randint(0, 3, (48,), generator=g))
    return DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))


def _train(ckpt, epochs, **kw):
    from manualdp.devices import cpu_devices
    from manualdp.runners.loop import train
    torch.manual_seed(3)
    net = _net()
    train(net, _loader(), _loader(), cpu_devices(2), epochs, kw.pop("lr", 0.1), checkpoint_dir=ckpt,
          progress=False, log=None, **kw)
    return [p.detach().clone() for p in net.parameters()]


def _damage(kind: str, tmp: str) -> str:
    from manualdp.support.checkpoint import lock_path, read_checkpoint, save_checkpoint
    ckpt = os.path.join(tmp, "ckpt")
    straight = _train(None, 3)
    _train(ckpt, 2)
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".pt"))
    newest = os.path.join(ckpt, files[-1])
    resume = {"resume": True}
    if kind == "flipped-bit":
        outer = torch.load(newest, weights_only=False)
        payload = bytearray(outer["payload"])
        payload[len(payload) // 2] ^= 0x04
        outer["payload"] = bytes(payload)
        torch.save(outer, newest)
    elif kind == "truncated":
        with open(newest, "r+b") as f:
            f.truncate(200)
    elif kind == "wrong-content":
        state = read_checkpoint(newest)
        state["model"] = nn.Linear(2, 2).state_dict()
        del state["path"]
        save_checkpoint(ckpt, 10**6, state)
    elif kind == "orphan-tmp":
        open(newest + ".x1y2.tmp", "wb").write(b"0" * 4096)
    elif kind in ("changed-lr", "changed-seed"):
        resume.update({"lr": 0.3} if kind == "changed-lr" else {"config": {"seed": 1}})
        try:
            _train(ckpt, 3, **resume)
        except ValueError as e:
            return "handled" if "configuration changed" in str(e) else "crash"
        return "silent"
    elif kind == "folder-in-use":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with open(lock_path(ckpt), "w") as f:
                json.dump({"pid": sleeper.pid, "host": os.uname().nodename}, f)
            try:
                _train(ckpt, 3, **resume)
            except ValueError as e:
                return "handled" if "in use" in str(e) else "crash"
            return "silent"
        finally:
            sleeper.kill()
            sleeper.wait()
    elif kind == "stale-lock":
        with open(lock_path(ckpt), "w") as f:
            json.dump({"pid": 2**22 + 12345, "host": os.uname().nodename}, f)
    else:
        raise ValueError(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _train(ckpt, 3, **resume)
    if kind == "orphan-tmp" and any(f.endswith(".tmp") for f in os.listdir(ckpt)):
        return "lost"  # a full checkpoint's worth of disk, never reclaimed
    return "handled" if all(torch.equal(a, b) for a, b in zip(straight, got)) else "silent"


# ---------------------------------------------------------------- bad command lines

def _cli(argv: list[str], tmp: str) -> str:
    from manualdp.runners.cli import main as cli_main
    err = io.StringIO()
    argv = [a.replace("TMP", tmp) for a in argv]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(["train", *SMALL, "--epochs", "1", *argv])
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    if code in (1, 2) and lines and "error:" in lines[-1] and "Traceback" not in err.getvalue():
        return "handled"
    return "silent" if code == 0 else "crash"


# ---------------------------------------------------------------- kill, stop

def _manualdp(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "manualdp", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _kill(sig_name: str, tmp: str) -> str:
    """Kill a single-process run after its first checkpoints, resume it, compare with a straight run."""
    ckpt, a, b = (os.path.join(tmp, n) for n in ("ckpt", "a.json", "b.json"))
    run = ["train", *SMALL, "--epochs", "2"]
    straight = _manualdp([*run, "--json", a])
    victim = _manualdp([*run, "--checkpoint-dir", ckpt, "--checkpoint-every", "2"])
    deadline = time.monotonic() + 120
    while (time.monotonic() < deadline
           and len([f for f in os.listdir(ckpt) if f.endswith(".pt")] if os.path.isdir(ckpt) else []) < 2):
        if victim.poll() is not None:
            break
        time.sleep(0.05)
    victim.send_signal(getattr(signal, sig_name))
    victim.communicate(timeout=60)
    straight.communicate(timeout=300)
    resumed = _manualdp([*run, "--checkpoint-dir", ckpt, "--resume", "--json", b])
    try:
        _, err = resumed.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        resumed.kill()
        return "hang"
    if resumed.returncode != 0:
        return "crash" if "Traceback" in err else "handled"
    x, y = (json.load(open(p)) for p in (a, b))
    return "handled" if x["train_loss"] == y["train_loss"] and x["test_acc"] == y["test_acc"] else "silent"


def _stop(tmp: str) -> str:
    """SIGSTOP one of two torchrun ranks: the other must exit with a named error within its timeout."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "-m", "manualdp", "train", *SMALL, "--epochs", "100", "--timeout", "5"]  # still training at the stop
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        time.sleep(8)  # past the rendezvous, into training
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if len(children) < 2:
            proc.kill()
            return "crash"
        os.kill(int(children[-1]), signal.SIGSTOP)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            return "hang"
        return "handled" if "no answer from rank" in err or "rank" in err and "error:" in err else "crash"
    finally:
        # The workers may sit in process groups of their own: end each one, the stopped rank too.
        for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------- fault-tolerant replicas (issue 33)

FT_CASES = {  # case -> the node of tests/spmd/ft/ that stages it with replica processes and checks every replica
    "kill -9 during forward": "test_ft_kill.py::test_a_killed_replica_costs_one_step_and_rejoins_with_the_state"
                              "[kill_forward]",
    "kill -9 during the allreduce": "test_ft_kill.py::test_a_killed_replica_costs_one_step_and_rejoins_with_"
                                    "the_state[kill_allreduce]",
    "SIGSTOP past the deadline, SIGCONT": "test_ft_stop.py::test_a_stopped_replica_is_dropped_past_the_deadline_"
                                          "and_rejoins_when_it_wakes",
    "allreduce fails on a live replica": "test_ft_stop.py::test_an_allreduce_that_fails_on_a_live_replica_is_"
                                         "discarded_everywhere_and_taken_again",
    "quorum below the minimum and back": "test_ft_stop.py::test_below_min_replicas_the_first_waits_then_both_"
                                         "go_on",
    "kill -9 in recovery, the joiner": "test_ft_faults.py::test_a_joiner_killed_in_its_recovery_costs_the_"
                                       "others_one_round_and_rejoins_when_started_again",
    "kill -9 in recovery, the source": "test_ft_faults.py::test_a_source_killed_while_sending_the_state_leaves_"
                                       "the_joiner_to_receive_it_from_another",
    "two kill -9 in one step": "test_ft_faults.py::test_two_replicas_killed_in_one_step_cost_the_last_one_that_"
                               "step_and_both_rejoin",
    "partition (SIGSTOP in the allreduce), healed": "test_ft_faults.py::test_a_partitioned_replica_is_dropped_"
                                                    "past_the_deadline_and_finds_its_step_discarded_when_it_returns",
    "CLI: kill -9, same command, survivors stopped": "test_ft_cli_rejoin.py::test_a_killed_replica_started_again_by_"
                                                     "the_same_command_rejoins_and_all_end_as_one_process",
    "CLI: below the minimum and back": "test_ft_cli_rejoin.py::test_two_replicas_one_killed_and_started_again_end_as_"
                                       "one_process",
}


def _ft(case: str, tmp: str) -> str:
    """One fault of the fault-tolerant replicas, staged by its test: handled when no step was applied on some
    replicas and not others, nothing hung past its deadline, and every replica ended equal to the reference."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             "--basetemp", os.path.join(tmp, "pytest"), "-m", "soak",
                             os.path.join("tests", "spmd", "ft", FT_CASES[case])], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "hang"
    if proc.returncode == 0:
        return "handled"
    return "silent" if "AssertionError" in out else "crash"


# ---------------------------------------------------------------- the table

CASES = [
    *[("special path", k, True, lambda tmp, k=k: _special(k, tmp))
      for k in ("symlink", "fifo", "char-device", "stdout-pipe", "stdout-file", "empty")],
    *[("damage", k, True, lambda tmp, k=k: _damage(k, tmp))
      for k in ("flipped-bit", "truncated", "wrong-content", "orphan-tmp", "changed-lr", "changed-seed",
                "folder-in-use", "stale-lock")],
    *[("bad input", " ".join(a), True, lambda tmp, a=a: _cli(list(a), tmp))
      for a in (("--lr", "inf"), ("--lr", "nan"), ("--lr", "1e308"), ("--seed", str(2**40)),
                ("--timeout", "1e15"), ("--json", ""), ("--plot", ""), ("--checkpoint-dir", ""),
                ("--json", "/sys/h.json"), ("--num-train", str(10**12)))],
    ("kill", "SIGKILL mid-run, resume", False, lambda tmp: _kill("SIGKILL", tmp)),
    ("kill", "SIGTERM mid-run, resume", False, lambda tmp: _kill("SIGTERM", tmp)),
    ("stop", "SIGSTOP one of 2 torchrun ranks", False, _stop),
    ("kill", "SIGKILL node 2 of 2x2 ranks, resume", False, lambda tmp: _node(tmp)),
    *[("ft replicas", k, False, lambda tmp, k=k: _ft(k, tmp)) for k in FT_CASES],
    *FEATURE_CASES,
]


def _node(tmp: str) -> str:
    """Two torchrun nodes of 2 ranks on 127.0.0.1: node 2 killed whole mid-run, then both resume (nodes.py)."""
    from bench.nodes import classify, kill_node_and_resume
    return classify(kill_node_and_resume(tmp, nproc=2))


def run_cases(quick: bool = False, show=print, only: str | None = None) -> dict:
    """Run the cases (only the in-process ones with `quick`, only those whose name has `only`); rows and counts."""
    rows = []
    for category, name, fast, fn in CASES:
        if (quick and not fast) or (only is not None and only not in f"{category} {name}"):
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="manualdp-faults-") as tmp:
            try:
                outcome = fn(tmp)
            except subprocess.TimeoutExpired:
                outcome = "hang"
            except Exception as e:  # the harness saw a traceback: the case crashed
                outcome, name = "crash", f"{name} ({type(e).__name__}: {str(e)[:60]})"
        rows.append({"category": category, "case": name, "outcome": outcome,
                     "seconds": round(time.perf_counter() - start, 2)})
        show(f"  {category:<14}{name:<46}{outcome}")
    counts = {"tried": len(rows), **{o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}}
    return {"rows": rows, "counts": counts}


# ---------------------------------------------------------------- cost of the always-on rank checks

def _cost_job(steps: int, rounds: int, model_name: str = "lenet") -> dict:
    from manualdp.spmd.transport import call_check
    from manualdp.spmd.ddp.wrapper import DistributedDataParallel
    from manualdp.support.models import get_model
    torch.manual_seed(0)
    model = DistributedDataParallel(get_model(model_name), timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    X, y = torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    def block(check: bool) -> float:
        model.check_calls = check
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(X), y).backward()
            opt.step()
        return (time.perf_counter() - start) / steps

    block(True)  # warm-up
    on, off = [], []
    for _ in range(rounds):  # alternate, so machine noise hits both alike
        on.append(block(True))
        off.append(block(False))
    model.check_calls = True
    # The check alone, as the wrapper runs it once per step (queued ahead of the buckets, while
    # backward computes): steadier than the difference of two step times, which swings by several
    # percent between blocks on a shared machine.
    calls, total = [], sum(b.flat.numel() for b in model._buckets)
    for i in range(CHECK_CALLS + 5):
        start = time.perf_counter()
        call_check.check_same_call(model._buckets[0].flat, model._algorithms[0], model.segment_bytes, None, 60,
                                   numel=total)
        if i >= 5:
            calls.append(time.perf_counter() - start)
    return {"on": statistics.median(on), "off": statistics.median(off), "buckets": len(model._buckets),
            "check_s": statistics.median(calls)}


CHECK_CALLS = 200  # timed calls of the check alone


def check_cost(steps: int, rounds: int, model: str = "lenet", world_size: int = 2) -> dict:
    """Median step time of `model` (gloo, per-rank batch 128) with and without the per-step check."""
    from manualdp.spmd import launch
    from manualdp.support.models import MODELS
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 2 <= world_size <= 8:
        raise ValueError(f"world_size must be an int from 2 to 8, got {world_size!r}")
    result = launch(_cost_job, world_size, (steps, rounds, model), timeout=600)[0]
    result.update(model=model, world_size=world_size)
    result["overhead"] = result["on"] / result["off"] - 1
    result["check_share"] = result["check_s"] / result["off"]  # one check per step, whatever the buckets
    return result


def main(argv: list[str] | None = None) -> int:
    """`python bench/faults.py`: print the fault table, or the cost of the rank checks."""
    parser = argparse.ArgumentParser(prog="bench/faults.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the in-process cases (seconds)")
    parser.add_argument("--only", metavar="TEXT", help="only the cases whose category or name contains TEXT")
    parser.add_argument("--check-cost", action="store_true", help="measure the always-on rank checks instead")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block for --check-cost (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per setting for --check-cost (default 5)")
    from manualdp.support.models import MODELS
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet",
                        help="model for --check-cost (default lenet)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks for --check-cost (default 2, at most 8)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    if not 2 <= args.world_size <= 8:
        parser.error(f"--world-size must be from 2 to 8, got {args.world_size}")
    if args.check_cost:
        r = check_cost(args.steps, args.rounds, args.model, args.world_size)
        print(f"{args.model} step, {args.world_size} ranks: {r['on'] * 1e3:.2f} ms with the rank checks, "
              f"{r['off'] * 1e3:.2f} ms without: "
              f"{100 * r['overhead']:+.2f}%; the check alone: {r['check_s'] * 1e6:.0f} us, once per step for its "
              f"{r['buckets']} bucket(s) = {100 * r['check_share']:.2f}% of the step without it (target < 2%), "
              "less in the step, where it runs while forward and backward compute")
        save_outputs(r, args.json, None)
        return 0
    print(f"  {'category':<14}{'case':<46}outcome")
    result = run_cases(args.quick, only=args.only)
    print("  " + "  ".join(f"{k} {v}" for k, v in result["counts"].items()))
    save_outputs(result, args.json, None)
    return 0 if result["counts"]["handled"] == result["counts"]["tried"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
