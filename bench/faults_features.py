"""The fault table's rows for last round's features, each case tried as a new user would try it.

    python bench/faults.py --only zero        # one class: zero, changed, cache, trace, lock, syncbn

ZeRO resume, a changed optimizer, a hostile tuner cache, a trace to a FIFO, the checkpoint
lock under another name, SyncBatchNorm far from zero. Every outcome is checked, not assumed:
a resume is compared with the same run without a stop (`handled` if equal, `silent` if not,
`lost` if the checkpoint was not used); a refusal must be one line naming the option (`silent`
if the run went on); a run must end within its limit (`hang`); a traceback is a `crash`.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.common import environment

__all__ = ["FEATURE_CASES"]

CLI = ["--no-progress", "--num-train", "256", "--num-test", "128", "--batch-size", "32"]


# ---------------------------------------------------------------- running `manualdp train`

def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`manualdp train CLI argv` in this process: exit code, stdout, stderr (for runs that cannot block)."""
    from manualdp.runners.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            code = main(["train", *CLI, *argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its children (torchrun's workers lead groups of their own) and its group."""
    for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _spawn(argv: list[str], tmp: str, nproc: int = 0, env: dict | None = None,
           stdout=subprocess.PIPE) -> subprocess.Popen:
    """`manualdp train` in a new process, or under torchrun with `nproc` ranks; the tuner's cache under `tmp`."""
    run = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
           if nproc else [sys.executable])
    extra = ["--timeout", "30"] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": os.path.join(tmp, "cache"), **(env or {})}
    return subprocess.Popen([*run, "-m", "manualdp", "train", *CLI, *extra, *argv], cwd=tmp, env=env, text=True,
                            stdout=stdout, stderr=subprocess.PIPE, start_new_session=True)


def _run(argv: list[str], tmp: str, nproc: int = 0, env: dict | None = None,
         limit: float = 240) -> tuple[int, str, str]:
    """`_spawn` to its end: exit code, stdout, stderr; TimeoutExpired (a hang) after `limit` seconds."""
    proc = _spawn(argv, tmp, nproc, env)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _end(proc)
        raise
    return proc.returncode, out, err


def _traceback(err: str) -> bool:
    """A traceback through manualdp, or a rank killed by a signal (an abort): torchrun's own traceback, and the
    SIGTERM it sends the other ranks once one has exited, do not count."""
    lines = [line.strip() for line in err.splitlines()]
    return (any(line.startswith("File ") and "manualdp" in line for line in lines)
            or any(line.startswith("exitcode") and ": -" in line and "SIGTERM" not in line for line in lines)
            or ("Traceback" in err and "ChildFailedError" not in err))


def _refusal(code: int, err: str, *words: str) -> str:
    """`handled` for a one-line error naming `words` (under torchrun, other ranks may point to it), else what it was."""
    if code == 0:
        return "silent"
    errors = [line for line in err.splitlines() if line.startswith("manualdp train: error:")]
    if _traceback(err) or not errors:
        return "crash"
    return "handled" if any(all(w in line for w in words) for line in errors) else "crash"


def _models(folder: str) -> list[dict]:
    """The model in the newest checkpoint of `folder`, or of each of its rank folders."""
    from manualdp.support.checkpoint import load_latest
    ranks = sorted(d for d in os.listdir(folder) if d.startswith("rank"))
    return [load_latest(os.path.join(folder, d))["model"] for d in ranks] if ranks else [load_latest(folder)["model"]]


def _drop_newest(folder: str) -> None:
    """Delete the newest checkpoint of `folder` (each rank's): as if the run died just before writing it."""
    for d in [folder] + [os.path.join(folder, r) for r in os.listdir(folder) if r.startswith("rank")]:
        files = sorted(f for f in os.listdir(d) if f.endswith(".pt"))
        if files:
            os.remove(os.path.join(d, files[-1]))


# ---------------------------------------------------------------- ZeRO resume

def _zero_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))  # 103 elements: uneven at 2 and 3 devices


def _zero_loader():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
    return DataLoader(data, batch_size=12, shuffle=True, generator=torch.Generator().manual_seed(2))


OPTIMIZERS = {"SGD-momentum": dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
              "Adam": dict(lr=0.01, optimizer=torch.optim.Adam),
              "AdamW": dict(lr=0.01, optimizer=torch.optim.AdamW)}


def _zero_api(stage: int, name: str, devices: int, tmp: str) -> str:
    """`train(zero=stage)` stopped after step 6 of 8 and resumed, against the same run without a stop."""
    from manualdp.devices import cpu_devices
    from manualdp.runners.loop import train

    def run(**kw):
        torch.manual_seed(3)
        net, logs = _zero_net(), []
        opts = dict(OPTIMIZERS[name])
        train(net, _zero_loader(), _zero_loader(), cpu_devices(devices), 2, opts.pop("lr"), zero=stage,
              progress=False, log=logs.append, **opts, **kw)
        return [p.detach().clone() for p in net.parameters()], logs

    ckpt = os.path.join(tmp, "ckpt")
    straight, _ = run()
    run(checkpoint_dir=ckpt, checkpoint_every=3)  # 4 steps an epoch: checkpoints of steps 6 and 8 are kept
    _drop_newest(ckpt)
    got, logs = run(checkpoint_dir=ckpt, checkpoint_every=3, resume=True)
    if not any("resumed from" in line and "step 6" in line for line in logs):
        return "lost"
    return "handled" if all(torch.equal(a, b) for a, b in zip(straight, got)) else "silent"


def _zero_cli(argv: list[str], tmp: str, nproc: int = 0, mid_epoch: bool = False) -> str:
    """`manualdp train --zero ...` (here, or under torchrun) stopped and resumed, against one straight run."""
    def run(*more):
        return _run([*argv, *more], tmp, nproc) if nproc else _cli([*argv, *more])

    a, b = (os.path.join(tmp, n) for n in ("a", "b"))
    done = [run("--epochs", "2", "--checkpoint-dir", a, "--json", a + ".json")]
    if mid_epoch:  # 8 steps an epoch, a checkpoint every 3: the run dies after step 15
        done.append(run("--epochs", "2", "--checkpoint-dir", b, "--checkpoint-every", "3"))
        _drop_newest(b)
    else:
        done.append(run("--epochs", "1", "--checkpoint-dir", b))
    done.append(run("--epochs", "2", "--checkpoint-dir", b, "--resume", "--json", b + ".json"))
    if any(code != 0 for code, _, _ in done):
        return "crash"
    if "resumed from" not in done[-1][1]:
        return "lost"
    x, y = (json.load(open(p + ".json")) for p in (a, b))
    same = x["train_loss"] == y["train_loss"] and x["test_acc"] == y["test_acc"]
    same = same and all(torch.equal(s[k], t[k]) for s, t in zip(_models(a), _models(b)) for k in s)
    return "handled" if same else "silent"


# ---------------------------------------------------------------- a resume with another optimizer or stage

def _changed(before: list[str], after: list[str], word: str, tmp: str, nproc: int = 0) -> str:
    """A checkpoint written with `before`, resumed with `after`: one line naming `word`, the folder untouched."""
    ckpt = os.path.join(tmp, "ckpt")
    run = (lambda argv: _run(argv, tmp, nproc)) if nproc else _cli
    code, _, err = run([*before, "--epochs", "1", "--checkpoint-dir", ckpt])
    if code != 0:
        return "crash"
    files = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs}
    code, _, err = run([*after, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume"])
    now = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs}
    if code != 0 and now != files:
        return "lost"
    return _refusal(code, err, word, "changed")


# ---------------------------------------------------------------- a hostile tuner cache, a bad MANUALDP_LINK

def _cache_file(tmp: str, nproc: int = 2) -> str:
    from manualdp.spmd.auto.link_cache import cache_path
    with environment(XDG_CACHE_HOME=os.path.join(tmp, "cache")):
        path = cache_path("gloo", nproc)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path



def _plant(kind: str, path: str) -> None:
    """A cache of this version's format (one it would use, but for `kind`'s damage) at `path`."""
    from manualdp.spmd.auto import link_cache
    good = {"alpha": 1e-5, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.5}
    numbers = {**{k: good.get(k, 0.0) for k in link_cache.MEASURED}, "measured_at": time.time(),
               "calibration": link_cache.CALIBRATION}
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        text = {"huge numbers": json.dumps({**numbers, "alpha": 1e308, "beta": 1e308}),
                "huge integer": json.dumps(numbers).replace("1e-05", "9" * 3900),
                "nan": json.dumps({**numbers, "gamma": float("nan")}),
                "negative": json.dumps({**numbers, "beta": -1e-9}),
                "wrong types": json.dumps({**numbers, "alpha": "fast", "duplex": [0.5]}),
                "deep nesting": "[" * 4000 + "]" * 4000,
                "a megabyte": json.dumps({**numbers, "pad": " " * (1 << 20)})}[kind]
        with open(path, "w") as f:
            f.write(text)


def _hostile_cache(kind: str, tmp: str) -> str:
    """Two torchrun ranks with `kind` at the tuner's cache path: a warning naming it, then measured and saved again."""
    path = _cache_file(tmp)
    _plant(kind, path)
    code, _, err = _run(["--epochs", "1", "--num-train", "64"], tmp, nproc=2, limit=180)
    if code != 0:
        return "crash"
    warned = [line for line in err.splitlines() if "ignoring the tuner's cache" in line and path in line]
    try:  # a regular file again (a FIFO here would block the open)
        remeasured = os.path.isfile(path) and json.load(open(path)).get("calibration") is not None
    except (OSError, ValueError):
        remeasured = False
    return "handled" if len(warned) == 1 and remeasured else "silent"


def _hostile_read(kind: str, tmp: str) -> str:
    """The cache read alone (`known_link`), within 10 s: no constants, one warning naming the file."""
    from manualdp.spmd.auto.link_cache import known_link
    path = _cache_file(tmp)
    _plant(kind, path)
    got: list = []

    def read():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append((known_link("gloo", 2), [str(w.message) for w in caught]))

    with environment(XDG_CACHE_HOME=os.path.join(tmp, "cache")):  # put back even if the reader never returns
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
    if reader.is_alive():
        return "hang"
    (link, _), messages = got[0]
    return "handled" if link is None and len(messages) == 1 and path in messages[0] else "silent"


def _bad_link(value: str, tmp: str) -> str:
    """Two torchrun ranks with MANUALDP_LINK=value: every rank stops with one line naming the variable."""
    code, _, err = _run(["--epochs", "1", "--num-train", "64"], tmp, nproc=2, env={"MANUALDP_LINK": value}, limit=120)
    errors = [line for line in err.splitlines() if line.startswith("manualdp train: error:")]
    outcome = _refusal(code, err, "MANUALDP_LINK")  # torchrun may end rank 1 before it says so too
    return outcome if outcome != "handled" or max(map(len, errors)) < 400 else "crash"


# ---------------------------------------------------------------- traces to a FIFO or stdout, outputs on one path

def _trace(target: str, tmp: str, nproc: int = 0) -> str:
    """`--trace TARGET --plot-trace p.png`: ends, draws the plot, and the trace arrives whole."""
    png, got = os.path.join(tmp, "p.png"), []
    if target == "fifo":
        trace = os.path.join(tmp, "trace")
        os.mkfifo(trace)
        reader = threading.Thread(target=lambda: got.append(open(trace).read()), daemon=True)
        reader.start()
    else:
        trace = "/dev/stdout"
    to_file = target == "stdout to a file"
    with open(os.path.join(tmp, "out"), "w") if to_file else contextlib.nullcontext(subprocess.PIPE) as stdout:
        proc = _spawn(["--epochs", "1", "--trace", trace, "--plot-trace", png], tmp, nproc, stdout=stdout)
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            _end(proc)
            return "hang"
    if to_file:
        out = open(os.path.join(tmp, "out")).read()
    if proc.returncode != 0:
        return "crash"
    text = (got[0] if got else "") if target == "fifo" else out
    whole = '"traceEvents"' in text and text.count("{") == text.count("}")
    return "handled" if whole and os.path.getsize(png) > 0 else "silent"


def _same_path(argv: list[str], tmp: str) -> str:
    """Outputs naming one file: refused before training, nothing written."""
    if any("link.json" in a for a in argv):
        os.symlink("t.json", os.path.join(tmp, "link.json"))
    argv = [os.path.join(tmp, a) if a.endswith((".json", ".png")) else a for a in argv]
    code, out, err = _cli(["--epochs", "1", *argv])
    if "epoch 1" in out or set(os.listdir(tmp)) - {"link.json"}:
        return "silent"
    return _refusal(code, err, "same file")


def _same_stdout(tmp: str) -> str:
    """`--trace /dev/stdout --json /dev/stdout` (a new process: it would write to ours): refused before training."""
    code, out, err = _run(["--epochs", "1", "--trace", "/dev/stdout", "--json", "/dev/stdout"], tmp, limit=120)
    return "silent" if "epoch 1" in out else _refusal(code, err, "same file")


# ---------------------------------------------------------------- the checkpoint lock under another name

HOLD = ("import sys, time; from manualdp.support.checkpoint import lock_checkpoint_dir; "
        "lock_checkpoint_dir(sys.argv[1]); print('locked', flush=True); time.sleep(float(sys.argv[2]))")


def _hold(folder: str, seconds: float = 120) -> subprocess.Popen:
    """A process holding `folder`'s lock (for `seconds`), once it says so."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, folder, str(seconds)], stdout=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "locked":
        holder.kill()
        raise RuntimeError("the holder did not take the lock")
    return holder


def _lock(name: str, tmp: str, nproc: int = 0) -> str:
    """A run on another name for a folder whose lock is held: refused, the holder's lock and folder untouched."""
    from manualdp.support.checkpoint import lock_path
    real = os.path.join(tmp, "ckpt")
    os.makedirs(os.path.join(tmp, "sub"))
    os.symlink(real, os.path.join(tmp, "link"))
    os.symlink(tmp, os.path.join(tmp, "up"))
    other = {"symlink": "link", "relative": "ckpt", "dot-dot": "sub/../ckpt", "trailing slash": "ckpt/",
             "symlinked parent": "up/ckpt"}[name]
    held = os.path.join(real, "rank0") if nproc else real
    holder = _hold(held)
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        code, _, err = _run(["--epochs", "1", "--checkpoint-dir", other], tmp, nproc) if nproc else \
            _cli(["--epochs", "1", "--checkpoint-dir", other])
        owner = json.load(open(lock_path(held)))
    finally:
        os.chdir(cwd)
        holder.kill()
        holder.wait()
    if owner["pid"] != holder.pid or any(f.endswith(".pt") for _, _, fs in os.walk(real) for f in fs):
        return "lost"  # two runs in one folder: the holder's checkpoints are no longer its own
    return _refusal(code, err, "in use")


def _lock_real_run(tmp: str) -> str:
    """A training run through a symlink holds the lock; a resume on the real path meanwhile is refused."""
    real, link = os.path.join(tmp, "ckpt"), os.path.join(tmp, "link")
    os.makedirs(real)
    os.symlink(real, link)
    first = _spawn(["--epochs", "400", "--checkpoint-dir", link], tmp)
    try:
        deadline = time.monotonic() + 60
        while not any(f.endswith(".pt") for f in os.listdir(real)):
            if first.poll() is not None or time.monotonic() > deadline:
                return "crash"
            time.sleep(0.1)
        code, _, err = _cli(["--epochs", "2", "--checkpoint-dir", real, "--resume"])
        alive = first.poll() is None
    finally:
        _end(first)
    return _refusal(code, err, "in use") if alive else "crash"


def _stale_lock_via_symlink(tmp: str) -> str:
    """The lock's owner died without releasing it; a resume through a symlink takes it over and goes on."""
    real, link = os.path.join(tmp, "ckpt"), os.path.join(tmp, "link")
    code, _, _ = _cli(["--epochs", "1", "--checkpoint-dir", real])
    os.symlink(real, link)
    holder = _hold(real, 0)
    holder.wait()  # gone, its lock left behind
    code2, out, err = _cli(["--epochs", "2", "--checkpoint-dir", link, "--resume"])
    if code != 0 or code2 != 0:
        return "crash"
    return "handled" if "taking over the stale lock" in err and "resumed from" in out else "silent"


# ---------------------------------------------------------------- SyncBatchNorm far from zero

def _syncbn_job(counts, shape, offset, dtype, eval_alone):
    """One forward and backward of SyncBatchNorm on this rank's rows of a batch around `offset`."""
    import torch.distributed as dist

    from manualdp.spmd.syncbn import SyncBatchNorm
    rank = dist.get_rank()
    x, w, weight, bias = _syncbn_data(counts, shape, offset, dtype)
    start = sum(counts[:rank])
    mine = x[start:start + counts[rank]].clone().requires_grad_()
    bn = SyncBatchNorm(shape[0]).to(dtype)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    y = bn(mine)
    (y * w[start:start + counts[rank]]).sum().backward()
    out = {"y": y.detach(), "dx": mine.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
           "mean": bn.running_mean, "var": bn.running_var}
    if eval_alone and rank == 0:  # the other ranks have left: eval must not wait for them
        out["eval"] = bn.eval()(mine.detach())
    return out


def _syncbn_data(counts, shape, offset, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(counts), *shape, generator=g, dtype=torch.float64) + offset).to(dtype)
    w = torch.randn(sum(counts), *shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, 1 + torch.rand(shape[0], generator=g).to(dtype), torch.randn(shape[0], generator=g).to(dtype)


def _syncbn(counts: tuple, shape: tuple, offset: float, tmp: str, dtype=torch.float32, eval_alone=False) -> str:
    """Ranks holding `counts` rows each, against torch's BatchNorm on the whole batch: outputs, gradients, stats."""
    from manualdp.spmd import launch
    try:
        ranks = launch(_syncbn_job, len(counts), (counts, shape, offset, dtype, eval_alone), timeout=90)
    except TimeoutError:
        return "hang"
    x, w, weight, bias = _syncbn_data(counts, shape, offset, dtype)
    bn = {1: nn.BatchNorm1d, 3: nn.BatchNorm2d}[len(shape)](shape[0]).to(dtype)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * w).sum().backward()
    ours = {k: torch.cat([r[k] for r in ranks]) for k in ("y", "dx")}
    ours.update({k: sum(r[k] for r in ranks) for k in ("dw", "db")})
    torch_ = {"y": y, "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad}
    running = {"mean": bn.running_mean, "var": bn.running_var}
    checks = [(ours[k], torch_[k]) for k in torch_] + [(r[k], v) for r in ranks for k, v in running.items()]
    if eval_alone:
        checks.append((ranks[0]["eval"], bn.eval()(x.detach()[:counts[0]])))
    close = all(a.isfinite().all() and torch.allclose(a.detach(), b.detach(), rtol=1e-3, atol=5e-3) for a, b in checks)
    return "handled" if close else "silent"


# ---------------------------------------------------------------- the rows

ZERO = [(s, o, n) for s in (1, 2) for o in OPTIMIZERS for n in (2, 3)]
CHANGED = [("adam -> adamw", ["--optimizer", "adam", "--lr", "0.001"], ["--optimizer", "adamw", "--lr", "0.001"],
            "optimizer"),
           ("sgd -> adam", [], ["--optimizer", "adam"], "optimizer"),
           ("adam -> sgd", ["--optimizer", "adam"], [], "optimizer"),
           ("--zero 1 -> none", ["--zero", "1"], [], "zero"),
           ("none -> --zero 1", [], ["--zero", "1"], "zero"),
           ("--zero 1 -> --zero 2", ["--zero", "1"], ["--zero", "2"], "zero"),
           ("--zero 2: adam -> adamw", ["--zero", "2", "--optimizer", "adam"], ["--zero", "2", "--optimizer", "adamw"],
            "optimizer")]
CACHES = ("huge numbers", "huge integer", "nan", "negative", "wrong types", "deep nesting", "a megabyte", "fifo",
          "link to /dev/zero")
LINKS = ("1,2", "nan,1e-9,1e-10", "1e9,1e-9,1e-10", "fast", "1e-5,1e-9,1e-10,0.5," + "9" * 5000)
SAME = (("--trace", "t.json", "--json", "t.json"), ("--trace", "t.json", "--json", "./t.json"),
        ("--trace", "t.json", "--json", "link.json"), ("--trace", "t.png", "--plot-trace", "t.png"),
        ("--trace", "x.json", "--plot", "p.png", "--plot-trace", "./p.png"))


FEATURE_CASES = [
    *[("zero resume", f"train() stage {s} {o} {n} dev", True, lambda tmp, s=s, o=o, n=n: _zero_api(s, o, n, tmp))
      for s, o, n in ZERO],
    ("zero resume", "cli --zero 2, 1 epoch +1", True, lambda tmp: _zero_cli(["--zero", "2"], tmp)),
    ("zero resume", "cli --zero 1 adam, 1 epoch +1", True,
     lambda tmp: _zero_cli(["--zero", "1", "--optimizer", "adam", "--lr", "0.001"], tmp)),
    ("zero resume", "cli --zero 2 adamw --devices 3", True,
     lambda tmp: _zero_cli(["--zero", "2", "--optimizer", "adamw", "--lr", "0.001", "--devices", "3"], tmp)),
    ("zero resume", "cli --zero 1 --devices 3, mid-epoch", True,
     lambda tmp: _zero_cli(["--zero", "1", "--devices", "3"], tmp, mid_epoch=True)),
    ("zero resume", "torchrun 2: --zero 1 adam", False,
     lambda tmp: _zero_cli(["--zero", "1", "--optimizer", "adam", "--lr", "0.001"], tmp, nproc=2)),
    ("zero resume", "torchrun 2: --zero 2, mid-epoch", False,
     lambda tmp: _zero_cli(["--zero", "2"], tmp, nproc=2, mid_epoch=True)),
    ("zero resume", "torchrun 2: --zero 2 adamw", False,
     lambda tmp: _zero_cli(["--zero", "2", "--optimizer", "adamw", "--lr", "0.001"], tmp, nproc=2)),
    *[("changed opt", name, True, lambda tmp, a=a, b=b, w=w: _changed(a, b, w, tmp)) for name, a, b, w in CHANGED],
    ("changed opt", "torchrun 2: --zero 1 adam -> adamw", False,
     lambda tmp: _changed(["--zero", "1", "--optimizer", "adam"], ["--zero", "1", "--optimizer", "adamw"],
                          "optimizer", tmp, nproc=2)),
    ("changed opt", "torchrun 2: sgd -> --zero 1", False, lambda tmp: _changed([], ["--zero", "1"], "zero", tmp, 2)),
    *[("hostile cache", f"read: {k}", True, lambda tmp, k=k: _hostile_read(k, tmp))
      for k in ("fifo", "link to /dev/zero")],
    *[("hostile cache", f"torchrun 2: {k}", False, lambda tmp, k=k: _hostile_cache(k, tmp)) for k in CACHES],
    *[("hostile cache", f"torchrun 2: MANUALDP_LINK={v[:16]}", False, lambda tmp, v=v: _bad_link(v, tmp))
      for v in LINKS],
    ("trace", "--trace FIFO --plot-trace", False, lambda tmp: _trace("fifo", tmp)),
    ("trace", "--trace /dev/stdout (pipe) --plot-trace", False, lambda tmp: _trace("stdout", tmp)),
    ("trace", "--trace /dev/stdout (file) --plot-trace", False, lambda tmp: _trace("stdout to a file", tmp)),
    ("trace", "torchrun 2: --trace FIFO --plot-trace", False, lambda tmp: _trace("fifo", tmp, nproc=2)),
    ("trace", "torchrun 2: --trace /dev/stdout", False, lambda tmp: _trace("stdout", tmp, nproc=2)),
    *[("trace", "same path: " + " ".join(a[-4:]), True, lambda tmp, a=a: _same_path(list(a), tmp)) for a in SAME],
    ("trace", "same path: /dev/stdout twice", False, _same_stdout),
    *[("lock", f"held; run on {k}", True, lambda tmp, k=k: _lock(k, tmp))
      for k in ("symlink", "relative", "dot-dot", "trailing slash", "symlinked parent")],
    ("lock", "torchrun 2: held; run on symlink", False, lambda tmp: _lock("symlink", tmp, nproc=2)),
    ("lock", "run via symlink; resume on real path", False, _lock_real_run),
    ("lock", "stale lock, resume via symlink", True, _stale_lock_via_symlink),
    ("syncbn", "offset 1e4, 2 ranks, (N,C)", False, lambda tmp: _syncbn((8, 8), (3,), 1e4, tmp)),
    ("syncbn", "offset 1e4, 3 ranks, (N,C,H,W)", False, lambda tmp: _syncbn((4, 4, 4), (2, 3, 3), 1e4, tmp)),
    ("syncbn", "offset -1e4, uneven 3+7 rows", False, lambda tmp: _syncbn((3, 7), (4,), -1e4, tmp)),
    ("syncbn", "offset 1e8 float64", False, lambda tmp: _syncbn((6, 6), (3,), 1e8, tmp, dtype=torch.float64)),
    ("syncbn", "offset 1e4, eval on rank 0 alone", False, lambda tmp: _syncbn((8, 8), (3,), 1e4, tmp, eval_alone=True)),
]
