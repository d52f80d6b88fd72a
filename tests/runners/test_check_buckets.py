"""The buckets exercise (book chapter 5, rung 4 by hand): a right answer passes; each wrong one in tests/answers/
is told its own slip (sent at the end only, one flat buffer over the cap, averaged twice, a bucket never sent, a
blocking all_reduce, the frozen layer bucketed). The judge's verdicts are checked here on records made by hand (fast;
a decoy sent early and a wait during backward too);
the answers' ranks start in the soak."""
import functools
import pathlib
import re

import pytest
import torch

from manualdp.runners.cli import main
from manualdp.runners.grader.properties import Mismatch, buckets_job, buckets_mismatch
from manualdp.runners.grader.properties.buckets import CAP_BYTES, Buckets, reference_steps
from manualdp.spmd import launch

ANSWERS = pathlib.Path(__file__).resolve().parents[1] / "answers"
NAME = "BucketedDDP"
VERDICTS = {  # answer -> what the verdict must say
    "buckets_at_the_end.py": r"step 0, rank 0: no overlap: every bucket was sent after backward returned; send each "
                             r"bucket from a gradient hook",
    "buckets_one_flat.py": rf"an all_reduce of 200 elements \(1600 bytes\) is over the bucket cap of {CAP_BYTES} bytes",
    "buckets_average_twice.py": r"is [\d.]+ where the average is [\d.]+: yours is 1/2 of the average: it was divided "
                                r"by the world size twice",
    "buckets_unused_never_sent.py": r"rank 0's own gradient, not the average\. Its bucket was never sent.*\(the model "
                                    r"never calls `unused`",
    "buckets_blocking.py": r"an all_reduce during backward was made with async_op=False: backward stops until it ends",
    "buckets_frozen.py": r"frozen\.weight does not require grad \(the model's frozen layer\), yet has a \.grad: leave "
                         r"parameters with requires_grad=False out of the buckets",
}


@functools.lru_cache(maxsize=None)
def _reference():
    return reference_steps(2)


def _records(events_of_step=None, grads=None) -> list[dict]:
    """What 2 ranks of a right answer would send back, built from one process's run; `events_of_step(step)` and
    `grads(step, rank)` replace the events and gradients."""
    start = {k: p.detach() for k, p in Buckets(seed=0).double().named_parameters()}
    right = [("ready", "out.bias"), ("ready", "out.weight"), ("ready", "shared.bias"), ("ready", "shared.weight"),
             ("ready", "inp.bias"), ("send", 72, 576, True), ("ready", "inp.weight"), ("send", 48, 384, True),
             ("backward returned",), ("send", 80, 640, True)]
    return [{NAME: {"start": start, "steps": [
        {"grads": grads(step, r) if grads else s["grads"], "params": s["params"],
         "events": events_of_step(step) if events_of_step else right} for step, s in enumerate(_reference())]}}
        for r in range(2)]


def test_the_judge_passes_a_right_record_and_names_each_slip_in_a_record_made_by_hand():
    buckets_mismatch(_records(), NAME)
    ref = _reference()

    def judged(**kwargs) -> str:
        with pytest.raises(Mismatch) as e:
            buckets_mismatch(_records(**kwargs), NAME)
        return str(e.value)

    at_the_end = [("ready", "out.bias"), ("ready", "inp.weight"), ("backward returned",), ("send", 72, 576, True)]
    assert "no overlap: every bucket was sent after backward returned" in judged(events_of_step=lambda s: at_the_end)
    late = [("ready", "out.bias"), ("ready", "inp.weight"), ("send", 72, 576, True), ("backward returned",)]
    assert "every bucket was sent after the last gradient was ready" in judged(events_of_step=lambda s: late)
    blocking = [("ready", "out.bias"), ("send", 72, 576, False), ("ready", "inp.weight"), ("backward returned",)]
    assert "async_op=False" in judged(events_of_step=lambda s: blocking)
    over = [("ready", "out.bias"), ("send", 101, 808, True), ("ready", "inp.weight"), ("backward returned",)]
    assert "an all_reduce of 101 elements (808 bytes) is over the bucket cap" in judged(events_of_step=lambda s: over)
    # one gradient larger than the cap goes alone, as in torch's DDP: 64 elements is the model's largest
    alone = [("ready", "shared.weight"), ("send", 64, 900, True), ("ready", "inp.weight"), ("backward returned",)]
    buckets_mismatch(_records(events_of_step=lambda s: alone), NAME)
    # a decoy: one element sent early, to look overlapped, the buckets at the end
    decoy = [("ready", "out.bias"), ("send", 1, 8, True), ("ready", "inp.weight"), ("backward returned",),
             ("send", 72, 576, True)]
    told = judged(events_of_step=lambda s: decoy)
    assert "no overlap: before the last gradient was ready only an all_reduce of 1 elements went out" in told, told
    waited = [("ready", "shared.weight"), ("send", 64, 512, True), ("wait",), ("ready", "inp.weight"),
              ("backward returned",)]
    assert "a handle was waited on during backward" in judged(events_of_step=lambda s: waited)
    silent = [("ready", "x"), ("backward returned",)]
    assert "no torch.distributed.all_reduce" in judged(events_of_step=lambda s: silent)

    other_order = _records()
    for step in other_order[1][NAME]["steps"]:  # rank 1 sends its two early buckets the other way round
        step["events"] = [("ready", "shared.weight"), ("ready", "inp.weight"), ("send", 48, 384, True),
                          ("send", 72, 576, True), ("ready", "inp.bias"), ("backward returned",),
                          ("send", 80, 640, True)]
    with pytest.raises(Mismatch, match=r"the ranks sent their buckets in other orders \(elements per all_reduce: "
                                       r"\[\[72, 48, 80\], \[48, 72, 80\]\]\)"):
        buckets_mismatch(other_order, NAME)

    right = _records()[0][NAME]["steps"][0]["events"]
    stale = judged(events_of_step=lambda s: right if s == 0 else at_the_end)  # counts never reset after step 0
    assert "step 1, rank 0: no overlap" in stale and "start again after each step" in stale, stale

    def scaled(factor):
        return lambda step, r: {k: None if g is None else g * factor for k, g in ref[step]["grads"].items()}
    assert "yours is 1/2 of the average: it was divided by the world size twice" in judged(grads=scaled(0.5))
    assert "yours is 2 times the average: divide each bucket's sum by the world size" in judged(grads=scaled(2))
    own = judged(grads=lambda step, r: {**ref[step]["grads"], **ref[step]["own"][r]})
    assert "rank 0's own gradient, not the average" in own, own
    second = judged(grads=lambda step, r: {**ref[step]["grads"], **(ref[step]["own"][r] if r == 1 else {})})
    assert "rank 1: the gradients" in second and "rank 1's own gradient" in second, second  # right on rank 0 only
    frozen = judged(grads=lambda step, r: {**ref[step]["grads"], "frozen.bias": torch.zeros(8, dtype=torch.float64)})
    assert "frozen.bias does not require grad" in frozen, frozen
    unused = judged(grads=lambda step, r: {**ref[step]["grads"], "unused.bias": torch.zeros(4, dtype=torch.float64)})
    assert "unused.bias is used by no rank" in unused and "leave the gradient" in unused, unused
    missing = judged(grads=lambda step, r: {**ref[step]["grads"], "out.bias": None})
    assert "out.bias has no .grad" in missing, missing
    nudged = judged(grads=lambda step, r: {k: None if g is None else g + 1e-11 for k, g in ref[step]["grads"].items()})
    assert "where the average is" in nudged, nudged  # off by 1e-11: more than the 1e-12 the check allows


def test_the_reference_averages_what_each_rank_holds():
    for step in _reference():  # the average of the ranks' own gradients is one process's on the whole batch
        for k, g in step["grads"].items():
            if g is None:
                assert k.startswith(("frozen.", "unused.")), k
                continue
            assert torch.allclose((step["own"][0][k] + step["own"][1][k]) / 2, g, atol=1e-14), k


@pytest.mark.soak
@pytest.mark.parametrize("answer", sorted(VERDICTS))
def test_each_wrong_answer_on_2_ranks_is_told_its_slip(answer):
    ranks = launch(buckets_job, 2, (str(ANSWERS / answer), NAME), timeout=120)
    assert not any("error" in r for r in ranks), ranks
    with pytest.raises(Mismatch) as e:
        buckets_mismatch(ranks, NAME)
    assert re.search(VERDICTS[answer], str(e.value)), str(e.value)


@pytest.mark.soak
def test_manualdp_check_buckets_passes_the_right_answer_and_fails_a_wrong_one(capsys):
    assert main(["check", "buckets", str(ANSWERS / "buckets_right.py")]) == 0
    assert "PASS buckets" in capsys.readouterr().out
    assert main(["check", "buckets", str(ANSWERS / "buckets_at_the_end.py")]) == 1
    assert re.search("FAIL buckets .*no overlap", capsys.readouterr().out.replace("\n", " "))


@pytest.mark.soak
def test_the_librarys_own_rung_4_handed_in_is_refused(tmp_path, capsys):
    taken = tmp_path / "taken.py"
    taken.write_text("from manualdp.spmd.ladder.bucketed import BucketedDDP  # noqa: F401\n")
    assert main(["check", "buckets", str(taken)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    expected = ("the file's BucketedDDP is built on manualdp.spmd.ladder.overlapped.OverlappedDDP, "
                "the library's own: write it yourself")
    assert expected in out, out


@pytest.mark.soak
def test_torchs_ddp_inside_the_answer_with_a_decoy_send_is_refused(capsys):
    # torch's DDP does the work in C++, a decoy async all_reduce fakes the overlap: nothing of rung 4 is written
    assert main(["check", "buckets", str(ANSWERS / "planted" / "buckets_torch_decoy.py")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "write it yourself: torch's DistributedDataParallel (its buckets and hooks)" in out, out
