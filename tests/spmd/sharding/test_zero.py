"""ZeRO-1/2 across processes: parameters equal torch's ZeroRedundancyOptimizer, plain DDP and one process.

One spawned job per world size (gloo on 127.0.0.1, one thread per rank, killed after a
timeout) returns the parameters after every step; the assertions run here, in the parent.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch, shard
from manualdp.spmd.sharding.zero import ZeroRedundancyOptimizer
from tests.helpers import Branchy, Crash, CrashingLoss, seeded_mlp, small_mlp, uneven_mlp

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
STEPS = 3


def _batches(batch=13):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(STEPS)]


def _flat(module):
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _shard_loss(model, X, y, rank, n):
    Xs, ys = shard(X, y, rank, n)
    return nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n  # DDP averages: times n


def _job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        models = {"stage1": DistributedDataParallel(seeded_mlp()), "stage2": DistributedDataParallel(seeded_mlp()),
                  "plain": DistributedDataParallel(seeded_mlp()), "torch": TorchDDP(seeded_mlp())}
        opts = {"stage1": ZeroRedundancyOptimizer(models["stage1"].parameters(), cls, **kw),
                "stage2": ZeroRedundancyOptimizer(models["stage2"].parameters(), cls, stage=2, **kw),
                "plain": cls(models["plain"].parameters(), **kw),
                "torch": TorchZero(models["torch"].parameters(), cls, **kw)}
        single = seeded_mlp()
        single_opt = cls(single.parameters(), **kw)
        steps = []
        for X, y in _batches():
            for key, model in models.items():
                opts[key].zero_grad()
                if key == "stage2":
                    with model.no_sync():
                        _shard_loss(model, X, y, rank, n).backward()
                else:
                    _shard_loss(model, X, y, rank, n).backward()
                opts[key].step()
            single_opt.zero_grad()
            (nn.functional.cross_entropy(single(X), y, reduction="sum") / len(X)).backward()
            single_opt.step()
            steps.append({key: _flat(m.module) for key, m in models.items()} | {"single": _flat(single)})
        out[name] = {"steps": steps, "state": {k: _state_bytes(opts[k]) for k in ("stage1", "stage2", "plain")}}
    return out


def _state_bytes(opt):
    inner = getattr(opt, "optimizer", opt)
    return sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@functools.lru_cache(maxsize=None)
def _results(n):
    return launch(_job, n, timeout=180.0)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_equals_torch_zero_ddp_and_one_process_after_every_step(n, name):
    results = [r[name] for r in _results(n)]
    for step in range(STEPS):
        for r in range(n):
            got = results[r]["steps"][step]
            for stage in ("stage1", "stage2"):
                torch.testing.assert_close(got[stage], got["torch"], rtol=0, atol=1e-10, msg=f"{stage} vs torch's ZeRO")
                torch.testing.assert_close(got[stage], got["plain"], rtol=0, atol=1e-10, msg=f"{stage} vs plain DDP")
                torch.testing.assert_close(got[stage], got["single"], rtol=0, atol=1e-10, msg=f"{stage} vs one process")
                assert torch.equal(got[stage], results[0]["steps"][step][stage]), "ranks differ after the all-gather"
    assert not torch.equal(results[0]["steps"][0]["stage1"], _flat(seeded_mlp())), (
        "training did not move the parameters")


@pytest.mark.parametrize("n", [2, 3])
def test_adam_state_per_rank_is_about_one_nth(n):
    results = [r["adam"]["state"] for r in _results(n)]
    total = sum(p.numel() for p in seeded_mlp().parameters())
    for r in range(n):
        assert results[r]["plain"] == 2 * 8 * total
        for stage in ("stage1", "stage2"):
            assert abs(results[r][stage] - 2 * 8 * total / n) <= 2 * 8
    assert sum(r["stage1"] for r in results) == 2 * 8 * total


def _train_spmd_job():
    from torch.utils.data import DataLoader, TensorDataset

    from manualdp import train_spmd
    from manualdp.spmd import full_state_dict
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(60, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (60,), generator=g))
    out = {}
    for zero in (None, 1, 2, 3):
        net = seeded_mlp()
        train_spmd(net, DataLoader(data, batch_size=13), DataLoader(data, batch_size=30), 2, 1e-2,
                   optimizer=torch.optim.Adam, zero=zero, progress=False, log=None)
        out[zero] = _flat(net) if zero != 3 else torch.cat([v.reshape(-1) for k, v in full_state_dict(net).items()])
    try:
        train_spmd(seeded_mlp(), DataLoader(data, batch_size=13), DataLoader(data), 1, 1e-2, zero=2, nonfinite="raise",
                   log=None)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_train_spmd_with_zero_equals_train_spmd_without():
    results = launch(_train_spmd_job, 2, timeout=180.0)
    for r in range(2):
        for zero in (1, 2, 3):  # (ZeRO-3: the model put together from the shards, in state-dict order)
            torch.testing.assert_close(results[r][zero], results[r][None], rtol=0, atol=1e-10)
            assert torch.equal(results[r][zero], results[0][zero])
        assert "nonfinite" in results[r]["refused"]
    assert not torch.equal(results[0][None], _flat(seeded_mlp()))


# --- what a new user tries across processes: resume, unused parameters, groups, dtypes, stages ---


RESUME_CASES = [(stage, name) for stage in (1, 2) for name in ("sgd", "adam", "adamw")] + [(3, "adam")]


def _resume_job(root):
    import os

    from torch.utils.data import DataLoader, TensorDataset

    from manualdp import train_spmd
    from manualdp.spmd import full_state_dict
    from manualdp.support.checkpoint import load_latest
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(52, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (52,), generator=g))
    out = {}
    for stage, name in RESUME_CASES:
        cls, kw = OPTIMIZERS[name]
        kw = dict(kw)
        lr = kw.pop("lr")

        def run(**extra):
            net = uneven_mlp()
            train_spmd(net, DataLoader(data, batch_size=13), DataLoader(data, batch_size=26), 2, lr, optimizer=cls,
                       zero=stage, nonfinite=None, progress=False, log=None, **kw, **extra)
            return _flat(net) if stage != 3 else torch.cat([v.reshape(-1) for v in full_state_dict(net).values()])

        ckpt = os.path.join(root, f"{stage}-{name}")
        ref = run()
        try:  # 4 steps an epoch; stop in step 7, after the checkpoint of step 6
            run(checkpoint_dir=ckpt, checkpoint_every=3, loss_fn=CrashingLoss(7))
        except Crash:
            pass
        rank_dir = os.path.join(ckpt, f"rank{dist.get_rank()}")
        before = load_latest(rank_dir)["identity"]["run_id"]
        out[stage, name] = (ref, run(checkpoint_dir=ckpt, checkpoint_every=3, resume=True))
        out["run_id", stage, name] = (before, load_latest(rank_dir)["identity"]["run_id"])
    try:  # Adam's folder resumed with AdamW: the optimizer asked for is the run's, not ZeRO's wrapper
        net = uneven_mlp()
        train_spmd(net, DataLoader(data, batch_size=13), DataLoader(data, batch_size=26), 2, 1e-2,
                   optimizer=torch.optim.AdamW, zero=1, nonfinite=None, progress=False, log=None,
                   checkpoint_dir=os.path.join(root, "1-adam"), checkpoint_every=3, resume=True)
        out["changed"] = None
    except ValueError as e:
        out["changed"] = (str(e), torch.equal(_flat(net), _flat(uneven_mlp())))
    return out


@pytest.fixture(scope="module")
def zero_resumes(tmp_path_factory):
    return launch(_resume_job, 3, args=(str(tmp_path_factory.mktemp("resume")),), timeout=240.0)


def test_resume_under_torchrun_with_zero_refuses_another_optimizer_naming_it(zero_resumes):
    for r in range(3):
        assert zero_resumes[r]["changed"] is not None, f"rank {r} resumed Adam's checkpoint with AdamW"
        message, untouched = zero_resumes[r]["changed"]
        assert "optimizer 'Adam' -> 'AdamW'" in message and "\n" not in message and untouched


def test_resume_under_torchrun_equals_an_uninterrupted_run_on_uneven_shards(zero_resumes):
    results = zero_resumes
    for case in RESUME_CASES:
        for r in range(3):
            ref, resumed = results[r][case]
            assert torch.equal(resumed, ref), f"{case}: rank {r}'s resumed run differs"
            # one run id for the whole run: rank 0's, kept across the resume
            assert results[r][("run_id", *case)] == (results[0][("run_id", *case)][0],) * 2
        assert not torch.equal(results[0][case][0], _flat(uneven_mlp()))


def _features_job():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"unused": {}, "groups": None, "dtypes": None}
    # 1. A parameter no rank has a gradient for is skipped, as torch's optimizers skip it.
    for name, (cls, kw) in OPTIMIZERS.items():
        nets = {k: Branchy() for k in ("plain", "stage1", "stage2")}
        models = {k: DistributedDataParallel(m, find_unused_parameters=True) for k, m in nets.items()}
        opts = {"plain": cls(models["plain"].parameters(), **kw),
                "stage1": ZeroRedundancyOptimizer(models["stage1"].parameters(), cls, **kw),
                "stage2": ZeroRedundancyOptimizer(models["stage2"].parameters(), cls, stage=2, **kw)}
        for step, (X, y) in enumerate(_batches(12) + _batches(12)):
            for k, model in models.items():
                nets[k].use_side = step % 2 == 0
                opts[k].zero_grad()
                if k == "stage2":
                    with model.no_sync():
                        _shard_loss(model, X, y, rank, n).backward()
                else:
                    _shard_loss(model, X, y, rank, n).backward()
                opts[k].step()
        out["unused"][name] = {k: _flat(m) for k, m in nets.items()}
    # 2. Parameter groups as torch takes them, and a scheduler.
    nets = {k: seeded_mlp() for k in ("plain", "zero")}
    groups = lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[4].parameters()) +
                                                              list(m[2].parameters()), "lr": 1e-3, "momentum": 0.0}]
    models = {k: DistributedDataParallel(m) for k, m in nets.items()}
    opts = {"plain": torch.optim.SGD(groups(nets["plain"]), lr=0.1, momentum=0.9),
            "zero": ZeroRedundancyOptimizer(groups(nets["zero"]), torch.optim.SGD, lr=0.1, momentum=0.9)}
    scheds = {k: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for k, o in opts.items()}
    for X, y in _batches():
        for k, model in models.items():
            opts[k].zero_grad()
            _shard_loss(model, X, y, rank, n).backward()
            opts[k].step()
            scheds[k].step()
    out["groups"] = {k: _flat(m) for k, m in nets.items()} | {
        "lrs": {k: [g["lr"] for g in o.param_groups] for k, o in opts.items()}}
    # 3. float32 and float64 parameters are refused at both stages, as torch's ZeroRedundancyOptimizer refuses them.
    mixed = nn.Sequential(nn.Linear(6, 8).double(), nn.Linear(8, 4).float())
    out["dtypes"] = {}
    for stage in (1, 2):
        try:
            ZeroRedundancyOptimizer(mixed.parameters(), torch.optim.Adam, stage=stage, lr=1e-2)
        except ValueError as e:
            out["dtypes"][stage] = str(e)
    zero = ZeroRedundancyOptimizer(seeded_mlp().parameters(), torch.optim.Adam, stage=2, lr=1e-2)
    # 4. Another rank's state is refused.
    try:
        zero.load_state_dict(dict(zero.shard_state_dict(), rank=(rank + 1) % n))
    except ValueError as e:
        out["refused"] = str(e)
    # 5. Ranks asking for different stages raise, naming them (last: it must not leave gloo broken).
    try:
        ZeroRedundancyOptimizer(seeded_mlp().parameters(), torch.optim.SGD, stage=1 + (rank == n - 1), lr=0.1)
    except ValueError as e:
        out["stages"] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def _features():
    return launch(_features_job, 3, timeout=180.0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_no_rank_has_a_gradient_for_is_skipped(name):
    for r in range(3):
        got = _features()[r]["unused"][name]
        for stage in ("stage1", "stage2"):
            torch.testing.assert_close(got[stage], got["plain"], rtol=0, atol=1e-12, msg=f"{name} {stage} rank {r}")


def test_param_groups_and_a_scheduler_match_plain_ddp():
    got = _features()[0]["groups"]
    torch.testing.assert_close(got["zero"], got["plain"], rtol=0, atol=1e-12)
    assert got["lrs"]["zero"] == got["lrs"]["plain"] == [0.1 / 8, 1e-3 / 8]


def test_mixed_dtypes_and_another_ranks_state_refused_and_different_stages_named():
    for r in range(3):
        got = _features()[r]
        assert got["dtypes"] == {stage: "params: ZeroRedundancyOptimizer only supports using the same dense type for "
                                 "all parameters but got both torch.DoubleTensor and torch.FloatTensor"
                                 for stage in (1, 2)}
        assert "rank" in got["refused"] and f"this is rank {r} of 3" in got["refused"]
        assert "stage 1..2 (per rank: 1, 1, 2)" in got["stages"]


# ---------------------------------------------------------------- planted bugs slipped past these (issue 20)

def _fixed_loss(model):
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (10,), generator=g)
    return nn.functional.cross_entropy(model(X), y)


def _zero_grad_job():
    """Stage 2: the gradient bytes held after zero_grad(), which drops the shards, and zero_grad(False), which keeps
    them."""
    model = DistributedDataParallel(small_mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    held = {}
    for set_to_none in (False, True):
        with model.no_sync():
            _fixed_loss(model).backward()
        held["backward"] = opt.gradient_bytes()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        held[set_to_none] = opt.gradient_bytes()
    return held


def _scheduler_resume_job():
    """A rank's shard saved after a scheduler's step, loaded into a new optimizer: its lr, and the next step."""
    out = {}
    for stage in (1, 2):
        nets = [small_mlp(), small_mlp()]
        models = [DistributedDataParallel(net) for net in nets]
        first = ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.1)
        _zero_step(models[0], first, stage)
        scheduler.step()
        again = ZeroRedundancyOptimizer(models[1].parameters(), torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
        nets[1].load_state_dict(nets[0].state_dict())
        again.load_state_dict(first.shard_state_dict())
        for model, opt in zip(models, (first, again)):
            _zero_step(model, opt, stage)
        out[stage] = {"lr": [g["lr"] for g in again.param_groups], "equal": torch.equal(
            torch.cat([p.detach().reshape(-1) for p in nets[0].parameters()]),
            torch.cat([p.detach().reshape(-1) for p in nets[1].parameters()]))}
    return out


def _zero_step(model, opt, stage):
    opt.zero_grad()
    if stage == 2:
        with model.no_sync():
            _fixed_loss(model).backward()
    else:
        _fixed_loss(model).backward()
    opt.step()


def _corners_job():
    return {"zero_grad": _zero_grad_job(), "resume": _scheduler_resume_job(), "params_change": _params_change_job()}


@functools.lru_cache(maxsize=None)
def _corners_results():
    return launch(_corners_job, 2, timeout=120.0)


def test_zero_grad_drops_the_gradient_shards_and_set_to_none_false_keeps_them():
    for r, result in enumerate(_corners_results()):
        held = result["zero_grad"]
        assert held["backward"] > 0, f"rank {r} holds no gradient shard after backward"
        assert held[False] == held["backward"], f"rank {r}: zero_grad(set_to_none=False) should keep the shards"
        assert held[True] == 0, f"rank {r} holds {held[True]} bytes of gradient after zero_grad()"


def test_a_loaded_shard_brings_back_the_schedulers_learning_rate_at_both_stages():
    for r, result in enumerate(_corners_results()):
        for stage in (1, 2):
            assert result["resume"][stage]["lr"] == [0.1 * 0.1], f"rank {r}, stage {stage}"
            assert result["resume"][stage]["equal"], f"rank {r}, stage {stage}: the resumed step differs"


# ---------------------------------------------------------------- parameters changed under it between steps (round 32)
# Each ends as torch's SGD would, or raises one line on every rank (every rank is fed the same batch, so the answer is
# plain SGD on it): a second optimizer built over the same parameters while the first lives takes them over, and the
# first refuses to step; weights rebound by vector_to_parameters are taken back (another dtype is refused, naming the
# parameter); a layer frozen when the optimizer is built and unfrozen later is trained, and its state consolidates.
# They run in the corners launch above.

CHANGE_SGD = dict(lr=0.1, momentum=0.9)
CHANGE_CAP = 300 / 2**20  # a few small parameters a bucket


def _mlp5():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _step_loss(model, step):
    g = torch.Generator().manual_seed(100 + step)
    X, y = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    return nn.functional.cross_entropy(model(X), y)


def _zero_or_sgd(params, zero, stage=2, **kw):
    kw = kw or CHANGE_SGD
    return (ZeroRedundancyOptimizer(params, torch.optim.SGD, stage=stage, bucket_cap_mb=CHANGE_CAP, **kw) if zero
            else torch.optim.SGD(params, **kw))


def _error_of(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _rebuilt(zero):
    """A second optimizer (lr 0.05) after a step of the first, which a StepLR keeps alive, and a backward: torch's
    SGD steps with the gradient summed before it was built. Then the first is asked to step."""
    model = _mlp5()
    first = _zero_or_sgd(model.parameters(), zero)
    sched = torch.optim.lr_scheduler.StepLR(first, 10)
    first.zero_grad()
    _step_loss(model, 0).backward()
    first.step()
    sched.step()
    _step_loss(model, 1).backward()  # summed before the new one is built: a fresh SGD steps with it
    second = _zero_or_sgd(model.parameters(), zero, lr=0.05, momentum=0.9)
    second.step()
    for step in range(2, 4):
        second.zero_grad()
        _step_loss(model, step).backward()
        second.step()
    return _flat(model), _error_of(first.step) if zero else None


def _rebuilt_in_another_layout():
    """The sums of the old one cannot be carried into other groups: step refuses until zero_grad, then trains."""
    model = _mlp5()
    first = _zero_or_sgd(model.parameters(), True)
    _step_loss(model, 0).backward()
    params = list(model.parameters())
    second = _zero_or_sgd([{"params": params[:2]}, {"params": params[2:]}], True)
    refused = _error_of(second.step)
    second.zero_grad()
    _step_loss(model, 0).backward()
    second.step()
    return refused, first.grad_shards.released


def _reloaded(zero, dtype=None):
    """Weights halved with vector_to_parameters before step 1 (or the model cast to `dtype`)."""
    model = _mlp5()
    opt = _zero_or_sgd(model.parameters(), zero)
    for step in range(3):
        if step == 1:
            if dtype is not None:  # after zero_grad: the stand-ins of the last step's .grad refuse a cast
                opt.zero_grad()
                model.to(dtype)
                return _error_of(opt.step)
            vec = torch.nn.utils.parameters_to_vector(model.parameters()).detach() * 0.5
            torch.nn.utils.vector_to_parameters(vec, model.parameters())
        opt.zero_grad()
        _step_loss(model, step).backward()
        opt.step()
    return _flat(model)


def _two_groups(model):
    return [{"params": model[0:4].parameters()}, {"params": model[4].parameters(), "lr": 0.05}]


def _unfrozen(zero, stage, only_rank=None):
    """The first layer frozen in group 0 (the last layer in group 1) when built, unfrozen before step 1."""
    model = _mlp5()
    model[0].requires_grad_(False)
    opt = _zero_or_sgd(_two_groups(model), zero, stage)
    for step in range(3):
        if step == 1 and (only_rank is None or dist.get_rank() == only_rank):
            model[0].requires_grad_(True)
        opt.zero_grad()
        _step_loss(model, step).backward()
        if only_rank is not None and step == 1:
            return _error_of(opt.step)
        opt.step()
    if not zero:
        return _flat(model), [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    opt.consolidate_state_dict(0)
    state = opt.state_dict() if dist.get_rank() == 0 else None
    momenta = None
    if state is not None:
        plain = _zero_or_sgd(_two_groups(model), False)
        plain.load_state_dict(state)
        momenta = [plain.state[p]["momentum_buffer"] for p in model.parameters()]
    return _flat(model), momenta


_CHANGE_CASES = {
    "rebuilt": lambda: (_rebuilt(True), _rebuilt(False)),
    "rebuilt_in_another_layout": _rebuilt_in_another_layout,
    "reloaded": lambda: (_reloaded(True), _reloaded(False)),
    "reloaded_as_float32": lambda: _reloaded(True, torch.float32),
    "unfrozen_stage1": lambda: (_unfrozen(True, 1), _unfrozen(False, 1)),
    "unfrozen_stage2": lambda: (_unfrozen(True, 2), _unfrozen(False, 2)),
    "unfrozen_on_one_rank": lambda: _unfrozen(True, 2, only_rank=1),
}


def _params_change_job():
    torch.set_num_threads(1)
    out = {}
    for name, case in _CHANGE_CASES.items():
        try:
            out[name] = ("ok", case())
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[name] = ("err", type(e).__name__, str(e))
        dist.barrier()
    return out


def _changed(name):
    for r, out in enumerate(_corners_results()):
        assert out["params_change"][name][0] == "ok", (r, out["params_change"][name])
    return [out["params_change"][name][1] for out in _corners_results()]


def _one_line(message, *words):
    assert message is not None and "\n" not in message and all(w in message for w in words), message


def test_a_second_optimizer_takes_the_parameters_over_and_the_first_refuses_to_step():
    for (got, refused), (want, _) in _changed("rebuilt"):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        _one_line(refused, "newer ZeroRedundancyOptimizer", "took their gradients over")


def test_sums_that_cannot_follow_into_another_layout_are_refused_until_zero_grad():
    for refused, first_released in _changed("rebuilt_in_another_layout"):
        _one_line(refused, "took its parameters over", "zero_grad()")
        assert first_released


def test_weights_rebound_by_vector_to_parameters_are_taken_back():
    for got, want in _changed("reloaded"):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_parameter_rebound_to_another_dtype_is_refused_on_every_rank_naming_it():
    for refused in _changed("reloaded_as_float32"):
        _one_line(refused, "parameter 0 (group 0)", "float32", "rebound")


@pytest.mark.parametrize("stage", [1, 2])
def test_a_layer_unfrozen_after_construction_is_trained_and_its_state_consolidates(stage):
    results = _changed(f"unfrozen_stage{stage}")
    for (got, momenta), (want, plain_momenta) in results:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (_, momenta), (_, plain_momenta) = results[0]
    for m, want in zip(momenta, plain_momenta):
        torch.testing.assert_close(m, want, rtol=0, atol=1e-12)


def test_a_layer_unfrozen_on_one_rank_only_is_refused_on_every_rank_naming_it():
    for refused in _changed("unfrozen_on_one_rank"):
        _one_line(refused, "parameter 0 (group 0)", "requires grad on 1 of 2 ranks")
