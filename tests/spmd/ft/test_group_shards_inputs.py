"""`spmd/ft/group_shards.py`'s public functions refuse bad input in one line naming the argument and the value, on 2
ranks sharded by `fully_shard` (uneven rows: rank 0's shard is not rank 1's), and a refused load changes no tensor."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from manualdp.spmd.ft.group_shards import (flat_local_grads, like, load_local_model_state, load_local_optim_state,
                                           local, local_model_state, local_optim_state, put_local_grads)
from manualdp.spmd.launch import launch
from manualdp.spmd.sharding.fsdp import fully_shard


def _refusal(call) -> tuple[str, str] | None:
    """The type and message of what `call()` raised, or None if it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (the test judges the type)
        return type(e).__name__, str(e)
    return None


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every tensor a load or a put could write: parameters, gradients, the optimizer's state."""
    params = list(model.parameters())
    moments = [v for p in params for v in opt.state[p].values()]
    return [local(t).detach().clone() for t in [*params, *(p.grad for p in params), *moments]]


def _model_cases(model: nn.Module, saved: dict) -> dict:
    """Each bad call of the model's state, by name: what it raised."""
    key = "0.weight"
    saved = {k: v + 1 for k, v in saved.items()}  # another state: a load that went half-way would show
    shard = saved[key]
    plain = nn.Linear(5, 7)
    return {
        "local_non_tensor": _refusal(lambda: local([1.0])),
        "like_plain_model": _refusal(lambda: like(shard, shard.clone())),
        "like_other_shape": _refusal(lambda: like(shard[:-1], model[0].weight)),
        "like_other_dtype": _refusal(lambda: like(shard.double(), model[0].weight)),
        "state_non_module": _refusal(lambda: local_model_state("model")),
        "state_unsharded": _refusal(lambda: local_model_state(plain)),
        "load_unsharded": _refusal(lambda: load_local_model_state(plain, plain.state_dict())),
        "load_non_dict": _refusal(lambda: load_local_model_state(model, list(saved.values()))),
        "load_missing_key": _refusal(lambda: load_local_model_state(model, {k: v for k, v in saved.items()
                                                                           if k != key})),
        "load_extra_key": _refusal(lambda: load_local_model_state(model, {**saved, "extra": shard})),
        "load_other_shape": _refusal(lambda: load_local_model_state(model, {**saved, key: torch.zeros(9, 5)})),
        "load_other_dtype": _refusal(lambda: load_local_model_state(model, {**saved, key: shard.double()})),
        "load_non_tensor": _refusal(lambda: load_local_model_state(model, {**saved, key: shard.tolist()})),
    }


def _optim_cases(model: nn.Module, opt: torch.optim.Optimizer, saved: dict) -> dict:
    """Each bad call of the optimizer's state, by name: what it raised."""
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    moment = saved["state"][0]["exp_avg"] + 1
    def with_moment(value) -> dict:
        return {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": value}}}
    return {
        "optim_non_optimizer": _refusal(lambda: local_optim_state(model)),
        "optim_unsharded": _refusal(lambda: local_optim_state(plain)),
        "optim_load_non_dict": _refusal(lambda: load_local_optim_state(opt, [saved])),
        "optim_load_no_state": _refusal(lambda: load_local_optim_state(opt, {"param_groups": saved["param_groups"]})),
        "optim_load_other_count": _refusal(lambda: load_local_optim_state(opt, {
            **saved, "param_groups": [{**saved["param_groups"][0], "params": [0, 1]}]})),
        "optim_load_other_shape": _refusal(lambda: load_local_optim_state(opt, with_moment(torch.zeros(9, 5)))),
        "optim_load_other_dtype": _refusal(lambda: load_local_optim_state(opt, with_moment(moment.double()))),
        "optim_load_bad_pair": _refusal(lambda: load_local_optim_state(opt, {**saved, "manualdp_sharded": [[0, "x"]]})),
    }


def _grad_cases(model: nn.Module) -> dict:
    """Each bad call of the gradients, by name: what it raised."""
    params = list(model.parameters())
    flat = flat_local_grads(params)
    mixed = [*params, nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    return {
        "flat_one_tensor": _refusal(lambda: flat_local_grads(params[0])),
        "flat_generator": _refusal(lambda: flat_local_grads(p for p in params)),
        "flat_empty": _refusal(lambda: flat_local_grads([])),
        "flat_mixed_dtypes": _refusal(lambda: flat_local_grads(mixed)),
        "put_non_tensor": _refusal(lambda: put_local_grads(params, flat.tolist())),
        "put_short": _refusal(lambda: put_local_grads(params, flat[:-1])),
        "put_long": _refusal(lambda: put_local_grads(params, torch.cat([flat, flat[:1]]))),
        "put_other_dtype": _refusal(lambda: put_local_grads(params, flat.double())),
        "put_two_dims": _refusal(lambda: put_local_grads(params, flat.view(1, -1))),
        "put_mixed_dtypes": _refusal(lambda: put_local_grads(mixed, torch.cat([flat + 1, torch.zeros(2)]))),
    }


def _placement_cases(model: nn.Module, opt: torch.optim.Optimizer, folder: str) -> dict:
    """Each state of another rank, group size, optimizer or layout, by name: what loading it raised."""
    rank = dist.get_rank()
    saved_model, saved_optim = local_model_state(model), local_optim_state(opt)
    peers = [None, None]
    dist.all_gather_object(peers, (saved_model, saved_optim))
    peer_model, peer_optim = peers[1 - rank]  # files mixed up: even shards, the same shapes on both ranks
    three = torch.load(f"{folder}/rank{rank}_of_3.pt", weights_only=True)  # saved by rank `rank` of 3
    params = list(model.parameters())
    sgd = torch.optim.SGD([*params, opt.param_groups[0]["params"][-1]], lr=0.1, momentum=0.9)
    for p in sgd.param_groups[0]["params"]:
        sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)  # the state a step makes, without stepping
    saved_sgd = local_optim_state(sgd)
    entry = {**saved_optim["state"][0]}
    return {
        "model_other_rank": _refusal(lambda: load_local_model_state(model, peer_model)),
        "optim_other_rank": _refusal(lambda: load_local_optim_state(opt, peer_optim)),
        "model_other_size": _refusal(lambda: load_local_model_state(model, three["model"])),
        "optim_other_size": _refusal(lambda: load_local_optim_state(opt, three["optim"])),
        "optim_plain_other_shape": _refusal(lambda: load_local_optim_state(opt, {**saved_optim, "state": {
            **saved_optim["state"], 4: {**saved_optim["state"][4], "exp_avg": torch.zeros(7, 7).double()}}})),
        "optim_sgd_into_adam": _refusal(lambda: load_local_optim_state(opt, saved_sgd)),
        "optim_other_entry_keys": _refusal(lambda: load_local_optim_state(opt, {**saved_optim, "state": {
            **saved_optim["state"], 0: {"momentum_buffer": entry["exp_avg"]}},
            "manualdp_sharded": [pair for pair in saved_optim["manualdp_sharded"] if pair[0] != 0]})),
        "optim_no_marker": _refusal(lambda: load_local_optim_state(opt, {k: v for k, v in saved_optim.items()
                                                                        if k != "manualdp_sharded"})),
    }


def _torch_sharded_cases() -> dict:
    """Each call on parameters sharded by torch's own fully_shard, by name: what it raised."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    torch_fully_shard(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    return {
        "optim_torch_sharded": _refusal(lambda: local_optim_state(opt)),
        "flat_torch_sharded": _refusal(lambda: flat_local_grads(params)),
        "put_torch_sharded": _refusal(lambda: put_local_grads(params, torch.zeros(sum(local(p).numel()
                                                                                       for p in params)))),
    }


def _even_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """6 and 4 rows (even over 2 ranks, 6 uneven over 3), stepped once by Adam with a plain (unsharded) extra."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    fully_shard(model)
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([*model.parameters(), extra], lr=0.1)
    (model(torch.randn(2, 4)).sum() + extra.sum()).backward()
    opt.step()
    return model, opt


def _save_at_3(folder: str) -> None:
    """Rank r of 3 saves its states, for the 2-rank job to load."""
    model, opt = _even_model()
    state = {"model": local_model_state(model), "optim": local_optim_state(opt)}
    torch.save(state, f"{folder}/rank{dist.get_rank()}_of_3.pt")


def _job(folder: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # 7 and 3 rows: uneven over 2 ranks
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    saved_model, saved_optim = local_model_state(model), local_optim_state(opt)
    even, even_opt = _even_model()
    before = _values(model, opt) + _values(even, even_opt)
    out = {**_model_cases(model, saved_model), **_optim_cases(model, opt, saved_optim), **_grad_cases(model),
           **_placement_cases(even, even_opt, folder), **_torch_sharded_cases()}
    after = _values(model, opt) + _values(even, even_opt)
    out["unchanged"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    older = dict(saved_model)  # as an older manualdp wrote it: tensors alone, no record of the shard's place
    older_optim = {k: v for k, v in saved_optim.items() if k != "manualdp_shard"}
    out["older_loads"] = _refusal(lambda: (load_local_model_state(model, older),
                                           load_local_optim_state(opt, older_optim)))
    return out


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> list[dict]:
    """Every case's outcome on each of 2 ranks, from one launch (after 3 ranks saved their states)."""
    folder = str(tmp_path_factory.mktemp("shards"))
    launch(_save_at_3, 3, (folder,), timeout=120)
    return launch(_job, 2, (folder,), timeout=120)


CASES = {  # case: (the error's type, words its one line must hold)
    "local_non_tensor": ("TypeError", ["value", "list"]),
    "like_plain_model": ("TypeError", ["model", "DTensor", "Tensor"]),
    "like_other_shape": ("ValueError", ["value", "model's local shard", "shape"]),
    "like_other_dtype": ("ValueError", ["value", "torch.float64", "torch.float32"]),
    "state_non_module": ("TypeError", ["module", "str"]),
    "state_unsharded": ("ValueError", ["module", "Linear", "fully_shard"]),
    "load_unsharded": ("ValueError", ["module", "Linear", "fully_shard"]),
    "load_non_dict": ("TypeError", ["state", "list"]),
    "load_missing_key": ("ValueError", ["state", "missing '0.weight'"]),
    "load_extra_key": ("ValueError", ["state", "unexpected 'extra'"]),
    "load_other_shape": ("ValueError", ["state['0.weight']", "(9, 5)"]),
    "load_other_dtype": ("ValueError", ["state['0.weight']", "torch.float64"]),
    "load_non_tensor": ("TypeError", ["state['0.weight']", "list"]),
    "optim_non_optimizer": ("TypeError", ["optimizer", "Optimizer"]),
    "optim_unsharded": ("ValueError", ["optimizer", "SGD", "fully_shard"]),
    "optim_load_non_dict": ("TypeError", ["state", "list"]),
    "optim_load_no_state": ("TypeError", ["state", "'param_groups'"]),
    "optim_load_other_count": ("ValueError", ["state", "2 parameters", "optimizer steps 4"]),
    "optim_load_other_shape": ("ValueError", ["state['state'][0]['exp_avg']", "(9, 5)"]),
    "optim_load_other_dtype": ("ValueError", ["state['state'][0]['exp_avg']", "torch.float64"]),
    "optim_load_bad_pair": ("ValueError", ["manualdp_sharded", "[0, 'x']"]),
    "flat_one_tensor": ("TypeError", ["params", "Tensor"]),
    "flat_generator": ("TypeError", ["params", "generator"]),
    "flat_empty": ("ValueError", ["params", "empty"]),
    "flat_mixed_dtypes": ("TypeError", ["params", "torch.float32", "torch.float64"]),
    "put_non_tensor": ("TypeError", ["flat", "list"]),
    "put_short": ("ValueError", ["flat", "shape ("]),
    "put_long": ("ValueError", ["flat", "shape ("]),
    "put_other_dtype": ("ValueError", ["flat", "torch.float64"]),
    "put_two_dims": ("ValueError", ["flat", "1-D", "shape (1, "]),
    "put_mixed_dtypes": ("TypeError", ["params", "torch.float32", "torch.float64"]),
    "model_other_rank": ("ValueError", ["state", "saved by rank {peer} of a shard group of 2", "rank {rank} of 2"]),
    "optim_other_rank": ("ValueError", ["state", "saved by rank {peer} of a shard group of 2", "rank {rank} of 2"]),
    "model_other_size": ("ValueError", ["state", "saved by rank {rank} of a shard group of 3", "rank {rank} of 2"]),
    "optim_other_size": ("ValueError", ["state", "saved by rank {rank} of a shard group of 3", "rank {rank} of 2"]),
    "optim_plain_other_shape": ("ValueError", ["state['state'][4]['exp_avg']", "(7, 7)", "torch.float64", "(3,)"]),
    "optim_sgd_into_adam": ("ValueError", ["state['param_groups'][0]", "missing 'betas'", "unexpected 'momentum'",
                                           "Adam"]),
    "optim_other_entry_keys": ("ValueError", ["state['state'][0]", "missing 'step'", "unexpected 'momentum_buffer'"]),
    "optim_no_marker": ("ValueError", ["state['state'][0]['exp_avg']", "manualdp_sharded", "does not name it"]),
    "optim_torch_sharded": ("ValueError", ["optimizer's parameters[0]", "DTensor", "torch's own fully_shard"]),
    "flat_torch_sharded": ("ValueError", ["params[0]", "DTensor", "torch's own fully_shard"]),
    "put_torch_sharded": ("ValueError", ["params[0]", "DTensor", "torch's own fully_shard"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line_naming_the_argument_and_the_value(refusals, case):
    kind, words = CASES[case]
    for rank, out in enumerate(refusals):
        got = out[case]
        assert got is not None, (rank, case, "returned without an error")
        wanted = [w.format(rank=rank, peer=1 - rank) for w in words]
        assert got[0] == kind and "\n" not in got[1] and all(w in got[1] for w in wanted), (rank, case, got)


def test_a_refused_load_or_put_changes_no_tensor(refusals):
    # parameters, gradients and Adam's moments, bitwise, after every refused call above
    for rank, out in enumerate(refusals):
        assert out["unchanged"], rank


def test_a_state_without_the_record_of_its_place_loads_as_an_older_manualdp_wrote_it(refusals):
    # `--checkpoint-dir` folders written before the record: accepted on their shapes alone
    for rank, out in enumerate(refusals):
        assert out["older_loads"] is None, (rank, out["older_loads"])
