"""Uneven inputs: manualdp's `join()` and torch's generic `Join` against torch's DDP, at world sizes 2 and 3.

Rank r has `2 + 2r` batches. Ranks that run out shadow the others' collectives with zeros;
at the end every rank takes the model of the last rank to join.
"""
import copy
import functools
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from tests.helpers import WRAPPERS, rank_input
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 240.0
STEP_TIMEOUT = 20.0  # a wrapper waits this long for a peer: a rank out of step fails the test in seconds


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(rank):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (4,), generator=g))
            for _ in range(2 + 2 * rank)]


def _train(model, context, accumulate):
    """Train under `context`; with `accumulate`, every other batch only accumulates (no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    with context:
        for i, (X, y) in enumerate(_batches(dist.get_rank())):
            local = accumulate and i % 2 == 0
            with (model.no_sync() if local else _nothing()):
                nn.functional.cross_entropy(model(X), y).backward()
            if not local:
                opt.step()
                opt.zero_grad()
                steps.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return steps, torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _compare(divide, accumulate, generic):
    torch.manual_seed(0)
    module = _mlp()
    ours = DistributedDataParallel(copy.deepcopy(module), timeout=STEP_TIMEOUT)
    theirs = TorchDDP(copy.deepcopy(module))
    context = (Join([ours], divide_by_initial_world_size=divide) if generic
               else ours.join(divide_by_initial_world_size=divide))
    mine = _train(ours, context, accumulate)
    reference = _train(theirs, theirs.join(divide_by_initial_world_size=divide), accumulate)
    # the rank whose model every rank took at the end (torch's private name; its Join tests read it)
    return {"ours": mine, "theirs": reference, "authority": (ours._authoritative_rank, theirs._authoritative_rank)}


def _early_termination():
    """throw_on_early_termination: every rank raises once the first one (rank 0) runs out."""
    torch.manual_seed(0)
    ours = DistributedDataParallel(_mlp(), timeout=STEP_TIMEOUT)
    try:
        _train(ours, ours.join(throw_on_early_termination=True), accumulate=False)
    except RuntimeError as e:
        return str(e)
    return None


CASES = {"plain": (True, False, False), "fewer": (False, False, False), "no_sync": (True, True, False),
         "generic": (True, False, True), "generic_no_sync_fewer": (False, True, True)}


def _joined_grads():
    """`.grad` of a rank that joined early, after the Join and after one more step, both wrappers (torch's test
    test_ddp_grad_div_uneven_inputs): the shadowed steps' averages must not stay in it."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        rows = []
        for view in (False, True):
            torch.manual_seed(0)
            model = wrapper(nn.Linear(3, 2).double(), gradient_as_bucket_view=view)
            with model.join():
                for step in range(rank + 2):  # rank 0 joins first and shadows one step
                    model(rank_input(rank + step)).sum().backward()
                    model.zero_grad(set_to_none=not view)
            rows.append(None if model.module.weight.grad is None else model.module.weight.grad.clone())
            model(rank_input(rank)).sum().backward()  # accumulates into what the Join left
            rows.append(model.module.weight.grad.clone())
        out[name] = rows
    return out


def _job():
    # A case that fails leaves the ranks out of step: stop there, or every later case would wait out its timeouts.
    out = dict.fromkeys([*CASES, "early"], "not run: an earlier case failed")
    if dist.get_world_size() == 2:
        out.update(run_scenarios({"joined_grads": _joined_grads}))
    for name, args in CASES.items():
        try:
            out[name] = _compare(*args)
        except Exception:
            out[name] = "ERROR " + traceback.format_exc()
            return out
    out["early"] = _early_termination()
    return out


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, (), timeout=JOB_TIMEOUT)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_uneven_inputs_train_like_torch_ddp_join(n, case):
    finals = []
    for rank in range(n):
        value = _results(n)[rank][case]
        assert not isinstance(value, str), value
        (ours_steps, ours_final), (theirs_steps, theirs_final) = value["ours"], value["theirs"]
        assert len(ours_steps) == len(theirs_steps) > 0
        for step, (a, b) in enumerate(zip(ours_steps, theirs_steps)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), f"rank {rank} step {step}"
        assert torch.allclose(ours_final, theirs_final, rtol=0, atol=1e-12)
        assert value["authority"] == (n - 1, n - 1)  # rank n-1 has the most batches: it joins last
        finals.append(ours_final)
    assert all(torch.equal(finals[0], f) for f in finals), "the ranks' final models differ"


@pytest.mark.parametrize("n", [2, 3])
def test_throw_on_early_termination_raises_on_every_rank(n):
    for rank in range(n):
        message = _results(n)[rank]["early"]
        assert message is not None and ("exhausted all inputs" in message if rank == 0
                                        else "exhausted inputs" in message)


def test_a_rank_that_joined_early_keeps_its_grad_as_torchs_does():
    for ranks in _results(2):
        value = ranks["joined_grads"]
        assert not (isinstance(value, str) and value.startswith("ERROR")), value
        for mine, torchs in zip(value["ours"], value["theirs"], strict=True):
            assert (mine is None) == (torchs is None) and (mine is None or torch.equal(mine, torchs)), (mine, torchs)


def _raise_inside_join(raiser, at):
    torch.manual_seed(0)
    ours = DistributedDataParallel(_mlp(), timeout=STEP_TIMEOUT)
    rank = dist.get_rank()
    try:
        with ours.join():
            for i, (X, y) in enumerate(_batches(rank)):
                if rank == raiser and i == at:
                    raise KeyError("a bad batch")
                nn.functional.cross_entropy(ours(X), y).backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_an_exception_inside_join_is_a_peer_error_naming_it_on_the_other_ranks():
    # Rank 0 (2 batches) has joined and shadows the others; rank 1 (4) trains; rank 2 (6) raises at its 4th.
    results = launch(_raise_inside_join, 3, (2, 3), timeout=JOB_TIMEOUT)
    assert results[2] == ("KeyError", "'a bad batch'")
    for rank in (0, 1):
        kind, message = results[rank]
        assert kind == "PeerError" and "rank 2" in message, (rank, message)
        assert "raised KeyError: 'a bad batch' inside Join" in message, (rank, message)
