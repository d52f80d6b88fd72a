"""A stranger on the coordinator's port: with the run's secret, every forged write is ignored and logged.

Each attack of issue 42 runs in this process against a `Coordinator` and store clients: the
honest parties use `connect(..., token=TOKEN)`; the stranger holds a plain `TCPStore` client and
no secret. torch's store lists its keys to anyone, so the stranger is given every name there is
(`list_keys`), and the name of each key it attacks (the test computes it with the secret): the
worst case. Malformed values are also tried without a secret (the open mode): ignored, logged.
"""
import datetime
import hashlib
import io
import json
import logging
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from manualdp.spmd.ft import Coordinator, RecoveryError
from manualdp.spmd.ft import keys
from manualdp.spmd.ft.commit import commit_or_discard
from manualdp.spmd.ft.coordinator import connect, load_token
from manualdp.spmd.ft.heartbeat import Heartbeat, Liveness, register
from manualdp.spmd.ft.quorum import Quorum, wait_for_quorum
from manualdp.spmd.ft.recovery import plan_recovery, receive_state, send_state
from manualdp.spmd.ft.signed_store import SignedStore

from .harness import member

TOKEN = "a-secret-of-the-run-0123456789"


@pytest.fixture(scope="module")
def signed():
    with Coordinator(0, token=TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
def open_():
    with Coordinator(0) as c:
        yield c


def stranger(coordinator) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", coordinator.port, is_master=False, timeout=datetime.timedelta(seconds=5))


def honest(coordinator, name, token=TOKEN):
    return connect("127.0.0.1", coordinator.port, 5, token=token, namespace=name)


def real_name(store, key: str) -> str:
    return store._name(key)  # what a stranger finds by listing the keys and watching which one changes


def forger(store, coordinator) -> SignedStore:
    """A stranger who knows the format (the source is public) and every name, but guesses the secret."""
    forged = SignedStore(stranger(coordinator), b"a-guess-at-the-secret-000000", "unused")
    forged._name = store._name
    return forged


def save(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def ignored(caplog, key_part: str) -> bool:
    return any("ignored the value" in r.getMessage() and key_part in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------ where it listens, who may connect


def test_the_coordinator_listens_on_the_address_given_only(signed):
    listening = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == signed.port]
    assert listening == [f"0100007F:{signed.port:04X}"]  # 127.0.0.1, not 0.0.0.0
    other = other_address()
    if other is not None:  # this machine's address on its network: refused there, reached on a wide coordinator
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect((other, signed.port))
        with Coordinator(0, host="0.0.0.0", token=TOKEN) as wide, socket.create_connection((other, wide.port), 2):
            pass


def other_address() -> str | None:
    """The address this machine would send from to another network (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_another_address_is_listened_on_only_when_asked_and_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"), Coordinator(0, host="0.0.0.0", token=TOKEN):
        pass
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "0.0.0.0" in text and "encrypts nothing" in text and "no limit on connections" in text


def test_a_replica_without_the_secret_or_with_another_is_refused_in_one_line(signed, open_):
    with pytest.raises(ValueError, match="asks for the run's secret"):
        honest(signed, "t", token=None)
    with pytest.raises(ValueError, match="does not hold this secret"):
        honest(signed, "t", token="another-secret-0123456789")
    with pytest.raises(ValueError, match="runs without a secret"):  # not "does not hold this secret": it holds none
        honest(open_, "t")
    with pytest.raises(ValueError, match="at least 16 characters"):
        honest(signed, "t", token="short")


def test_an_unreachable_coordinator_is_one_line_within_the_timeout_without_cpp_logs(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: nobody answers
        with pytest.raises(ConnectionError) as e:
            connect("127.0.0.1", port, 1)
    assert str(e.value) == f"cannot reach the coordinator at 127.0.0.1:{port} within 1 s"
    assert capfd.readouterr().err == ""


def test_a_token_file_is_read_and_a_bad_one_named(tmp_path, monkeypatch):
    monkeypatch.delenv("MANUALDP_FT_TOKEN", raising=False)
    assert load_token(None) is None
    (tmp_path / "t").write_text(TOKEN + "\n")
    assert load_token(str(tmp_path / "t")) == TOKEN
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="--token-file .*short.*at least 16"):
        load_token(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="--token-file .*cannot read"):
        load_token(str(tmp_path / "missing"))
    monkeypatch.setenv("MANUALDP_FT_TOKEN", TOKEN)
    assert load_token(None) == TOKEN


# ------------------------------------------------------------ the attacks, with the secret


def vote_after_forgery(coordinator, name, round_, forged: dict, oks, caplog):
    """a and b vote `oks` on round `round_`'s step after a stranger set `forged` (key -> value); their outcomes."""
    stores = {rid: honest(coordinator, name) for rid in "ab"}
    beats = []
    for rid, store in stores.items():
        register(store, rid)
        beats.append(Heartbeat(store, rid, 0.05))
    quorum = Quorum(round_, (member("a"), member("b")), round_)
    s = stranger(coordinator)
    for key, value in forged.items():  # str: sealed with a guessed secret; bytes: as they are
        forger(stores["a"], coordinator).set(key, value) if isinstance(value, str) else s.set(
            real_name(stores["a"], key), value)
    results = {}

    def one(rid, ok):
        results[rid] = commit_or_discard(stores[rid], quorum, rid, ok, Liveness(stores[rid], 2.0), timeout=5)
    try:
        with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
            threads = [threading.Thread(target=one, args=(rid, ok)) for rid, ok in zip("ab", oks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        for b in beats:
            b.stop(leave=True)
    return [results.get(rid) for rid in "ab"]


def test_a_forged_commit_is_ignored_and_the_votes_decide(signed, caplog):
    stranger(signed).set("manualdp-ft/forged-commit/" + keys.outcome(1), "commit")  # the plain name: not the run's
    outcome = vote_after_forgery(signed, "forged-commit", 1, {keys.outcome(1): "commit"}, [False, True], caplog)
    assert outcome == [False, False]  # a's allreduce failed: nobody applies the step
    assert ignored(caplog, "round/1/outcome")


def test_a_discard_written_ahead_does_not_stall_the_step(signed, caplog):
    copied = honest(signed, "discard-ahead")._seal(keys.outcome(6), "discard")  # another key's signed value
    outcome = vote_after_forgery(signed, "discard-ahead", 7, {keys.outcome(7): copied}, [True, True], caplog)
    assert outcome == [True, True]
    assert ignored(caplog, "round/7/outcome")


def test_a_forged_heartbeat_neither_ejects_nor_keeps_a_dead_replica_alive(signed, caplog):
    store = honest(signed, "heartbeats")
    register(store, "a")
    register(store, "dead")
    first_a, old = store.get(keys.heartbeat("a")), store.get(keys.heartbeat("dead"))  # signed once: replayed later
    beat = Heartbeat(store, "a", 0.05)
    s = stranger(signed)
    liveness = Liveness(store, 0.5)
    try:
        with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
            liveness.live(["a", "dead"])
            forger(store, signed).set(keys.heartbeat("a"), "ffff -1")  # eject a
            assert liveness.live(["a"]) == {"a"}
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                if int(time.monotonic() * 10) % 3 == 0:
                    s.set(real_name(store, keys.heartbeat("a")), store._seal(keys.heartbeat("a"), first_a))
                forger(store, signed).set(keys.heartbeat("dead"), f"ffff {int(time.monotonic() * 1000)}")
                live = liveness.live(["a", "dead"])
                s.set(real_name(store, keys.heartbeat("dead")), store._seal(keys.heartbeat("dead"), old))
                live = liveness.live(["a", "dead"])
                time.sleep(0.02)
    finally:
        beat.stop(leave=True)
    assert live == {"a"}
    assert ignored(caplog, "heartbeat/a") and ignored(caplog, "heartbeat/dead")


def ask_alone(store, rid, timeout=5.0, **kw):
    """`rid` registered, beating, asking in `store` until its quorum; the quorum (heartbeat stopped after)."""
    register(store, rid)
    beat = Heartbeat(store, rid, 0.05)
    try:
        return wait_for_quorum(store, member(rid, **kw), Liveness(store, 1.0), 0, 0.5, timeout, time.monotonic())
    finally:
        beat.stop(leave=True)


@pytest.mark.parametrize("mode", ["signed", "open"])
def test_malformed_latest_asks_quorum_and_heartbeat_are_ignored_and_logged(signed, open_, mode, caplog):
    coordinator, token = (signed, TOKEN) if mode == "signed" else (open_, None)
    store = honest(coordinator, "malformed", token)
    s = stranger(coordinator)
    name = (lambda k: real_name(store, k))
    s.set(name(keys.LATEST), "x")
    for round_ in (1, 2):  # the open mode skips round 1, which holds a quorum (however malformed)
        s.append(name(keys.asks(round_)), "garbage\n{\"id\": 3}\n")
    s.set(name(keys.quorum(1)), "{not a quorum")
    s.append(name(keys.REPLICAS), "ghost\n")  # an id with no heartbeat at all
    s.set(name(keys.held("b")), "x y z")
    with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
        quorum = ask_alone(store, "a", min_replicas=1)
    assert quorum.ids == ["a"]
    assert ignored(caplog, "latest") and ignored(caplog, f"round/{quorum.round}/asks")
    assert ignored(caplog, "round/1/quorum") and ignored(caplog, "replicas")


def test_a_forged_ask_and_a_forged_quorum_are_ignored(signed, caplog):
    store = honest(signed, "forged-ask")
    s = stranger(signed)
    forged = json.dumps({"id": "liar", "step": 10**6, "synced": True, "group": None, "min_replicas": 1}) + "\n"
    f = forger(store, signed)
    f.append(keys.REPLICAS, "liar\n")
    f.set(keys.heartbeat("liar"), "ffff 1")
    f.append(keys.asks(1), forged)
    s.append(real_name(store, keys.asks(1)), forged)
    f.set(keys.quorum(1), Quorum(1, (member("liar", step=10**6),), 1).to_json())
    with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
        quorum = ask_alone(store, "a", min_replicas=1)
    assert quorum.ids == ["a"] and quorum.step == 0
    assert ignored(caplog, "round/1/quorum")


def test_a_poisoned_state_with_its_own_sha256_is_never_loaded(signed, caplog):
    store = honest(signed, "poison")
    s = stranger(signed)
    poison = save({"step": 10**6, "model": {"w": torch.full((3,), 1e30)}})
    s.set(real_name(store, keys.state(4, "a")), poison)  # written before the source sends: overwritten
    s.set(real_name(store, keys.state_sha256(4, "a")), hashlib.sha256(poison).hexdigest())
    honest_state = {"step": 3, "model": {"w": torch.ones(3)}}
    send_state(store, 4, "a", honest_state)
    state, _ = receive_state(honest(signed, "poison"), 4, "a", timeout=2)
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.ones(3))
    forger(store, signed).set(keys.state(4, "a"), poison)  # written after: the receiver waits, then gives up
    forger(store, signed).set(keys.state_sha256(4, "a"), hashlib.sha256(poison).hexdigest())
    with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"), pytest.raises(RecoveryError):
        receive_state(honest(signed, "poison"), 4, "a", timeout=0.5)
    assert ignored(caplog, "state/4/a")
    send_state(store, 5, "a", honest_state)
    forger(store, signed).set(keys.state(5, "a"), poison)  # the state alone, its sum in place: a store error
    with pytest.raises(RuntimeError, match="holds no value signed"):  # (a RuntimeError: the round fails, not the run)
        receive_state(connect("127.0.0.1", signed.port, 0.5, token=TOKEN, namespace="poison"), 5, "a", timeout=2)


def test_an_open_store_with_a_sum_that_is_not_text_fails_the_recovery_not_the_run(open_):
    store = honest(open_, "sum-bytes", token=None)
    send_state(store, 1, "a", {"step": 0})
    stranger(open_).set(real_name(store, keys.state_sha256(1, "a")), b"\xff\xfe")
    with pytest.raises(RecoveryError, match="damaged"):
        receive_state(store, 1, "a", timeout=2)


def test_a_claim_above_the_committed_steps_is_no_source(open_, caplog):
    store = honest(open_, "claim", token=None)
    store.set(keys.COMMITTED, "5")
    register(store, "liar")
    register(store, "z")
    beats = [Heartbeat(store, "liar", 0.05), Heartbeat(store, "z", 0.05)]
    try:
        with caplog.at_level(logging.WARNING, "manualdp.spmd.ft"):
            store.append(keys.asks(1), json.dumps({"id": "liar", "step": 10**6, "synced": True, "group": None,
                                                   "min_replicas": 1, "since": 0}) + "\n")
            quorum = wait_for_quorum(store, member("z", step=5), Liveness(store, 1.0), 0, 0.5, 5.0, time.monotonic())
    finally:
        for b in beats:
            b.stop(leave=True)
    assert sorted(quorum.ids) == ["liar", "z"]
    assert plan_recovery(quorum) == {"liar": "z"}  # the liar receives; it is nobody's source
    assert any("claims 1000000 committed steps" in r.getMessage() for r in caplog.records)


def test_the_keys_of_a_signed_run_do_not_name_what_they_hold(signed):
    store = honest(signed, "names")
    send_state(store, 1, "a", {"step": 0})
    names = stranger(signed).list_keys()
    assert names and not any("state" in n or "names" in n for n in names)


def test_a_manager_with_the_secret_steps_and_its_group_meets_under_a_secret_name(signed):
    from manualdp.spmd.ft import Manager
    with Manager("solo-signed", "127.0.0.1", signed.port, timeout=10, token=TOKEN) as manager:
        quorum = manager.start_step()
        t = torch.ones(3)
        assert quorum.ids == ["solo-signed"] and manager.average(t) and manager.should_commit(True)
        assert manager.step == 1 and torch.equal(t, torch.ones(3))
    names = stranger(signed).list_keys()
    assert not any("group" in n or "solo" in n or "heartbeat" in n for n in names)


# ------------------------------------------------------------ the split-brain guard


def previous_quorum(store, ids):
    store.set(keys.quorum(1), Quorum(1, tuple(member(r) for r in ids), 1).to_json())
    store.set(keys.LATEST, "1")


def test_the_split_brain_guard_wants_more_than_half_of_the_last_quorum(open_):
    store = honest(open_, "split-brain", token=None)
    previous_quorum(store, "abc")
    register(store, "b")
    register(store, "c")  # c and b registered, silent: dead or cut off by the network
    with pytest.raises(TimeoutError, match="at least 2 replicas"):
        ask_alone(store, "a", timeout=1.5, min_replicas=0)


def test_the_split_brain_guard_goes_on_with_a_majority_or_an_explicit_min_replicas(open_):
    store = honest(open_, "majority", token=None)
    previous_quorum(store, "abc")
    register(store, "b")
    b = Heartbeat(store, "b", 0.05)
    results = {}
    try:
        thread = threading.Thread(target=lambda: results.update(b=wait_for_quorum(
            honest(open_, "majority", token=None), member("b", min_replicas=0), Liveness(store, 1.0), 0, 0.5, 5.0,
            time.monotonic())))
        thread.start()
        results["a"] = ask_alone(store, "a", min_replicas=0)
        thread.join(10)
    finally:
        b.stop(leave=True)
    assert results["a"].ids == ["a", "b"] == results["b"].ids
    alone = honest(open_, "explicit", token=None)
    previous_quorum(alone, "abc")
    assert ask_alone(alone, "a", min_replicas=1).ids == ["a"]  # explicit: the user decided


def test_replicas_that_left_on_purpose_do_not_count_for_the_guard(open_):
    store = honest(open_, "left", token=None)
    previous_quorum(store, "abc")
    for rid in "bc":
        register(store, rid)
        Heartbeat(store, rid, 0.05).stop(leave=True)
    assert ask_alone(store, "a", min_replicas=0).ids == ["a"]


def test_a_signed_value_survives_bytes_appended_and_compare_set_swaps_it(signed):
    store, s = honest(signed, "junk"), stranger(signed)
    store.set("k", "3")
    s.append(real_name(store, "k"), "junk")
    assert store.get("k") == b"3"
    assert store.compare_set("k", "3", "4") == b"4" and store.get("k") == b"4"  # as durable.record_committed does
    s.set(real_name(store, "k"), "forged")
    assert not store.check(["k"])
    assert store.compare_set("k", "", "5") == b"5" and store.get("k") == b"5"  # first writer among the honest
    assert store.compare_set("k", "", "6") == b"5"


# ------------------------------------------------------------ the command line


@pytest.mark.parametrize("argv", [
    ["coordinator", "--port", "0", "--host", "no-such-host.invalid"],
    ["coordinator", "--port", "0", "--host", "a b"],
    ["train", "--fault-tolerant", "no-such-host.invalid:29510", "--replica-id", "a"],
])
def test_a_host_is_checked_before_anything_starts(argv, capsys):
    from manualdp.runners.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "host" in err[-1] and ("resolve" in err[-1] or "spaces" in err[-1])


def test_a_missing_token_file_is_one_line_before_anything_starts(tmp_path, capsys):
    from manualdp.runners.cli import main
    code = main(["coordinator", "--port", "0", "--token-file", str(tmp_path / "missing")])
    assert code == 2 and "--token-file" in capsys.readouterr().err
    code = main(["train", "--fault-tolerant", "127.0.0.1:1", "--replica-id", "a", "--token-file",
                 str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot read it" in err[0]


# ------------------------------------------------------------ the command line, with a stranger writing all along


@pytest.mark.soak
def test_two_replicas_with_a_token_file_train_alike_while_a_stranger_forges(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "token").write_text(TOKEN + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MANUALDP_FT_TOKEN", None)
    run = [sys.executable, "-m", "manualdp"]
    co = subprocess.Popen([*run, "coordinator", "--port", "0", "--token-file", str(tmp_path / "token")],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    procs = [co]
    try:
        port = int(co.stdout.readline().split("127.0.0.1:")[1].split(";")[0])
        options = ["--fault-tolerant", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token"),
                   "--min-replicas", "2", "--model", "mlp", "--num-train", "256", "--num-test", "64",
                   "--batch-size", "32", "--lr", "0.1", "--epochs", "1", "--timeout", "30", "--no-progress"]
        for rid in "ab":
            procs.append(subprocess.Popen([*run, "train", *options, "--replica-id", rid, "--json",
                                           str(tmp_path / f"{rid}.json")], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env))
        s = stranger(type("C", (), {"port": port}))
        while any(p.poll() is None for p in procs[1:]):  # forge decisions, votes, beats and asks under plain names
            for r in range(1, 12):
                for key, value in ((f"round/{r}/outcome", "discard"), (f"round/{r}/vote/a", "0"),
                                   ("heartbeat/b", "ffff -1"), ("latest", "x")):
                    s.set(f"manualdp-ft/{key}", value)
            for name in s.list_keys():  # and append junk to every key it can find
                if name.startswith("manualdp-ft-signed/"):
                    s.append(name, "\n{junk}\n")
            time.sleep(0.05)
        outputs = [p.communicate(timeout=120)[0] for p in procs[1:]]
        assert [p.returncode for p in procs[1:]] == [0, 0], outputs
        sums = [json.loads((tmp_path / f"{rid}.json").read_text())["config"]["fault_tolerant"]["parameters_sha256"]
                for rid in "ab"]
        assert sums[0] == sums[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_strangers_mode_key_neither_refuses_a_replica_with_the_secret_nor_is_called_the_coordinators():
    with Coordinator(0, token=TOKEN) as c:  # its own: the mode key of the module's coordinator stays as it is
        stranger(c).set(f"{keys.PREFIX}/{keys.MODE}", b"junk")
        store = honest(c, "t")  # the signed nonce decides, not the unsigned mode key
        store.set("k", b"v")
        assert store.get("k") == b"v"
    with Coordinator(0) as c:  # an open coordinator with a stranger's "signed": what is known, not a false claim
        with pytest.raises(ValueError, match="asks for the run's secret \\(so says its mode key, which is not signed"):
            stranger(c).set(f"{keys.PREFIX}/{keys.MODE}", b"signed")
            honest(c, "t", token=None)


def test_a_replica_with_a_secret_at_an_open_coordinator_is_told_the_mode_key_is_unsigned(open_):
    with pytest.raises(ValueError, match="holds nothing signed with this secret, and its mode key \\(not signed\\) "
                                         "says 'open': it runs without a secret \\(open\\), or a stranger wrote"):
        honest(open_, "t")
