"""A fast subset of bench/faults.py: its cases are handled, and the table counts what it ran."""
from bench.faults import OUTCOMES, run_cases


def test_a_fast_subset_of_the_fault_table_is_all_handled():
    lines = []
    result = run_cases(quick=True, show=lines.append, only="special path")
    result2 = run_cases(quick=True, show=lines.append, only="flipped-bit")
    rows = result["rows"] + result2["rows"]
    assert len(rows) == 7 and len(lines) == 7
    assert [r["case"] for r in rows if r["outcome"] != "handled"] == []
    assert result["counts"]["tried"] == sum(result["counts"][o] for o in OUTCOMES) == 6


def test_the_check_cost_benchmark_names_a_bad_model_or_world_size_before_it_starts_ranks():
    import pytest

    from bench.faults import check_cost, main
    with pytest.raises(ValueError, match="model must be one of .*got 'vgg'"):
        check_cost(1, 1, model="vgg")
    with pytest.raises(ValueError, match="world_size must be an int from 2 to 8, got 1"):
        check_cost(1, 1, world_size=1)
    with pytest.raises(SystemExit):
        main(["--check-cost", "--world-size", "9"])


# One case of each class the last round's features brought (bench/faults_features.py), the quickest of each.
FEATURE_SAMPLES = ["zero resume train() stage 2 Adam 3 dev", "changed opt adam -> adamw", "hostile cache read: fifo",
                   "trace same path: --trace t.json --json ./t.json", "lock held; run on symlinked parent",
                   "syncbn offset 1e4, 2 ranks"]


def test_one_case_of_each_new_feature_class_is_handled():
    rows = [r for only in FEATURE_SAMPLES for r in run_cases(show=lambda line: None, only=only)["rows"]]
    assert [r["category"] for r in rows] == ["zero resume", "changed opt", "hostile cache", "trace", "lock", "syncbn"]
    assert [(r["case"], r["outcome"]) for r in rows if r["outcome"] != "handled"] == []
