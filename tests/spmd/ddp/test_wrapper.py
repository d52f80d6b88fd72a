"""manualdp's DistributedDataParallel as a drop-in: torch's keywords and calls, step by step against torch's DDP
and one process; torch's private helpers and its errors.

One spawned job per world size (2, 3, 4 ranks; gloo on 127.0.0.1, one thread per rank, killed
after a timeout) runs every scenario and returns tensors; the assertions run here, in the parent.
A scenario that raises returns its error text, so one failure does not hide the others.
Buffer sync, unused parameters, comm hooks and Join have files of their own.
"""
import copy
import functools
import io
import pickle
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.buckets import assign_buckets
from manualdp.distributed import DistributedDataParallel, allreduce
from manualdp.spmd import launch
from manualdp.spmd.ddp.graph import module_device
from manualdp.spmd.ddp.private import LOGGED_FIELDS
from tests.helpers import (WRAPPERS, EitherHead, bn_mlp, cat_flat, global_batches, mean_loss, mlp, pair_of_wrappers,
                           rank_batches, rank_input, same_rows, sharded_loss, train_each)
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 300.0
STEPS = 3
ALGORITHM = {2: "ring", 3: "tree", 4: "naive"}  # the schedule each world size's equivalence runs


# ---------------------------------------------------------------- scenarios (run on every rank)

def _keywords():
    """Positional device_ids/output_device and torch's keywords give torch's training."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = mlp()
    ours = DistributedDataParallel(copy.deepcopy(module), None, None, 0, True, True, None, 25, False, False, False,
                                   True)
    theirs = TorchDDP(copy.deepcopy(module), None, None, 0, True, True, None, 25, False, False, False, True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    return train_each([ours, theirs], opts, rank_batches(rank))


def _device_mesh():
    """device_mesh= instead of process_group, as torch takes it."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours, theirs, opts = pair_of_wrappers(mlp, {"device_mesh": mesh}, {"device_mesh": mesh})
    rows = train_each([ours, theirs], opts, rank_batches(dist.get_rank()))
    errors = {}  # torch's RuntimeErrors for a group and a mesh both, and for a mesh of two dimensions
    flat = init_device_mesh("cpu", (dist.get_world_size(), 1))
    cases = {"both": {"device_mesh": mesh, "process_group": dist.group.WORLD}, "2d": {"device_mesh": flat}}
    for case, kwargs in cases.items():
        for name, wrapper in (("ours", DistributedDataParallel), ("theirs", TorchDDP)):
            try:
                wrapper(mlp(), **kwargs)
            except RuntimeError as e:
                errors[case, name] = str(e)
    return {"rows": rows, "mesh": ours.device_mesh is mesh, "errors": errors}


def _train_keeping_grads(ours, theirs, opts, rank):
    """Train both with `.grad` kept between steps; the parameters after each step, and whether
    each of ours' `.grad` lives in one of its buckets."""
    steps = []
    for X, y in rank_batches(rank):
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=False)
            mean_loss(m, X, y).backward()
            opt.step()
        steps.append([cat_flat(ours.parameters()), cat_flat(theirs.parameters())])
    storages = {b.flat.untyped_storage().data_ptr() for b in ours._buckets}
    return steps, [p.grad.untyped_storage().data_ptr() in storages for p in ours.module.parameters()]


def _bucket_view():
    """gradient_as_bucket_view: `.grad` is a view into the bucket, and training equals torch's."""
    ours, theirs, opts = pair_of_wrappers(mlp, {"gradient_as_bucket_view": True}, {"gradient_as_bucket_view": True})
    steps, views = _train_keeping_grads(ours, theirs, opts, dist.get_rank())
    return {"steps": steps, "views": views}


def _no_init_sync():
    """init_sync=False: every rank keeps the parameters it built."""
    torch.manual_seed(dist.get_rank())
    return cat_flat(DistributedDataParallel(mlp(), init_sync=False).parameters())


def _copies():
    """deepcopy, torch.save/load and plain pickle of the wrapper train like torch's DDP."""
    rank = dist.get_rank()
    ours, theirs, _ = pair_of_wrappers(mlp)
    copied = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pickled = pickle.loads(pickle.dumps(ours))  # plain pickle stores each view of a bucket apart
    models = [copied, loaded, pickled, theirs]
    return train_each(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models], rank_batches(rank))


def _copy_on_a_subgroup():
    """A wrapper on another group than the default one: torch refuses to copy it, and so do we
    (the copy would fall back to the default group and average over other ranks)."""
    group = dist.new_group([0, 1])
    errors = []
    for wrapper in (DistributedDataParallel, TorchDDP):
        model = wrapper(mlp(), process_group=group)
        for copier in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
            try:
                copier(model)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
    return errors


def _no_parameters():
    """A module with nothing to train: torch refuses with RuntimeError, and so do we."""
    errors = []
    for wrapper in (DistributedDataParallel, TorchDDP):
        try:
            wrapper(nn.Linear(2, 2).requires_grad_(False))
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return errors


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 6, sparse=True).double()
        self.head = nn.Linear(6, 4).double()

    def forward(self, idx):
        return self.head(self.embed(idx))


def _sparse():
    """nn.Embedding(sparse=True): gradients stay sparse and average like torch's."""
    rank = dist.get_rank()
    ours, theirs, opts = pair_of_wrappers(_Sparse)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 20, (5,), generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(STEPS)]
    rows = train_each([ours, theirs], opts, batches)
    return {"rows": rows, "sparse": ours.module.embed.weight.grad.is_sparse}


def _no_sync_used_map():
    """A head used only in the no_sync micro-batch is still averaged at the sync (pytorch#69031)."""
    rank = dist.get_rank()
    ours, theirs, opts = pair_of_wrappers(lambda: EitherHead().double(), {"find_unused_parameters": True},
                               {"find_unused_parameters": True})
    (X1, y1), (X2, y2) = rank_batches(rank, steps=2)
    for m, opt in zip((ours, theirs), opts):
        opt.zero_grad()
        with m.no_sync():
            mean_loss(lambda x: m(x, use_b=True), X1, y1).backward()
        mean_loss(lambda x: m(x, use_b=False), X2, y2).backward()
        opt.step()
    return [cat_flat(ours.parameters()), cat_flat(theirs.parameters())]


class _Proxy(nn.Module):
    """`late` differs across ranks and is ignored by DDP (replaced later, as torch's tests do)."""

    def __init__(self, rank):
        super().__init__()
        self.early = nn.Linear(6, 8)
        self.late = nn.Linear(8, 4 + rank)
        self.late.register_buffer("scale", torch.full((3 + rank,), rank + 1.0))

    def forward(self, x):
        return self.late(torch.tanh(self.early(x))) * self.late.scale[0]


def _ignored():
    """Parameters and buffers set aside with _set_params_and_buffers_to_ignore_for_model stay each rank's own."""
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank starts from its own parameters: init_sync must reach only `early`
    module = _Proxy(rank).double()
    models = []
    for wrapper in (DistributedDataParallel, TorchDDP):
        copied = copy.deepcopy(module)
        wrapper._set_params_and_buffers_to_ignore_for_model(copied, ["late.weight", "late.bias", "late.scale"])
        models.append(wrapper(copied))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    rows = []
    for X, _ in rank_batches(rank):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(X).pow(2).mean().backward()
            opt.step()
        rows.append([cat_flat(m.parameters()) for m in models])
    early = [cat_flat(m.module.early.parameters()) for m in models]
    ours = models[0]
    return {"rows": rows, "early": early, "late": cat_flat(ours.module.late.parameters()),
            "scale": ours.module.late.scale,
            "ignored": (ours.parameters_to_ignore, models[1].parameters_to_ignore),
            "group": ours.process_group is dist.group.WORLD}


def _cap_list():
    """bucket_cap_mb_list: a cap per bucket, the last for the rest; trains as torch's DDP with the same list."""
    caps = [0.0002, 0.0004]  # 52 and 104 float64s
    ours, theirs, opts = pair_of_wrappers(mlp, {"bucket_cap_mb_list": caps}, {"bucket_cap_mb_list": caps})
    rows = train_each([ours, theirs], opts, rank_batches(dist.get_rank()))
    return {"rows": rows, "sizes": [b.offsets[-1] for b in ours._buckets],
            "caps": (ours.bucket_bytes_cap_list, theirs.bucket_bytes_cap_list)}


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))

    def forward(self, x):
        return (x * self.w).tanh().pow(2).sum()


def _create_graph():
    """backward(create_graph=True), gradients accumulating: averaged as torch's DDP averages them.

    (torch's DDP itself refuses create_graph on an nn.Linear model: "a leaf Variable ... in-place".)
    """
    rank = dist.get_rank()
    ours, theirs, _ = pair_of_wrappers(_Scale)
    rows = []
    for X, _ in rank_batches(rank):
        for m in (ours, theirs):
            m(X).backward(create_graph=True)
        rows.append([cat_flat(p.grad for p in m.parameters()) for m in (ours, theirs)])
    return {"rows": rows, "grad_fn": [p.grad.grad_fn is not None for p in ours.parameters()]}


def _two_forwards_batchnorm():
    """Two forward passes before one backward with BatchNorm (a GAN step) run and match torch."""
    rank = dist.get_rank()
    ours, theirs, opts = pair_of_wrappers(bn_mlp)

    def step(m):
        X1, y1 = batches[0]
        X2, y2 = batches[1]
        (mean_loss(m, X1, y1) + mean_loss(m, X2, y2)).backward()

    batches = rank_batches(rank, steps=2)
    rows = train_each([ours, theirs], opts, [batches[0]], step=step)
    return rows + [[cat_flat(ours.module.buffers()), cat_flat(theirs.module.buffers())]]


def _wrappers(count):
    """`count` wrappers on one process group in one backward: no interleaved messages, torch's result."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    modules = [mlp() for _ in range(count)]
    ours = [DistributedDataParallel(copy.deepcopy(m), bucket_cap_mb=0.0005) for m in modules]
    theirs = [TorchDDP(copy.deepcopy(m), bucket_cap_mb=0.0005) for m in modules]
    rows = []
    for X, y in rank_batches(rank):
        for group in (ours, theirs):
            for m in group:
                m.zero_grad()
            sum(mean_loss(m, X, y) for m in group).backward()
            with torch.no_grad():
                for m in group:
                    for p in m.parameters():
                        p -= 0.1 * p.grad
        rows.append([cat_flat(p for m in ours for p in m.parameters()),
                     cat_flat(p for m in theirs for p in m.parameters())])
    return rows


class _Branches(nn.Module):
    """Registered head first; two branches whose order in forward differs by rank, so do their gradients'."""

    def __init__(self, flip):
        super().__init__()
        self.head = nn.Linear(64, 4)
        self.a, self.b = nn.Linear(6, 64), nn.Linear(6, 64)
        self.big = nn.Linear(64, 64, bias=False)
        self.wide = nn.Parameter(torch.randn(300_000) * 1e-3)  # 2.4 MB: no room for it in a 1 MiB first bucket
        self.flip = flip

    def forward(self, x):
        h = self.b(x) + self.a(x) if self.flip else self.a(x) + self.b(x)
        return self.wide[:4].sum() + self.head(torch.tanh(self.big(h)))


def _rebuild():
    """Buckets rebuilt in ready order after the first step: rank 0's order everywhere, torch's training."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = _Branches(flip=rank == 1).double()
    ours = DistributedDataParallel(copy.deepcopy(module), gradient_as_bucket_view=True)
    theirs = TorchDDP(copy.deepcopy(module), gradient_as_bucket_view=True)
    initial = copy.deepcopy(ours._layout)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    steps, views = _train_keeping_grads(ours, theirs, opts, rank)
    names = [n for n, _ in ours.module.named_parameters()]
    return {"steps": steps, "initial": initial, "layout": ours._layout, "names": names, "views": views,
            "first_bytes": ours._buckets[0].grads.numel() * 8}


def _equivalence(algorithm, bucket_cap_mb, steps=3):
    """Ours, torch's DDP and one process on the global batch, step by step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # every rank starts elsewhere: construction must fix that
    ours = DistributedDataParallel(mlp(), bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    out = {"init": cat_flat(ours.parameters()), "buckets": len(ours._buckets), "steps": []}
    theirs = TorchDDP(copy.deepcopy(ours.module))
    single = copy.deepcopy(ours.module)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs, single)]
    for X, y in global_batches(steps):
        for opt in opts:
            opt.zero_grad()
        sharded_loss(ours, X, y, rank, n).backward()
        sharded_loss(theirs, X, y, rank, n).backward()
        (nn.functional.cross_entropy(single(X), y, reduction="sum") / len(X)).backward()
        grads = cat_flat(p.grad for p in ours.parameters())
        for opt in opts:
            opt.step()
        out["steps"].append({"ours": cat_flat(ours.parameters()), "theirs": cat_flat(theirs.parameters()),
                             "single": cat_flat(single.parameters()), "grads": grads})
    return out


def _no_sync():
    """Two micro-batches, the first under no_sync, then one step: ours against torch's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = DistributedDataParallel(mlp(), bucket_cap_mb=0.0005)
    theirs = TorchDDP(copy.deepcopy(ours.module), bucket_cap_mb=0.0005)
    out = {"local": [], "ours": [], "theirs": []}
    for model, key in ((ours, "ours"), (theirs, "theirs")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for first, second in zip(global_batches(2, seed=7), global_batches(2, seed=8)):
            opt.zero_grad()
            with model.no_sync():
                sharded_loss(model, *first, rank, n).backward()
            if key == "ours":
                out["local"].append(cat_flat(p.grad for p in model.parameters()))
            sharded_loss(model, *second, rank, n).backward()
            opt.step()
        out[key] = cat_flat(model.parameters())
    return out


def _mismatch():
    """Models that differ on rank 1: every rank must raise, none may hang."""
    rank = dist.get_rank()
    messages = []
    for model in (nn.Linear(6, 5 if rank == 1 else 4),  # same count, other shape
                  nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 if rank == 0 else 2)])):  # more parameters
        try:
            DistributedDataParallel(model)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    x = torch.ones(3) * (rank + 1)
    allreduce(x)  # the group still works afterwards
    messages.append(x)
    return messages


def _after_wrapper_is_gone():
    """A module whose wrapper was deleted trains locally again: its hooks went with the wrapper."""
    import gc
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = mlp()
    DistributedDataParallel(module)
    gc.collect()
    X, y = global_batches(1, seed=rank)[0]
    nn.functional.cross_entropy(module(X), y).backward()
    return cat_flat(p.grad for p in module.parameters())


def _logging():
    """`_get_ddp_logging_data()` of both wrappers on the same module, before and after a comm hook."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in WRAPPERS:
        model = wrapper(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double(), gradient_as_bucket_view=True)
        before = model._get_ddp_logging_data()
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        for _ in range(2):
            model(rank_input(rank)).sum().backward()
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


def _remove_hooks():
    """A wrapper whose hooks are removed leaves the module alone; a second wrapper on it trains as torch's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Linear(3, 2).double()
    reference = copy.deepcopy(module)
    first = DistributedDataParallel(module)
    first._remove_autograd_hooks()
    module(rank_input(rank)).sum().backward()  # not through any wrapper: the local gradient, if no hook averages it
    local = module.weight.grad.clone()
    reference(rank_input(rank)).sum().backward()
    expected_local = reference.weight.grad.clone()
    module.zero_grad()
    reference.zero_grad()
    second, theirs = DistributedDataParallel(module), TorchDDP(reference)
    rows = []
    for model in (second, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            model(rank_input(rank + 10 * step)).sum().backward()
            opt.step()
        rows.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"local": local, "expected_local": expected_local, "rows": rows}


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
        ddp(rank_input(dist.get_rank())).sum().backward()
    except ValueError as e:
        said["first forward"] = str(e)
    return said


def _device_errors():
    """torch's ValueErrors for device_ids with a CPU module, and for a module on two device types."""
    out = {}
    for name, wrapper in WRAPPERS:
        said = {}
        for case, args in (("cpu with device_ids", (nn.Linear(3, 2), [torch.device("cpu")])),
                           ("two device types",
                            (nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2, device="meta")), None))):
            try:
                wrapper(*args)
            except ValueError as e:
                said[case] = str(e)
        out[name] = said
    return out


def _job(n):
    scenarios = {"keywords": _keywords, "bucket_view": _bucket_view, "no_init_sync": _no_init_sync,
                 "copies": _copies, "no_parameters": _no_parameters, "sparse": _sparse,
                 "no_sync_used_map": _no_sync_used_map, "two_forwards_bn": _two_forwards_batchnorm,
                 "wrappers2": lambda: _wrappers(2), "wrappers3": lambda: _wrappers(3),
                 "device_mesh": _device_mesh, "rebuild": _rebuild, "ignored": _ignored,
                 "cap_list": _cap_list, "create_graph": _create_graph, "copy_subgroup": _copy_on_a_subgroup,
                 # against torch's DDP and one process, with several buckets and with one
                 "equivalence": lambda: _equivalence(ALGORITHM[n], bucket_cap_mb=0.0005),
                 "equivalence_one_bucket": lambda: _equivalence("tree", bucket_cap_mb=25),
                 "no_sync": _no_sync, "mismatch": _mismatch, "gone": _after_wrapper_is_gone,
                 # torch's private helpers and its errors
                 "logging": _logging, "remove_hooks": _remove_hooks, "in_backward": _in_backward,
                 "device_errors": _device_errors}
    if n == 3:
        scenarios = {k: scenarios[k] for k in ("keywords", "wrappers3", "equivalence")}
    if n == 4:
        scenarios = {k: scenarios[k] for k in ("equivalence",)}
    return run_scenarios(scenarios)


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, (n,), timeout=JOB_TIMEOUT)


def _get(n, rank, name):
    value = _results(n)[rank][name]
    assert not (isinstance(value, str) and value.startswith("ERROR")), value
    return value


def _ranks(name, n=2):
    """What each of the n ranks returned for scenario `name`."""
    return [_get(n, rank, name) for rank in range(n)]


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["keywords", "wrappers3"])
def test_training_equals_torch_ddp_step_by_step(n, name):
    for rank in range(n):
        same_rows(_get(n, rank, name))


@pytest.mark.parametrize("name",
                         ["copies", "no_sync_used_map", "two_forwards_bn", "wrappers2", "sparse", "device_mesh"])
def test_more_cases_equal_torch_ddp(name):
    for rank in range(2):
        value = _get(2, rank, name)
        rows = value["rows"] if isinstance(value, dict) else value
        same_rows([rows] if isinstance(rows[0], torch.Tensor) else rows)


def test_sparse_gradients_stay_sparse():
    assert all(_get(2, r, "sparse")["sparse"] for r in range(2))


def test_gradient_as_bucket_view_makes_grad_a_view_and_trains_like_torch():
    for rank in range(2):
        value = _get(2, rank, "bucket_view")
        assert all(value["views"]), value["views"]
        same_rows(value["steps"])


def test_init_sync_false_keeps_each_ranks_parameters():
    a, b = (_get(2, r, "no_init_sync") for r in range(2))
    assert not torch.equal(a, b)


def test_a_module_without_trainable_parameters_is_refused_as_torch_refuses_it():
    ours, theirs = _get(2, 0, "no_parameters")
    assert ours is not None and theirs is not None
    assert "doesn't have any parameter that requires a gradient" in ours


def test_a_wrapper_on_another_group_than_the_default_is_not_copied_as_torch_refuses():
    for rank in range(2):
        errors = _get(2, rank, "copy_subgroup")
        assert None not in errors, errors
        ours, theirs = errors[:2], errors[2:]
        assert all(e.startswith("DDP Pickling/Unpickling are only supported") for e in ours + theirs), errors


def test_buckets_are_rebuilt_in_rank0s_ready_order_and_training_equals_torch():
    a, b = (_get(2, r, "rebuild") for r in range(2))
    assert a["layout"] == b["layout"]  # rank 1's own ready order differs (its branches run flipped): rank 0's wins
    assert a["layout"] != a["initial"]  # the head was registered first but its gradients come first
    names = a["names"]
    first = [names[i] for i in a["layout"][0]]
    assert sorted(first[:2]) == ["head.bias", "head.weight"] and first[2:] == ["big.weight"], first
    assert names[a["layout"][1][0]] == "wide"  # 2.4 MB: past the 1 MiB of the first bucket, so the second begins
    assert a["first_bytes"] <= 2**20  # DDP's small first bucket at the default cap
    assert [names[i] for i in a["initial"][0]][-2:] == ["head.bias", "head.weight"]  # reverse registration order
    for value in (a, b):
        assert all(value["views"]), value["views"]  # gradient_as_bucket_view: .grad moved into the new buckets
        same_rows(value["steps"])


def test_ignored_parameters_and_buffers_stay_local_as_with_torch():
    late = [_get(2, r, "ignored")["late"] for r in range(2)]
    assert late[0].numel() != late[1].numel()  # each rank kept its own shapes
    early = []
    for rank in range(2):
        value = _get(2, rank, "ignored")
        same_rows(value["rows"])
        assert value["ignored"][0] == value["ignored"][1] == {"late.weight", "late.bias", "late.scale"}
        assert torch.equal(value["scale"], torch.full((3 + rank,), rank + 1.0, dtype=torch.float64))
        assert value["group"]
        early.append(value["early"][0])
    assert torch.equal(early[0], early[1])  # the synchronised part agrees across ranks


@pytest.mark.parametrize("names", ["late.weight", [1], None])
def test_params_and_buffers_to_ignore_must_be_full_names(names):
    with pytest.raises(TypeError, match="params_and_buffers_to_ignore"):
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(nn.Linear(2, 2), names)


def test_bucket_cap_mb_list_caps_each_bucket_and_trains_like_torch():
    for rank in range(2):
        value = _get(2, rank, "cap_list")
        same_rows(value["rows"])
        assert value["caps"][0] == value["caps"][1] == [int(0.0002 * 2**20), int(0.0004 * 2**20)]
        # mlp's gradients from the last: 4 | 32 + 8 | 128 | 16 | 96 (bucket 0 holds <= 26 float64s, the rest <= 52)
        assert value["sizes"] == [4, 40, 128, 16, 96]


def test_assign_buckets_takes_a_cap_per_bucket():
    params = [torch.zeros(2**18) for _ in range(6)]  # 1 MiB each
    assert assign_buckets(params, [1, 2]) == [[5], [4, 3], [2, 1], [0]]
    assert assign_buckets(params, 2.0) == [[5, 4], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number, got -1"):
        assign_buckets(params, [1, -1])
    with pytest.raises(TypeError, match="bucket_cap_mb_list"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=2)


def test_device_mesh_is_kept_and_refused_as_torch_refuses_it():
    for rank in range(2):
        value = _get(2, rank, "device_mesh")
        assert value["mesh"]
        errors = value["errors"]
        both = "Cannot specify both process_group and device_mesh arguments."
        assert errors["both", "ours"] == errors["both", "theirs"] == both
        assert errors["2d", "ours"] == errors["2d", "theirs"] and errors["2d", "ours"].startswith("Only 1D device mesh")


def test_create_graph_averages_as_torch_and_keeps_the_local_graph():
    for rank in range(2):
        value = _get(2, rank, "create_graph")
        same_rows(value["rows"])
        assert all(value["grad_fn"])  # as with torch: higher-order graph kept, locally


# ---------------------------------------------------------------- against torch's DDP and one process

@pytest.mark.parametrize("n, key", [(2, "equivalence"), (2, "equivalence_one_bucket"), (3, "equivalence"),
                                    (4, "equivalence")])
def test_parameters_equal_torch_ddp_and_one_process_after_every_step(n, key):
    results = _ranks(key, n)
    if key == "equivalence":
        assert results[0]["buckets"] >= 3, "the cap should force several buckets"
    for r in range(n):
        assert torch.equal(results[r]["init"], results[0]["init"]), "construction must broadcast rank 0's parameters"
    for step in range(len(results[0]["steps"])):
        for r in range(n):
            got = results[r]["steps"][step]
            torch.testing.assert_close(got["ours"], got["theirs"], rtol=0, atol=1e-12)
            torch.testing.assert_close(got["ours"], got["single"], rtol=0, atol=1e-10)
            assert torch.equal(got["grads"], results[0]["steps"][step]["grads"]), "gradients differ across ranks"
            assert torch.equal(got["ours"], results[0]["steps"][step]["ours"]), "parameters differ across ranks"
    first = results[0]["steps"][0]
    assert not torch.equal(first["ours"], results[0]["init"]), "training did not move the parameters"


def test_no_sync_accumulates_like_torch_ddp():
    results = _ranks("no_sync", 2)
    for r in range(2):
        torch.testing.assert_close(results[r]["ours"], results[r]["theirs"], rtol=0, atol=1e-12)
    assert torch.equal(results[0]["ours"], results[1]["ours"])
    # Inside no_sync nothing is exchanged: the ranks' gradients are still their own.
    assert not torch.allclose(results[0]["local"][0], results[1]["local"][0])


def test_a_model_that_differs_across_ranks_fails_on_every_rank():
    results = _ranks("mismatch", 2)
    for r in range(2):
        shape_msg, count_msg, after = results[r]
        assert shape_msg is not None and "differs across ranks" in shape_msg and "(5, 6)" in shape_msg
        assert count_msg is not None and "differs across ranks" in count_msg and "parameters and buffers" in count_msg
        assert torch.equal(after, torch.full((3,), 3.0))


def test_deleting_the_wrapper_removes_its_hooks():
    local = _ranks("gone", 2)
    assert not torch.allclose(local[0], local[1]), "gradients were still averaged after the wrapper was deleted"


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected")


def _failed_backward():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = DistributedDataParallel(net, bucket_cap_mb=None, timeout=10)
    x = torch.randn(3, 4)
    try:  # layer 1's gradients arrive (its bucket goes out), then backward raises
        net[1](_Boom.apply(net[0](x))).sum().backward()
    except RuntimeError as e:
        first = str(e)
    try:
        model(x)
        return first, "no error"
    except RuntimeError as e:
        return first, str(e)


def test_after_a_failed_backward_the_next_forward_says_the_ranks_are_out_of_step():
    for first, second in launch(_failed_backward, 2, timeout=JOB_TIMEOUT):
        assert first == "injected"
        assert "previous backward pass failed part-way" in second


# ---------------------------------------------------------------- torch's private helpers and its errors

def test_ddp_logging_data_has_torchs_values_for_the_fields_manualdp_keeps():
    for value in _ranks("logging"):
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


def test_remove_autograd_hooks_takes_the_wrappers_hooks_off():
    for value in _ranks("remove_hooks"):
        assert torch.equal(value["local"], value["expected_local"])  # nothing averaged it
        ours, theirs = value["rows"]
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)


def test_parameters_with_in_backward_optimizers_are_refused_at_construction_or_first_forward():
    for value in _ranks("in_backward"):
        for when in ("construction", "first forward"):
            assert "_apply_optimizer_in_backward" in value[when] and "['weight'" in value[when], value


def test_device_errors_are_torchs():
    for value in _ranks("device_errors"):
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
