"""The DDP ladder (naive, flat, overlapped, bucketed): each rung equals torch's DDP after every step.

One spawned job per world size trains every rung and torch's DDP on the same data: a model
with a parameter used twice in one forward, a frozen layer, and (for the bucketed rung)
several buckets. The assertions run here, in the parent.
"""
import functools

import pytest
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.runners.grader.properties import Twice, ddp_mismatch, train_steps
from manualdp.spmd import BucketedDDP, FlatDDP, NaiveDDP, OverlappedDDP, launch

STEPS = 3
RUNGS = {"naive": NaiveDDP, "flat": FlatDDP, "overlapped": OverlappedDDP,
         "bucketed": functools.partial(BucketedDDP, bucket_cap_mb=0.0005)}  # 512 B: several buckets


def _job():
    rank = dist.get_rank()
    # every rank builds other weights: the wrappers must copy rank 0's, as torch's DDP does
    nets = {name: Twice(seed=rank).double() for name in [*RUNGS, "torch"]}
    models = {name: (make(nets[name]), nets[name]) for name, make in RUNGS.items()}
    models["torch"] = (TorchDDP(nets["torch"]), nets["torch"])
    events = {k: [] for k in RUNGS}
    for k in ("overlapped", "bucketed"):  # when does each allreduce start: during backward, or after?
        m = models[k][0]
        start = m.start_bucket if k == "bucketed" else m.start
        wrapped = (lambda start, log: lambda *a: (log.append("send"), start(*a))[1])(start, events[k])
        setattr(m, "start_bucket" if k == "bucketed" else "start", wrapped)
        end = m._end_of_backward
        m._end_of_backward = (lambda end, log: lambda: (log.append("end"), end())[1])(end, events[k])
    return {"results": train_steps(models, STEPS), "events": events, "buckets": len(models["bucketed"][0].buckets)}


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=120.0)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_rung_equals_torch_ddp_after_every_step(n, rung):
    # The comparison `manualdp check ddp` grades a student's rung with: after construction, and at
    # every step the gradients when backward returned and the parameters after; ranks bitwise equal.
    ddp_mismatch([r["results"] for r in _results(n)], rung)


def test_the_comparison_sees_a_rank_that_kept_its_own_weights():
    results = [{k: {"start": dict(v["start"]), "steps": v["steps"]} for k, v in r["results"].items()}
               for r in _results(2)]
    name = next(iter(results[1]["naive"]["start"]))
    results[1]["naive"]["start"][name] = results[1]["naive"]["start"][name] + 1
    with pytest.raises(AssertionError, match=f"naive on 2 ranks: right after construction, rank 1's .*{name}"):
        ddp_mismatch(results, "naive")


def test_the_overlapping_rungs_send_during_backward():
    results = _results(2)
    assert results[0]["buckets"] >= 3
    per_step = {"overlapped": 6, "bucketed": results[0]["buckets"]}  # inp, shared, out: 6 need a gradient
    for rung, sends in per_step.items():
        events = results[0]["events"][rung]
        assert events == (["send"] * sends + ["end"]) * STEPS, f"{rung}: {events}"


def _bad_input_job():
    out = {}
    for name, make in RUNGS.items():
        frozen = nn.Linear(2, 2).requires_grad_(False)
        try:
            make(frozen)
        except ValueError as e:
            out[name] = str(e)
    try:
        NaiveDDP(nn.Linear(2, 2), algorithm="fastest")
    except ValueError as e:
        out["algorithm"] = str(e)
    try:
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=-1)
    except ValueError as e:
        out["cap"] = str(e)
    return out


def test_rungs_refuse_bad_input_naming_it():
    got = launch(_bad_input_job, 2, timeout=60.0)[0]
    for name in RUNGS:
        assert "no parameter that requires grad" in got[name]
    assert "algorithm" in got["algorithm"] and "fastest" in got["algorithm"]
    assert "bucket_cap_mb" in got["cap"] and "-1" in got["cap"]
