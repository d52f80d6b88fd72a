"""The allreduce benchmark on tiny sizes: structure of its rows, its JSON and its plot; no timing assertions."""
import json

import numpy as np
import pytest
import torch

from bench.allreduce import fit_cost, main, memory_bytes, serial_features, time_in_process
from bench.spread import format_load
from manualdp.schedule import ALGORITHMS, get_schedule
from manualdp.cost import traffic


@pytest.mark.parametrize("devices", [3, 4])
def test_rows_json_and_plot(tmp_path, capsys, devices):
    out_json, out_png = tmp_path / "ar.json", tmp_path / "ar.png"
    argv = ["--devices", str(devices), "--min-bytes", "64", "--max-bytes", "1024", "--factor", "4",
            "--iters", "2", "--warmup", "1", "--no-progress", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    sizes = [64, 256, 1024]
    assert [(r["algorithm"], r["size"]) for r in rows] == [(a, s) for s in sizes for a in sorted(ALGORITHMS)]
    for r in rows:
        assert r["wrong"] == 0
        assert r["count"] == r["size"] // 4 and r["type"] == "float32"
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (devices - 1) / devices)
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["time_us"] == pytest.approx(float(np.median(r["times_us"]))) and len(r["times_us"]) == 2
        schedule = get_schedule(r["algorithm"], devices)
        assert r["effbw"] == pytest.approx(memory_bytes(schedule, r["size"], 4) / r["time_us"] / 1e3)
        assert r["eff_ratio"] == pytest.approx(r["effbw"] / r["memcpy"])
        runs = r["eff_ratio_runs"]  # the same ratio run by run: each run's time against the memcpy just before it
        assert runs["min"] <= runs["median"] <= runs["max"]
        assert f"{r['eff_ratio']:.2f} ({runs['min']:.2f}-{runs['max']:.2f})" in printed
        assert f"{r['time_us']:.1f}" in printed
    avg = result["load"]["loadavg_1min"]  # main's load average over the run, no busy processes without --load
    assert avg["max"] >= max(avg["start"], avg["end"]) and result["load"]["busy_processes"] == 0
    assert format_load(result["load"]) in printed
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))  # atomic writes leave no temporary file behind


def test_memory_bytes_is_three_per_reduced_byte_and_two_per_copied_byte():
    for algorithm in ALGORITHMS:
        for n in range(1, 9):
            schedule = get_schedule(algorithm, n)
            t = traffic(schedule, 4096 * 4, 4)
            reduced, moved = sum(t["reduced"]), sum(t["received"])
            # the executor adds a swapped chunk once and copies the sum back (recursive doubling's pairs)
            p = 1 << (n.bit_length() - 1)  # half of its p devices copy back, in each of its log2(p) swapping rounds
            swapped = 4096 * 4 * p // 2 * (n.bit_length() - 1) if algorithm == "recursive_doubling" else 0
            assert memory_bytes(schedule, 4096 * 4, 4) == 3 * (reduced - swapped) + 2 * (moved - reduced + swapped)
            transfers, f_moved, f_reduced = serial_features(schedule, 4096 * 4, 4)
            assert (f_moved, f_reduced) == (moved, reduced - swapped), (algorithm, n)
            assert transfers == sum(len(rnd) for rnd in schedule.rounds)


def test_recursive_doublings_features_count_each_swap_as_one_addition_and_one_copy():
    # 4 devices, 2 rounds of 2 pairs: each pair adds the whole buffer once and copies the sum back once
    assert serial_features(get_schedule("recursive_doubling", 4), 1 << 20, 4) == (8, 8 << 20, 4 << 20)
    assert memory_bytes(get_schedule("recursive_doubling", 4), 1 << 20, 4) == (3 * 4 + 2 * 4) << 20


def test_the_timer_finds_wrong_results(monkeypatch):
    import bench.allreduce as bench

    assert time_in_process("ring", 100, torch.float32, 3, iters=2, warmup=0).wrong == 0
    monkeypatch.setattr(bench, "allreduce", lambda tensors, algorithm: tensors[0].add_(tensors[1]))
    assert time_in_process("ring", 100, torch.float64, 3, iters=2, warmup=0).wrong > 0


def test_fit_cost_recovers_non_negative_coefficients():
    rng = np.random.default_rng(0)
    features = rng.uniform(1, 100, size=(30, 3))
    for truth in ([2.0, 0.5, 0.0], [0.0, 1.0, 3.0], [1.0, 1.0, 1.0]):
        assert fit_cost(features, features @ np.array(truth)) == pytest.approx(truth, abs=1e-9)
    # A negative true coefficient is clipped to 0, never returned.
    assert np.all(fit_cost(features, features @ np.array([1.0, -0.5, 2.0]) + 100) >= 0)
    with pytest.raises(ValueError, match="seconds"):
        fit_cost(features, np.zeros(30))


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0"], "--devices"),
    (["--min-bytes", "2048", "--max-bytes", "1024"], "--min-bytes"),
    (["--min-bytes", "6"], "multiple of 4"),
    (["--factor", "1"], "--factor"),
    (["--iters", "0"], "--iters"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--no-progress"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("bench, argv, words", [
    ("allreduce", ["--plot", "out.pdf"], "must end in .png"),
    ("compare_ddp", ["--json", "."], "is a directory"),
    ("overhead", ["--json", "/no/such/dir/x.json"], "does not exist"),
    ("soak", ["--json", "."], "is a directory"),
])
def test_benchmarks_refuse_output_paths_before_running(bench, argv, words, capsys):
    import importlib
    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"bench.{bench}").main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_spmd_sweep_times_auto_against_its_prediction_and_gloo(tmp_path, monkeypatch):
    from bench.allreduce_spmd import main as spmd_main
    from manualdp.schedule import ALGORITHMS

    monkeypatch.setenv("MANUALDP_LINK", "1e-5,1e-9,1e-10")  # no calibration: the prediction is then known here
    out = tmp_path / "spmd.json"
    assert spmd_main(["--world-size", "2", "--min-bytes", "4096", "--max-bytes", "16384", "--iters", "1",
                      "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    autos = [r for r in result["rows"] if r["algorithm"] == "auto"]
    assert [r["size"] for r in autos] == [4096, 16384]
    for r in autos:
        assert r["pick"] in ALGORITHMS and r["fastest"] in ALGORITHMS and r["wrong"] == 0
        assert r["predicted_us"] > 0
        same = {"naive": "tree", "tree": "naive"}  # one schedule at two ranks
        assert r["pick_is_fastest"] == (r["fastest"] in (r["pick"], same.get(r["pick"])))
    assert result["link"] == {"alpha": 1e-5, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.0, "parallel": 0,
                              "duplex_spread": 0.0}
    checked = [r for r in result["rows"] if r["algorithm"] == "auto+check"]  # auto as users call it, also timed
    assert [r["size"] for r in checked] == [4096, 16384] and all(r["wrong"] == 0 for r in checked)
    assert result["target"]["checked_vs_gloo_min"] is None  # the target counts sizes from 64 KiB only
    missed = [r["pick_vs_fastest"] for r in autos if not r["pick_is_fastest"]]
    assert result["target"]["pick_vs_fastest_max"] == (max(missed) if missed else None)
    assert all(x >= 1.0 for x in missed)  # a miss took at least as long as the fastest
    assert all(r["pick_within_5pct"] == (r["pick_is_fastest"] or r["pick_vs_fastest"] <= 1.05) for r in autos)
    assert result["target"]["auto_picks_within_5pct"] == sum(r["pick_within_5pct"] for r in autos)


def test_spmd_sweep_busbw_is_algbw_times_2_n_minus_1_over_n(monkeypatch):
    # At two ranks 2(n-1)/n is 1 and the factor cannot be seen: four ranks, whose times are given.
    import manualdp.spmd
    from bench.allreduce_spmd import CHECKED, GLOO, run

    names = ["ring", "auto", CHECKED, GLOO]
    seconds = {0: 1e-3, 1: 2e-3, 2: 1.5e-3, 3: 0.5e-3}  # the collective takes as long as its slowest rank: 2 ms

    def fake_launch(fn, world_size, args, **kwargs):
        return [{4096: {"times": {name: [seconds[r]] for name in names}, "wrong": dict.fromkeys(names, 0),
                        "pick": "ring"},
                 "link": {"alpha": 1e-5, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.0, "parallel": 0},
                 "remeasures": 0, "late": 0}
                for r in range(world_size)]

    monkeypatch.setattr(manualdp.spmd, "launch", fake_launch)
    config = {"world_size": 4, "sizes": [4096], "dtype": "float32", "algorithms": ["ring"], "iters": 1, "warmup": 0,
              "segment_bytes": 1 << 20, "timeout": 60.0, "threads": 1}
    rows = run(config)["rows"]
    assert [r["algorithm"] for r in rows] == names
    for r in rows:
        assert r["time_us"] == pytest.approx(2000.0)
        assert r["algbw"] == pytest.approx(4096 / 2e-3 / 1e9)          # 0.002048 GB/s
        assert r["busbw"] == pytest.approx(4096 / 2e-3 / 1e9 * 6 / 4)  # 2(n-1)/n = 6/4 at four ranks: 0.003072


def test_spmd_sweep_prints_each_ratio_with_its_min_and_max_over_the_rounds_and_the_load(monkeypatch):
    import manualdp.spmd
    from bench.allreduce_spmd import CHECKED, GLOO, format_table, run

    names = ["ring", "auto", CHECKED, GLOO]
    gloo, ours = [1e-3, 2e-3, 4e-3], [2e-3, 1e-3, 5e-3]  # per round: gloo/ours 0.5, 2, 0.8

    def fake_launch(fn, world_size, args, **kwargs):
        return [{4096: {"times": {name: list(gloo if name == GLOO else ours) for name in names},
                        "wrong": dict.fromkeys(names, 0), "pick": "ring"},
                 "link": {"alpha": 1e-5, "beta": 1e-9, "gamma": 1e-10, "duplex": 0.0, "parallel": 0},
                 "remeasures": r, "late": 3 * r} for r in range(world_size)]

    monkeypatch.setattr(manualdp.spmd, "launch", fake_launch)
    config = {"world_size": 2, "sizes": [4096], "dtype": "float32", "algorithms": ["ring"], "iters": 3, "warmup": 0,
              "segment_bytes": 1 << 20, "timeout": 60.0, "threads": 1}
    result = run(config)
    ring = next(r for r in result["rows"] if r["algorithm"] == "ring")
    assert ring["vs_gloo_rounds"] == {"min": 0.5, "median": 0.8, "max": 2.0}
    assert ring["vs_gloo"] == pytest.approx(2e-3 / 2e-3)  # of the medians
    assert result["remeasures"] == [0, 1] and result["late_calls"] == [0, 3]
    assert "load" not in result  # main measures it around run
    load = {"busy_processes": 2, "loadavg_1min": {"start": 0.25, "max": 1.5, "end": 1.0}}
    table = format_table(dict(result, config=dict(result["config"], torch="x"), load=load))
    assert "1.00 (0.50-2.00)" in table
    assert format_load(load) in table and "--load: 2 busy processes" in table
    assert "auto measured the link again 1 time(s)" in table


def test_the_check_cost_breakdown_times_four_ways_at_each_size(tmp_path, capsys):
    from bench import allreduce_check

    out = tmp_path / "check.json"
    assert allreduce_check.main(["--sizes", "64", "4096", "--calls", "2", "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(rows) == ["4096", "64"]
    for row in rows.values():
        assert row["pick"] in ALGORITHMS
        assert all(row[w] > 0 for w in allreduce_check.WAYS)
    printed = capsys.readouterr().out
    assert all(w in printed for w in allreduce_check.WAYS)
    with pytest.raises(SystemExit):
        allreduce_check.main(["--world-size", "1"])
    assert "--world-size must be 2 to 8, got 1" in capsys.readouterr().err
