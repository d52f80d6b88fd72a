"""Buffer sync: rank 0's buffers before every forward (forward_sync_buffers, torch's deprecated broadcast_buffers),
and torch's private buffer comm hook; against torch's DDP.

One spawned job at 2 ranks runs every scenario on both wrappers; the assertions run here.
A scenario that raises returns its error text, so one failure does not hide the others.
"""
import copy
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _BufferCommHookLocation

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from tests.helpers import WRAPPERS, bn_mlp, cat_flat, global_batches, rank_input, sharded_loss
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 240.0


class _WithBuffer(nn.Module):
    """A buffer that starts as this rank's number and counts the forwards, by rank + 1 each."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2).double()
        self.register_buffer("buf", torch.full((2,), float(rank), dtype=torch.float64))
        self.rank = rank

    def forward(self, x):
        out = self.lin(x) + self.buf
        with torch.no_grad():
            self.buf += self.rank + 1
        return out


def _quiet(wrapper, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return wrapper(*args, **kwargs)


# ---------------------------------------------------------------- scenarios (run on every rank)

def _batchnorm():
    """BatchNorm: buffers follow rank 0 before every forward, as with torch's DDP."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    ours = DistributedDataParallel(bn_mlp(), bucket_cap_mb=0.0005)
    after_init = cat_flat(ours.buffers())
    theirs = TorchDDP(copy.deepcopy(ours.module), bucket_cap_mb=0.0005)
    out = {"init": after_init}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for X, y in global_batches(3, batch=16):
            opt.zero_grad()
            sharded_loss(model, X, y, rank, n).backward()
            opt.step()
        out[key] = cat_flat(model.parameters())
        out[key + "_buffers"] = cat_flat(model.module.buffers())
    return out


def _counting():
    """Each rank's buffer after construction, after one forward that rank 0 preceded by +10, and after a Join."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        rows = {}
        for case, kwargs in (("forward_false", {"forward_sync_buffers": False}),
                             ("broadcast_false", {"broadcast_buffers": False}), ("default", {})):
            module = _WithBuffer(rank)
            model = _quiet(wrapper, module, **kwargs)
            built = module.buf.clone()
            if rank == 0:
                module.buf += 10
            model(rank_input(rank)).sum().backward()
            rows[case] = (built, module.buf.clone())
        module = _WithBuffer(rank)
        model = wrapper(module, forward_sync_buffers=False)
        with model.join():
            for _ in range(rank + 1):  # rank 0 runs out first
                model(rank_input(rank)).sum().backward()
        rows["join"] = module.buf.clone()
        out[name] = rows
    return out


def _warnings():
    """The FutureWarnings each way of asking for buffer syncing gives, and the flag it sets."""
    out = {}
    for name, wrapper in WRAPPERS:
        rows = []
        for kwargs in ({"broadcast_buffers": True}, {"broadcast_buffers": False},
                       {"broadcast_buffers": False, "forward_sync_buffers": True},
                       {"broadcast_buffers": True, "forward_sync_buffers": False}, {}, {"forward_sync_buffers": False}):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = wrapper(nn.Linear(3, 2), **kwargs)
            said = [(w.category.__name__, str(w.message)) for w in caught if "broadcast_buffers" in str(w.message)]
            rows.append((said, model.forward_sync_buffers, model.broadcast_buffers))
        out[name] = rows
    return out


def _buffer_hook():
    """torch's private buffer comm hook (allreduce, before or after forward, futures or not): buffers after each
    step."""
    rank = dist.get_rank()

    def average(ddp, named, futures=False):
        works = [dist.all_reduce(b.div_(dist.get_world_size()), async_op=True) for b in named.values()]
        if futures:  # waited for at the end of backward
            return [w.get_future() for w in works]
        for w in works:
            w.wait()
        return None

    out = {}
    for name, wrapper in WRAPPERS:
        rows = []
        # not futures before forward: they would race with the forward's update of the buffer (torch says so)
        for where, futures in ((_BufferCommHookLocation.PRE_FORWARD, False),
                               (_BufferCommHookLocation.POST_FORWARD, False),
                               (_BufferCommHookLocation.POST_FORWARD, True)):
            module = _WithBuffer(rank)
            model = wrapper(module)
            model._register_buffer_comm_hook(model, functools.partial(average, futures=futures), where)
            for step in range(2):
                model(rank_input(rank + step)).sum().backward()
                rows.append(module.buf.clone())
        out[name] = rows
    return out


def _job():
    scenarios = {"batchnorm": _batchnorm, "counting": _counting, "warnings": _warnings, "buffer_hook": _buffer_hook}
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

def test_buffers_are_broadcast_like_torch_ddp():
    results = _get("batchnorm")
    assert torch.equal(results[0]["init"], results[1]["init"])
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
        torch.testing.assert_close(results[r]["ours_buffers"], results[r]["theirs_buffers"], rtol=0, atol=1e-12)


def test_forward_sync_buffers_and_the_deprecated_broadcast_buffers_sync_as_torchs():
    for rank, value in enumerate(_get("counting")):
        ours, theirs = value["ours"], value["theirs"]
        for case in ("forward_false", "broadcast_false", "default"):
            for mine, torchs in zip(ours[case], theirs[case]):
                assert torch.equal(mine, torchs), (rank, case, mine, torchs)
        assert torch.equal(ours["join"], theirs["join"]), (rank, ours["join"], theirs["join"])
        # forward_sync_buffers=False: rank 0's buffer at construction, each its own after forward
        built, after = ours["forward_false"]
        assert torch.equal(built, torch.zeros(2, dtype=torch.float64))
        assert torch.equal(after, torch.full((2,), 10.0 * (rank == 0) + rank + 1, dtype=torch.float64))
        # broadcast_buffers=False: not even at construction
        assert torch.equal(ours["broadcast_false"][0], torch.full((2,), float(rank), dtype=torch.float64))
        # the default: rank 0's before the forward, then each rank counts
        assert torch.equal(ours["default"][1], torch.full((2,), 10.0 + rank + 1, dtype=torch.float64))
        # Join's final sync leaves the buffers alone (rank r ran r + 1 forwards of +(r + 1) from rank 0's 0)
        assert torch.equal(ours["join"], torch.full((2,), float((rank + 1) ** 2), dtype=torch.float64))


def test_broadcast_buffers_gives_torchs_future_warning_word_for_word():
    for value in _get("warnings"):
        assert value["ours"] == value["theirs"]
        said = [row[0] for row in value["ours"]]
        assert all(w and w[0][0] == "FutureWarning" for w in said[:4]) and said[4:] == [[], []]
        assert [row[1] for row in value["ours"]] == [True, False, True, False, True, False]


def test_buffer_comm_hook_syncs_buffers_as_torchs():
    for value in _get("buffer_hook"):
        for mine, torchs in zip(value["ours"], value["theirs"], strict=True):
            assert torch.allclose(mine, torchs, rtol=0, atol=1e-12), (mine, torchs)
    ranks = _get("buffer_hook")
    for after_forward in (3, 5):  # the hook ran after forward: it averaged the ranks' buffers
        assert torch.equal(ranks[0]["ours"][after_forward], ranks[1]["ours"][after_forward])
