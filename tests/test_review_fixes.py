"""Edge cases found in review: each test fails on the code as it was before the fix."""
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import allreduce, broadcast, cpu_devices, replicate, train, train_batch
from manualdp.allreduce import run_schedule
from manualdp.support.checkpoint import load_latest, save_checkpoint
from manualdp.runners.cli import main
from manualdp.schedule import ring


def _net(bn=False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers).double()


def _data(n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _step(n, loss_fn=None, net=None, **kw):
    devices = cpu_devices(n)
    replicas = replicate(net or _net(), devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in replicas]
    X, y = _data()
    result = train_batch(X, y, replicas, opts, devices, loss_fn, **kw)
    return replicas, result


def test_plain_loss_function_returning_a_mean_is_refused():
    with pytest.raises(ValueError, match=r"loss_fn must return one loss per example \(shape \(\d+,\)\), got \(\)"):
        _step(3, F.cross_entropy)


def test_plain_loss_function_with_per_example_losses_equals_the_module():
    per_example = functools.partial(F.cross_entropy, reduction="none")
    a, _ = _step(3, per_example)
    b, _ = _step(3, nn.CrossEntropyLoss())
    one, _ = _step(1)
    for p, q, r in zip(a[0].parameters(), b[0].parameters(), one[0].parameters()):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)


class Poison(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == 2 else x


def test_skipped_step_restores_batchnorm_statistics():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), Poison(), nn.Linear(8, 3)).double()
    devices = cpu_devices(2)
    replicas = replicate(net, devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5) for r in replicas]
    X, y = _data()
    train_batch(X, y, replicas, opts, devices)  # replica 1 calls Poison once here
    before = [b.clone() for b in replicas[0].buffers()]
    result = train_batch(X, y, replicas, opts, devices, nonfinite="skip")  # replica 1's 2nd call is NaN
    assert result.skipped
    for r in replicas:
        for b, saved in zip(r.buffers(), before):
            assert torch.equal(b, saved)
    assert all(torch.isfinite(b.float()).all() for r in replicas for b in r.buffers())


def test_buffers_including_integer_ones_are_identical_after_a_step():
    replicas, _ = _step(3, net=_net(bn=True))
    bn = [r[1] for r in replicas]
    for other in bn[1:]:
        assert torch.equal(other.num_batches_tracked, bn[0].num_batches_tracked)
        assert torch.equal(other.running_mean, bn[0].running_mean)


def test_short_last_batch_is_skipped_with_a_message():
    X, y = _data(33)
    loader = DataLoader(TensorDataset(X, y), batch_size=8)  # last batch: 1 example, 4 devices
    messages = []
    net = _net()
    before = [p.clone() for p in net.parameters()]
    history = train(net, loader, loader, cpu_devices(4), 1, 0.1, progress=False, log=messages.append)
    assert any("skipped a batch of 1, fewer examples than the 4 devices" in m for m in messages)
    assert history.config and len(history.train_loss) == 1
    assert any(not torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_empty_training_loader_is_an_error():
    with pytest.raises(ValueError, match="train_iter gave no usable batch in epoch 1"):
        train(_net(), [], [], cpu_devices(2), 1, 0.1, progress=False, log=None)


def test_unused_parameter_keeps_no_gradient_and_does_not_move():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    net = Two().double()
    devices = cpu_devices(2)
    replicas = replicate(net, devices)
    opts = [torch.optim.SGD(r.parameters(), lr=0.5, weight_decay=0.1) for r in replicas]
    X, y = _data()
    train_batch(X, y, replicas, opts, devices)
    for r in replicas:
        assert r.unused.weight.grad is None
        assert torch.equal(r.unused.weight, net.unused.weight)  # weight decay must not touch it


def test_stale_checkpoints_are_refused_unless_resuming(tmp_path):
    save_checkpoint(str(tmp_path), 12, {"run": "old"})
    X, y = _data(16)
    loader = DataLoader(TensorDataset(X, y), batch_size=8)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(_net(), loader, loader, cpu_devices(2), 1, 0.1, checkpoint_dir=str(tmp_path), progress=False, log=None)


def test_saving_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (8, 12):
        save_checkpoint(str(tmp_path), step, {"run": "old"})
    path = save_checkpoint(str(tmp_path), 4, {"run": "new"}, keep=2)
    assert os.path.exists(path)


def test_sparse_gradients_get_a_clear_error():
    t = [torch.zeros(4).to_sparse(), torch.zeros(4).to_sparse()]
    with pytest.raises(TypeError, match="dense tensors only"):
        allreduce(t)


@pytest.mark.parametrize("device, match", [("cuda:0", "GPU"), ("meta", "'meta'")])
def test_devices_that_do_not_exist_are_refused(device, match):
    if device.startswith("cuda") and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=match):
        replicate(nn.Linear(2, 2), ["cpu", device])


def test_run_schedule_validates_its_tensors():
    tensors = [torch.ones(4), torch.ones(6)]
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(6,\)"):
        run_schedule(ring(2), tensors)
    assert torch.equal(tensors[0], torch.ones(4))


def test_broadcast_checks_shapes_before_writing():
    tensors = [torch.ones(3), torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"tensors\[2\] has shape \(4,\)"):
        broadcast(tensors)
    assert torch.equal(tensors[1], torch.zeros(3))
    with pytest.raises(ValueError, match="src must index tensors"):
        broadcast(tensors[:2], src=True)


@pytest.mark.parametrize("argv, words", [
    (["train", "--plot", "curves.pdf"], ["--plot", "must end in .png"]),
    (["train", "--json", "."], ["--json", "is a directory"]),
    (["train", "--devices", "4", "--batch-size", "2"], ["--batch-size 2", "4 devices"]),
])
def test_cli_refuses_before_training(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for w in words:
        assert w in err


def test_cli_refuses_a_checkpoint_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(SystemExit):
        main(["train", "--checkpoint-dir", str(f)])
    assert "is not a folder" in capsys.readouterr().err
