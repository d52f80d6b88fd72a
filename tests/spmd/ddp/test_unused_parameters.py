"""Unused parameters and the static graph: find_unused_parameters, and torch's errors word for word when a
parameter goes unused without it or a static graph changes; against torch's DDP.

One spawned job at 2 ranks runs every scenario on both wrappers; the assertions run here.
A scenario that raises returns its error text, so one failure does not hide the others.
"""
import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch, shard
from tests.helpers import WRAPPERS, EitherHead, cat_flat, global_batches, rank_batches, rank_input
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 240.0


class _UsedByRank0(nn.Module):
    """Head `b` is used on rank 0 only; head `never` on no rank."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b, self.never = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


class _Chain(nn.Module):
    """lin1, then lin2 when asked: lin2's gradients come before lin1's (torch's ControlFlowToyModel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x, second):
        h = torch.relu(self.lin1(x))
        return self.lin2(h) if second else h


class _Switch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


# ---------------------------------------------------------------- scenarios (run on every rank)

def _unused():
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = DistributedDataParallel(_UsedByRank0().double(), bucket_cap_mb=0.0002, find_unused_parameters=True)
    theirs = TorchDDP(copy.deepcopy(ours.module), find_unused_parameters=True)
    out = {}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for X, y in global_batches(3):
            Xs, ys = shard(X, y, rank, n)
            opt.zero_grad()
            (nn.functional.cross_entropy(model(Xs, rank == 0), ys, reduction="sum") / len(X) * n).backward()
            opt.step()
        out[key] = cat_flat(model.parameters())
        out[key + "_never_grad"] = model.module.never.weight.grad
        out[key + "_b_grad"] = model.module.b.weight.grad  # used on rank 0 only
    return out


def _unused_without_find_unused():
    """Heads unused on one rank, find_unused_parameters=False: each wrapper's calls, and where they raise."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in (("ours", DistributedDataParallel), ("theirs", TorchDDP)):
        torch.manual_seed(0)
        model = wrapper(EitherHead().double())
        X, _ = rank_batches(rank, steps=1)[0]
        calls = [("backward", lambda: model(X, use_b=rank == 1).sum().backward()),
                 ("forward without grad", lambda: torch.no_grad()(model)(X, use_b=False)),
                 ("forward", lambda: model(X, use_b=False)), ("forward again", lambda: model(X, use_b=False))]
        out[name] = []
        for call, fn in calls:
            try:
                fn()
                out[name].append((call, None))
            except RuntimeError as e:
                out[name].append((call, str(e)))
    return out


def _errors():
    """torch's words: a parameter left unused without find_unused_parameters, and a static graph that changes."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        said = {}
        model = wrapper(_Chain())
        model(rank_input(rank, d=4), False).sum().backward()
        try:
            model(rank_input(rank, d=4), False)
        except RuntimeError as e:
            said["unused"] = str(e)
        for case, seconds in (("grown", (False, True, True)), ("shrunk", (True, False, True))):
            model = wrapper(_Chain(), static_graph=True)
            said[case] = []
            for second in seconds:
                try:
                    model(rank_input(rank, d=4), second).sum().backward()
                    said[case].append(None)
                except RuntimeError as e:
                    said[case].append(str(e))
            said[case + " logged"] = model._get_ddp_logging_data().get("error")
        out[name] = said
    return out


def _static_graph_changes():
    """static_graph=True and a graph that changes: both wrappers raise torch's words (grown, then shrunk)."""
    out = {}
    for name, wrapper in (("ours", DistributedDataParallel), ("theirs", TorchDDP)):
        messages = []
        for order in ((False, True), (True, False, False)):  # torch says the second at the next forward
            torch.manual_seed(0)
            model = wrapper(_Switch(), static_graph=True)
            try:
                for use_b in order:
                    model(torch.randn(3, 4), use_b).sum().backward()
                messages.append(None)
            except RuntimeError as e:
                messages.append(str(e))
        out[name] = messages
    return out


def _job():
    scenarios = {"unused": _unused, "unused_error": _unused_without_find_unused, "errors": _errors,
                 "static_graph": _static_graph_changes}
    return run_scenarios(scenarios)


@functools.lru_cache(maxsize=None)
def _results():
    return launch(_job, 2, (), timeout=JOB_TIMEOUT)


def _get(name):
    values = [ranks[name] for ranks in _results()]
    for value in values:
        assert not (isinstance(value, str) and value.startswith("ERROR")), value
    return values


# ---------------------------------------------------------------- the checks

def test_unused_parameters_behave_like_torch_ddp():
    results = _get("unused")
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
        # used by no rank: no gradient at all, so SGD leaves it alone (DDP: the same)
        assert results[r]["ours_never_grad"] is None and results[r]["theirs_never_grad"] is None
        # used by rank 0 only: both ranks get the average, rank 1 counting as zero
        torch.testing.assert_close(results[r]["ours_b_grad"], results[r]["theirs_b_grad"], rtol=0, atol=1e-12)
        assert results[r]["ours_b_grad"].abs().sum() > 0
    assert torch.equal(results[0]["ours"], results[1]["ours"])


def test_unused_parameters_without_find_unused_raise_at_the_next_forward_as_torch_does():
    for rank in range(2):
        value = _get("unused_error")[rank]
        ours, theirs = value["ours"], value["theirs"]
        assert [(call, error is None) for call, error in ours] == [(call, error is None) for call, error in theirs]
        assert [error is None for _, error in ours] == [True, True, False, False]
        for _, error in ours[2:]:  # on every rank, both heads: each was left without a gradient on one rank
            assert error.startswith("Expected to have finished reduction in the prior iteration")
            assert "find_unused_parameters=True" in error
            named = error[error.index("did not receive grad"):]
            assert all(f"{p} (1 of 2)" in named for p in ("a.weight", "a.bias", "b.weight", "b.bias"))
            assert "trunk" not in named
            mine = "b.weight, b.bias" if rank == 0 else "a.weight, a.bias"  # torch names this rank's own
            assert f"Parameters which did not receive grad for rank {rank}: {mine}\n" in error


def test_errors_are_torchs_word_for_word_with_the_debug_hint():
    for rank, value in enumerate(_get("errors")):
        ours, theirs = value["ours"], value["theirs"]
        assert "TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL" in theirs["unused"]
        assert ours["unused"].startswith(theirs["unused"]), (ours["unused"], theirs["unused"])
        assert f"Parameters which did not receive grad for rank {rank}: lin2.weight, lin2.bias" in ours["unused"]
        # a parameter newly used raises; the next forward raises torch's unfinished-reduction error
        assert theirs["grown"][0] is None and ours["grown"][0] is None
        assert ours["grown"][1].startswith(theirs["grown"][1]), (ours["grown"][1], theirs["grown"][1])
        assert ours["grown"][2].startswith(theirs["grown"][2]), (ours["grown"][2], theirs["grown"][2])
        assert theirs["grown"][2].startswith("Expected to have finished reduction in the prior iteration")
        assert f"Parameter indices which did not receive grad for rank {rank}: 0 1\n" in ours["grown"][2]
        # a parameter no longer used: torch says so at the next forward
        assert [e is None for e in ours["shrunk"]] == [e is None for e in theirs["shrunk"]] == [True, True, False]
        assert ours["shrunk"][2].startswith(theirs["shrunk"][2]), (ours["shrunk"][2], theirs["shrunk"][2])
        for case in ("grown", "shrunk"):  # and it is logged, as torch's is
            assert ours[case + " logged"] == ours[case][2]


def test_static_graph_refuses_a_changing_graph_as_torch_does():
    for result in _get("static_graph"):
        for ours, theirs in zip(result["ours"], result["theirs"]):
            assert theirs is not None and ours is not None
        assert "Your training graph has changed in this iteration" in result["ours"][0]
        assert result["ours"][1].startswith("Expected to have finished reduction in the prior iteration")
        assert "'b.bias'" in result["ours"][1]
