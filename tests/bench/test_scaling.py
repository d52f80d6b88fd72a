"""The scaling table: both wrappers at each world size, their ratio and speedups, JSON and PNG."""
import json
import statistics

from bench.scaling import format_table, main


def test_scaling_table_compares_both_wrappers_at_every_world_size(tmp_path, capsys):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    code = main(["--models", "mlp", "--world-sizes", "2", "1", "--rounds", "2", "--steps", "1",
                 "--warmup", "1", "--batch-size", "16", "--no-progress",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [(r["model"], r["world_size"]) for r in rows] == [("mlp", 1), ("mlp", 2)]
    for r in rows:
        ours, theirs = r["manualdp"], r["torch DDP"]
        assert abs(r["ratio"] - ours["samples_per_s"] / theirs["samples_per_s"]) < 1e-9
        assert ours["p50_ms"] <= ours["p75_ms"] <= ours["p90_ms"] <= ours["p95_ms"]
        assert r["max_param_diff"] < 1e-5  # both wrappers trained the same model on the same data
    assert rows[0]["manualdp"]["speedup"] == rows[0]["torch DDP"]["speedup"] == 1.0
    assert abs(rows[1]["manualdp"]["speedup"]
               - rows[1]["manualdp"]["samples_per_s"] / rows[0]["manualdp"]["samples_per_s"]) < 1e-9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert format_table(result) in printed
    for r in rows:  # each round's ratio, from the samples/s of both wrappers' blocks in that round
        rounds = [o / t for o, t in zip(r["manualdp"]["rounds_samples_per_s"], r["torch DDP"]["rounds_samples_per_s"])]
        assert len(rounds) == 2
        assert r["ratio_rounds"] == {"min": min(rounds), "median": statistics.median(rounds), "max": max(rounds)}
    load = result["load"]
    assert load["busy_processes"] == 0 and load["loadavg_1min"]["max"] >= load["loadavg_1min"]["start"]
    assert "load average (1 min) during the run" in printed
