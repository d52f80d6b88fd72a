"""The API cases: tuple and dict outputs, non-finite by default, double division, shared optimizers, dict batches,
meta tensors."""
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import allreduce, cpu_devices, evaluate, replicate, train, train_batch
from manualdp.guard import NonFiniteGradientError


class _Tuple(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.kind = nn.Linear(4, 3), kind

    def forward(self, x):
        out = self.lin(x)
        return (out, out.sum()) if self.kind == "tuple" else {"aux": out.sum(), "logits": out}


def _data(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_models_returning_a_tuple_or_dict_train_and_evaluate_like_the_plain_one(kind):
    X, y = _data()
    plain = nn.Linear(4, 3)
    wrapped = _Tuple(kind)
    plain.load_state_dict(wrapped.lin.state_dict())
    results, params = [], []
    for net, wrap in ((plain, lambda m: m), (wrapped, lambda m: m.lin)):
        replicas = replicate(net, cpu_devices(2))
        opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
        results.append(train_batch(X, y, replicas, opts, cpu_devices(2)))
        params.append([p.clone() for p in wrap(replicas[0]).parameters()])
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(*params))
    assert evaluate(wrapped, [(X, y)]) == evaluate(plain, [(X, y)])


def _loader():
    return DataLoader(TensorDataset(*_data(32)), batch_size=8)


def test_train_refuses_an_infinite_lr_and_stops_on_nan_by_default():
    with pytest.raises(ValueError, match="lr must be a positive number.*inf"):
        train(nn.Linear(4, 3), _loader(), _loader(), cpu_devices(2), 1, float("inf"), progress=False, log=None)
    X, y = _data(32)
    X[20, 1] = float("nan")  # batch 3: its gradient is NaN; without a check it would reach the parameters
    net = nn.Linear(4, 3)
    with pytest.raises(NonFiniteGradientError, match="at step 2"):
        train(net, DataLoader(TensorDataset(X, y), batch_size=8), _loader(), cpu_devices(2), 1, 0.1, progress=False,
              log=None)


class _AlwaysMean(nn.Module):
    reduction = "mean"

    def forward(self, out, y):
        return nn.functional.cross_entropy(out, y)


class _ReadsReductionButMeans(nn.CrossEntropyLoss):
    """Reads `reduction` and calls its parent: reading its source would find nothing wrong."""

    def forward(self, out, y):
        if self.reduction == "none":
            return super().forward(out, y)
        return nn.functional.cross_entropy(out, y, reduction="none").mean()  # "sum" too: a mean


class _SumsQuietly(nn.Module):
    """Honours `reduction` through a dict of options: its source never says the word."""

    def __init__(self):
        super().__init__()
        self.reduction, self.calls = "mean", 0

    def forward(self, out, y):
        self.calls += 1
        return nn.functional.cross_entropy(out, y, **{k: getattr(self, k) for k in vars(self) if k[:3] == "red"})


@pytest.mark.parametrize("mean", [_AlwaysMean, _ReadsReductionButMeans])
def test_a_custom_loss_that_ignores_reduction_is_refused_before_any_update(mean):
    X, y = _data()
    replicas = replicate(nn.Linear(4, 3), cpu_devices(2))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    before = [p.clone() for r in replicas for p in r.parameters()]
    with pytest.raises(ValueError, match=f"loss_fn {mean.__name__} ignores reduction='sum'.*honour self.reduction"):
        train_batch(X, y, replicas, opts, cpu_devices(2), mean())
    assert all(torch.equal(a, b) for a, b in zip(before, [p for r in replicas for p in r.parameters()]))
    with pytest.raises(ValueError, match="ignores reduction='sum'"):
        train(nn.Linear(4, 3), _loader(), _loader(), cpu_devices(2), 1, 0.1, loss_fn=mean(), progress=False, log=None)


def test_a_custom_loss_that_sums_is_accepted_and_called_once_per_shard():
    X, y = _data()
    replicas = replicate(nn.Linear(4, 3), cpu_devices(2))
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    loss = _SumsQuietly()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_batch(X, y, replicas, opts, cpu_devices(2), loss)
        train_batch(X, y, replicas, opts, cpu_devices(2), nn.CrossEntropyLoss())
    counting = _SumsQuietly()
    counting.reduction = "sum"
    train(nn.Linear(4, 3), _loader(), _loader(), cpu_devices(2), 1, 0.1, loss_fn=counting, progress=False, log=None)
    assert counting.calls == 4 * 2  # 4 batches, 2 shards each: the check called a copy, never the loss itself


def test_train_takes_a_loss_function_that_returns_one_loss_per_example():
    per_example = functools.partial(nn.functional.cross_entropy, reduction="none")
    nets = [nn.Linear(4, 3), nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    for net, loss in zip(nets, (per_example, nn.CrossEntropyLoss())):
        train(net, _loader(), _loader(), cpu_devices(2), 1, 0.1, loss_fn=loss, progress=False, log=None)
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


def test_one_optimizer_shared_by_two_replicas_is_refused_and_nothing_changes():
    X, y = _data()
    replicas = replicate(nn.Linear(4, 3), cpu_devices(2))
    shared = torch.optim.SGD([p for r in replicas for p in r.parameters()], lr=0.1)
    before = [p.clone() for r in replicas for p in r.parameters()]
    with pytest.raises(ValueError, match=r"optimizers\[0\] updates parameters that are not replicas\[0\]'s"):
        train_batch(X, y, replicas, [shared, shared], cpu_devices(2))
    assert all(torch.equal(a, b) for a, b in zip(before, [p for r in replicas for p in r.parameters()]))


def test_an_iterator_of_dicts_gets_a_clear_message():
    X, y = _data()
    batches = [{"image": X, "label": y}]
    with pytest.raises(TypeError,
                       match=r"train_iter must yield \(X, y\) pairs, got a dict with keys \['image', 'label'\]"):
        train(nn.Linear(4, 3), batches, [], cpu_devices(2), 1, 0.1, progress=False, log=None)
    with pytest.raises(TypeError, match=r"data_iter must yield \(X, y\) pairs, got a dict"):
        evaluate(nn.Linear(4, 3), batches)


def test_allreduce_on_cpu_and_meta_writes_nothing():
    tensors = [torch.ones(4), torch.ones(4, device="meta")]
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        allreduce(tensors)
    assert torch.equal(tensors[0], torch.ones(4))
