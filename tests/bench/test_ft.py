"""bench/ft.py: FaultTolerantDDP against the drop-in DDP on the same replicas: steps/s, the ratio's spread, shares."""
import json
import statistics

import pytest

from bench.ft import NAMES, format_table, main


def test_refuses_fewer_than_two_replicas_and_a_batch_smaller_than_the_replicas(capsys):
    with pytest.raises(SystemExit):
        main(["--replicas", "1"])
    assert "--replicas must be at least 2 (a quorum to average over), got 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--replicas", "3", "--batch-size", "2", "--models", "mlp"])
    assert "--batch-size 2 is smaller than --replicas 3" in capsys.readouterr().err


@pytest.mark.soak  # starts replica processes
def test_both_wrappers_step_in_turns_and_every_figure_follows_from_the_rounds(tmp_path, capsys):
    out = tmp_path / "ft.json"
    assert main(["--models", "mlp", "--rounds", "2", "--steps", "2", "--warmup", "1", "--batch-size", "16",
                 "--profile", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    rates = row["rounds_steps_per_s"]
    assert all(len(rates[name]) == 2 for name in NAMES)
    rounds = [f / d for f, d in zip(rates[NAMES[1]], rates[NAMES[0]])]
    assert row["ratio"] == {"min": min(rounds), "median": statistics.median(rounds), "max": max(rounds)}
    assert row["steps_per_s"] == {name: statistics.median(rates[name]) for name in NAMES}
    for share in (row["quorum_share"], row["vote_share"]):
        assert 0 < share["min"] <= share["median"] <= share["max"] < 1
    assert row["quorum_share"]["max"] + row["vote_share"]["max"] < 1
    assert row["committed"] == 1 + 1 + 2 * 2 + 3  # the first step, the warm-up, the rounds, the profile: all committed
    ddp, ft = (row["profile"][name] for name in NAMES)
    assert ddp["cpu_us_per_step"] > 0 and ft["cpu_us_per_step"] > 0 and not ddp["store_per_step"]
    assert ft["store_per_step"]["MainThread:set"] == 1  # its vote
    assert result["load"]["busy_processes"] == 0
    assert format_table(result) in capsys.readouterr().out


def test_the_profiles_store_counter_counts_each_call_by_thread_and_passes_values_through():
    import collections
    import threading

    from bench.ft import _CountingClient, _thread_cpu

    class Store:
        timeout = 5

        def get(self, key):
            return key.encode()

        def clone(self):
            return Store()

    counts = collections.Counter()
    client = _CountingClient(Store(), counts)
    assert client.get("a") == b"a" and client.timeout == 5 and isinstance(client.clone(), Store)
    worker = threading.Thread(target=lambda: [client.get("b") for _ in range(3)], name="manualdp-ft-quorum-x")
    worker.start()
    worker.join()
    assert counts == {"MainThread:get": 1, "ft-quorum-x:get": 3}
    sum(range(10 ** 6))  # some CPU of this thread's own
    assert _thread_cpu().get("MainThread", 0.0) > 0
