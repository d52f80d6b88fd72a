"""Where torch 2.13's own DDP tests found manualdp's wrapper differing, against torch's DDP (issue 21, item 5).

One spawned job at 2 ranks runs every scenario on both wrappers; the assertions run here.
A scenario that raises returns its error text, so one failure does not hide the others.
"""
import copy
import functools
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _BufferCommHookLocation

from manualdp.spmd import launch
from manualdp.spmd import comm_hooks as hooks
from manualdp.spmd.ddp.wrapper import DistributedDataParallel
from manualdp.spmd.ddp.graph import module_device
from manualdp.spmd.ddp.private import LOGGED_FIELDS
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 240.0
WRAPPERS = (("ours", DistributedDataParallel), ("theirs", TorchDDP))


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


class _Chain(nn.Module):
    """lin1, then lin2 when asked: lin2's gradients come before lin1's (torch's ControlFlowToyModel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x, second):
        h = torch.relu(self.lin1(x))
        return self.lin2(h) if second else h


def _x(rank, n=5, d=3):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def _quiet(wrapper, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return wrapper(*args, **kwargs)


# ---------------------------------------------------------------- scenarios (run on every rank)

def _buffers():
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
            model(_x(rank)).sum().backward()
            rows[case] = (built, module.buf.clone())
        module = _WithBuffer(rank)
        model = wrapper(module, forward_sync_buffers=False)
        with model.join():
            for _ in range(rank + 1):  # rank 0 runs out first
                model(_x(rank)).sum().backward()
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


def _errors():
    """torch's words: a parameter left unused without find_unused_parameters, and a static graph that changes."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        said = {}
        model = wrapper(_Chain())
        model(_x(rank, d=4), False).sum().backward()
        try:
            model(_x(rank, d=4), False)
        except RuntimeError as e:
            said["unused"] = str(e)
        for case, seconds in (("grown", (False, True, True)), ("shrunk", (True, False, True))):
            model = wrapper(_Chain(), static_graph=True)
            said[case] = []
            for second in seconds:
                try:
                    model(_x(rank, d=4), second).sum().backward()
                    said[case].append(None)
                except RuntimeError as e:
                    said[case].append(str(e))
            said[case + " logged"] = model._get_ddp_logging_data().get("error")
        out[name] = said
    return out


def _logging():
    """`_get_ddp_logging_data()` of both wrappers on the same module, before and after a comm hook."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        model = wrapper(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double(), gradient_as_bucket_view=True)
        before = model._get_ddp_logging_data()
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        for _ in range(2):
            model(_x(rank)).sum().backward()
        builtin = wrapper(nn.Linear(3, 2))
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        try:
            builtin.register_comm_hook({}, {})
        except TypeError as e:
            raised = str(e)
        logged = builtin._get_ddp_logging_data()
        out[name] = {"before": before, "after": model._get_ddp_logging_data(), "builtin": logged.get("comm_hook"),
                     "raised": raised, "logged": (logged.get("has_error"), logged.get("error"))}
    return out


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
                    model(_x(rank + step)).sum().backward()
                    model.zero_grad(set_to_none=not view)
            rows.append(None if model.module.weight.grad is None else model.module.weight.grad.clone())
            model(_x(rank)).sum().backward()  # accumulates into what the Join left
            rows.append(model.module.weight.grad.clone())
        out[name] = rows
    return out


def _remove_hooks():
    """A wrapper whose hooks are removed leaves the module alone; a second wrapper on it trains as torch's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Linear(3, 2).double()
    reference = copy.deepcopy(module)
    first = DistributedDataParallel(module)
    first._remove_autograd_hooks()
    module(_x(rank)).sum().backward()  # not through any wrapper: the local gradient, if no hook averages it
    local = module.weight.grad.clone()
    reference(_x(rank)).sum().backward()
    expected_local = reference.weight.grad.clone()
    module.zero_grad()
    reference.zero_grad()
    second, theirs = DistributedDataParallel(module), TorchDDP(reference)
    rows = []
    for model in (second, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            model(_x(rank + 10 * step)).sum().backward()
            opt.step()
        rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"local": local, "expected_local": expected_local, "rows": rows}


def _buffer_hook():
    """torch's private buffer comm hook (allreduce, before or after forward, futures or not): buffers after each step."""
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
        for where, futures in ((_BufferCommHookLocation.PRE_FORWARD, False), (_BufferCommHookLocation.POST_FORWARD, False),
                               (_BufferCommHookLocation.POST_FORWARD, True)):
            module = _WithBuffer(rank)
            model = wrapper(module)
            model._register_buffer_comm_hook(model, functools.partial(average, futures=futures), where)
            for step in range(2):
                model(_x(rank + step)).sum().backward()
                rows.append(module.buf.clone())
        out[name] = rows
    return out


class _Tower(nn.Module):
    """Registered head first, used last: its gradients come first, not in reverse registration order.

    float32: torch's PowerSGD hangs in float64 with gloo (torch's DDP as well as ours).
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.a, self.b = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).sum()


def _serial_powersgd(state, bucket):
    """torch's powerSGD_hook, waited for. With gloo, torch's DDP runs several buckets' PowerSGD at once and their
    allreduces, started from callbacks, interleave differently on each rank: it hangs. One bucket at a time, as
    manualdp's wrapper runs hooks anyway."""
    future = torch_powersgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


# One layer's gradients (16x16 + 16 floats) a bucket, exactly: torch closes a bucket once it holds the cap,
# manualdp before it would pass it, so only a cap met exactly gives both wrappers the same buckets.
LAYER_MB = 1088 / 2**20


def _powersgd():
    """torch's powerSGD_hook on both wrappers, 5 steps, several buckets whose order the first step changes."""
    rank = dist.get_rank()
    rows = []
    for _, wrapper in WRAPPERS:
        model = wrapper(_Tower(), bucket_cap_mb=LAYER_MB)
        model.register_comm_hook(torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                                 _serial_powersgd)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = []
        for step in range(5):
            opt.zero_grad()
            model(_x(rank + 10 * step, d=16).float()).backward()
            opt.step()
            steps.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        rows.append(steps)
    return {"rows": rows, "buckets": len(DistributedDataParallel(_Tower(), bucket_cap_mb=LAYER_MB)._buckets)}


def _powersgd_state():
    """manualdp's PowerSGD: a bucket index that holds other parameters (buckets rebuilt) starts afresh."""
    g = torch.Generator().manual_seed(dist.get_rank())
    a, b = torch.empty(4, 3, dtype=torch.float64), torch.empty(4, 3, dtype=torch.float64)
    grads = [torch.randn(12, generator=g, dtype=torch.float64) for _ in range(2)]
    used = hooks.PowerSGDState(None, matrix_approximation_rank=1)
    hooks.powerSGD_hook(used, hooks.GradBucket(0, grads[0].clone(), [a], [0, 12], True)).wait()
    after = hooks.powerSGD_hook(used, hooks.GradBucket(0, grads[1].clone(), [b], [0, 12], True)).wait()
    fresh = hooks.powerSGD_hook(hooks.PowerSGDState(None, matrix_approximation_rank=1),
                                hooks.GradBucket(0, grads[1].clone(), [b], [0, 12], True)).wait()
    again = hooks.powerSGD_hook(used, hooks.GradBucket(0, grads[1].clone(), [b], [0, 12], True)).wait()
    return {"after": after, "fresh": fresh, "again": again}


def _in_backward():
    """Parameters with torch's in-backward optimizers: refused at construction, or at the first forward."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    said = {}
    model = nn.Linear(3, 2).double()
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    try:
        DistributedDataParallel(model)
    except ValueError as e:
        said["construction"] = str(e)
    model = nn.Linear(3, 2).double()
    ddp = DistributedDataParallel(model)
    _apply_optimizer_in_backward(torch.optim.SGD, [model.weight], {"lr": 0.1})
    try:
        ddp(_x(dist.get_rank())).sum().backward()
    except ValueError as e:
        said["first forward"] = str(e)
    return said


def _device_errors():
    """torch's ValueErrors for device_ids with a CPU module, and for a module on two device types."""
    out = {}
    for name, wrapper in WRAPPERS:
        said = {}
        for case, args in (("cpu with device_ids", (nn.Linear(3, 2), [torch.device("cpu")])),
                           ("two device types", (nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2, device="meta")), None))):
            try:
                wrapper(*args)
            except ValueError as e:
                said[case] = str(e)
        out[name] = said
    return out


def _job():
    scenarios = {"buffers": _buffers, "warnings": _warnings, "errors": _errors, "logging": _logging,
                 "joined_grads": _joined_grads, "remove_hooks": _remove_hooks, "buffer_hook": _buffer_hook, "powersgd": _powersgd,
                 "powersgd_state": _powersgd_state, "in_backward": _in_backward, "device_errors": _device_errors}
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

def test_forward_sync_buffers_and_the_deprecated_broadcast_buffers_sync_as_torchs():
    for rank, value in enumerate(_get("buffers")):
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


def test_ddp_logging_data_has_torchs_values_for_the_fields_manualdp_keeps():
    for value in _get("logging"):
        ours, theirs = value["ours"], value["theirs"]
        for when in ("before", "after"):
            shared = set(LOGGED_FIELDS) & set(theirs[when]) - {"iteration"}
            assert {"world_size", "rank", "module_name", "backend_name", "broadcast_buffers",
                    "gradient_as_bucket_view", "total_parameter_size_bytes"} <= shared
            assert {k: ours[when].get(k) for k in shared} == {k: theirs[when][k] for k in shared}, when
        assert "comm_hook" not in ours["before"] and ours["after"]["comm_hook"] == "allreduce_hook"
        assert ours["builtin"] == theirs["builtin"] == "BuiltinCommHookType.FP16_COMPRESS"
        assert ours["after"]["iteration"] == 2 and ours["after"]["has_error"] == 0
        # an error raised after construction is logged, as torch logs it
        assert "must be callable" in ours["raised"] and "must be callable" in theirs["raised"]
        for said in (ours, theirs):  # torch's Python errors are logged with their class in front
            assert said["logged"][0] == 1 and said["logged"][1].endswith(said["raised"])


def test_a_rank_that_joined_early_keeps_its_grad_as_torchs_does():
    for value in _get("joined_grads"):
        for mine, torchs in zip(value["ours"], value["theirs"], strict=True):
            assert (mine is None) == (torchs is None) and (mine is None or torch.equal(mine, torchs)), (mine, torchs)


def test_remove_autograd_hooks_takes_the_wrappers_hooks_off():
    for value in _get("remove_hooks"):
        assert torch.equal(value["local"], value["expected_local"])  # nothing averaged it
        ours, theirs = value["rows"]
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)


def test_buffer_comm_hook_syncs_buffers_as_torchs():
    for value in _get("buffer_hook"):
        for mine, torchs in zip(value["ours"], value["theirs"], strict=True):
            assert torch.allclose(mine, torchs, rtol=0, atol=1e-12), (mine, torchs)
    ranks = _get("buffer_hook")
    for after_forward in (3, 5):  # the hook ran after forward: it averaged the ranks' buffers
        assert torch.equal(ranks[0]["ours"][after_forward], ranks[1]["ours"][after_forward])


def test_torchs_powersgd_hook_on_ours_equals_on_torchs_ddp_as_buckets_are_rebuilt():
    for value in _get("powersgd"):
        assert value["buckets"] >= 3
        for step, (ours, theirs) in enumerate(zip(*value["rows"])):
            assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), f"step {step}: {(ours - theirs).abs().max()}"


def test_manualdp_powersgd_starts_afresh_when_a_bucket_holds_other_parameters():
    for value in _get("powersgd_state"):
        assert torch.equal(value["after"], value["fresh"])
        assert not torch.equal(value["again"], value["fresh"])  # the same parameters again: state kept


def test_parameters_with_in_backward_optimizers_are_refused_at_construction_or_first_forward():
    for value in _get("in_backward"):
        for when in ("construction", "first forward"):
            assert "_apply_optimizer_in_backward" in value[when] and "['weight'" in value[when], value


def test_device_errors_are_torchs():
    for value in _get("device_errors"):
        ours, theirs = value["ours"], value["theirs"]
        assert ours["cpu with device_ids"] == theirs["cpu with device_ids"]
        head = "DistributedDataParallel's input module must be on the same type of devices"
        assert ours["two device types"].startswith(head) and theirs["two device types"].startswith(head)


def _on(*devices):
    return [types.SimpleNamespace(device=torch.device(d)) for d in devices]


def test_a_module_over_several_devices_of_one_type_is_accepted_without_device_ids():
    assert module_device(_on("cuda:0", "cuda:1", "cuda:0"), None, None) == torch.device("cuda:0")
    assert module_device(_on("cuda:1"), [1], None) == torch.device("cuda:1")
    assert module_device(_on("cpu"), None, None) == torch.device("cpu")


@pytest.mark.parametrize("devices, device_ids, output_device, match", [
    (("cuda:0", "cuda:1"), [0], None, "device_ids and output_device arguments only work with"),
    (("cuda:0", "cuda:1"), None, 0, "device_ids and output_device arguments only work with"),
    (("cpu",), [torch.device("cpu")], None, "device_ids and output_device arguments only work with"),
    (("cuda:0",), [0, 1], None, "device_ids can only be None or contain a single element"),
    (("cuda:0",), [1], None, "but the module is on cuda:0"),
    (("cpu", "cuda:0"), None, None, "must be on the same type of devices"),
])
def test_device_ids_refused_as_torch_refuses_them(devices, device_ids, output_device, match):
    with pytest.raises(ValueError, match=match):
        module_device(_on(*devices), device_ids, output_device)
