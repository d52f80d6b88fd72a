"""Adversarial tests of the fault-tolerant room (manualdp/spmd/ft/) and its command line (issue 33).

Each case asserts the RIGHT behaviour; a case that exposes a bug is marked xfail(strict=True) with
what goes wrong, so the file is green and the bug recorded. Classes as in shared/ADVERSARY.md.

    python -m pytest -q bench/test_adversary_ft.py            (a few minutes on 2 cores)

The replica processes run this very file: `python -m bench.test_adversary_ft CONFIG_JSON` (`worker`).
"""
import contextlib
import copy
import hashlib
import json
import math
import os
import pathlib
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ================================================================ the replica process

def _model(cfg):
    torch.manual_seed(cfg.get("seed", 0))
    width = cfg.get("width", 16)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 4))
    if cfg.get("extra"):  # a parameter used by some replicas only
        model.add_module("extra", nn.Linear(4, 4))
    if cfg.get("frozen"):
        model[0].weight.requires_grad_(False)
    return model.to(getattr(torch, cfg.get("dtype", "float64")))


def _shard(b, index, dtype):
    from tests.spmd.ft.replica import my_shard
    X, y = my_shard(b, index)
    return X.to(dtype), y.to(dtype)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _sha(model):
    return hashlib.sha256(_flat(model).numpy().tobytes()).hexdigest()


def _patch(cfg, manager_module):
    """Faults planted in this process, by name."""
    fault = cfg.get("fault")
    if fault == "kill_in_send_state":  # a source that dies right after it wrote the state, at its second sending
        original, count = manager_module.send_state, [0]

        def send(store, round_, source, state):
            out = original(store, round_, source, state)
            count[0] += 1
            if count[0] >= cfg.get("fault_nth", 2):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        manager_module.send_state = send
    elif fault == "kill_in_receive_state":  # a joiner that dies while it receives
        def receive(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        manager_module.receive_state = receive
    elif fault in ("corrupt_send", "corrupt_send_once"):  # the state is damaged in the store after it was written
        original, count = manager_module.send_state, [0]

        def send(store, round_, source, state):
            digest = original(store, round_, source, state)
            count[0] += 1
            if fault == "corrupt_send" or count[0] == 1:
                key = f"state/{round_}/{source}"
                blob = bytearray(store.get(key))
                blob[len(blob) // 2] ^= 0xFF
                store.set(key, bytes(blob))
            return digest
        manager_module.send_state = send


def worker(cfg):
    torch.set_num_threads(1)
    import manualdp.spmd.ft.manager as manager_module
    from manualdp.spmd.ft import DiLoCo, FaultTolerantDDP, LocalSGD, Manager
    _patch(cfg, manager_module)
    out = pathlib.Path(cfg["out"])
    index, dtype = cfg["index"], getattr(torch, cfg.get("dtype", "float64"))
    try:
        manager = Manager(cfg["id"], "127.0.0.1", cfg["port"], min_replicas=cfg.get("min_replicas", 1),
                          timeout=cfg.get("timeout", 5), quorum_timeout=cfg.get("quorum_timeout", 2),
                          heartbeat_interval=0.1, heartbeat_timeout=cfg.get("heartbeat_timeout", 1.0))
        model = _model(cfg)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.get("lr", 0.1),
                              momentum=0.9)
        mode = cfg.get("mode", "ddp")
        if mode == "ddp":
            ft = FaultTolerantDDP(model, opt, manager)
        elif mode == "local_sgd":
            ft = LocalSGD(model, opt, manager, cfg["sync_every"])
        else:
            ft = DiLoCo(model, opt, manager, cfg["sync_every"], outer_lr=0.7, outer_momentum=0.9)
        if cfg.get("bad_state"):  # code a user wrote: a registered state torch.load(weights_only=True) refuses
            manager.register_state("mine", lambda: {"when": Opaque()}, lambda s: None)
        records = []
        while manager.step < cfg["steps"]:
            quorum = ft.start_step()
            b = ft.batch_index
            if cfg.get("hold_at") == b:  # a slow step (evaluation, a slow loader): alive, beating, not asking
                cfg["hold_at"] = None
                deadline = time.monotonic() + 60
                while not manager.store.check(["go"]) and time.monotonic() < deadline:
                    time.sleep(0.02)
            X, y = _shard(b, index, dtype)
            if cfg.get("nan_at") == b:
                X = X.clone()
                X[0, 0] = float("nan")
            if cfg.get("step_sleep"):
                time.sleep(cfg["step_sleep"])
            h = model[2](model[1](model[0](X)))
            if cfg.get("extra") and index in cfg.get("extra_used_by", []):
                h = model.extra(h)
            ((h - y) ** 2).mean().backward()
            if cfg.get("kill_allreduce_at") == b:
                from tests.spmd.ft.replica import die_in_first_send
                die_in_first_send(signal.SIGKILL)
            committed = ft.step()
            if committed is None:
                continue
            q = manager.quorum
            rec = {"batch": b, "round": q.round, "members": q.ids, "committed": committed, "step": manager.step}
            if committed:
                rec["sha256"] = _sha(model)
            records.append(rec)
            with open(str(out) + "l", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if cfg.get("pause_after") is not None and manager.step == cfg["pause_after"]:
                deadline = time.monotonic() + 60
                while not manager.store.check(["go"]) and time.monotonic() < deadline:
                    time.sleep(0.02)
                cfg["pause_after"] = None
        result = {"id": cfg["id"], "step": manager.step, "sha256": _sha(model), "final": _flat(model).tolist(),
                  "recoveries": manager.recoveries, "records": records}
        out.write_text(json.dumps(result))
        manager.close()
    except BaseException as e:  # noqa: BLE001 - recorded for the test to judge
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.stdout.flush()
        os._exit(3)
    sys.stdout.flush()
    os._exit(0)


class Opaque:
    """An object torch.load(weights_only=True) will not load."""


# ================================================================ the harness

class Run:
    """A coordinator in this process, replica processes of `worker`, each killed at the end."""

    def __init__(self, tmp):
        from manualdp.spmd.ft import Coordinator
        self.tmp = tmp
        self.coordinator = Coordinator(0)
        self.port = self.coordinator.port
        self.store = torch.distributed.PrefixStore(
            "manualdp-ft", torch.distributed.TCPStore("127.0.0.1", self.port, is_master=False))
        self.procs, self.outs = {}, {}

    def start(self, rid, index, **cfg):
        n = len(self.outs.setdefault(rid, []))
        out = self.tmp / f"{rid}-{n}.json"
        self.outs[rid].append(out)
        cfg = {"id": rid, "index": index, "port": self.port, "out": str(out), **cfg}
        log = open(self.tmp / f"{rid}-{n}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "bench.test_adversary_ft", json.dumps(cfg)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        log.close()
        self.procs.setdefault(rid, []).append(proc)
        return proc

    def key(self, key):
        return self.store.get(key) if self.store.check([key]) else None

    def records(self, rid, n=0):
        p = pathlib.Path(str(self.outs[rid][n]) + "l")
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def wait(self, what, cond, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s; logs:\n{self.logs()}")
            time.sleep(0.05)

    def finish(self, timeout=60.0, rids=None):
        """Wait for the last process of each replica; {rid: (returncode, result)}."""
        deadline = time.monotonic() + timeout
        out = {}
        for rid, procs in self.procs.items():
            if rids is not None and rid not in rids:
                continue
            for n, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"replica {rid} did not end within {timeout} s (a hang); logs:\n"
                                       f"{self.logs()}") from None
                path = self.outs[rid][n]
                out.setdefault(rid, []).append((code, json.loads(path.read_text()) if path.exists() else {}))
        return out

    def logs(self):
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self):
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        self.store = None
        self.coordinator.close()


@contextlib.contextmanager
def run(tmp):
    r = Run(tmp)
    try:
        yield r
    finally:
        r.close()


def last(results, rid):
    return results[rid][-1]


def committed_shas(results):
    """batch -> {rid: sha256} over every committed record of every process."""
    steps = {}
    for rid, runs in results.items():
        for _, res in runs:
            for r in res.get("records", []):
                if r["committed"]:
                    steps.setdefault(r["batch"], {})[rid] = r["sha256"]
    return steps


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(args, timeout=60, log=None):
    """`manualdp ARGS` as a subprocess: (returncode, output, seconds); killed on timeout."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "manualdp", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, time.monotonic() - start


CLI_RUN = ["--model", "mlp", "--num-train", "128", "--num-test", "32", "--batch-size", "32", "--epochs", "1",
           "--no-progress"]


# ================================================================ in-process fixtures

@pytest.fixture(scope="module")
def coordinator():
    from manualdp.spmd.ft import Coordinator
    with Coordinator(0) as c:
        yield c


@pytest.fixture
def manager(coordinator, request):
    from manualdp.spmd.ft import Manager
    made = []

    def make(rid=None, **kw):
        m = Manager(rid or f"{request.node.name[:40]}-{len(made)}".replace("[", "_").replace("]", "_")
                    .replace("/", "_"), "127.0.0.1", coordinator.port, **{"timeout": 5, **kw})
        made.append(m)
        return m
    yield make
    for m in made:
        m.close()


def one_line_naming(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text.strip(), text
    for w in words:
        assert w in text, (w, text)


# ================================================================ values: inputs of the wrong type or range

@pytest.mark.parametrize("kw, name", [
    ({"replica_id": 5}, "replica_id"), ({"replica_id": ""}, "replica_id"), ({"replica_id": "a b"}, "replica_id"),
    ({"port": "29510"}, "port"), ({"port": True}, "port"), ({"port": 70000}, "port"),
    ({"min_replicas": 0}, "min_replicas"), ({"min_replicas": True}, "min_replicas"),
    ({"min_replicas": 2.5}, "min_replicas"),
    ({"timeout": float("nan")}, "timeout"), ({"timeout": 0}, "timeout"), ({"timeout": "5"}, "timeout"),
    ({"quorum_timeout": -1}, "quorum_timeout"), ({"heartbeat_interval": float("inf")}, "heartbeat_interval"),
    ({"heartbeat_timeout": None}, "heartbeat_timeout"), ({"algorithm": "auto"}, "algorithm"),
    ({"algorithm": "bogus"}, "algorithm"),
])
def test_values_manager_refuses_a_bad_argument_naming_it(coordinator, kw, name):
    from manualdp.spmd.ft import Manager
    args = {"replica_id": "v", "host": "127.0.0.1", "port": coordinator.port, **kw}
    rid, host, port = args.pop("replica_id"), args.pop("host"), args.pop("port")
    t = time.monotonic()
    with pytest.raises((ValueError, TypeError)) as e:
        Manager(rid, host, port, **args)
    assert time.monotonic() - t < 5
    one_line_naming(e, name)


def test_values_manager_refuses_a_host_that_is_not_a_string(coordinator):
    from manualdp.spmd.ft import Manager
    with pytest.raises((ValueError, TypeError)) as e:
        Manager("h", None, coordinator.port)
    one_line_naming(e, "host")


def test_values_manager_refuses_a_heartbeat_timeout_shorter_than_the_interval(coordinator):
    from manualdp.spmd.ft import Manager
    m = None
    try:
        with pytest.raises(ValueError) as e:
            m = Manager("hb", "127.0.0.1", coordinator.port, heartbeat_interval=1.0, heartbeat_timeout=0.2)
        one_line_naming(e, "heartbeat_timeout")
    finally:
        if m is not None:
            m.close()


@pytest.mark.parametrize("kw, name", [({"port": -1}, "port"), ({"port": "x"}, "port"), ({"port": 1.5}, "port"),
                                      ({"host": None}, "host"), ({"host": 7}, "host")])
def test_values_coordinator_refuses_a_bad_argument_naming_it(kw, name):
    from manualdp.spmd.ft import Coordinator
    c = None
    try:
        with pytest.raises((ValueError, TypeError)) as e:
            c = Coordinator(**kw)
        one_line_naming(e, name)
    finally:
        if c is not None:
            c.close()


def test_values_coordinator_on_a_port_in_use_says_so(coordinator):
    from manualdp.spmd.ft import Coordinator
    with pytest.raises((RuntimeError, OSError)) as e:
        Coordinator(coordinator.port)
    text = str(e.value).lower()
    assert "use" in text or str(coordinator.port) in text, text


def test_values_ft_wrappers_refuse_bad_arguments_naming_them(manager):
    from manualdp.spmd.ft import DiLoCo, FaultTolerantDDP, LocalSGD
    m = manager()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="module"):
        FaultTolerantDDP("net", opt, m)
    with pytest.raises(TypeError, match="manager"):
        FaultTolerantDDP(net, opt, None)
    for bad in (0, -1, 2.5, True, "2", None):
        with pytest.raises(ValueError, match=rf"sync_every must be a positive int, got {bad!r}"):
            LocalSGD(net, opt, m, bad)
    for kw, name in (({"outer_lr": 0}, "outer_lr"), ({"outer_lr": float("nan")}, "outer_lr"),
                     ({"outer_momentum": 1.5}, "outer_momentum"), ({"outer_momentum": float("nan")}, "outer_momentum")):
        with pytest.raises(ValueError, match=name):
            DiLoCo(nn.Linear(2, 2), opt, manager(), 2, **kw)


def test_values_a_refused_wrapper_leaves_the_manager_usable(manager):
    from manualdp.spmd.ft import DiLoCo, FaultTolerantDDP
    m = manager()
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="outer_lr"):
        DiLoCo(net, opt, m, 2, outer_lr=-1.0)
    FaultTolerantDDP(net, opt, m)  # the user fixes the typo and goes on


def test_user_code_optimizer_over_other_parameters_is_refused(manager):
    from manualdp.spmd.ft import FaultTolerantDDP
    net, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer"):
        FaultTolerantDDP(net, torch.optim.SGD(other.parameters(), lr=0.1), manager())


# ================================================================ between and around steps, in one process

def test_around_steps_calls_out_of_order_raise_clearly(manager):
    m = manager()
    with pytest.raises(RuntimeError, match="start_step"):
        m.average(torch.ones(3))
    with pytest.raises(RuntimeError, match="start_step"):
        m.should_commit(True)


def test_around_steps_two_wrappers_on_one_manager_are_refused(manager):
    from manualdp.spmd.ft import FaultTolerantDDP
    m = manager()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    FaultTolerantDDP(a, torch.optim.SGD(a.parameters(), lr=0.1), m)
    with pytest.raises(ValueError, match="already registered"):
        FaultTolerantDDP(b, torch.optim.SGD(b.parameters(), lr=0.1), m)


def test_around_steps_quorum_and_member_pickle_and_the_manager_refuses_clearly(manager):
    from manualdp.spmd.ft import Member, Quorum, RecoveryError
    q = Quorum(3, (Member("a", 2, True, (1, 2), 1), Member("b", 2, True, (1, 2), 1)), 1)
    assert pickle.loads(pickle.dumps(q)) == q and Quorum.from_json(q.to_json()) == q
    e = pickle.loads(pickle.dumps(RecoveryError("x")))
    assert isinstance(e, RecoveryError) and str(e) == "x"
    with pytest.raises(TypeError):
        pickle.dumps(manager())


def test_around_steps_start_step_twice_raises(coordinator):
    from manualdp.spmd.ft import Coordinator, Manager
    with Coordinator(0) as c:
        m = Manager("twice", "127.0.0.1", c.port, timeout=5, quorum_timeout=0.5)
        try:
            m.start_step()
            with pytest.raises(RuntimeError, match="start_step"):
                m.start_step()
        finally:
            m.close()


def test_around_steps_manager_from_two_threads_does_not_hang_or_corrupt(coordinator):
    """Two threads asking for a step on one manager at once: both get the same quorum, or one is told clearly."""
    from manualdp.spmd.ft import Coordinator, Manager
    with Coordinator(0) as c:
        m = Manager("threads", "127.0.0.1", c.port, timeout=5, quorum_timeout=0.5)
        got, errors = [], []

        def go():
            try:
                got.append(m.start_step())
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=go, daemon=True) for _ in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            assert not any(t.is_alive() for t in threads), "start_step from two threads hung"
            assert len(got) + len(errors) == 2
            if len(got) == 2:
                assert got[0] == got[1], "two threads of one replica took two different rounds"
        finally:
            m.close()


# ================================================================ ranks that disagree (processes)

def test_disagree_two_live_replicas_with_the_same_id(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=30, step_sleep=0.1, timeout=4)
        r.start("b", 1, steps=30, step_sleep=0.1, timeout=4)
        r.wait("a and b trained a step", lambda: len(r.records("a")) >= 1)
        dup = r.start("a", 2, steps=30, step_sleep=0.1, timeout=4)
        try:
            dup.wait(timeout=12)
        except subprocess.TimeoutExpired:
            pytest.fail("the duplicate replica 'a' was not refused within 12 s")
        err = json.loads(r.outs["a"][1].read_text()).get("error", "")
        assert dup.returncode != 0 and "'a'" in err and ("already" in err or "duplicate" in err or "live" in err), err
        res = r.finish(timeout=60, rids=["b"])
        assert res["b"][0][0] == 0


def test_disagree_local_sgd_beside_diloco_is_refused(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, mode="diloco", sync_every=2, min_replicas=2)
        r.start("b", 1, steps=3, mode="local_sgd", sync_every=2, min_replicas=2)
        res = r.finish(timeout=60)
    assert all(code != 0 for code, _ in (last(res, "a"), last(res, "b"))), "both trained: no refusal"


def test_disagree_local_sgd_sync_every_differs_is_refused(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, mode="local_sgd", sync_every=2, min_replicas=2)
        r.start("b", 1, steps=3, mode="local_sgd", sync_every=3, min_replicas=2)
        res = r.finish(timeout=60)
    assert all(code != 0 for code, _ in (last(res, "a"), last(res, "b"))), "both trained: no refusal"


def test_disagree_model_dtype_differs_refused_without_a_gloo_abort(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, timeout=4)
        r.start("b", 1, steps=3, min_replicas=2, timeout=4, dtype="float32")
        res = r.finish(timeout=60)
    codes = [last(res, x)[0] for x in "ab"]
    assert -signal.SIGABRT not in codes and -signal.SIGSEGV not in codes, (codes, r.logs())
    assert any(c != 0 for c in codes), "float64 beside float32 trained without a word"
    errors = " ".join(last(res, x)[1].get("error", "") for x in "ab")
    assert "dtype" in errors or "float32" in errors or "Float" in errors, errors


def test_disagree_model_shape_differs_fails_clearly_no_hang(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, timeout=2)
        r.start("b", 1, steps=3, min_replicas=2, timeout=2, width=32)
        res = r.finish(timeout=60)
    (ca, ra), (cb, rb) = last(res, "a"), last(res, "b")
    assert ca != 0 and cb != 0, (ca, cb)
    assert "size mismatch" in rb.get("error", "") or "shape" in rb.get("error", ""), rb
    assert "TimeoutError" in ra.get("error", ""), ra  # a, left alone below its minimum, says so


def test_disagree_learning_rate_differs_is_refused(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=2, min_replicas=2, lr=0.1)
        r.start("b", 1, steps=2, min_replicas=2, lr=0.5)
        res = r.finish(timeout=60)
    assert any(last(res, x)[0] != 0 for x in "ab"), "lr 0.1 beside lr 0.5 trained without a word"


def test_disagree_min_replicas_a_lone_joiner_never_overwrites_the_members_state(tmp_path):
    with run(tmp_path) as r:
        for i, rid in enumerate("ab"):
            r.start(rid, i, steps=3, min_replicas=2, hold_at=1, quorum_timeout=1.0, timeout=6)
        r.wait("a and b committed a step", lambda: len(r.records("a")) >= 1 and len(r.records("b")) >= 1)
        r.start("c", 2, steps=5, min_replicas=1, pause_after=3, quorum_timeout=1.0, timeout=6)
        time.sleep(4.0)  # c holds nothing: it may not begin the run again below the committed step (durable.Floor)
        assert not r.records("c"), "c trained alone from step 0 while the run had committed steps"
        r.store.set("go", "1")
        res = r.finish(timeout=60)
    for rid in "ab":
        code, out = last(res, rid)
        assert code == 0, r.logs()
        later = [x for x in out["recoveries"] if x["round"] > 1]
        assert not later, f"{rid}, which never missed a step, received another state: {later}"


# ================================================================ models that are not a plain stack

def test_models_frozen_and_one_rank_only_parameters_stay_identical(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, frozen=True, extra=True, extra_used_by=[0])
        r.start("b", 1, steps=3, min_replicas=2, frozen=True, extra=True, extra_used_by=[0])
        res = r.finish(timeout=60)
    assert last(res, "a")[0] == 0 and last(res, "b")[0] == 0, r.logs()
    steps = committed_shas(res)
    assert sorted(steps) == [0, 1, 2]
    for shas in steps.values():
        assert len(set(shas.values())) == 1
    assert last(res, "a")[1]["final"] == last(res, "b")[1]["final"]


# ================================================================ values (processes)

def test_values_nan_on_one_replica_is_discarded_and_named_never_committed(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, timeout=4)
        r.start("b", 1, steps=3, min_replicas=2, nan_at=1, timeout=4)
        res = r.finish(timeout=60)
    logs = r.logs()
    assert "replica b's contribution is out of line: non-finite" in logs and "removed after 3 in a row" in logs, logs
    assert last(res, "b")[0] != 0, logs  # the contribution guard removed it
    for shas in committed_shas(res).values():
        assert len(set(shas.values())) == 1
    final = last(res, "a")[1].get("final")
    assert final is None or not any(math.isnan(v) for v in final), "a NaN step was committed"


# ================================================================ what a user does around steps (processes)

def test_around_steps_local_sgd_joiner_in_the_middle_of_a_window_loses_nothing(tmp_path):
    with run(tmp_path) as r:
        for i, rid in enumerate("ab"):
            r.start(rid, i, steps=3, mode="local_sgd", sync_every=2, hold_at=3, quorum_timeout=1.0, timeout=6)
        r.wait("a and b committed a block", lambda: len(r.records("a")) >= 1 and len(r.records("b")) >= 1)
        r.start("c", 2, steps=5, mode="local_sgd", sync_every=2, pause_after=3, quorum_timeout=1.0, timeout=6)
        time.sleep(4.0)  # c holds nothing: it may not begin the run again below the committed step (durable.Floor)
        assert not r.records("c"), "c trained blocks alone from step 0 while the run had committed steps"
        r.store.set("go", "1")
        res = r.finish(timeout=60)
    for rid in "ab":
        code, out = last(res, rid)
        assert code == 0, r.logs()
        later = [x for x in out["recoveries"] if x["round"] > 1]
        assert not later, f"{rid}, which never missed a block, received another state: {later}"


# ================================================================ faults

def test_faults_two_failures_in_one_step_the_survivor_goes_on(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=4, timeout=4)
        r.start("b", 1, steps=4, timeout=4, kill_allreduce_at=2)
        r.start("c", 2, steps=4, timeout=4, kill_allreduce_at=2)
        res = r.finish(timeout=60)
    code, a = last(res, "a")
    assert code == 0, r.logs()
    assert [p[0] for p in (last(res, "b"), last(res, "c"))] == [-signal.SIGKILL] * 2
    at2 = [(x["members"], x["committed"]) for x in a["records"] if x["batch"] == 2]
    assert at2[-1] == (["a"], True) and all(not c for _, c in at2[:-1]), at2
    assert a["step"] == 4 and sorted(x["batch"] for x in a["records"] if x["committed"]) == [0, 1, 2, 3]


def test_faults_joiner_killed_while_receiving_the_others_go_on(tmp_path):
    with run(tmp_path) as r:
        for i, rid in enumerate("ab"):
            r.start(rid, i, steps=5, min_replicas=2, pause_after=2, timeout=4)
        r.wait("a at step 2", lambda: len(r.records("a")) >= 2)
        c = r.start("c", 2, steps=5, min_replicas=2, fault="kill_in_receive_state", timeout=4)
        r.wait("c asked", lambda: r.key("replicas") is not None and b"c" in r.key("replicas"))
        time.sleep(0.5)
        r.store.set("go", "1")
        res = r.finish(timeout=60)
    assert c.returncode == -signal.SIGKILL
    for rid in "ab":
        assert last(res, rid)[0] == 0, r.logs()
    assert last(res, "a")[1]["sha256"] == last(res, "b")[1]["sha256"]
    for shas in committed_shas(res).values():
        assert len(set(shas.values())) == 1


def test_faults_source_killed_after_sending_the_joiner_recovers_from_another(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=5, min_replicas=2, pause_after=2, timeout=4, fault="kill_in_send_state")
        r.start("b", 1, steps=5, min_replicas=2, pause_after=2, timeout=4)
        r.wait("a at step 2", lambda: len(r.records("a")) >= 2 and len(r.records("b")) >= 2)
        r.start("c", 2, steps=5, min_replicas=2, timeout=4)
        r.wait("c registered", lambda: b"c" in (r.key("replicas") or b""))
        time.sleep(0.5)
        r.store.set("go", "1")
        res = r.finish(timeout=60)
    assert last(res, "a")[0] == -signal.SIGKILL, r.logs()
    (cb, b), (cc, c) = last(res, "b"), last(res, "c")
    assert cb == 0 and cc == 0, r.logs()
    assert b["sha256"] == c["sha256"] and b["step"] == c["step"] == 5
    for shas in committed_shas(res).values():
        assert len(set(shas.values())) == 1


def test_faults_a_payload_damaged_once_is_sent_again_and_all_end_identical(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, timeout=4, fault="corrupt_send_once")
        r.start("b", 1, steps=3, min_replicas=2, timeout=4)
        res = r.finish(timeout=60)
    (ca, a), (cb, b) = last(res, "a"), last(res, "b")
    assert ca == 0 and cb == 0, r.logs()
    assert a["sha256"] == b["sha256"]
    assert b["recoveries"] and all(len(x["sha256"]) == 64 for x in b["recoveries"])


def test_faults_a_payload_always_damaged_is_never_loaded_and_fails_within_the_deadline(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=2, timeout=2, fault="corrupt_send")
        r.start("b", 1, steps=3, min_replicas=2, timeout=2)
        t = time.monotonic()
        res = r.finish(timeout=45)
        took = time.monotonic() - t
    (ca, a), (cb, b) = last(res, "a"), last(res, "b")
    assert not r.records("b"), "b trained on a damaged state"
    assert took < 30, took
    assert cb != 0 and "damaged" in b.get("error", ""), b


def test_faults_coordinator_gone_mid_run_every_replica_ends_within_the_deadline(tmp_path):
    port = free_port()
    coord = subprocess.Popen([sys.executable, "-m", "manualdp", "coordinator", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs = []
    try:
        assert "listening" in coord.stdout.readline()
        outs = []
        for i, rid in enumerate("ab"):
            out = tmp_path / f"{rid}.json"
            outs.append(out)
            cfg = {"id": rid, "index": i, "port": port, "out": str(out), "steps": 10_000, "min_replicas": 2,
                   "timeout": 3, "step_sleep": 0.02}
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.test_adversary_ft", json.dumps(cfg)],
                                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + 60
        while not pathlib.Path(str(outs[0]) + "l").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait()
        t = time.monotonic()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail("a replica hung for 30 s after its coordinator died (timeout 3)")
        assert all(p.returncode == 3 for p in procs), [p.returncode for p in procs]
        assert time.monotonic() - t < 20
        for out in outs:
            assert json.loads(out.read_text())["error"], out
    finally:
        for p in [coord, *procs]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_faults_min_replicas_never_reached_waits_and_never_trains(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=3, min_replicas=3, timeout=2)
        r.start("b", 1, steps=3, min_replicas=3, timeout=2)
        t = time.monotonic()
        res = r.finish(timeout=40)
        took = time.monotonic() - t
    for rid in "ab":
        code, out = last(res, rid)
        assert code == 3 and "TimeoutError" in out["error"] and "at least 3" in out["error"], out
        assert not r.records(rid), f"{rid} trained below its minimum"
    assert took < 20, took


# ================================================================ code a user wrote

def test_user_code_a_state_the_joiner_cannot_load_is_named(tmp_path):
    with run(tmp_path) as r:
        r.start("a", 0, steps=2, min_replicas=2, timeout=2, bad_state=True)
        r.start("b", 1, steps=2, min_replicas=2, timeout=2, bad_state=True)
        res = r.finish(timeout=45)
    errors = [last(res, x)[1].get("error", "") for x in "ab"]
    assert any(e.startswith("RecoveryError") and "mine" in e for e in errors), errors


# ================================================================ paths and addresses: the command line

@pytest.mark.parametrize("address", ["localhost", ":29510", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:x",
                                     "127.0.0.1:", "", "a b:1",
                                     "127.0.0.1:\u00b2"])
def test_paths_cli_bad_host_port_is_one_line_exit_2(address, capsys):
    from manualdp.runners.cli import main
    with pytest.raises(SystemExit) as e:
        main(["train", "--fault-tolerant", address, "--replica-id", "a", *CLI_RUN])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--fault-tolerant" in err and "Traceback" not in err, err
    assert "invalid literal" not in err, err


@pytest.mark.parametrize("args, words", [
    (["--replica-id", "a b"], "--replica-id"), (["--replica-id", ""], "--replica-id"),
    (["--replica-id", "a", "--min-replicas", "0"], "--min-replicas"),
    (["--replica-id", "a", "--min-replicas", "x"], "--min-replicas"),
    ([], "--replica-id"), (["--replica-id", "a", "--devices", "2"], "--devices"),
])
def test_paths_cli_bad_replica_options_are_one_line_exit_2(args, words, capsys):
    from manualdp.runners.cli import main
    with pytest.raises(SystemExit) as e:
        main(["train", "--fault-tolerant", "127.0.0.1:29510", *args, *CLI_RUN])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_paths_cli_nobody_listening_is_one_line_within_the_timeout():
    code, out, took = cli(["train", "--fault-tolerant", f"127.0.0.1:{free_port()}", "--replica-id", "a",
                           "--timeout", "2", *CLI_RUN], timeout=60)
    assert code == 1, out
    assert "cannot reach the coordinator" in out and "Traceback" not in out, out
    assert took < 30, took


def test_paths_cli_coordinator_on_a_port_in_use_is_one_line_exit_1():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, took = cli(["coordinator", "--port", str(port)], timeout=30)
    assert code == 1 and "cannot listen" in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_disagree_cli_different_seed_is_refused(tmp_path):
    port = free_port()
    coord = subprocess.Popen([sys.executable, "-m", "manualdp", "coordinator", "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs = []
    try:
        assert "listening" in coord.stdout.readline()
        for rid, seed in (("a", "0"), ("b", "1")):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "manualdp", "train", "--fault-tolerant", f"127.0.0.1:{port}", "--replica-id",
                 rid, "--min-replicas", "2", "--timeout", "10", "--seed", seed, *CLI_RUN],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1")))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=90))
            except subprocess.TimeoutExpired:
                pytest.fail("a replica hung")
        assert any(c != 0 for c in codes), "seed 0 beside seed 1 trained without a word"
    finally:
        for p in [coord, *procs]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
