"""The quick chaos of `bench/ft_chaos.py`: about 10 random SIGKILLs of 3 replicas (two at once, sometimes), the
coordinator once, with a checkpoint folder; every step committed once, rc 0 everywhere, the replicas equal.

    python -m pytest -q -m soak tests/spmd/ft/test_ft_chaos.py      (about 2 minutes; bench/soak_tests.sh runs it)
"""
import pytest

from bench.ft_chaos import chaos, check, reference_run

pytestmark = pytest.mark.soak  # replica processes, killed and started again


def test_the_quick_chaos_commits_every_step_once_and_ends_as_one_process(tmp_path):
    epochs = 2
    summary = chaos(str(tmp_path), kills=10, epochs=epochs, seed=1, progress=False, timeout=170)
    assert summary["kills"] >= 1
    assert check(summary, epochs, reference_run(str(tmp_path), epochs)) == []
