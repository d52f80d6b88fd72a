"""`bench/ft_chaos.py --group-size 2 --plot PNG` (`bench/ft_chaos_plot.py`): the membership drawn from a summary."""
import pytest
from PIL import Image

from bench.ft_chaos import main
from bench.ft_chaos_plot import membership, plot_membership


def _summary() -> dict:
    """Steps 0-3 of A and B; B's rank 1 killed in step 2 (after round 2 committed step 1), step 2 discarded once."""
    return {"total": 4, "procs": {"A": [[0, 0]], "B": [[1, -9], [0, 0]]}, "killed": [["B", 0, 1]],
            "kill_rounds": [2],
            "committed": {"1": [0, ["A", "B"]], "2": [1, ["A", "B"]], "4": [2, ["A"]], "5": [3, ["A", "B"]]},
            "discarded": {"3": [2, ["A", "B"]]}}


def test_the_cells_are_each_steps_committed_quorum_its_discarded_attempts_and_the_kills():
    cells = membership(_summary())
    assert cells["committed"] == {(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (3, "A"), (3, "B")}
    assert cells["discarded"] == {(2, "B")}  # A's discarded attempt of step 2 is hidden by its commit
    assert cells["kills"] == [(2, "B")]  # round 2 committed step 1: the kill hit step 2
    assert cells["groups"] == ["A", "B"] and cells["steps"] == 4


def test_a_kill_after_a_discarded_round_is_in_that_rounds_step_and_before_any_round_in_step_0():
    summary = _summary()
    summary["killed"], summary["kill_rounds"] = [["B", 0, 1], ["A", 0, 0]], [3, 0]
    assert membership(summary)["kills"] == [(2, "B"), (0, "A")]


def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / "groups.png"
    assert plot_membership(_summary(), str(path))["kills"] == [(2, "B")]
    with Image.open(path) as image:
        assert image.format == "PNG" and min(image.size) > 100


@pytest.mark.parametrize("args, words", [
    (["--plot", "{tmp}/g.png"], "--plot '{tmp}/g.png': draws replica groups: add --group-size 2"),
    (["--group-size", "2", "--plot", "{tmp}/no/g.png"], "--plot '{tmp}/no/g.png': its folder {tmp}/no does not exist"),
    (["--group-size", "2", "--plot", "{tmp}"], "--plot '{tmp}': is a directory"),
    (["--group-size", "2", "--plot", "{tmp}/g.jpg"], "--plot '{tmp}/g.jpg': a PNG: end the name in .png"),
])
def test_a_plot_that_cannot_be_drawn_is_refused_in_one_line_before_the_run(args, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in args] + ["--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].endswith(words.format(tmp=tmp_path)), err
    assert not (tmp_path / "w").exists()


def test_a_minimum_of_groups_other_than_1_or_2_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--group-size", "2", "--min-groups", "3", "--workdir", str(tmp_path / "w")])
    assert info.value.code == 2 and "--min-groups: invalid choice: 3" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_summary_that_is_not_a_group_runs_is_refused_naming_what_it_lacks():
    summary = _summary()
    del summary["killed"], summary["total"]
    with pytest.raises(ValueError, match="it lacks killed, total"):
        membership(summary)
