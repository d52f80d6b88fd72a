"""`manualdp check` against the wrong, careless and hostile answers of tests/answers/: each fails in one paragraph
that says what happened, exits 1, within its timeout, and leaves no process and no folder behind; the book's
reference solutions pass.

The answers that wait out their timeout are graded by `manualdp check` processes of their own, while this
process grades the others.
"""
import concurrent.futures
import contextlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from manualdp.runners.cli import main

ANSWERS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "answers"
SOLUTIONS = pathlib.Path(__file__).resolve().parents[1] / "book" / "solutions"
TIMEOUT = 3  # seconds each call may take: the hostile answers that never return cost this much
SLOW = 60  # seconds a grading may take on a busy machine, startup of two interpreters included
SLOW_RANKS = 150  # the same, for the exercises that start 2 ranks twice (ddp, hook)
SLOW_CALL = ["--timeout", "30"]  # a whole training run per call (checkpoint): 3 s is too tight on a busy machine

CALL = r"allreduce\(tensors\) on \d tensors? of shape .* and dtype \w+(, holding [-\d., ]+)?"
NOTHING = (rf"{CALL}: expected every device to hold the sum 13; device 0 holds 4\. No device's tensor changed: your "
           r"allreduce wrote into none of them .*$")  # an answer that does nothing
NEVER = r"did not return within the 3 s it may take: does it loop forever"
OUTSIDE = r", outside its own folder: an answer may write only in its own folder"
VERDICTS = {  # answer -> (what its first line must say, extra options)
    "allreduce_loop.py": (rf"{CALL} {NEVER}", []),
    "schedule_loop.py": (rf"schedule\(1\) {NEVER}", []),
    "split_batch_loop.py": (rf"split_batch\(X, y, devices\) with X of shape \(1, 1\), .* 1 device {NEVER}", []),
    "allreduce_selftest_exit.py": (r"importing the file raised SystemExit: 0 \(at .*allreduce_selftest_exit.py, "
                                   r"line 13\)\. Is there a self-test at the end of the file\? Put it under "
                                   r"`if __name__ == \"__main__\":`", []),
    "allreduce_os_exit.py": (rf"{CALL} ended the process \(exit status 0\) instead of returning: does it call "
                             r"sys.exit, os._exit", []),
    "allreduce_sigkill.py": (rf"{CALL} was killed by SIGKILL", []),
    "allreduce_sigstop.py": (rf"{CALL} stopped \(SIGSTOP\?\): it never answered", []),
    "allreduce_keyboard_interrupt.py": (rf"{CALL} raised KeyboardInterrupt \(at .*, line 5\)\. The grader calls your "
                                        "function: it must return, not raise KeyboardInterrupt", []),
    "allreduce_recursion.py": (rf"{CALL} raised RecursionError: maximum recursion depth exceeded .* Does your "
                               "function call itself without end\\?", []),
    "allreduce_fork.py": (rf"{CALL} {NEVER}", []),
    "allreduce_patch_hypothesis.py": (NOTHING, []),
    "allreduce_patch_torch.py": (NOTHING, []),
    "allreduce_nothing.py": (NOTHING, []),
    "allreduce_d2l.py": (rf"{CALL} raised IndexError: slice\(\) cannot be applied to a 0-dim tensor.*d2l's "
                         r"`data\[0\]\[:\] \+= \.\.\.` fails on it: write in place with `tensors\[0\]\.add_\(\.\.\.\)` "
                         r"and `tensors\[i\]\.copy_\(tensors\[0\]\)`", []),
    "allreduce_float64_only.py": (rf"{CALL}: expected every device to hold the sum, of dtype int8 and shape \(\), in "
                                  "the very tensor it held; device 0 holds a tensor of dtype float64", []),
    "allreduce_memory.py": (rf"{CALL} raised RuntimeError: .*can't allocate memory.*The grader caps the memory", []),
    "allreduce_print_flood.py": (rf"{CALL} (raised OSError: \[Errno 27\] File too large|was killed by SIGXFSZ)", []),
    "split_batch_device0.py": (r"split_batch\(X, y, devices\) with X of shape \(2, 1\), y = torch.arange\(2\) and "
                               r"devices = \[cpu, meta\] .*: expected shard 1 on devices\[1\] = meta; X's is on cpu, "
                               r"y's on cpu", []),
    "schedule_only_two.py": (r"schedule\(3\): after its 1 rounds, device 0 holds a0\+b0 in chunk 0, expected the sum "
                             r"of every device's chunk 0, a0\+b0\+c0: it misses device 2", []),
    "ddp_patch_torch.py": (r"DDP on 2 ranks, step 0, rank 0: the gradients when backward returned differ from "
                           r"torch's DDP's .* \(yours / torch's = 2\)\. Rank 0 holds 2 times the average", []),
    # exercise 2.2 asks for powers of two only: the grader runs exactly those, so a halving-doubling without the
    # fold for other sizes passes
    "halving_doubling_powers_of_two.py": (r"", ["--powers-of-two"]),
    "buckets_right.py": (r"", []),
    "buckets_at_the_end.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: no overlap: every bucket was sent after "
                              r"backward returned", []),
    "buckets_one_flat.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: an all_reduce of 200 elements \(1600 bytes\) "
                            r"is over the bucket cap of 800 bytes", []),
    "buckets_average_twice.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: .*: yours is 1/2 of the average: it was "
                                 r"divided by the world size twice", []),
    "buckets_unused_never_sent.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: .*rank \d's own gradient, not the "
                                     r"average\. Its bucket was never sent", []),
    "buckets_blocking.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: an all_reduce during backward was made with "
                            r"async_op=False", []),
    "buckets_frozen.py": (r"BucketedDDP on 2 ranks, step 0, rank \d: .*frozen\.weight does not require grad", []),
    # the exercises of chapters 3, 5, 6 and 7: each wrong answer's slip is named
    "cost_sent_only.py": (r"cost\(schedule, nbytes=\d+, .*\): expected \S+ s \(manualdp.cost.cost\), got \S+ s\. Yours "
                          r"counts bytes sent only: a device's beta term is beta times the larger", []),
    "cost_message_per_transfer.py": (r"cost\(schedule, .*\) for a schedule of \d devices .*: expected \S+ s "
                                     r"\(manualdp.cost.cost\), got \S+ s\. Yours counts a message per transfer: the "
                                     r"chunks one device sends to one peer in a round travel as one message", []),
    "hook_sum_then_divide.py": (r"fp16_compress_hook on 2 ranks, step 1 \(the step with the loss scaled by 8192\), "
                                r"rank \d: .*: 2\.bias, element \d, is inf where torch's is 32768\. The sum of the "
                                r"ranks' float16 gradients overflowed \(float16 holds at most 65504\): divide by the "
                                r"world size before the allreduce", []),
    "hook_float32.py": (r"fp16_compress_hook on 2 ranks, step 0, rank \d: the gradients when backward returned differ "
                        r"from those with torch's fp16_compress_hook: .* Close, but not torch's: its hook rounds each "
                        r"rank's gradient to float16", []),
    "zero1_no_gather.py": (r"zero1_step\(params, grads, momenta, .*\) on 2 devices, .*: expected every device's "
                           r"parameters to be plain data parallelism's; .* That element was not updated on this "
                           r"device: all-gather the updated chunks", []),
    # device 0 right, the others not: caught only where every device's parameters are compared
    "zero1_gather_to_device0.py": (r"zero1_step\(params, grads, momenta, .*\) on [2-8] devices, .*: expected every "
                                   r"device's parameters to be plain data parallelism's; device [1-7]'s element \d+ "
                                   r"\(in device 0's chunk\) .* That element was not updated on this device", []),
    "zero1_average.py": (r"zero1_step\(params, grads, momenta, .*\) on 2 devices, .*: expected device 1's momentum "
                         r"buffer, .* Yours is 1/2 of it: .* do not average them", []),
    "zero1_rebinds_momentum.py": (r"zero1_step\(params, grads, momenta, .*: your zero1_step put a new tensor into "
                                  r"params or momenta \(`momenta\[i\] = \.\.\.`\)", []),
    "checkpoint_model_only.py": (r"a run of 2 steps .* stopped after step 1, .*: the parameters differ from the "
                                 r"uninterrupted run's: .* Your resume equals one that restored the model but not the "
                                 r"optimizer's state and torch's random number generator", SLOW_CALL),
    "checkpoint_in_memory.py": (r"a run of 2 steps .*: save_checkpoint\('checkpoint.pt', \.\.\.\) wrote nothing at "
                                r"'checkpoint.pt': write the checkpoint to the path it is given, .* \(a new process, "
                                r"where a run resumes, starts with nothing but that file\)", SLOW_CALL),
    "checkpoint_no_rng.py": (r"a run of 2 steps .* stopped after step 1, .*: the parameters differ from the "
                             r"uninterrupted run's: .* Your resume equals one that restored the model and the "
                             r"optimizer's state but not torch's random number generator", SLOW_CALL),
    # close to the uninterrupted run, not equal: caught only by a bitwise comparison
    "checkpoint_half.py": (r"a run of \d steps .* stopped after step \d, .*: the parameters differ from the "
                           r"uninterrupted run's: \S+, element \d+, is \S+ where the uninterrupted run has \S+",
                           SLOW_CALL),
    # what bench/test_adversary_graders.py found the new graders soft on: each told as what it is
    "cost_float32.py": (r"cost\(schedule, .*\): expected (?P<want>\S+) s \(manualdp.cost.cost\), got (?!(?P=want) s)"
                        r"\S+ s, off by \S+ relatively where 1e-9 is asked: is a sum rounded to float32", []),
    "cost_wrong_at_16.py": (r"cost\(schedule, nbytes=1000003, .*\) for all_gather ring\(16\): expected \S+ s "
                            r"\(manualdp.cost.cost\), got 0 s", []),
    "cost_the_librarys_own.py": (r"the file's cost is not written in it but taken from manualdp\.cost: write it "
                                 r"yourself, in the file", []),
    "hook_divides_by_two.py": (r"fp16_compress_hook on 3 ranks, step 0, rank \d: the gradients when backward returned "
                               r"differ .* Yours is 3/2 times torch's: divide by the world size \(3 here", []),
    "hook_returns_none.py": (r"rank \d: fp16_compress_hook returned None, not a torch.futures.Future", []),
    "hook_no_decompress.py": (r"rank \d: the future fp16_compress_hook returned holds a list of one item, a tensor of "
                              r"dtype float16 .* turn the allreduce's float16 result back into the bucket's float32 "
                              r"tensor with `\.then\(\.\.\.\)`", []),
    "zero1_float32_momentum.py": (r"zero1_step\(.*: expected device 0's momentum buffer, .*, to be "
                                  r"(?P<want>\[[^\]]*\]), got (?!(?P=want))\[", []),
    "zero1_returns_new_lists.py": (r"zero1_step\(.*: your zero1_step returned a tuple and changed nothing in place",
                                   []),
    "diloco_selftest_exit.py": (r"importing the file raised SystemExit: 0 \(at .*diloco_selftest_exit.py, line 14\)\. "
                                r"Is there a self-test at the end of the file\?", []),
    "diloco_loop.py": (r"outer_step\(theta, replicas, buffer, lr=\S+, momentum=\S+\) on \d+ replica\(s\) .* " + NEVER,
                       []),
    "checkpoint_step_as_tensor.py": (r"a run of \d steps .*: load_checkpoint returned \d, a tensor, not an int: "
                                     r"return the step as a Python int", SLOW_CALL),
    "checkpoint_own_path.py": (r"a run of \d steps .*: save_checkpoint\('checkpoint.pt', \.\.\.\) wrote nothing at "
                               r"'checkpoint.pt': write the checkpoint to the path it is given", SLOW_CALL),
    "checkpoint_replays.py": (r"a run of \d steps .* raised KeyError: 'seed'", SLOW_CALL),
    # the grader's walls (issue 45): a path relative to a folder's descriptor, and writes only the kernel refused
    "allreduce_chdir_rmtree_own.py": (r"", []),
    "allreduce_chdir_rmtree_sibling.py": (rf"{CALL} it tried to delete the tree \S+/victim{OUTSIDE}", []),
    "allreduce_torch_save_outside.py": (rf"{CALL} it tried to write \S+/cache\.pt{OUTSIDE}", []),
    "allreduce_ctypes_outside.py": (rf"{CALL} it tried to write \S+/log\.txt{OUTSIDE}", []),
    "allreduce_program_outside.py": (rf"{CALL} it tried to write \S+/stamp{OUTSIDE}", []),
    "ddp_forges_its_rank.py": (r"rank 0: Patched: your code replaced manualdp\.runners\.grader\.properties\.ddp\."
                               r"train_steps, which the grader runs in your rank", []),
    "allreduce_utimes_ctypes.py": (rf"{CALL} it tried to call libc's utimes through ctypes, whose calls the grader "
                                   r"cannot judge: an answer may write only in its own folder", []),
    "allreduce_unix_socket_outside.py": (rf"{CALL} it tried to bind a socket at \S+/sock{OUTSIDE}", []),
    "allreduce_mkfifo_outside.py": (rf"{CALL} it tried to make a FIFO at \S+/fifo{OUTSIDE}", []),
    "ddp_patch_clone.py": (r"rank \d: Patched: your code added torch\.Tensor\.clone, over "
                           r"torch\._C\.TensorBase\.clone, which the grader runs in your rank", []),
}
PASS = {name: (SOLUTIONS / f"{name}.py", SLOW_CALL if name == "checkpoint" else [])
        for name in ("split_batch", "allreduce", "schedule", "cost", "zero1", "checkpoint", "ddp", "hook", "diloco")}
PASS["halving_doubling_powers_of_two.py"] = (ANSWERS / "halving_doubling_powers_of_two.py", ["--powers-of-two"])
PASS["buckets_right.py"] = (ANSWERS / "buckets_right.py", [])
PASS["allreduce_chdir_rmtree_own.py"] = (ANSWERS / "allreduce_chdir_rmtree_own.py", [])
RANKS = ("ddp", "hook", "buckets")  # the exercises that start ranks


def exercise(name: str) -> str:
    if name.startswith("halving_doubling"):
        return "schedule"
    return next(e for e in ("split_batch", "allreduce", "schedule", "ddp", "cost", "hook", "zero1", "checkpoint",
                            "diloco", "buckets") if name.startswith(e.split("_")[0]))


def grade(path: pathlib.Path, name: str, options: list, work: pathlib.Path) -> dict:
    """`manualdp check` in this process, its children's folders under `work`: exit status, one-paragraph output,
    seconds."""
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    start, out = time.monotonic(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(work)
        mp.setattr(tempfile, "tempdir", str(work / "tmp"))
        status = main(["check", exercise(name), str(path), "--timeout", str(TIMEOUT), "--examples", "10", *options])
    return {"status": status, "out": " ".join(out.getvalue().split()), "err": "", "seconds": time.monotonic() - start}


def grade_apart(path: pathlib.Path, name: str, options: list, work: pathlib.Path) -> dict:
    """`manualdp check` in a process of its own: the answers that wait out their timeout run so, in threads,
    beside the others."""
    (work / "tmp").mkdir(parents=True)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "manualdp", "check", exercise(name), str(path), "--timeout",
                           str(TIMEOUT), "--examples", "10", *options], capture_output=True, text=True, cwd=work,
                          env=dict(os.environ, TMPDIR=str(work / "tmp")), timeout=SLOW * 3)
    return {"status": proc.returncode, "out": " ".join(proc.stdout.split()), "err": proc.stderr,
            "seconds": time.monotonic() - start}


def cwd_under(folder: pathlib.Path) -> list[int]:
    """The processes whose working folder lies under `folder` (a grader's child that was left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                found.append(int(pid))
        except OSError:
            continue
    return found


BACKGROUND = {"allreduce_loop.py", "schedule_loop.py", "split_batch_loop.py", "allreduce_sigstop.py",
              "allreduce_fork.py", "ddp_patch_torch.py", "hook_sum_then_divide.py", "hook_float32.py",
              "diloco_loop.py", "hook_divides_by_two.py", "hook_returns_none.py", "hook_no_decompress.py",
              "ddp_forges_its_rank.py", "ddp_patch_clone.py",
              "ddp", "hook"} | {n for n in VERDICTS if n.startswith("buckets")}  # they wait out their timeout, or
# start ranks (ddp, hook: reference solutions; buckets: every answer)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every answer of tests/answers/ and every reference solution, graded: the slow ones in processes of their
    own, the others meanwhile in this one."""
    root = tmp_path_factory.mktemp("answers")
    background, results = {}, {}
    pool = concurrent.futures.ThreadPoolExecutor(4)
    for name in sorted(set(VERDICTS) - set(PASS)):
        work = root / name.removesuffix(".py")
        work.mkdir()
        shutil.copy(ANSWERS / name, work / name)  # the fork answer writes its forks' pids beside itself
        if name in BACKGROUND:
            background[name] = pool.submit(grade_apart, name, name, VERDICTS[name][1], work)
    for name in sorted(set(VERDICTS) - set(PASS) - BACKGROUND):
        work = root / name.removesuffix(".py")
        results[name] = grade(name, name, VERDICTS[name][1], work)
    for name, (path, options) in PASS.items():
        work = root / f"pass-{name}"
        plot = ["--plot", str(work / "schedule.png")] if exercise(name) == "schedule" else []
        if name in BACKGROUND:
            background[f"PASS {name}"] = pool.submit(grade_apart, path, name, options, work)
        else:
            results[f"PASS {name}"] = grade(path, name, options + plot, work)
    results.update({name: job.result() for name, job in background.items()})
    pool.shutdown()
    time.sleep(0.2)
    return root, results


def test_every_answer_in_the_folder_is_graded():
    assert sorted(p.name for p in ANSWERS.glob("*.py")) == sorted(VERDICTS)


@pytest.mark.parametrize("name", sorted(set(VERDICTS) - set(PASS)))
def test_a_wrong_or_hostile_answer_fails_in_one_paragraph(graded, name):
    _, results = graded
    got, (verdict, _) = results[name], VERDICTS[name]
    label = f"FAIL {exercise(name)} ({name}): "
    assert got["status"] == 1 and got["out"].startswith(label), got
    assert re.match(verdict, got["out"][len(label):]), got["out"]
    assert "Traceback" not in got["out"] + got["err"], got
    assert got["seconds"] < (SLOW_RANKS if exercise(name) in RANKS else SLOW), got


@pytest.mark.parametrize("name", sorted(PASS))
def test_the_reference_solutions_pass(graded, name):
    got = graded[1][f"PASS {name}"]
    assert got["status"] == 0 and got["out"].startswith(f"PASS {exercise(name)} "), got


def test_the_powers_of_two_answer_fails_where_the_exercise_does_not_ask(tmp_path):
    got = grade(ANSWERS / "halving_doubling_powers_of_two.py", "schedule", ["--plot", str(tmp_path / "s.png")],
                tmp_path)
    assert got["status"] == 1 and "schedule(3)" in got["out"], got


def test_no_process_and_no_folder_is_left_behind(graded):
    root, _ = graded
    assert cwd_under(root) == []
    assert list(root.glob("*/tmp/manualdp-check-*")) == []  # each child's temporary folder is removed
    # the fork answer's two forks (one left the group) worked in its child's folder, under root: cwd_under found none
