"""bench/allreduce_profile.py: CPU time per call, checked arguments, and a short 2-rank run that prints its rows."""
import pytest

from bench.allreduce_profile import cpu_per_call, main


def test_cpu_time_per_call_counts_every_call_and_refuses_no_calls():
    calls = []
    thread, process = cpu_per_call(lambda: calls.append(sum(range(1000))), 50)
    assert len(calls) == 50 and 0 <= thread <= process + 1e3  # the process's CPU time holds the thread's
    with pytest.raises(ValueError, match="calls"):
        cpu_per_call(lambda: None, 0)


@pytest.mark.parametrize("argv, words", [(["--calls", "0"], "calls"), (["--sizes", "-4"], "sizes"),
                                         (["--world-size", "0"], "world_size")])
def test_bad_arguments_are_refused_in_one_line(argv, words):
    with pytest.raises(ValueError, match=words):
        main(argv)


@pytest.mark.soak
def test_a_short_run_prints_every_rank_and_size(capsys):
    main(["--calls", "3", "--sizes", "4096", "--top", "3"])
    out = capsys.readouterr().out
    assert "== 4096 bytes, 2 ranks" in out and "rank 0:" in out and "rank 1:" in out
    assert "link measured again" in out
