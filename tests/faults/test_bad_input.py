"""Every public boundary: bad input is a clear error naming the argument and the value, inputs unchanged."""
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import manualdp
from manualdp import allreduce, cpu_devices, evaluate, replicate, replicate_params, split_batch, train, try_gpu
from manualdp.buckets import assign_buckets, unflatten_
from manualdp.runners.cli import main
from manualdp.schedule import get_schedule
from manualdp.cost import cost, traffic
from manualdp.distributed import DistributedDataParallel, plan
from manualdp.distributed import allreduce as spmd_allreduce
from manualdp.train import train_batch


def _tensors(n=3, size=4):
    return [torch.arange(size, dtype=torch.float32) + i for i in range(n)]


CASES = [
    # (call, error type, words the message must contain)
    (lambda: cpu_devices(0), ValueError, ["n must be a positive int", "0"]),
    (lambda: cpu_devices("2"), ValueError, ["n must be a positive int", "'2'"]),
    (lambda: try_gpu(-1), ValueError, ["i must be", "-1"]),
    (lambda: split_batch(torch.zeros(3, 2), torch.zeros(3), cpu_devices(4)), ValueError, ["batch of 3", "4 devices"]),
    (lambda: split_batch(torch.zeros(4, 2), torch.zeros(5), cpu_devices(2)), ValueError, ["len(X)=4", "len(y)=5"]),
    (lambda: split_batch(torch.zeros(4, 2), torch.zeros(4), []), ValueError, ["devices must not be empty"]),
    (lambda: split_batch(torch.zeros(4, 2), torch.zeros(4), ["gpu7"]), TypeError, ["devices contains 'gpu7'"]),
    (lambda: split_batch(torch.tensor(1.0), torch.zeros(4), cpu_devices(1)), ValueError,
     ["X must have a batch dimension"]),
    (lambda: replicate(nn.Linear(2, 2), "cpu"), TypeError, ["devices must be a list", "'cpu'"]),
    (lambda: replicate_params([1.0], "cpu"), TypeError, ["params[0] must be a torch.Tensor", "float"]),
    (lambda: allreduce([]), ValueError, ["tensors must not be empty"]),
    (lambda: allreduce(torch.zeros(3)), TypeError, ["tensors must be a list", "Tensor"]),
    (lambda: allreduce(_tensors(), algorithm="butterfly"), ValueError, ["algorithm must be one of", "'butterfly'"]),
    (lambda: get_schedule("ring", 0), ValueError, ["n (number of devices) must be a positive int", "0"]),
    (lambda: get_schedule("hypercube", 4), ValueError, ["algorithm must be one of", "'hypercube'"]),
    (lambda: traffic(get_schedule("ring", 2), -8), ValueError, ["nbytes must be a non-negative int", "-8"]),
    (lambda: traffic(get_schedule("ring", 2), 10, element_size=4), ValueError, ["nbytes=10", "element_size=4"]),
    (lambda: cost(get_schedule("ring", 2), 8, alpha=-1.0, beta=0.0, gamma=0.0), ValueError, ["alpha", "-1.0"]),
    (lambda: assign_buckets([torch.zeros(2)], 0), ValueError, ["bucket_cap_mb must be a positive number", "0"]),
    (lambda: assign_buckets([torch.zeros(2)], -1.5), ValueError, ["bucket_cap_mb", "-1.5"]),
    (lambda: assign_buckets([torch.zeros(2)], [1, -2]), ValueError, ["bucket_cap_mb", "-2"]),
    (lambda: assign_buckets([torch.zeros(2), torch.zeros(2)], 1, order=[1, 1]), ValueError,
     ["order must hold", "[1, 1]"]),
    (lambda: unflatten_(torch.zeros(3), [torch.zeros(2)]), ValueError, ["flat has 3 elements", "hold 2"]),
    (lambda: evaluate("net", []), TypeError, ["net must be an nn.Module", "str"]),
    (lambda: train(nn.Linear(2, 2), [], [], cpu_devices(1), 1, 0.1, nonfinite="ignore", progress=False, log=None),
     ValueError, ["nonfinite must be one of", "'ignore'"]),
    (lambda: train(nn.Linear(2, 2), [], [], cpu_devices(1), 2.5, 0.1, progress=False, log=None),
     ValueError, ["num_epochs must be a positive int", "2.5"]),
    (lambda: train(nn.Linear(2, 2), [], [], cpu_devices(1), 1, float("nan"), progress=False, log=None),
     ValueError, ["lr must be a positive number", "nan"]),
    (lambda: train(nn.Linear(2, 2), [], [], cpu_devices(1), 1, 0.1, bucket_cap_mb="25", progress=False, log=None),
     ValueError, ["bucket_cap_mb", "'25'"]),
]


@pytest.mark.parametrize("call, error, words", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_input_is_a_clear_error(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value)


NOTHING_TO_TRAIN = {
    "frozen": (lambda: nn.Linear(4, 3).requires_grad_(False),
               "net has no parameters that require grad (all 2 are frozen)"),
    "parameterless": (lambda: nn.Softmax(dim=1), "net has no parameters that require grad (it has none)"),
    "lazy": (lambda: nn.Sequential(nn.LazyLinear(3)), "net has uninitialized parameters (0.weight, 0.bias: a lazy"),
}


@pytest.mark.parametrize("kind", NOTHING_TO_TRAIN)
def test_a_model_with_nothing_to_train_is_one_clear_error_in_both_modes(kind):
    from manualdp.runners.loop import train_spmd
    make, words = NOTHING_TO_TRAIN[kind]
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    with pytest.raises(ValueError, match=re.escape(words)):
        train(make(), data, data, cpu_devices(2), 1, 0.1, progress=False, log=None)
    with pytest.raises(ValueError, match=re.escape(words)):  # checked before it looks for a process group
        train_spmd(make(), data, data, 1, 0.1, progress=False, log=None)


def test_the_book_refuses_lazy_and_frozen_models_before_touching_them():
    # Replicas of a lazy module would each draw their own values at their first forward pass.
    with pytest.raises(ValueError, match="module has uninitialized parameters .* run one forward pass"):
        replicate(nn.Sequential(nn.LazyLinear(3)), cpu_devices(2))
    replicas = replicate(nn.Linear(4, 3).requires_grad_(False), cpu_devices(2))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    with pytest.raises(ValueError, match=re.escape("replicas[0] has no parameters that require grad")):
        train_batch(torch.randn(8, 4), torch.randint(0, 3, (8,)), replicas, opts, cpu_devices(2))


@pytest.mark.parametrize("bad", [
    lambda ts: ts.append(torch.zeros(5)),                       # shape
    lambda ts: ts.append(torch.zeros(4, dtype=torch.float64)),  # dtype
    lambda ts: ts.append(ts[0]),                                # the same tensor twice
    lambda ts: ts.append(ts[1].view(2, 2).view(-1)),            # a view of another
    lambda ts: ts.append(torch.zeros(4, dtype=torch.bool)),     # not summable
    lambda ts: ts.append("x"),                                  # not a tensor
])
@pytest.mark.parametrize("algorithm", ["naive", "ring", "tree"])
def test_failed_allreduce_leaves_tensors_unchanged(bad, algorithm):
    tensors = _tensors()
    bad(tensors)
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]
    with pytest.raises((ValueError, TypeError)):
        allreduce(tensors, algorithm)
    for t, b in zip(tensors, before):
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, b)


def test_failed_split_leaves_the_batch_unchanged():
    X, y = torch.arange(6.0).view(3, 2), torch.arange(3)
    X0, y0 = X.clone(), y.clone()
    with pytest.raises(ValueError):
        split_batch(X, y, cpu_devices(4))
    assert torch.equal(X, X0) and torch.equal(y, y0)


def test_failed_train_batch_leaves_replicas_unchanged():
    replicas = replicate(nn.Linear(3, 2), cpu_devices(2))
    opts = [torch.optim.SGD(r.parameters(), lr=1.0) for r in replicas]
    before = [p.clone() for p in replicas[0].parameters()]
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        train_batch(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), replicas, opts, cpu_devices(2),
                    nonfinite="warn")
    with pytest.raises(ValueError, match="batch of 1 is smaller than the 2 devices"):
        train_batch(torch.randn(1, 3), torch.zeros(1, dtype=torch.long), replicas, opts, cpu_devices(2))
    for p, b in zip(replicas[0].parameters(), before):
        assert torch.equal(p, b) and p.grad is None


@pytest.mark.parametrize("argv, words", [
    (["train", "--devices", "0"], ["--devices", "must be > 0", "0"]),
    (["train", "--devices", "two"], ["--devices", "'two'"]),
    (["train", "--batch-size", "-5"], ["--batch-size", "-5"]),
    (["train", "--lr", "0"], ["--lr", "must be > 0"]),
    (["train", "--epochs", "1.5"], ["--epochs", "'1.5'"]),
    (["train", "--bucket-mb", "0"], ["--bucket-mb", "must be > 0"]),
    (["train", "--algorithm", "butterfly"], ["--algorithm", "'butterfly'"]),
    (["train", "--model", "vgg"], ["--model", "'vgg'"]),
    (["train", "--resume"], ["--resume", "--checkpoint-dir"]),
    (["train", "--json", "/no/such/dir/h.json"], ["--json", "/no/such/dir/h.json"]),
    (["train", "--timeout", "-1"], ["--timeout", "must be > 0"]),
    (["bench", "nonsense"], ["'bench nonsense'", "not installed with the package", "python bench/NAME.py"]),
])
def test_cli_bad_arguments_are_one_line_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "error:" in last
    for w in words:
        assert w in last


def test_public_names_exist():
    for name in manualdp.__all__:
        assert hasattr(manualdp, name), name


# ------------------------------------------------------ the engine (manualdp.distributed), outside any process group

@pytest.mark.parametrize("call, error, words", [
    (lambda: spmd_allreduce([torch.ones(2)]), TypeError, "tensor must be a torch.Tensor"),
    (lambda: spmd_allreduce(torch.ones(2, dtype=torch.bool)), TypeError, "torch.bool"),
    (lambda: spmd_allreduce(torch.ones(2, dtype=torch.uint16)), TypeError,
     "torch.uint16, which torch cannot add on cpu"),
    (lambda: spmd_allreduce(torch.zeros(2, dtype=torch.float8_e4m3fn)), TypeError,
     "float8_e4m3fn, which torch cannot add"),
    (lambda: spmd_allreduce(torch.ones(1).expand(3)), ValueError, "stride 0"),
    (lambda: spmd_allreduce(torch.ones(2), "rings"), ValueError, "'rings'"),
    (lambda: spmd_allreduce(torch.ones(2), segment_bytes=0), ValueError, "segment_bytes"),
    (lambda: spmd_allreduce(torch.ones(2)), RuntimeError, "not initialised"),
    (lambda: plan(get_schedule("ring", 2), 2, 10, 1), ValueError, "rank must be an int >= 0 and <= 1, got 2"),
    (lambda: plan(get_schedule("ring", 2), 0, -1, 1), ValueError, "numel"),
    (lambda: plan(get_schedule("ring", 2), 0, 10, 0), ValueError, "segment_numel"),
    (lambda: plan("ring", 0, 10, 1), TypeError, "schedule must be a Schedule"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2).parameters()), TypeError, "module must be an nn.Module"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), algorithm="fast"), ValueError, "'fast'"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers="yes"), TypeError, "broadcast_buffers"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False)), ValueError, "no parameters"),
    (lambda: DistributedDataParallel(nn.Sequential(nn.LazyLinear(2))), ValueError, "uninitialized .* forward pass"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1]), ValueError, "device_ids"),
    (lambda: DistributedDataParallel(nn.Linear(2, 2)), RuntimeError, "not initialised"),
])
def test_bad_input_to_the_engine_is_a_clear_error(call, error, words):
    assert not dist.is_initialized()
    with pytest.raises(error, match=words):
        call()


def test_bad_input_to_the_engine_leaves_the_tensor_unchanged():
    x = torch.arange(4.0)
    with pytest.raises(ValueError):
        spmd_allreduce(x, "nope")
    assert torch.equal(x, torch.arange(4.0))


def test_a_dtype_probe_that_runs_out_of_memory_is_raised_and_not_remembered(monkeypatch):
    from manualdp import validate
    validate._adds.cache_clear()
    zeros = torch.zeros

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CPU out of memory")
    monkeypatch.setattr(torch, "zeros", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        validate.check_summable(torch.ones(2, dtype=torch.float16))
    monkeypatch.setattr(torch, "zeros", zeros)
    assert validate.check_summable(torch.ones(2, dtype=torch.float16)) is not None  # asked again, and it adds
