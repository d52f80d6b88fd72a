"""The guard on every contribution (`guard.py`): a non-finite or far out of line member discards the step, naming it.

In this process: the judgement as a pure function, and `average_and_vote` on a manager that stands
for one member of a quorum whose others contribute given norms. Replica processes by the command
line, with one replica's contributions multiplied by 1000: soak (the end of this file).
"""
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from manualdp.spmd.ft import Quorum
from manualdp.spmd.ft.average import average_and_vote
from manualdp.spmd.ft.guard import FACTOR, MIN_EXAMPLES, PAIR_FACTOR, STRIKES, ContributionGuard, Removed, offenders
from tests.spmd.ft.cli_harness import ROOT, check_against_reference, committed, reference, run
from tests.spmd.ft.harness import member


def test_offenders_by_the_median_of_the_others_with_three_or_more():
    assert list(offenders([1.0, 1.2, 1000.0])) == [2]
    assert "over 100 times the median of the others' (1.1)" in offenders([1.0, 1.2, 1000.0])[2]
    assert offenders([1.0, 2.0, 0.5, 1.5]) == {}  # honest shards differ by a few times
    assert list(offenders([1.0, 1000.0, 1.1, 999.0, 1.2])) == [1, 3]  # two out of five
    assert offenders([0.0, 0.0, 3.0]) == {}  # no scale to judge by
    assert offenders([1.0, 1.0, FACTOR * 1.0]) == {}  # the factor itself is in line
    assert offenders([1.0, math.nan, 1.0]) == {1: "non-finite (NaN or Inf)"}
    assert list(offenders([math.inf, 1.0, 1.0, 1.0])) == [0]


def test_a_contribution_far_below_the_others_is_out_of_line_too():
    """Case 32 of issue 42's adversary: a member sending zeros (or gradients scaled down) is flagged, both ways."""
    assert offenders([1.0, 1.2, 0.0]) == {2: "norm 0, under 1/100 of the median of the others' (1.1)"}
    assert list(offenders([1.0, 1.2, 0.009, 0.9])) == [2]
    assert offenders([1.0, 1.2, 0.011, 0.9]) == {}  # within the factor
    assert list(offenders([0.0, 0.0, 1.0, 1.0, 1.0])) == [0, 1]  # two of five: still a minority
    assert offenders([0.0, 0.0, 3.0]) == {}  # a majority at zero: no scale to judge by
    assert offenders([1.0, 0.0]) == {1: "norm 0, under 1/100 of the other member's (1)"}  # of two, the silent one
    assert list(offenders([0.005, 1.0])) == [1]  # far apart, neither zero: no majority to tell, the larger is named
    assert offenders([0.02, 1.0]) == {}
    assert offenders([0.0, 0.0]) == {}


def test_offenders_of_a_pair_use_the_pair_factor_and_a_crowd_the_factor():
    """B3 of issue 42: the pair rule is `pair_factor`'s, never `factor`'s."""
    assert offenders([1.0, 50.0], factor=10.0, pair_factor=100.0) == {}
    assert list(offenders([1.0, 50.0], factor=100.0, pair_factor=10.0)) == [1]
    assert offenders([1.0, 0.05], factor=10.0, pair_factor=100.0) == {}
    assert list(offenders([1.0, 0.05], factor=100.0, pair_factor=10.0)) == [0]
    assert "1/7" in offenders([1.0, 0.0], factor=100.0, pair_factor=7.0)[1]
    assert list(offenders([1.0, 1.0, 50.0], factor=10.0, pair_factor=100.0)) == [2]
    assert offenders([1.0, 1.0, 50.0], factor=100.0, pair_factor=10.0) == {}


def test_offenders_of_a_pair_only_far_apart_or_non_finite():
    assert list(offenders([1.0, 1000.0])) == [1] and list(offenders([1000.0, 1.0])) == [0]
    assert offenders([1.0, 50.0]) == {} and offenders([1.0, PAIR_FACTOR]) == {}
    assert list(offenders([math.nan, 1.0])) == [0] and list(offenders([math.nan, math.inf])) == [0, 1]
    assert offenders([3.0]) == {}


class Member:
    """A manager for member `me` of a quorum whose other members' contributions have the given norms."""

    def __init__(self, me: str, others: dict[str, float]) -> None:
        self.id, self.others, self.step, self.capacity = me, others, 7, 0
        self.quorum = Quorum(1, tuple(member(r) for r in sorted([me, *others])), 1)
        self.guard = ContributionGuard()
        self.sent, self.votes = [], []
        self.store = torch.distributed.HashStore()  # where the guard bars a removed member (none beats here)

    def average(self, flat: torch.Tensor) -> bool:
        self.sent.append(flat.numel())
        if flat.numel() == len(self.quorum.ids) and flat.dtype == torch.float64 and len(self.sent) == 1:
            for rid, norm in self.others.items():
                flat[self.quorum.rank(rid)] = norm
        flat.div_(len(self.quorum.ids))
        return True

    def should_commit(self, ok: bool) -> bool:
        self.votes.append(ok)
        return ok

    def step_with(self, tensors, also=()):
        self.sent = []
        return average_and_vote(self, tensors, also)


def test_a_member_far_out_of_line_discards_the_step_on_every_member_naming_it(caplog):
    honest = [torch.ones(4), torch.ones(5)]  # norm 3
    before = [t.clone() for t in honest]
    a = Member("a", {"b": 3.1, "c": 3000.0})  # c sends 1000 times a's
    with caplog.at_level(logging.WARNING, logger="manualdp.spmd.ft"):
        assert not a.step_with(honest)
    assert a.votes == [False] and a.sent == [3]  # the norms went, the buffers did not
    assert all(torch.equal(t, b) for t, b in zip(honest, before))
    assert "replica a: step 7 discarded: replica c's contribution is out of line: norm 3e+03, over 100 times " \
           "the median of the others' (3.05) (1 in a row)" in caplog.text
    c = Member("c", {"a": 3.0, "b": 3.1})  # the same step, on the offender: the same decision
    assert not c.step_with([1000 * t for t in honest]) and c.votes == [False]


def test_an_honest_step_is_averaged_and_a_non_finite_one_discarded():
    ok = Member("b", {"a": 2.9, "c": 3.2})
    tensors, totals = [torch.ones(9)], torch.tensor([4.0, 2.0], dtype=torch.float64)
    assert ok.step_with(tensors, (totals,)) and ok.votes == [True] and ok.sent == [3, 2, 9]
    nan_loss = Member("b", {"a": 2.9, "c": 3.2})
    assert not nan_loss.step_with([torch.ones(9)], (torch.tensor([math.nan, 2.0], dtype=torch.float64),))
    inf_grad = Member("a", {"b": 2.9})
    assert not inf_grad.step_with([torch.tensor([1.0, math.inf])]) and inf_grad.sent == [2]


def test_strikes_in_a_row_remove_the_offender_which_votes_first_and_a_clean_step_starts_the_count_again(caplog):
    poisoned = Member("c", {"a": 3.0, "b": 3.1})
    bad, good = [torch.full((9,), 1000.0)], [torch.ones(9)]
    for _ in range(STRIKES - 1):
        assert not poisoned.step_with(bad)
    assert poisoned.step_with(good)  # in line once: the count starts again
    for _ in range(STRIKES - 1):
        assert not poisoned.step_with(bad)
    with caplog.at_level(logging.WARNING, logger="manualdp.spmd.ft"):
        with pytest.raises(Removed, match=rf"^replica 'c' removed from the run: its contribution was out of line "
                                          rf"{STRIKES} steps in a row \(norm 3e\+03, over 100 times"):
            poisoned.step_with(bad)
    assert poisoned.votes[-1] is False and len(poisoned.votes) == 2 * STRIKES  # it voted before it left
    assert f"replica c's contribution is out of line: norm 3e+03, over 100 times the median of the others' (3.05); " \
           f"removed after {STRIKES} in a row" in caplog.text
    assert poisoned.guard.offences == {"a": 0, "b": 0, "c": STRIKES}


def test_on_shards_of_a_few_examples_only_a_non_finite_contribution_is_out_of_line():
    tiny = Member("a", {"b": 3.0, "c": 3000.0})  # one example misclassified, the others fitted: honest
    tiny.capacity = 3 * MIN_EXAMPLES - 1  # a global batch of 23: 7 examples per member
    assert tiny.step_with([torch.ones(9)]) and tiny.guard.offences == {"a": 0, "b": 0, "c": 0}
    tiny.others["c"] = math.nan
    assert not tiny.step_with([torch.ones(9)]) and tiny.guard.offences["c"] == 1
    enough = Member("a", {"b": 3.0, "c": 3000.0})
    enough.capacity = 3 * MIN_EXAMPLES
    assert not enough.step_with([torch.ones(9)]) and enough.guard.offences["c"] == 1


def test_without_a_guard_nothing_is_judged():
    m = Member("a", {"b": 3.0})
    m.guard = None
    assert m.step_with([torch.full((9,), 1000.0)]) and m.sent == [9]


# ---------------------------------------------------------------- by the command line (soak)

POISON = ("import sys; from manualdp.spmd.ft import manager as m; average = m.Manager.average; "
          "m.Manager.average = lambda self, t: average(self, t.mul_(1000)); "  # every contribution 1000 times
          "from manualdp.runners.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.soak
def test_by_the_command_line_a_replica_poisoning_its_contribution_is_removed_and_the_run_ends_as_one_process(
        tmp_path):
    epochs = 3
    with run(tmp_path, epochs=epochs) as r:
        with r.a_and_b_held():  # so that c comes before the run ends
            with open(tmp_path / "c-0.log", "w") as log:
                c = subprocess.Popen([sys.executable, "-c", POISON, *r.command("c")], cwd=ROOT, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
            r.procs.append(c)
            r.wait("c registered", lambda: r.registrations() == 3)
        assert c.wait(timeout=120) == 2
        results = r.finish()
        ref = reference(tmp_path, epochs)
    err = (tmp_path / "c-0.log").read_text()
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"manualdp train: error: replica 'c' removed from the run: its contribution was out of line {STRIKES} steps "
        f"in a row (norm "), err
    for rid in "ab":
        log = (tmp_path / f"{rid}-0.log").read_text()
        assert "replica c's contribution is out of line" in log and f"removed after {STRIKES} in a row" in log
        tried = [s for s in results[rid]["config"]["fault_tolerant"]["steps"] if "c" in s["members"]]
        assert len(tried) == STRIKES and not any(s["committed"] for s in tried)  # each discarded, then c was out
    assert all(m == ["a", "b"] for m in committed(results).values())
    assert sorted(committed(results)) == list(range(8 * epochs))
    check_against_reference(results, ref)
