"""`bench/ft_chaos.py --group-size 2 --zero 3`: bytes per recovery as the groups' rank 0 said them, `--zero` refused
without groups, and a short chaos of sharded groups (soak: 2 kills) that holds every check and measures its bytes.
"""
import pytest

from bench.ft_chaos import main, reference_run, report
from bench.ft_chaos_groups import GroupChaos, check_groups, group_chaos, received_bytes


class _Logs(GroupChaos):
    """Only what `received_bytes` reads: the groups' generations and their rank logs."""

    def __init__(self, workdir: str, generations: dict) -> None:
        self.dir, self.procs = workdir, {gid: [[None]] * n for gid, n in generations.items()}


def test_each_recovery_s_bytes_are_read_from_the_lines_rank_0_said(tmp_path):
    said = "replica group B: step {}: received its state over its 2 lane(s): {} bytes\n"
    (tmp_path / "A0-0.log").write_text("quorum of 2\n")
    (tmp_path / "B0-0.log").write_text("quorum of 2\n")
    (tmp_path / "B1-0.log").write_text("quorum of 2\n" + said.format(5, 1234) + "loss 1.0\n" + said.format(9, 99))
    (tmp_path / "B1-1.log").write_text(said.format(5, 777))  # only rank 0 speaks for its group
    assert received_bytes(_Logs(str(tmp_path), {"A": 1, "B": 2})) == [1234, 99]


@pytest.mark.parametrize("zero, mode", [(3, "--zero 3: each lane its shard"), (0, "each lane the whole model")])
def test_the_report_gives_bytes_per_recovery_for_groups_and_says_the_mode(zero, mode):
    summary = {"kills": 2, "coordinator_kills": 0, "rounds": {"commit": 10}, "recoveries": [1.0, 2.0],
               "state_bytes": None, "seconds": 3.0, "recovery_bytes": [100, 300], "zero": zero}
    line = report(summary)
    assert f"bytes per recovery (received over the lanes, {mode}): p50 200, max 300 over 2" in line, line
    assert "the state" in report({**summary, "recovery_bytes": None, "state_bytes": 5})


def test_zero_without_groups_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--zero", "3", "--kills", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "--zero 3" in err and "--group-size 2" in err, err


@pytest.mark.soak
def test_a_short_chaos_of_sharded_groups_holds_its_checks_and_measures_each_recovery(tmp_path):
    epochs = 2
    summary = group_chaos(str(tmp_path), kills=2, epochs=epochs, size=2, seed=1, timeout=240, zero=3)
    assert summary["kills"] >= 1 and len(summary["recoveries"]) >= 1, summary
    assert check_groups(summary, reference_run(str(tmp_path), epochs)) == []
    assert summary["zero"] == 3 and len(summary["recovery_bytes"]) >= 1 and min(summary["recovery_bytes"]) > 0
