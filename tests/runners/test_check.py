"""`manualdp check`: the book's reference solutions pass; a planted wrong answer fails, told in one paragraph."""
import pathlib
import re
import sys

import pytest

from manualdp.runners.cli import main

SOLUTIONS = pathlib.Path(__file__).resolve().parents[2] / "book" / "solutions"
ANSWERS = pathlib.Path(__file__).resolve().parents[1] / "answers"

WRONG = {  # exercise -> (a wrong answer a student might write, what the grader must say of it)
    "split_batch": ("""
import torch

def split_batch(X, y, devices):  # torch.chunk: fewer shards than devices when the batch does not divide
    return list(torch.chunk(X, len(devices))), list(torch.chunk(y, len(devices)))
""", r"split_batch\(X, y, devices\) with X of shape \(\d+, \d+\), y = torch.arange\(\d+\) and \d devices?: "
     r"(expected \d shards in X_shards, one per device; got \d|writing into X_shards\[0\] changed the caller's batch)"),
    "allreduce": ("""
def allreduce(tensors):  # rebinds the list's slots: the devices' own tensors never see the sum
    for i in range(1, len(tensors)):
        tensors[0] = tensors[0] + tensors[i]
    for i in range(1, len(tensors)):
        tensors[i] = tensors[0]
""", r"allreduce\(tensors\) on 2 tensors of shape .*: expected every device to hold the sum .*; device 0 holds .* "
     r"put a new tensor into the list"),
    "schedule": ("""
from manualdp.transfers import Transfer

def schedule(n):  # the all-gather adds what it should overwrite
    reduce_scatter = [[Transfer(i, (i + 1) % n, (i - s) % n, True) for i in range(n)] for s in range(n - 1)]
    all_gather = [[Transfer(i, (i + 1) % n, (i + 1 - s) % n, True) for i in range(n)] for s in range(n - 1)]
    return reduce_scatter + all_gather
""", r"schedule\(2\): after its 2 rounds, device 0 holds a0\+a0\+b0 in chunk 0, expected the sum of every "
     r"device's chunk 0, a0\+b0: it counts device 0 twice \(drawn in .*\.png\)"),
    "ddp": ("""
import torch.distributed as dist
from torch import nn

class DDP(nn.Module):  # sums the gradients but forgets to divide by the number of ranks
    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.requires_grad:
                dist.all_reduce(p.grad)
""", r"DDP on 2 ranks, step 0, rank 0: the gradients when backward returned differ from torch's DDP's on the "
     r"same data: \S+, element \d+, is \S+ where torch's is \S+ \(yours / torch's = 2\)\. Rank 0 holds 2 times the "
     r"average: divide the sum by the world size\."),
    # the exercises of chapters 3, 5, 6 and 7: one wrong answer each of tests/answers/ (all of them: bench/)
    "cost": (ANSWERS / "cost_sent_only.py",
             r"cost\(schedule, nbytes=\d+, .*\): expected \S+ s \(manualdp.cost.cost\), got \S+ s\. Yours counts bytes "
             r"sent only: a device's beta term is beta times the larger of the bytes it sends and the bytes it "
             r"receives"),
    "hook": (ANSWERS / "hook_sum_then_divide.py",
             r"fp16_compress_hook on 2 ranks, step 1 \(the step with the loss scaled by 8192\), rank \d: the gradients "
             r"when backward returned differ from those with torch's fp16_compress_hook: 2\.bias, element \d, is inf "
             r"where torch's is 32768\. The sum of the ranks' float16 gradients overflowed"),
    "zero1": (ANSWERS / "zero1_no_gather.py",
              r"zero1_step\(params, grads, momenta, .*\) on 2 devices, .*: expected every device's parameters to be "
              r"plain data parallelism's; device \d's element \d+ \(in device \d's chunk\) is \S+, expected \S+\. That "
              r"element was not updated on this device: all-gather the updated chunks"),
    "checkpoint": (ANSWERS / "checkpoint_no_rng.py",
                   r"a run of \d steps .* stopped after step \d, .*: the parameters differ from the uninterrupted "
                   r"run's: .* Your resume equals one that restored the model and the optimizer's state but not "
                   r"torch's random number generator, which draws the batches and the dropout masks"),
}
# the references that pass here; ddp's and hook's, which start ranks, pass in bench/test_check_answers.py
PASSING = ["split_batch", "allreduce", "schedule", "cost", "zero1", "checkpoint"]


def check(capsys, *args) -> tuple[int, str]:
    status = main(["check", *map(str, args)])
    return status, " ".join(capsys.readouterr().out.split())  # one paragraph, as read: line breaks are wrapping


@pytest.mark.parametrize("exercise", PASSING)
def test_the_reference_solution_passes(exercise, tmp_path, capsys):
    status, out = check(capsys, exercise, SOLUTIONS / f"{exercise}.py", "--examples", 20,
                        *(["--plot", tmp_path / "s.png"] if exercise == "schedule" else []))
    assert (status, out[:5]) == (0, "PASS "), out


@pytest.mark.parametrize("exercise", sorted(WRONG))
def test_a_wrong_answer_fails_with_a_readable_paragraph(exercise, tmp_path, capsys):
    code, message = WRONG[exercise]
    path = tmp_path / f"{exercise}.py"
    path.write_text(code if isinstance(code, str) else code.read_text())
    status, out = check(capsys, exercise, path, "--examples", 20)
    assert status == 1 and out.startswith(f"FAIL {exercise} ({path}): "), out
    assert re.search(message, out), out
    if exercise == "schedule":
        assert (tmp_path / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn beside the file


def test_a_schedule_is_counted_against_the_formula_and_drawn(tmp_path, capsys):
    ring = tmp_path / "ring.png"
    status, out = check(capsys, "schedule", SOLUTIONS / "schedule.py", "--plot", ring)
    assert status == 0 and ring.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the ring sends 2(n-1)/n * S from each device: 1.5 S at 4 devices, 1.75 S at 8
    assert "4 6 1572864 1572864 1572864 at the formula" in out and "8 14 1835008 1835008 1835008 at the formula" in out
    # the textbook's naive allreduce is right, but its device 0 sends (n-1) S: 2 and 4 times the ring's
    naive = tmp_path / "naive.py"
    naive.write_text("from manualdp.schedule import naive as schedule\n")
    status, out = check(capsys, "schedule", naive)
    assert status == 0 and "4 2 3145728 3145728 1572864 2.00 times the formula" in out, out
    assert "8 2 7340032 7340032 1835008 4.00 times the formula" in out and (tmp_path / "naive.png").exists()


@pytest.mark.parametrize("code, message", [
    ("def split(X, y, devices):\n    return X, y\n",
     r"the file defines no 'split_batch': the exercise asks for a function split_batch\(X, y, devices\)"),
    ("def split_batch(X, y, devices)\n", "importing the file raised SyntaxError"),
    ("def split_batch(X, y, devices):\n    return X.foo\n",
     r"raised AttributeError: 'Tensor' object has no attribute 'foo' \(at .*split_batch.py, line 2\)"),
])
def test_a_file_that_cannot_be_graded_is_told_why(code, message, tmp_path, capsys):
    path = tmp_path / "split_batch.py"
    path.write_text(code)
    status, out = check(capsys, "split_batch", path)
    assert status == 1 and re.search(message, out), out


def test_without_hypothesis_the_checker_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # `import hypothesis` now raises ImportError
    status, out = check(capsys, "allreduce", SOLUTIONS / "allreduce.py")
    assert status == 1 and "need hypothesis: pip install hypothesis" in out


def test_the_books_sample_message_is_what_the_grader_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pathlib.Path("my_allreduce.py").write_text(WRONG["allreduce"][0])
    status, out = check(capsys, "allreduce", "my_allreduce.py")
    sample = re.search(r"```text\n(FAIL allreduce.*?)```", (SOLUTIONS.parent / "README.md").read_text(), re.S).group(1)
    assert status == 1 and out == " ".join(sample.split())


LIBRARYS_OWN = {  # exercise -> (an answer that is the library's own code passed off as the student's, what is told)
    "ddp": ("from torch.nn.parallel import DistributedDataParallel\n\nclass DDP(DistributedDataParallel):\n"
            "    pass\n", r"the file's DDP is built on torch\.nn\.parallel\.distributed\.DistributedDataParallel, "
            r"the library's own: write it yourself"),
    "cost": ("def cost(schedule, nbytes, alpha, beta, gamma):\n    from manualdp import cost as c\n"
             "    return c.cost(schedule, nbytes, alpha, beta, gamma)\n",
             r"raised RuntimeError: write it yourself: manualdp\.cost\.cost is what this exercise asks you to write"),
    "hook": ("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d\n\n"
             "def fp16_compress_hook(process_group, bucket):\n    return d.fp16_compress_hook(process_group, bucket)\n",
             r"RuntimeError: write it yourself: torch's fp16_compress_hook is what this exercise asks you to write"),
}


@pytest.mark.parametrize("exercise", [pytest.param(e, marks=pytest.mark.soak) if e == "hook" else e
                                      for e in LIBRARYS_OWN])
def test_the_librarys_own_code_called_or_subclassed_fails_naming_it(exercise, tmp_path, capsys):
    code, message = LIBRARYS_OWN[exercise]
    path = tmp_path / f"{exercise}.py"
    path.write_text(code)
    status, out = check(capsys, exercise, path, "--examples", 5)
    assert status == 1 and out.startswith(f"FAIL {exercise} ({path}): ") and re.search(message, out), out
