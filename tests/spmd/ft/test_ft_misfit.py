"""A joiner that does not fit the run (other settings, no room in the global batch) is refused alone (`admission.py`).

In this process: the gates as pure functions, the quorum through a store with threads standing for
replicas, and a `Manager` refused before it asks while the run's manager steps on. The same by the
command line, replica processes: soak (the end of this file).
"""
import concurrent.futures
import dataclasses
import time

import pytest
import torch

from manualdp.spmd.ft import Coordinator, Manager
from manualdp.spmd.ft.coordinator import connect
from manualdp.spmd.ft.admission import Misfit, canonical, check, differences, digest, publish, refusals, split
from manualdp.spmd.ft.heartbeat import Liveness
from manualdp.spmd.ft.quorum import decide, wait_for_quorum
from tests.spmd.ft.cli_harness import check_against_reference, committed, reference, run
from tests.spmd.ft.harness import member
from tests.spmd.ft.test_ft_quorum import registered_with_heartbeat

@pytest.fixture
def store():
    """New connections to a coordinator of this test's own: a run's settings, once published, are for good."""
    with Coordinator(0) as c:
        yield lambda: connect("127.0.0.1", c.port, 10)


RUN = {"lr": 0.1, "seed": 0, "batch_size": 32, "optimizer": "SGD"}


def signed(rid, settings=RUN, capacity=0, **kw):
    """`rid`'s ask, carrying the digest of `settings` and its capacity."""
    return dataclasses.replace(member(rid, **kw), settings=digest(canonical(settings)), capacity=capacity)


def test_differences_name_each_field_with_this_replicas_value_first():
    assert differences({**RUN, "lr": 0.2}, RUN) == "lr 0.2 != 0.1"
    assert differences({**RUN, "seed": 3, "model": "mlp"}, {**RUN, "model": "lenet"}) == \
        "model mlp != lenet, seed 3 != 0"
    assert differences({"lr": 0.1, "epochs": 2}, {"lr": 0.1}) == "epochs 2 != (none)"
    assert differences(RUN, dict(RUN)) == ""


def test_a_quorum_takes_only_the_askers_with_the_run_settings():
    run = digest(canonical(RUN))
    asks = {"a": signed("a", step=4), "b": signed("b", step=4), "c": signed("c", {**RUN, "lr": 0.2}, synced=False)}
    assert [m.id for m in decide(asks, {"a", "b", "c"}, False, run)] == ["a", "b"]
    assert decide({"c": asks["c"]}, {"c"}, True, run) is None  # the misfit alone forms nothing
    assert [m.id for m in decide(asks, {"a", "b", "c"}, False, None)] == ["a", "b", "c"]  # nothing to compare yet


def test_a_quorum_holds_at_most_its_smallest_batch_keeping_those_that_hold_the_run():
    asks = {"a": signed("a", capacity=2, step=0, synced=False),  # the newcomer, first by id
            "m": signed("m", capacity=2, step=5), "n": signed("n", capacity=2, step=5)}
    assert [m.id for m in decide(asks, {"a", "m", "n"}, False)] == ["m", "n"]
    asks["a"] = signed("a", capacity=3, step=0, synced=False)
    assert [m.id for m in decide(asks, {"a", "m", "n"}, False)] == ["m", "n"]  # m's and n's batch has room for 2
    asks["n"] = signed("n", capacity=2, step=4)
    assert [m.id for m in decide(asks, {"a", "m", "n"}, False)] == ["m", "n"]  # behind, but holding the agreed state
    assert [m.id for m in decide({"a": asks["a"]}, {"a"}, False)] == ["a"]


def ask_as(connect_, me, after=0):
    s = connect_()
    return wait_for_quorum(s, me, Liveness(s, 1.0), after, 5.0, 10.0, time.monotonic())


def test_a_misfit_asking_with_the_run_is_refused_alone_naming_the_field(store):
    beats = registered_with_heartbeat(store, "abc")
    s = store()
    for rid, settings in (("a", RUN), ("b", RUN), ("c", {**RUN, "lr": 0.2})):
        check(s, rid, canonical(settings))  # each writes its own; the run's are not published yet: none refused
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            mine = {"a": signed("a", step=2), "b": signed("b", step=2), "c": signed("c", {**RUN, "lr": 0.2},
                                                                                 synced=False)}
            futures = {rid: pool.submit(ask_as, store, m) for rid, m in mine.items()}
            with pytest.raises(Misfit, match=r"^replica 'c' refused by the run: lr 0\.2 != 0\.1: start it with"):
                futures["c"].result(timeout=20)
            assert futures["a"].result(timeout=20).ids == futures["b"].result(timeout=20).ids == ["a", "b"]
    finally:
        for b in beats:
            b.stop(leave=True)
    assert refusals(s, 0) == (["replica c refused: lr 0.2 != 0.1"], 1)


def test_a_joiner_with_no_room_in_the_batch_is_refused_alone(store):
    beats = registered_with_heartbeat(store, "abc")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            mine = {"a": signed("a", capacity=2, step=2), "b": signed("b", capacity=2, step=2),
                    "c": signed("c", capacity=2, synced=False)}
            futures = {rid: pool.submit(ask_as, store, m) for rid, m in mine.items()}
            with pytest.raises(Misfit, match=r"replica 'c' refused by the run: the run's quorum is full: 2 members "
                                             r"already split a global batch of 2"):
                futures["c"].result(timeout=20)
            assert futures["a"].result(timeout=20).ids == ["a", "b"]
            assert futures["b"].result(timeout=20).ids == ["a", "b"]
    finally:
        for b in beats:
            b.stop(leave=True)


def test_the_first_settings_published_are_the_runs(store):
    s = store()
    publish(s, "a", canonical(RUN))
    publish(s, "b", canonical(RUN))  # the same again: nothing to refuse
    with pytest.raises(Misfit, match=r"replica 'c' refused by the run: optimizer Adam != SGD"):
        publish(s, "c", canonical({**RUN, "optimizer": "Adam"}))


def test_a_malformed_value_of_the_runs_settings_is_logged_and_ignored_never_fatal(store, caplog):
    s = store()
    s.set("settings", b"\xff{not json")  # what a stranger on an open port may write
    with caplog.at_level("WARNING", logger="manualdp.spmd.ft"):
        check(s, "a", canonical(RUN))  # not refused
        publish(s, "a", canonical(RUN))  # the first quorum writes over it
    assert "ignored a malformed value of 'settings'" in caplog.text
    assert s.get("settings").decode() == canonical(RUN)
    with pytest.raises(Misfit, match="lr 0.2 != 0.1"):
        check(s, "c", canonical({**RUN, "lr": 0.2}))
    s.append("refused", "x" * 5000 + "\nreplica z refused: " + "y" * 5000 + "\n")
    notes, count = refusals(s, 0)
    assert count == 3 and notes[0] == "replica c refused: lr 0.2 != 0.1" and len(notes) == 2
    assert notes[1].startswith("replica z refused: yyy") and len(notes[1]) == 300


@pytest.mark.parametrize("field, value", [("lr", 0.2), ("seed", 1), ("batch_size", 16), ("optimizer", "Adam"),
                                          ("model", "lenet"), ("num_train", 128), ("num_epochs", 3),
                                          ("sync_every", 4), ("num_test", 32)])
def test_a_manager_with_another_setting_is_refused_before_it_asks_and_the_run_steps_on(field, value):
    run = {**RUN, "model": "mlp", "num_train": 256, "num_epochs": 2, "sync_every": 1, "num_test": 64}
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=10, heartbeat_timeout=1.0) as a:
        a.require_same(**run)
        a.start_step()
        assert a.should_commit(True)
        with Manager("c", "127.0.0.1", c.port, timeout=10, heartbeat_timeout=1.0) as joiner:
            joiner.require_same(**{**run, field: value})
            with pytest.raises(Misfit, match=rf"^replica 'c' refused by the run: {field} {value} != {run[field]}: "):
                joiner.start_step()
            assert b'"id": "c"' not in (a.store.get("round/2/asks") if a.store.check(["round/2/asks"]) else b"")
        quorum = a.start_step()
        assert quorum.ids == ["a"] and a.should_commit(True) and a.step == 2
        assert refusals(a.store, 0)[0] == [f"replica c refused: {field} {value} != {run[field]}"]


@pytest.mark.parametrize("field, change, says", [("algorithm", {"algorithm": "tree"}, "algorithm tree != ring"),
                                                  ("guard", {}, "guard off != factor 100")])
def test_a_joiner_calling_the_allreduce_differently_is_refused_alone(field, change, says):
    """Cases 24, 25 of issue 42's adversary: --algorithm tree or --nonfinite off ended every replica; now the joiner."""
    from manualdp.runners.ft_train import shared_settings

    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=32)
    fast = {"timeout": 10, "heartbeat_timeout": 1.0}
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, **fast) as a:
        a.require_same(**shared_settings(a, loader, 2, RUN))
        a.start_step()
        assert a.should_commit(True)
        with Manager("c", "127.0.0.1", c.port, **fast, **change) as joiner:
            if field == "guard":
                joiner.guard = None  # what --nonfinite off does
            joiner.require_same(**shared_settings(joiner, loader, 2, RUN))
            with pytest.raises(Misfit, match=rf"^replica 'c' refused by the run: {says}"):
                joiner.start_step()
        quorum = a.start_step()
        assert quorum.ids == ["a"] and a.should_commit(True) and a.step == 2


def test_shared_settings_name_a_bad_argument():
    from manualdp.runners.ft_train import shared_settings

    with pytest.raises(TypeError, match="manager must be"):
        shared_settings(None, None, 1)
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=10) as a:
        with pytest.raises(ValueError, match="num_epochs must be a positive int, got 0"):
            shared_settings(a, None, 0)
        with pytest.raises(TypeError, match="settings must be a dict"):
            shared_settings(a, None, 1, settings=[1])


def test_a_manager_with_the_run_settings_is_not_refused():
    with Coordinator(0) as c, Manager("a", "127.0.0.1", c.port, timeout=10) as a:
        a.require_same(**RUN)
        a.start_step()
        assert a.should_commit(True)
        a.start_step()
        assert a.should_commit(torch.ones(1).item() == 1.0) and a.step == 2
        assert refusals(a.store, 0) == ([], 0)


def test_askers_with_other_settings_and_no_run_settings_are_told_which_field_differs_not_to_start_more(store):
    """Case 32 of issue 46's adversary: min_replicas 2, bucket_cap_mb None vs 25, both said 'start more replicas'."""
    beats = registered_with_heartbeat(store, "ab")
    s = store()
    mine = {"a": {**RUN, "bucket_cap_mb": None}, "b": {**RUN, "bucket_cap_mb": 25}}
    for rid, settings in mine.items():
        check(s, rid, canonical(settings))

    # each asker's connection made first: torch 2.13's store client now and then takes 5 s to connect, and an asker
    # whose peer is still connecting gives up after PATIENCE timeouts of 1 s with only its own ask seen (CI, stop 50)
    clients = {rid: store() for rid in mine}

    def ask(rid):
        c = clients[rid]
        return wait_for_quorum(c, signed(rid, mine[rid], min_replicas=2), Liveness(c, 1.0), 0, 0.5, 1.0,
                               time.monotonic())
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {rid: pool.submit(ask, rid) for rid in mine}
            for rid, future in futures.items():
                with pytest.raises(Misfit, match=rf"^replica '{rid}': no quorum of at least 2 replicas within 1 s: "
                                                 r"replicas a and b ask with other settings: bucket_cap_mb None != 25; "
                                                 r"start them with the same settings$"):
                    future.result(timeout=20)
    finally:
        for b in beats:
            b.stop(leave=True)


def test_split_names_each_group_and_says_so_when_the_settings_cannot_be_read(store):
    s = store()
    other = {**RUN, "lr": 0.2}
    check(s, "a", canonical(RUN))
    check(s, "c", canonical(RUN))
    asks = [signed("a"), signed("b", other), signed("c")]  # b never wrote its settings
    assert split(s, asks) == ("replicas [a, c] and b ask with other settings: their settings digests differ; "
                              "start them with the same settings")
    check(s, "b", canonical(other))
    assert split(s, asks).startswith("replicas [a, c] and b ask with other settings: lr 0.1 != 0.2;")
    assert split(s, [signed("a"), signed("c")]) is None  # they agree
    publish(s, "a", canonical(RUN))
    assert split(s, asks) is None  # the run's settings decide: gate 2 refuses b by name


def test_two_managers_started_with_other_settings_both_raise_naming_the_field():
    def start(rid, cap):
        with Manager(rid, "127.0.0.1", c.port, min_replicas=2, timeout=1.5, quorum_timeout=0.5,
                     heartbeat_timeout=1.0) as m:
            m.require_same(**RUN, bucket_cap_mb=cap)
            m.start_step()

    with Coordinator(0) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, "a", None), pool.submit(start, "b", 25)]
        for future in futures:
            with pytest.raises(Misfit, match=r"replicas a and b ask with other settings: bucket_cap_mb None != 25; "
                                             r"start them with the same settings"):
                future.result(timeout=30)


# ---------------------------------------------------------------- by the command line (soak)

@pytest.mark.soak
def test_by_the_command_line_a_joiner_with_another_lr_exits_2_in_one_line_and_the_run_ends_as_one_process(tmp_path):
    epochs = 3
    with run(tmp_path, epochs=epochs) as r:
        with r.a_and_b_held():  # so that c comes before the run ends
            r.options[r.options.index("--lr") + 1] = "0.2"
            c = r.start("c")
            assert c.wait(timeout=60) == 2
        r.replicas.pop("c")
        results = r.finish()
        ref = reference(tmp_path, epochs)
    err = (tmp_path / "c-0.log").read_text()
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "manualdp train: error: replica 'c' refused by the run: lr 0.2 != 0.1: start it with the run's settings"), err
    assert all("replica c refused: lr 0.2 != 0.1" in (tmp_path / f"{rid}-0.log").read_text() for rid in "ab")
    assert sorted(committed(results)) == list(range(8 * epochs))
    check_against_reference(results, ref)


@pytest.mark.soak
def test_by_the_command_line_a_third_replica_with_no_room_in_a_batch_of_2_is_refused_and_the_run_goes_on(tmp_path):
    with run(tmp_path, epochs=1) as r:
        r.options[r.options.index("--batch-size") + 1] = "2"  # room for 2 members, not 3
        with r.a_and_b_held():  # so that c comes before the run ends
            c = r.start("c")
            r.wait("c registered", lambda: r.registrations() == 3)
        assert c.wait(timeout=60) == 2
        r.replicas.pop("c")
        results = r.finish()
    err = (tmp_path / "c-0.log").read_text()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "manualdp train: error: replica 'c' refused by the run: the run's quorum is full: 2 members already split a "
        "global batch of 2: join with a larger batch, or when a member leaves"), err
    assert all("replica c refused: the run's quorum is full" in (tmp_path / f"{rid}-0.log").read_text() for rid in "ab")
    assert sorted(committed(results)) == list(range(256 // 2))
    assert results["a"]["config"]["fault_tolerant"]["parameters_sha256"] == \
        results["b"]["config"]["fault_tolerant"]["parameters_sha256"]
