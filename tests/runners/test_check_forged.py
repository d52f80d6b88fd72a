"""An answer that patches, in its rank, the grader's own functions that measure it (to forge the rank's results)
fails naming what it replaced (`runners/grader/intact.py`): a module's name rebound, a function's code replaced."""
import pathlib
import re

import pytest
import torch

import manualdp.runners.grader.properties.ddp as ddp
from manualdp.runners.cli import main
from manualdp.runners.grader import intact

from .test_check_ddp_frozen import one_rank  # noqa: F401 (a fixture: one gloo rank in this process)

FORGES = pathlib.Path(__file__).resolve().parents[1] / "answers" / "ddp_forges_its_rank.py"
CLONE = pathlib.Path(__file__).resolve().parents[1] / "answers" / "ddp_patch_clone.py"
CODE = """
import manualdp.runners.grader.properties.ddp as grader

grader.batches.__code__ = (lambda steps=3, batch=13: []).__code__  # no step trained: nothing to differ


def DDP(module):  # no wrapper at all
    return module
"""


def test_nothing_patched_passes_and_a_rebound_name_or_replaced_code_is_named():
    before = intact.snapshot()
    intact.check(before)
    saved = ddp.first_difference
    try:
        ddp.first_difference = lambda *args: None
        with pytest.raises(intact.Patched, match=r"replaced manualdp\.runners\.grader\.properties\.ddp\."
                                                 r"first_difference, which the grader runs in your rank"):
            intact.check(before)
    finally:
        ddp.first_difference = saved
    code = torch.nn.functional.cross_entropy.__code__
    try:
        torch.nn.functional.cross_entropy.__code__ = (lambda *a, **k: None).__code__
        with pytest.raises(intact.Patched, match=r"replaced torch\.nn\.functional\.cross_entropy"):
            intact.check(before)
    finally:
        torch.nn.functional.cross_entropy.__code__ = code
    intact.check(before)


@pytest.mark.parametrize("owner, name, value, told", [
    (torch.Tensor, "clone", lambda self, *a, **k: self, "added torch.Tensor.clone, over torch._C.TensorBase.clone"),
    (torch.optim.SGD, "zero_grad", lambda self, set_to_none=True: None,
     "added torch.optim.sgd.SGD.zero_grad, over torch.optim.optimizer.Optimizer.zero_grad"),
    (torch._C._distributed_c10d.ProcessGroup, "allreduce", lambda *a, **k: None,
     "replaced torch.distributed.distributed_c10d.ProcessGroup.allreduce"),
    (torch.distributed, "new_name", 1, "added torch.distributed.new_name")])
def test_an_attribute_added_or_replaced_in_a_class_or_module_the_ranks_reach_is_named(owner, name, value, told):
    before = intact.snapshot()
    saved = vars(owner).get(name, intact.MISSING)
    try:
        setattr(owner, name, value)
        with pytest.raises(intact.Patched, match=re.escape(f"your code {told}, which the grader runs in your rank")):
            intact.check(before)
    finally:
        if saved is intact.MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
    intact.check(before)


@pytest.mark.parametrize("attribute, value", [("__defaults__", (1e9,)), ("__kwdefaults__", {"atol": 1e9})])
def test_a_grader_function_whose_defaults_are_replaced_is_named(attribute, value):
    def close(mine, theirs, atol=1e-12):
        return abs(mine - theirs) <= atol

    close.__kwdefaults__ = {"atol": 1e-12}  # as a keyword-only default would be
    ddp.close_enough = close  # a function of the grader's module, there at the snapshot
    try:
        before = intact.snapshot()
        setattr(close, attribute, value)
        with pytest.raises(intact.Patched, match=r"replaced manualdp\.runners\.grader\.properties\.ddp\.close_enough"):
            intact.check(before)
    finally:
        del ddp.close_enough


def test_a_submodule_imported_after_the_snapshot_is_not_a_patch():
    before = intact.snapshot()
    import torch.distributed.algorithms.join  # noqa: F401 (sets `join` on its package, perhaps for the first time)

    intact.check(before)


def test_a_rank_whose_answer_shadows_tensor_clone_reports_it_not_an_average(one_rank, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "clone", torch._C.TensorBase.clone, raising=False)  # the answer sets it
    monkeypatch.delattr(torch.Tensor, "clone")  # put back after: none of its own, as before
    out = ddp.ddp_job(str(CLONE), steps=1)
    assert set(out) == {"error"} and out["error"].startswith(
        "rank 0: Patched: your code added torch.Tensor.clone, over torch._C.TensorBase.clone, which the grader runs "
        "in your rank"), out


def test_a_rank_whose_answer_rebinds_the_graders_train_steps_reports_that_not_forged_results(one_rank, monkeypatch):
    monkeypatch.setattr(ddp, "train_steps", ddp.train_steps)  # the answer rebinds it in this process: put back after
    out = ddp.ddp_job(str(FORGES), steps=1)
    assert set(out) == {"error"} and out["error"].startswith(
        "rank 0: Patched: your code replaced manualdp.runners.grader.properties.ddp.train_steps, which the grader "
        "runs in your rank to measure your answer"), out


def test_a_rank_whose_answer_replaces_the_code_of_the_graders_batches_reports_it(one_rank, tmp_path):
    answer = tmp_path / "forges_code.py"
    answer.write_text(CODE)
    code = ddp.batches.__code__
    try:
        out = ddp.ddp_job(str(answer), steps=1)
    finally:
        ddp.batches.__code__ = code
    assert set(out) == {"error"} and "replaced manualdp.runners.grader.properties.ddp.batches" in out["error"], out


@pytest.mark.soak
def test_manualdp_check_ddp_fails_an_answer_that_forges_its_ranks_results(capsys):
    status = main(["check", "ddp", str(FORGES)])
    out = " ".join(capsys.readouterr().out.split())
    assert status == 1 and out.startswith(f"FAIL ddp ({FORGES}): rank ") and (
        "Patched: your code replaced manualdp.runners.grader.properties.ddp.train_steps" in out), out


HOOK = """
import torch

import manualdp.runners.grader.properties.hook as grader
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

real = grader._hooked_steps
grader._hooked_steps = lambda hook: real(allreduce_hook)  # torch's plain allreduce hook trains in its place


def fp16_compress_hook(process_group, bucket):  # the bucket as it came: nothing averaged
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done
"""
BUCKETS = """
import manualdp.runners.grader.properties.buckets as grader

grader._train = lambda cls, net, events, on: {}  # nothing recorded: nothing to judge


def BucketedDDP(module, bucket_cap_mb=25):  # no wrapper at all
    return module
"""


@pytest.mark.parametrize("exercise, source, name, replaced", [
    ("hook", HOOK, "fp16_compress_hook", "hook._hooked_steps"), ("buckets", BUCKETS, "BucketedDDP", "buckets._train")])
def test_a_hook_or_buckets_rank_whose_answer_rebinds_the_graders_job_reports_it(exercise, source, name, replaced,
                                                                                  one_rank, tmp_path, monkeypatch):
    from manualdp.runners.grader import properties
    from manualdp.runners.grader.properties import buckets, hook

    for module in (hook, buckets):  # the answer rebinds them in this process: put back after
        for attr in ("_hooked_steps", "_train"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, getattr(module, attr))
    answer = tmp_path / f"{exercise}_forges.py"
    answer.write_text(source)
    out = getattr(properties, f"{exercise}_job")(str(answer), name)
    assert set(out) == {"error"} and f"Patched: your code replaced manualdp.runners.grader.properties.{replaced}" in \
        out["error"], out


def test_the_buckets_job_puts_torchs_ddp_back_when_it_returns(one_rank, tmp_path):
    import inspect

    from manualdp.runners.grader.properties import buckets_job

    before = inspect.signature(torch.nn.parallel.DistributedDataParallel)
    answer = tmp_path / "buckets_none.py"
    answer.write_text(BUCKETS)
    buckets_job(str(answer), "BucketedDDP")
    # the job refuses torch's DDP while the file runs; a process that goes on (this test's) gets it back
    assert inspect.signature(torch.nn.parallel.DistributedDataParallel) == before
    assert "module" in before.parameters
