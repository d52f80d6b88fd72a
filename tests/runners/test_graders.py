"""The new graders (cost, hook, zero1, checkpoint, diloco) against the answers of tests/answers/ that
bench/test_adversary_graders.py found them soft on: each property called here on the answer's own functions (fast);
the hook's ranks through `launch`; what needs the sandbox (where a function comes from, a call that never returns,
an import that exits) through `manualdp check`. bench/test_check_answers.py grades every answer as a student's."""
import importlib.util
import pathlib
import re

import pytest

from manualdp.cost import cost
from manualdp.runners.grader.check import HOOK_WORLDS
from manualdp.runners.cli import main
from manualdp.runners.grader.properties import (Mismatch, book_schedules, cost_property, cost_sweep_property,
                                                hook_job, hook_mismatch, resume_property, torch_hook_job,
                                                zero1_property)
from manualdp.schedule import get_schedule
from manualdp.spmd.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
ANSWERS = ROOT / "tests" / "answers"


def answer(name: str, folder: pathlib.Path = ANSWERS):
    """The module of `folder`/`name`.py, imported here (its functions called in this process)."""
    spec = importlib.util.spec_from_file_location(f"answer_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_values_that_differ_never_read_as_equal():
    with pytest.raises(Mismatch) as told:  # float32's 7 digits, where the grader asks 9: 2e-07 is 1.99999999e-07
        cost_property(answer("cost_float32").cost, get_schedule("ring", 2), 0, 1e-7, 0.0, 0.0)
    want, got = re.search(r"expected (\S+) s \(manualdp.cost.cost\), got (\S+) s, off by \S+ relatively where "
                          r"1e-9 is asked: is a sum rounded to float32", str(told.value)).groups()
    assert want != got and float(want) == pytest.approx(float(got), rel=1e-7), str(told.value)
    with pytest.raises(Mismatch) as told:
        zero1_property(answer("zero1_float32_momentum").zero1_step, 2, 3, 1, 0.1, 0.9, 0)
    want, got = re.search(r"momentum buffer, .*, to be (\[.*?\]), got (\[.*?\])", str(told.value)).groups()
    assert want != got, str(told.value)


def test_the_cost_check_calls_every_size_its_report_names():
    assert {s.num_devices for s in book_schedules()} == set(range(1, 17))
    cost_sweep_property(cost)
    with pytest.raises(Mismatch, match=r"for all_gather ring\(16\): expected \S+ s \(manualdp.cost.cost\), got 0 s"):
        cost_sweep_property(answer("cost_wrong_at_16").cost)


def test_a_zero1_step_that_returns_new_lists_is_told_to_update_in_place():
    with pytest.raises(Mismatch, match=r"your zero1_step returned a tuple and changed nothing in place: .* Update "
                                       r"params and momenta in place"):
        zero1_property(answer("zero1_returns_new_lists").zero1_step, 2, 3, 1, 0.1, 0.9, 0)


@pytest.mark.parametrize("exercise, name, told, options", [
    ("cost", "cost_the_librarys_own", r"the file's cost is not written in it but taken from manualdp\.cost: write it "
                                      r"yourself, in the file", []),
    ("diloco", "diloco_selftest_exit", r"importing the file raised SystemExit: 0 \(at .*, line 14\)\. Is there a "
                                       r"self-test at the end of the file\?", []),
    ("diloco", "diloco_loop", r"outer_step\(theta, replicas, buffer, lr=\S+, momentum=\S+\) on \d+ replica\(s\) of "
                              r"shape .* did not return within the 1 s it may take", ["--timeout", "1"]),
])
def test_what_the_sandbox_tells_is_told_as_for_every_exercise(exercise, name, told, options, capsys):
    status = main(["check", exercise, str(ANSWERS / f"{name}.py"), "--examples", "10", *options])
    out = " ".join(capsys.readouterr().out.split())
    assert status == 1 and re.match(rf"FAIL {exercise} \(.*{name}.py\): {told}", out), out


@pytest.mark.parametrize("name, told", [
    ("checkpoint_step_as_tensor", r"load_checkpoint returned 1, a tensor, not an int: return the step as a Python int "
                                  r"\(1 here, .*`int\(\.\.\.\)` of the tensor"),
    ("checkpoint_own_path", r"save_checkpoint\('checkpoint.pt', \.\.\.\) wrote nothing at 'checkpoint.pt'"),
    ("checkpoint_replays", r"load_checkpoint\(path, model, optimizer\) raised KeyError: 'seed'"),  # no seed to read
])
def test_a_resume_is_judged_by_its_file_and_its_step(name, told, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the run's checkpoint.pt is written
    module = answer(name)
    with pytest.raises(Mismatch, match=told):
        resume_property((module.save_checkpoint, module.load_checkpoint), "sgd", (3, 1), 5, 9)
    solution = answer("checkpoint", ROOT / "book" / "solutions")
    resume_property((solution.save_checkpoint, solution.load_checkpoint), "adam", (3, 1), 5, 9)


HOOK = "fp16_compress_hook"
HOOK_ANSWERS = ("hook_returns_none", "hook_no_decompress", "hook_divides_by_two")


def every_hook() -> list[dict]:
    """One rank: each hook answer on torch's DDP, as the grader's ranks run it (`hook_job`), then torch's own hook."""
    return [hook_job(str(ANSWERS / f"{name}.py"), HOOK) for name in HOOK_ANSWERS] + [torch_hook_job()]


def test_a_hook_that_breaks_the_contract_is_told_and_one_right_on_2_ranks_only_fails_on_3():
    assert HOOK_WORLDS == (2, 3)
    ranks = launch(every_hook, 3, timeout=90)  # one launch for all: each costs seconds
    none, raw, by_two, theirs = zip(*ranks)
    assert none[0]["error"].startswith(f"rank 0: {HOOK} returned None, not a torch.futures.Future"), none
    assert raw[0]["error"].startswith(f"rank 0: the future {HOOK} returned holds a list of one item, a tensor of "
                                      "dtype float16"), raw
    with pytest.raises(Mismatch, match=f"{HOOK} on 3 ranks, step 0, .* Yours is 3/2 times torch's: divide by the "
                                       r"world size \(3 here"):
        hook_mismatch([{HOOK: mine[HOOK], **torch} for mine, torch in zip(by_two, theirs)], HOOK)


def right_and_off_by_half_a_percent() -> list[dict]:
    """One rank: the book's hook, one that scales the average by 1.005 from 3 ranks on, then torch's own hook."""
    return [hook_job(str(path), HOOK) for path in (ROOT / "book" / "solutions" / "hook.py",
                                                   ANSWERS / "planted" / "hook_wrong_from_3.py")] + [torch_hook_job()]


def test_a_hook_off_by_half_a_percent_on_3_ranks_fails_and_the_books_and_torchs_pass():
    ranks = launch(right_and_off_by_half_a_percent, 3, timeout=90)
    book, off, theirs = zip(*ranks)
    hook_mismatch([{HOOK: mine[HOOK], **torch} for mine, torch in zip(book, theirs)], HOOK)
    hook_mismatch([{HOOK: t["torch"], **t} for t in theirs], HOOK)  # torch's own hook against itself
    with pytest.raises(Mismatch, match=f"{HOOK} on 3 ranks, step 0, rank 0: the gradients when backward returned "
                                       "differ from those with torch's fp16_compress_hook beyond float16 rounding"):
        hook_mismatch([{HOOK: mine[HOOK], **torch} for mine, torch in zip(off, theirs)], HOOK)
