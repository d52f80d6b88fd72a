"""SPMD reliability: dead and hung ranks end every rank in time, exact resume, non-finite gradients.

The ranks run as real processes (`python -c`, gloo on 127.0.0.1, one thread each), so what
is checked includes their exit: a rank must not hang at interpreter exit. Faults are
injected through the loss function or the model, on one rank only.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
EPOCHS, STEPS_PER_EPOCH = 3, 4  # 60 examples in batches of 16


# ---------------------------------------------------------------- what every rank runs

class FaultyLoss(nn.CrossEntropyLoss):
    """Cross-entropy that, on one rank at one step, makes the process exit, hang or return NaN."""

    def __init__(self, fault, rank, at, stamp):
        super().__init__(reduction="sum")
        self.fault, self.rank, self.at, self.stamp, self.calls = fault, rank, at, stamp, 0

    def forward(self, out, y):
        step, self.calls = self.calls, self.calls + 1
        if self.fault is not None and step == self.at and int(os.environ["RANK"]) == self.rank:
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            if self.fault == "exit":
                os._exit(17)
            if self.fault == "hang":
                time.sleep(3600)
            if self.fault == "nan":
                return super().forward(out, y) * float("nan")
        return super().forward(out, y)


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay)
        raise RuntimeError("injected failure in backward")


class RaiseInBackward(nn.Module):
    """Identity whose backward raises on rank `rank` at call `at`: after later layers' buckets have gone out."""

    def __init__(self, rank, at, delay):
        super().__init__()
        self.rank, self.at, self.delay, self.calls = rank, at, delay, 0

    def forward(self, x):
        if not self.training:  # rank 0 also evaluates
            return x
        step, self.calls = self.calls, self.calls + 1
        if step == self.at and int(os.environ["RANK"]) == self.rank:
            return _Raise.apply(x, self.delay)
        return x


def _net(raise_at=None, delay=0.0):
    torch.manual_seed(0)
    fault = RaiseInBackward(0, raise_at, delay) if raise_at is not None else nn.Identity()
    return nn.Sequential(nn.Linear(6, 16), fault, nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(16, 4)).double()


def _loaders():
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(80, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (80,), generator=g)
    train_iter = DataLoader(TensorDataset(X[:60], y[:60]), batch_size=16, shuffle=True,
                            generator=torch.Generator().manual_seed(4))
    return train_iter, DataLoader(TensorDataset(X[60:], y[60:]), batch_size=10)


def _rank_main(config: dict) -> None:
    """One rank: train with `config`'s options and faults, then save the parameters."""
    from manualdp.runners.loop import train_spmd
    from manualdp.spmd import init_from_env
    torch.set_num_threads(1)
    init_from_env(timeout=config["timeout"])
    net = _net(config.get("raise_at"), config.get("raise_delay", 0.0))
    torch.manual_seed(42 + int(os.environ["RANK"]))  # dropout differs per rank: each rank's RNG must be restored
    loss = FaultyLoss(config.get("fault"), config.get("fault_rank", 1), config.get("at"), config["stamp"])
    logs = []
    train_spmd(net, *_loaders(), EPOCHS, 0.2, momentum=0.9, bucket_cap_mb=0.0002, loss_fn=loss, progress=False,
               log=logs.append, nonfinite=config.get("nonfinite"), checkpoint_dir=config.get("checkpoint_dir"),
               checkpoint_every=config.get("checkpoint_every"), resume=config.get("resume", False))
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "logs": logs},
               config["out"] + f".rank{os.environ['RANK']}")
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- starting ranks and watching them end

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp, config, world_size=2, limit=60.0, hung=()):
    """Start `world_size` ranks; wait until every rank not in `hung` has exited; kill the rest.

    Returns, per rank: exit code (None: killed), the time.time() it was seen to exit, its stderr.
    """
    os.makedirs(tmp, exist_ok=True)
    config = {"stamp": os.path.join(tmp, "fault-time"), "out": os.path.join(tmp, "result"), **config}
    code = f"import sys; sys.path[:0] = {[ROOT]!r}; import {__name__} as t; t._rank_main({config!r})"
    port = _free_port()
    procs = []
    for r in range(world_size):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        err = open(os.path.join(tmp, f"stderr{r}"), "w+")
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=err)
        procs.append((proc, err))
    ended = [None] * world_size
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline and any(ended[r] is None for r in range(world_size) if r not in hung):
            for r, (p, _) in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.02)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for r, (p, err) in enumerate(procs):
        err.seek(0)
        status = p.returncode if ended[r] is not None else None
        results.append({"code": status, "ended": ended[r], "stderr": err.read()})
        err.close()
    return results


def _fault_time(tmp):
    with open(os.path.join(tmp, "fault-time")) as f:
        return float(f.read())


def _params(tmp, rank):
    return torch.load(os.path.join(tmp, f"result.rank{rank}"), weights_only=False)


def _last_error(result):
    lines = [line for line in result["stderr"].splitlines() if "Error" in line]
    return lines[-1] if lines else result["stderr"][-500:]


# ---------------------------------------------------------------- a dead rank, a hung rank

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Three epochs without faults: the reference parameters."""
    tmp = str(tmp_path_factory.mktemp("straight"))
    results = _run_ranks(tmp, {"timeout": 30})
    assert [r["code"] for r in results] == [0, 0], [r["stderr"] for r in results]
    return [_params(tmp, r)["params"] for r in range(2)]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Rank 1 dies (os._exit) before its backward of step 7; checkpoints every 3 steps and at epoch ends (4, 8)."""
    tmp = str(tmp_path_factory.mktemp("crashed"))
    results = _run_ranks(tmp, {"timeout": 30, "fault": "exit", "at": 7, "checkpoint_dir": os.path.join(tmp, "ckpt"),
                               "checkpoint_every": 3})
    return tmp, results


def test_when_a_rank_dies_the_other_exits_at_once_naming_step_and_peer(crashed):
    tmp, results = crashed
    assert results[1]["code"] == 17, "the injected exit"
    assert results[0]["code"] not in (None, 0)
    assert "rank 0: step 7: no answer from rank 1: the connection was closed" in _last_error(results[0])
    # The timeout is 30 s; gloo sees the closed connection at once.
    seconds = results[0]["ended"] - _fault_time(tmp)
    print(f"rank 0 exited {seconds:.2f} s after rank 1 died (timeout 30 s)")
    assert seconds < 10


def test_when_a_rank_hangs_the_other_exits_after_the_timeout(tmp_path):
    results = _run_ranks(str(tmp_path), {"timeout": 3, "fault": "hang", "at": 5}, hung=(1,))
    assert results[0]["code"] not in (None, 0)
    assert results[1]["code"] is None, "rank 1 hangs until killed"
    assert "rank 0: step 5: no answer from rank 1 within 3 s" in _last_error(results[0])
    seconds = results[0]["ended"] - _fault_time(str(tmp_path))
    print(f"rank 0 exited {seconds:.2f} s after rank 1 hung (timeout 3 s)")
    assert 2 < seconds < 3 + 6


@pytest.mark.soak  # about 20 s: bench/soak_tests.sh runs it
def test_a_rank_that_fails_while_its_allreduce_thread_waits_still_exits(tmp_path):
    # Rank 1 hangs before its backward of step 5; rank 0 raises in the middle of that backward,
    # after its last layers' buckets went out: its allreduce thread waits for rank 1 (60 s).
    results = _run_ranks(str(tmp_path), {"timeout": 60, "fault": "hang", "at": 5, "raise_at": 5, "raise_delay": 0.5},
                         hung=(1,))
    assert results[0]["code"] == 1, results[0]["stderr"][-2000:]
    assert "injected failure in backward" in results[0]["stderr"]
    assert "terminate called" not in results[0]["stderr"]
    seconds = results[0]["ended"] - _fault_time(str(tmp_path))
    print(f"rank 0 exited {seconds:.2f} s after raising (timeout 60 s)")
    assert seconds < 10


def test_a_rank_that_fails_while_its_allreduce_thread_finishes_exits_cleanly(tmp_path):
    # Rank 1 is healthy: rank 0's allreduce thread gets its answer while rank 0 is exiting.
    # A daemon thread that comes back into Python during finalization would abort the process.
    results = _run_ranks(str(tmp_path), {"timeout": 30, "raise_at": 5})
    assert results[0]["code"] == 1, results[0]["stderr"][-2000:]
    assert "terminate called" not in results[0]["stderr"]
    assert results[1]["code"] == 1
    assert "rank 1: step 5: no answer from rank 0: the connection was closed" in _last_error(results[1])


# ---------------------------------------------------------------- resume

def _resume(tmp_path, crashed, damage=None):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(crashed[0], "ckpt"), ckpt)
    if damage:
        damage(ckpt)
    results = _run_ranks(str(tmp_path), {"timeout": 30, "checkpoint_dir": ckpt, "checkpoint_every": 3, "resume": True})
    assert [r["code"] for r in results] == [0, 0], [r["stderr"][-2000:] for r in results]
    return [_params(str(tmp_path), r) for r in range(2)]


def test_resumed_after_a_crash_equals_one_straight_run(tmp_path, crashed, straight):
    for name in ("rank0", "rank1"):
        assert sorted(os.listdir(os.path.join(crashed[0], "ckpt", name))) == ["ckpt-00000004-epoch.pt",
                                                                               "ckpt-00000006.pt"]
    got = _resume(tmp_path, crashed)
    assert any("ckpt-00000006.pt (epoch 2, step 6)" in line for line in got[0]["logs"]), got[0]["logs"]
    # it continued rather than retrained: epoch 1 was done before the crash and is not run again
    assert not any(line.startswith("epoch 1:") for line in got[0]["logs"]), got[0]["logs"]
    for r in range(2):
        for p, q in zip(got[r]["params"], straight[r]):
            assert torch.equal(p, q), f"rank {r} differs from the straight run"
    assert not torch.equal(straight[0][0], _net()[0].weight.detach())


def test_a_truncated_checkpoint_on_one_rank_makes_all_ranks_resume_from_the_previous(tmp_path, crashed, straight):
    def truncate(ckpt):
        with open(os.path.join(ckpt, "rank1", "ckpt-00000006.pt"), "r+b") as f:
            f.truncate(100)
    got = _resume(tmp_path, crashed, truncate)
    assert any("ckpt-00000004-epoch.pt (epoch 2, step 4)" in line for line in got[0]["logs"]), got[0]["logs"]
    assert not any(line.startswith("epoch 1:") for line in got[0]["logs"]), got[0]["logs"]
    for r in range(2):
        for p, q in zip(got[r]["params"], straight[r]):
            assert torch.equal(p, q), f"rank {r} differs from the straight run"


# ---------------------------------------------------------------- non-finite gradients, resume mismatch

def _nonfinite_job(tmp):
    """On 3 ranks, with a NaN loss on rank 2 only at step 5: raise, skip, no check; then a rank without checkpoints."""
    from manualdp.runners.loop import train_spmd
    from manualdp.guard import NonFiniteGradientError
    rank = torch.distributed.get_rank()
    out = {}

    def run(nonfinite, epochs=EPOCHS, **kw):
        net = _net()
        logs = []
        faulty = FaultyLoss(kw.pop("fault", "nan"), 2, 5, os.path.join(tmp, "t"))
        train_spmd(net, *_loaders(), epochs, 0.2, loss_fn=faulty,
                   nonfinite=nonfinite, progress=False, log=logs.append, timeout=20, bucket_cap_mb=0.0002, **kw)
        return {"params": [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                           for p in net.parameters()], "logs": logs,
                "buffers": [b.detach().clone() for b in net.buffers()]}

    try:
        run("raise")
        out["raise"] = None
    except NonFiniteGradientError as e:
        out["raise"] = str(e)
    out["skip"] = run("skip")
    out["off"] = run(None)
    try:  # ZeRO-3: each rank holds its shards' gradients only, and the ranks decide together
        run("raise", zero=3, algorithm="ring")
        out["zero3 raise"] = None
    except NonFiniteGradientError as e:
        out["zero3 raise"] = str(e)
    out["zero3 skip"] = run("skip", zero=3, algorithm="ring")
    ckpt = os.path.join(tmp, "ckpt")
    run(None, epochs=1, fault=None, checkpoint_dir=ckpt)
    torch.distributed.barrier()
    if rank == 2:
        shutil.rmtree(os.path.join(ckpt, "rank2"))
    torch.distributed.barrier()
    try:
        run(None, fault=None, checkpoint_dir=ckpt, resume=True)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    from manualdp.spmd import launch
    return launch(_nonfinite_job, 3, (str(tmp_path_factory.mktemp("nonfinite")),), timeout=120)


def test_a_nan_on_one_rank_stops_every_rank_naming_parameter_and_step(nonfinite):
    for r in range(3):
        assert nonfinite[r]["raise"] == f"rank {r}: non-finite gradient in parameter '0.weight' at step 5"


def test_with_zero3_a_nan_on_one_rank_stops_or_is_skipped_by_every_rank(nonfinite):
    for r in range(3):
        message = nonfinite[r]["zero3 raise"]
        assert message.startswith(f"rank {r}: non-finite gradient in parameter '") and message.endswith(" at step 5")
    skip = nonfinite[0]["zero3 skip"]
    assert sum("skipped" in line for line in skip["logs"]) == 1
    assert all(torch.isfinite(p).all() for p in skip["params"])
    for r in range(1, 3):
        assert all(torch.equal(p, q) for p, q in zip(nonfinite[r]["zero3 skip"]["params"], skip["params"]))


def test_a_nan_on_one_rank_is_skipped_by_every_rank(nonfinite):
    skip, off = nonfinite[0]["skip"], nonfinite[0]["off"]
    assert "step 5: non-finite gradient, update skipped on every rank" in skip["logs"]
    assert sum("skipped" in line for line in skip["logs"]) == 1
    for r in range(1, 3):  # had one rank stepped with the NaN, or not skipped, the ranks would differ
        for p, q in zip(nonfinite[r]["skip"]["params"], skip["params"]):
            assert torch.equal(p, q)
    assert all(torch.isfinite(p).all() for p in skip["params"])
    assert all(torch.isfinite(b.double()).all() for b in skip["buffers"]), "the bad step's BatchNorm statistics stayed"
    # Without the check, rank 2's NaN reaches every rank's parameters: the skip was needed on all.
    for r in range(3):
        assert all(torch.isnan(p).any() for p in nonfinite[r]["off"]["params"])


def test_resume_refuses_when_one_rank_has_no_checkpoint(nonfinite):
    for r in range(3):
        message = nonfinite[r]["mismatch"]
        assert message is not None and "rank(s) [2] have no readable checkpoint" in message


# ---------------------------------------------------------------- bad input, in one process

@pytest.mark.parametrize("kwargs, error, words", [
    ({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of"),
    ({"checkpoint_every": 0, "checkpoint_dir": "x"}, ValueError,
     "checkpoint_every must be a positive int or None, got 0"),
    ({"checkpoint_every": 2}, ValueError, "need checkpoint_dir"),
    ({"resume": True}, ValueError, "need checkpoint_dir"),
    ({"resume": "yes", "checkpoint_dir": "x"}, TypeError, "resume must be a bool, got 'yes'"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or None, got 0"),
    ({"timeout": float("inf")}, ValueError, "timeout must be a positive number"),
    ({"timeout": "10"}, ValueError, "got '10'"),
    ({"log": "print"}, TypeError, "log must be callable"),
])
def test_train_spmd_rejects_bad_new_arguments(kwargs, error, words):
    from manualdp.runners.loop import train_spmd
    with pytest.raises(error, match=words):
        train_spmd(nn.Linear(2, 2), [], [], 1, 0.1, progress=False, **kwargs)


@pytest.mark.parametrize("timeout", [0, -1.5, True, "5", float("nan")])
def test_timeouts_are_checked_before_any_communication(timeout):
    from manualdp.distributed import DistributedDataParallel, allreduce
    x = torch.arange(3.0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds or None"):
        allreduce(x, timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        DistributedDataParallel(nn.Linear(2, 2), timeout=timeout)
    assert torch.equal(x, torch.arange(3.0))


def test_peer_error_names_rank_step_and_peer_and_survives_pickling():
    import pickle

    from manualdp.spmd.transport.peers import PeerError
    silent = PeerError(0, 1, True, 10.0, "Timed out waiting 10000ms").at("step 12")
    assert str(silent) == ("rank 0: step 12: no answer from rank 1 within 10 s (it may have died or hung) "
                           "[Timed out waiting 10000ms]")
    gone = PeerError(2, None, False, 10.0)
    assert str(gone) == "rank 2: no answer from the other ranks: the connection was closed (it may have died)"
    assert str(pickle.loads(pickle.dumps(silent))) == str(silent)


def test_after_one_failed_call_the_worker_fails_the_queued_ones_without_running_them():
    from manualdp.spmd.transport.worker import SerialWorker
    worker, ran = SerialWorker("test"), []

    def fail():
        time.sleep(0.1)  # the calls below are queued meanwhile
        raise OSError("boom")
    futures = [worker.submit(fail)] + [worker.submit(ran.append, i) for i in range(3)]
    for f in futures:
        with pytest.raises(OSError, match="boom"):
            f.result(timeout=10)
    assert ran == []
    worker.shutdown()
    worker._thread.join(timeout=10)
    assert not worker._thread.is_alive()


# ---------------------------------------------------------------- through the command line, under torchrun

CLI = ["--no-progress", "--num-train", "256", "--num-test", "128", "--batch-size", "32", "--timeout", "30"]


def _torchrun(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "manualdp", "train", *CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.mark.soak  # about 20 s: bench/soak_tests.sh runs it
def test_resume_under_torchrun_equals_one_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _torchrun("--epochs", "2", "--json", str(tmp_path / "a.json"))
    first = _torchrun("--epochs", "1", "--checkpoint-dir", ckpt, "--checkpoint-every", "3")
    second = _torchrun("--epochs", "2", "--checkpoint-dir", ckpt, "--resume", "--json", str(tmp_path / "b.json"))
    for out in (straight, first, second):
        assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["rank0", "rank1"]
    assert "resumed from" in second.stdout and "(epoch 2, step 8)" in second.stdout
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["train_loss"] == b["train_loss"] and a["test_acc"] == b["test_acc"]
    assert a["train_loss"][0] != a["train_loss"][1]


def test_a_rank_that_stops_on_an_error_under_torchrun_ends_without_the_interpreters_exit(tmp_path):
    # Left to the interpreter's exit, gloo's threads freeing the last broadcast's tensors aborted
    # about one run in four refused for a bad MANUALDP_LINK ("terminate called without an active
    # exception"): `python -m manualdp` ends at once after writing its error, its exit handlers run first (atexit:
    # multiprocessing removes its temporary folder there), the interpreter's finalization never (threading's own
    # exit hooks run there, first)
    script = tmp_path / "rank.py"
    script.write_text("import atexit, runpy, threading\n"
                      "atexit.register(lambda: print('exit handlers', flush=True))\n"
                      "threading._register_atexit(lambda: print('interpreter exit', flush=True))\n"
                      "runpy.run_module('manualdp', run_name='__main__')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", MANUALDP_LINK="fast", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), "train", *CLI, "--epochs", "1"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode != 0 and "manualdp train: error: MANUALDP_LINK must be" in out.stderr, out.stderr[-2000:]
    assert "interpreter exit" not in out.stdout and "terminate called" not in out.stderr
    assert out.stdout.count("exit handlers") == 2, out.stdout


def test_a_rank_whose_peers_never_come_gives_up_after_timeout_with_one_line(tmp_path):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "manualdp", "train", *CLI[:-1], "2", "--epochs", "1"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr.startswith("manualdp train: error: could not join the other ranks")
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 2 + 15
