"""train_spmd: the torchrun training path equals the single-controller loop on as many devices."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import cpu_devices, train
from manualdp.runners.loop import train_spmd
from manualdp.spmd import init_from_env, launch
from tests.helpers import seeded_bn_mlp

EPOCHS, LR, MOMENTUM = 2, 0.2, 0.9


def _loaders():
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(80, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (80,), generator=g)
    # 60 examples in batches of 17: uneven shards (9 and 8) and a short last batch (9: 5 and 4).
    train_iter = DataLoader(TensorDataset(X[:60], y[:60]), batch_size=17, shuffle=True,
                            generator=torch.Generator().manual_seed(4))
    return train_iter, DataLoader(TensorDataset(X[60:], y[60:]), batch_size=7)


def _train_two_ranks():
    assert not torch.distributed.is_initialized()
    device = init_from_env(timeout=60)  # from the RANK, WORLD_SIZE, MASTER_* variables, as under torchrun
    net = seeded_bn_mlp()
    history = train_spmd(net, *_loaders(), EPOCHS, LR, momentum=MOMENTUM, bucket_cap_mb=0.0002,
                         progress=False, log=None)
    return {"device": device, "history": history, "state": net.state_dict(),
            "params": [p.detach().clone() for p in net.parameters()]}


def test_train_spmd_on_two_ranks_equals_train_on_two_devices():
    ranks = launch(_train_two_ranks, 2, init=False, timeout=120)
    net = seeded_bn_mlp()
    expected = train(net, *_loaders(), cpu_devices(2), EPOCHS, LR, momentum=MOMENTUM, progress=False, log=None)

    assert ranks[0]["device"] == torch.device("cpu")
    assert ranks[1]["history"] is None, "only rank 0 reports"
    got = ranks[0]["history"]
    for field in ("train_loss", "train_acc", "test_acc"):
        assert len(getattr(got, field)) == EPOCHS
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=0, atol=1e-10)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=0, atol=1e-10, msg=name)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q), "ranks ended with different parameters"
    assert not torch.equal(ranks[0]["params"][0], seeded_bn_mlp()[0].weight), "training did not move the parameters"


@pytest.mark.parametrize("args, kwargs, error, words", [
    (("net",), {}, TypeError, "net must be an nn.Module"),
    ((nn.Linear(2, 2), [], [], 0, 0.1), {}, ValueError, "num_epochs"),
    ((nn.Linear(2, 2), [], [], 1, -1.0), {}, ValueError, "lr"),
    ((nn.Linear(2, 2), [], [], 1, 0.1), {"algorithm": "star"}, ValueError, "'star'"),
    ((nn.Linear(2, 2), [], [], 1, 0.1), {"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb"),
    ((nn.Linear(2, 2), [], [], 1, 0.1), {}, RuntimeError, "init_from_env"),
])
def test_train_spmd_rejects_bad_arguments(args, kwargs, error, words):
    args = args + (None,) * (5 - len(args))
    with pytest.raises(error, match=words):
        train_spmd(*args, **kwargs)
