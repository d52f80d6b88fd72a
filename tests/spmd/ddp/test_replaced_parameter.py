"""A parameter replaced (or resized) on one rank only after wrapping the drop-in: every rank raises in one line naming
the parameter and the rank, whatever the flags and the step (before: the peers waited out the timeout, or, with
`find_unused_parameters`, trained on without ever averaging it)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch
from manualdp.spmd.ladder.identity import replaced_line, replaced_mark

# (how rank 1 changes its model, before which step, the wrapper's flags)
CASES = [("replace", 1, {"find_unused_parameters": True}), ("replace", 1, {"static_graph": True}),
         ("replace", 0, {"drift_check_every": 0}), ("resize", 0, {}), ("resize", 1, {"drift_check_every": 0}),
         ("add", 1, {"find_unused_parameters": True})]


def _change(net, how):
    if how == "replace":  # the same values: only its identity tells
        net[0].weight = nn.Parameter(net[0].weight.detach().clone())
    elif how == "resize":
        net[0].weight = nn.Parameter(torch.zeros(2, 4))
    else:
        net[1].extra = nn.Parameter(torch.zeros(1))


def _job(how, at, flags):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = DistributedDataParallel(net, algorithm="ring", timeout=20, **flags)
    try:
        for step in range(3):
            if dist.get_rank() == 1 and step == at:
                _change(net, how)
            model(torch.randn(2, 4)).sum().backward()
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("how,at,flags", CASES)
def test_a_parameter_replaced_on_one_rank_after_wrapping_raises_on_every_rank_naming_it(n, how, at, flags):
    said = "a parameter added after wrapping" if how == "add" else "parameter 0.weight"
    for rank, message in enumerate(launch(_job, n, (how, at, flags), timeout=120)):
        assert message is not None and message.startswith(f"ValueError: rank {rank}: DistributedDataParallel:"), \
            message
        assert message.startswith(f"ValueError: rank {rank}: DistributedDataParallel: {said} on rank 1 is not the one "
                                  "the wrapper was built with ("), message
        assert "\n" not in message


def _everywhere():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = DistributedDataParallel(net, algorithm="ring", timeout=20)
    model(torch.randn(2, 4)).sum().backward()
    net.bias = nn.Parameter(net.bias.detach().clone())  # on every rank alike: each names itself, none waits
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_the_same_parameter_replaced_on_every_rank_raises_on_each_naming_every_rank():
    for rank, message in enumerate(launch(_everywhere, 2, timeout=120)):
        assert message is not None and message.startswith(f"rank {rank}: DistributedDataParallel: parameter bias "
                                                          "on ranks 0 and 1 is not the one"), message


NAMES = ["0.weight", "0.bias"]
TAIL = " is not the one the wrapper was built with ("


@pytest.mark.parametrize("marks,said", [
    ({2: replaced_mark(2)}, "a parameter added after wrapping on rank 2"),
    ({0: replaced_mark(0), 1: replaced_mark(0)}, "parameter 0.weight on ranks 0 and 1"),
    ({0: replaced_mark(1), 1: replaced_mark(1), 3: replaced_mark(1)}, "parameter 0.bias on ranks 0, 1 and 3"),
    ({2: replaced_mark(0), 0: replaced_mark(5), 1: replaced_mark(0)},
     "a parameter added after wrapping on rank 0; parameter 0.weight on ranks 1 and 2")])
def test_the_replaced_line_names_each_parameter_once_with_the_ranks_that_replaced_it(marks, said):
    line = replaced_line(1, "DistributedDataParallel", marks, NAMES)
    assert line.startswith(f"rank 1: DistributedDataParallel: {said}{TAIL}"), line


def _stateless(wrapper):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    model = wrapper(net)
    x = torch.rand(1, 1)
    weight, bias = torch.tensor([[1.0]], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    before = net.weight.detach().clone()
    out = torch.func.functional_call(model, {"module.weight": weight, "module.bias": bias}, x)
    out.sum().backward()
    return out.detach(), torch.equal(net.weight.detach(), before), weight.grad, bias.grad, net.weight.grad


def test_a_stateless_call_through_the_wrapper_is_not_a_replaced_parameter_and_equals_torchs():
    # torch.func.functional_call puts plain tensors in the parameters' places for one forward: torch's DDP runs it
    # (its own test_stateless_api_with_ddp); a plain tensor cannot be assigned to a parameter by hand
    ours = launch(_stateless, 2, (DistributedDataParallel,), timeout=120)
    torchs = launch(_stateless, 2, (nn.parallel.DistributedDataParallel,), timeout=120)
    for mine, theirs in zip(ours, torchs):
        assert mine[1] and theirs[1]  # the module's own weight is unchanged
        for a, b in zip(mine[:1] + mine[2:], theirs[:1] + theirs[2:]):
            assert (a is None and b is None) or torch.equal(a, b), (mine, theirs)
