"""bench/fsdp2_example.py: the FSDP2 script with only the import changed gives torch's numbers, and resumes bitwise."""
from bench.fsdp2_example import format_table, run


def test_the_example_with_mixed_precision_and_prefetching_equals_torchs_and_resumes_bitwise():
    result = run(2, layers=2, batch_size=4, steps=2, mixed_precision=True, explicit_prefetching=True)
    torch_row, ours = result["rows"]
    assert (torch_row["impl"], ours["impl"]) == ("torch", "manualdp")
    assert ours["losses"] == torch_row["losses"] and ours["max_diff_vs_torch"] == 0.0
    assert ours["resume_bitwise"] and ours["ranks_equal"] and torch_row["resume_bitwise"]
    assert ours["assign_resume"] is True, "load_state_dict(assign=True) into the meta model resumes bitwise"
    assert len(set(ours["losses"])) > 1, "it trains"
    table = format_table(result)
    assert table.splitlines()[3].split()[:1] == ["manualdp"] and f"{ours['losses'][0]:.4f}" in table
