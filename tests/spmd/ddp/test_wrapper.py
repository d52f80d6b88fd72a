"""manualdp's DistributedDataParallel as a drop-in: torch's keywords and calls, step by step against torch's DDP.

One spawned job per world size (gloo on 127.0.0.1, one thread per rank, killed after a
timeout) runs every scenario and returns tensors; the assertions run here, in the parent.
A scenario that raises returns its error text, so one failure does not hide the others.
"""
import copy
import functools
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.buckets import assign_buckets
from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd import comm_hooks as hooks
from tests.scenarios import run_scenarios

JOB_TIMEOUT = 240.0
STEPS = 3


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _bn_net():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()


def _data(rank, steps=STEPS, batch=5):
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _loss(model, X, y):
    return nn.functional.cross_entropy(model(X), y)


def _pair(make, ours_kwargs=None, theirs_kwargs=None):
    """The same model in our wrapper and torch's, with an SGD optimizer each."""
    torch.manual_seed(0)
    module = make()
    ours = DistributedDataParallel(copy.deepcopy(module), **(ours_kwargs or {}))
    theirs = TorchDDP(copy.deepcopy(module), **(theirs_kwargs or {}))
    return ours, theirs, [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]


def _train(models, opts, batches, step=None):
    """Train each model on `batches`; the parameters of each after every step."""
    out = []
    for X, y in batches:
        row = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            (step or (lambda m: _loss(m, X, y).backward()))(model)
            opt.step()
            row.append(_flat(model.parameters()))
        out.append(row)
    return out


# ---------------------------------------------------------------- scenarios (run on every rank)

def _keywords():
    """Positional device_ids/output_device and torch's keywords give torch's training."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = _mlp()
    ours = DistributedDataParallel(copy.deepcopy(module), None, None, 0, True, True, None, 25, False, False, False, True)
    theirs = TorchDDP(copy.deepcopy(module), None, None, 0, True, True, None, 25, False, False, False, True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    return _train([ours, theirs], opts, _data(rank))


def _device_mesh():
    """device_mesh= instead of process_group, as torch takes it."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours, theirs, opts = _pair(_mlp, {"device_mesh": mesh}, {"device_mesh": mesh})
    rows = _train([ours, theirs], opts, _data(dist.get_rank()))
    errors = {}  # torch's RuntimeErrors for a group and a mesh both, and for a mesh of two dimensions
    flat = init_device_mesh("cpu", (dist.get_world_size(), 1))
    cases = {"both": {"device_mesh": mesh, "process_group": dist.group.WORLD}, "2d": {"device_mesh": flat}}
    for case, kwargs in cases.items():
        for name, wrapper in (("ours", DistributedDataParallel), ("theirs", TorchDDP)):
            try:
                wrapper(_mlp(), **kwargs)
            except RuntimeError as e:
                errors[case, name] = str(e)
    return {"rows": rows, "mesh": ours.device_mesh is mesh, "errors": errors}


def _train_keeping_grads(ours, theirs, opts, rank):
    """Train both with `.grad` kept between steps; the parameters after each step, and whether
    each of ours' `.grad` lives in one of its buckets."""
    steps = []
    for X, y in _data(rank):
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=False)
            _loss(m, X, y).backward()
            opt.step()
        steps.append([_flat(ours.parameters()), _flat(theirs.parameters())])
    storages = {b.flat.untyped_storage().data_ptr() for b in ours._buckets}
    return steps, [p.grad.untyped_storage().data_ptr() in storages for p in ours.module.parameters()]


def _bucket_view():
    """gradient_as_bucket_view: `.grad` is a view into the bucket, and training equals torch's."""
    ours, theirs, opts = _pair(_mlp, {"gradient_as_bucket_view": True}, {"gradient_as_bucket_view": True})
    steps, views = _train_keeping_grads(ours, theirs, opts, dist.get_rank())
    return {"steps": steps, "views": views}


def _no_init_sync():
    """init_sync=False: every rank keeps the parameters it built."""
    torch.manual_seed(dist.get_rank())
    return _flat(DistributedDataParallel(_mlp(), init_sync=False).parameters())


def _copies():
    """deepcopy, torch.save/load and plain pickle of the wrapper train like torch's DDP."""
    rank = dist.get_rank()
    ours, theirs, _ = _pair(_mlp)
    copied = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pickled = pickle.loads(pickle.dumps(ours))  # plain pickle stores each view of a bucket apart
    models = [copied, loaded, pickled, theirs]
    return _train(models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models], _data(rank))


def _copy_on_a_subgroup():
    """A wrapper on another group than the default one: torch refuses to copy it, and so do we
    (the copy would fall back to the default group and average over other ranks)."""
    group = dist.new_group([0, 1])
    errors = []
    for wrapper in (DistributedDataParallel, TorchDDP):
        model = wrapper(_mlp(), process_group=group)
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
    ours, theirs, opts = _pair(_Sparse)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, 20, (5,), generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(STEPS)]
    rows = _train([ours, theirs], opts, batches)
    return {"rows": rows, "sparse": ours.module.embed.weight.grad.is_sparse}


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


def _no_sync_used_map():
    """A head used only in the no_sync micro-batch is still averaged at the sync (pytorch#69031)."""
    rank = dist.get_rank()
    ours, theirs, opts = _pair(lambda: _TwoHeads().double(), {"find_unused_parameters": True},
                               {"find_unused_parameters": True})
    (X1, y1), (X2, y2) = _data(rank, steps=2)
    for m, opt in zip((ours, theirs), opts):
        opt.zero_grad()
        with m.no_sync():
            _loss(lambda x: m(x, use_b=True), X1, y1).backward()
        _loss(lambda x: m(x, use_b=False), X2, y2).backward()
        opt.step()
    return [_flat(ours.parameters()), _flat(theirs.parameters())]


def _unused_without_find_unused():
    """Heads unused on one rank, find_unused_parameters=False: each wrapper's calls, and where they raise."""
    rank = dist.get_rank()
    out = {}
    for name, wrapper in (("ours", DistributedDataParallel), ("theirs", TorchDDP)):
        torch.manual_seed(0)
        model = wrapper(_TwoHeads().double())
        X, _ = _data(rank, steps=1)[0]
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
    for X, _ in _data(rank):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(X).pow(2).mean().backward()
            opt.step()
        rows.append([_flat(m.parameters()) for m in models])
    early = [_flat(m.module.early.parameters()) for m in models]
    ours = models[0]
    return {"rows": rows, "early": early, "late": _flat(ours.module.late.parameters()), "scale": ours.module.late.scale,
            "ignored": (ours.parameters_to_ignore, models[1].parameters_to_ignore),
            "group": ours.process_group is dist.group.WORLD}


def _cap_list():
    """bucket_cap_mb_list: a cap per bucket, the last for the rest; trains as torch's DDP with the same list."""
    caps = [0.0002, 0.0004]  # 52 and 104 float64s
    ours, theirs, opts = _pair(_mlp, {"bucket_cap_mb_list": caps}, {"bucket_cap_mb_list": caps})
    rows = _train([ours, theirs], opts, _data(dist.get_rank()))
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
    ours, theirs, _ = _pair(_Scale)
    rows = []
    for X, _ in _data(rank):
        for m in (ours, theirs):
            m(X).backward(create_graph=True)
        rows.append([_flat(p.grad for p in m.parameters()) for m in (ours, theirs)])
    return {"rows": rows, "grad_fn": [p.grad.grad_fn is not None for p in ours.parameters()]}


def _two_forwards_batchnorm():
    """Two forward passes before one backward with BatchNorm (a GAN step) run and match torch."""
    rank = dist.get_rank()
    ours, theirs, opts = _pair(_bn_net)

    def step(m):
        X1, y1 = batches[0]
        X2, y2 = batches[1]
        (_loss(m, X1, y1) + _loss(m, X2, y2)).backward()

    batches = _data(rank, steps=2)
    rows = _train([ours, theirs], opts, [batches[0]], step=step)
    return rows + [[_flat(ours.module.buffers()), _flat(theirs.module.buffers())]]


def _wrappers(count):
    """`count` wrappers on one process group in one backward: no interleaved messages, torch's result."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    modules = [_mlp() for _ in range(count)]
    ours = [DistributedDataParallel(copy.deepcopy(m), bucket_cap_mb=0.0005) for m in modules]
    theirs = [TorchDDP(copy.deepcopy(m), bucket_cap_mb=0.0005) for m in modules]
    rows = []
    for X, y in _data(rank):
        for group in (ours, theirs):
            for m in group:
                m.zero_grad()
            sum(_loss(m, X, y) for m in group).backward()
            with torch.no_grad():
                for m in group:
                    for p in m.parameters():
                        p -= 0.1 * p.grad
        rows.append([_flat(p for m in ours for p in m.parameters()), _flat(p for m in theirs for p in m.parameters())])
    return rows


def _gloo_bf16_hook(group, bucket):
    """torch's bf16_compress_hook in gloo's words (torch's own insists on NCCL)."""
    buffer = bucket.buffer()
    small = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    return dist.all_reduce(small, group=group, async_op=True).get_future().then(
        lambda fut: buffer.copy_(fut.value()[0]))


def _hook_pairs():
    """Each of our hooks and torch's own, registered on our wrapper, against torch's DDP with torch's hook."""
    rank = dist.get_rank()
    out = {}
    cases = {
        "ours_allreduce": (None, hooks.allreduce_hook, default_hooks.allreduce_hook),
        "ours_fp16": (None, hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
        "ours_bf16": (None, hooks.bf16_compress_hook, _gloo_bf16_hook),
        "torch_allreduce": (None, default_hooks.allreduce_hook, default_hooks.allreduce_hook),
        "torch_fp16": (None, default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    }
    for name, (state, mine, reference) in cases.items():
        ours, theirs, opts = _pair(lambda: _mlp().float())
        ours.register_comm_hook(state, mine)
        theirs.register_comm_hook(state, reference)
        out[name] = _train([ours, theirs], opts, [(X.float(), y) for X, y in _data(rank)])
    return out


def _powersgd():
    """Full-rank PowerSGD is exact (torch's plain DDP); rank 1 is not, yet the ranks stay identical."""
    rank = dist.get_rank()
    ours, theirs, opts = _pair(_mlp)
    ours.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=16), hooks.powerSGD_hook)
    full = _train([ours, theirs], opts, _data(rank))
    low, _, low_opts = _pair(_mlp)
    low.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=1), hooks.powerSGD_hook)
    one = _train([low], low_opts[:1], _data(rank))
    return {"full": full, "rank1": one[-1][0], "exact": full[-1][1]}


def _noop():
    """The no-op hook: no communication, so each rank trains on its own data."""
    rank = dist.get_rank()
    ours, _, opts = _pair(_mlp)
    ours.register_comm_hook(None, hooks.noop_hook)
    torch.manual_seed(0)
    local = _mlp()
    return _train([ours, local], [opts[0], torch.optim.SGD(local.parameters(), lr=0.1)], _data(rank))


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


def _job(n):
    scenarios = {"keywords": _keywords, "bucket_view": _bucket_view, "no_init_sync": _no_init_sync,
                 "copies": _copies, "no_parameters": _no_parameters, "sparse": _sparse,
                 "no_sync_used_map": _no_sync_used_map, "two_forwards_bn": _two_forwards_batchnorm,
                 "wrappers2": lambda: _wrappers(2), "wrappers3": lambda: _wrappers(3),
                 "hooks": _hook_pairs, "powersgd": _powersgd, "noop": _noop, "device_mesh": _device_mesh,
                 "rebuild": _rebuild, "unused_error": _unused_without_find_unused, "ignored": _ignored,
                 "cap_list": _cap_list, "create_graph": _create_graph,
                 "copy_subgroup": _copy_on_a_subgroup}
    if n == 3:
        scenarios = {k: scenarios[k] for k in ("keywords", "wrappers3", "hooks")}
    return run_scenarios(scenarios)


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, (n,), timeout=JOB_TIMEOUT)


def _get(n, rank, name):
    value = _results(n)[rank][name]
    assert not (isinstance(value, str) and value.startswith("ERROR")), value
    return value


def _same_rows(rows, atol=1e-12):
    for step, row in enumerate(rows):
        for other in row[1:]:
            assert torch.allclose(row[0], other, rtol=0, atol=atol), f"step {step}: max diff {(row[0] - other).abs().max()}"


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["keywords", "wrappers3"])
def test_training_equals_torch_ddp_step_by_step(n, name):
    for rank in range(n):
        _same_rows(_get(n, rank, name))


@pytest.mark.parametrize("name", ["copies", "no_sync_used_map", "two_forwards_bn", "wrappers2", "sparse", "device_mesh"])
def test_more_cases_equal_torch_ddp(name):
    for rank in range(2):
        value = _get(2, rank, name)
        rows = value["rows"] if isinstance(value, dict) else value
        _same_rows([rows] if isinstance(rows[0], torch.Tensor) else rows)


def test_sparse_gradients_stay_sparse():
    assert all(_get(2, r, "sparse")["sparse"] for r in range(2))


def test_gradient_as_bucket_view_makes_grad_a_view_and_trains_like_torch():
    for rank in range(2):
        value = _get(2, rank, "bucket_view")
        assert all(value["views"]), value["views"]
        _same_rows(value["steps"])


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


@pytest.mark.parametrize("n", [2, 3])
def test_comm_hooks_equal_torch_ddp_with_torchs_hooks(n):
    for rank in range(n):
        for name, rows in _get(n, rank, "hooks").items():
            tolerance = 1e-2 if "16" in name else 1e-6  # compressed: both round to 16 bits, perhaps differently
            for step, (ours, theirs) in enumerate(rows):
                assert torch.allclose(ours, theirs, rtol=0, atol=tolerance), f"{name} step {step}"


def test_powersgd_full_rank_is_exact_and_rank_one_keeps_ranks_identical():
    results = [_get(2, r, "powersgd") for r in range(2)]
    for value in results:
        _same_rows(value["full"], atol=1e-9)
        assert not torch.allclose(value["rank1"], value["exact"], atol=1e-9)
    assert torch.equal(results[0]["rank1"], results[1]["rank1"])


def test_noop_hook_trains_each_rank_on_its_own():
    rows = [_get(2, r, "noop") for r in range(2)]
    for r in range(2):
        _same_rows(rows[r])
    assert not torch.allclose(rows[0][-1][0], rows[1][-1][0])


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
        _same_rows(value["steps"])


def test_unused_parameters_without_find_unused_raise_at_the_next_forward_as_torch_does():
    for rank in range(2):
        value = _get(2, rank, "unused_error")
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


def test_ignored_parameters_and_buffers_stay_local_as_with_torch():
    late = [_get(2, r, "ignored")["late"] for r in range(2)]
    assert late[0].numel() != late[1].numel()  # each rank kept its own shapes
    early = []
    for rank in range(2):
        value = _get(2, rank, "ignored")
        _same_rows(value["rows"])
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
        _same_rows(value["rows"])
        assert value["caps"][0] == value["caps"][1] == [int(0.0002 * 2**20), int(0.0004 * 2**20)]
        # _mlp's gradients from the last: 4 | 32 + 8 | 128 | 16 | 96 (bucket 0 holds <= 26 float64s, the rest <= 52)
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
        _same_rows(value["rows"])
        assert all(value["grad_fn"])  # as with torch: higher-order graph kept, locally
