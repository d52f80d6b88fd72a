import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import cpu_devices, train
from manualdp.support.checkpoint import load_latest, save_checkpoint
from manualdp.guard import NonFiniteGradientError
from tests.helpers import Crash, CrashingLoss, dropout_mlp


def _loader(seed=0):
    g = torch.Generator().manual_seed(123)
    data = TensorDataset(torch.randn(70, 5, generator=g), torch.randint(0, 3, (70,), generator=g))
    return DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _run(tmp_path, n, **kw):
    torch.manual_seed(42)  # dropout draws from the global RNG: resume must restore it
    net = dropout_mlp()
    history = train(net, _loader(), _loader(1), cpu_devices(n), num_epochs=3, lr=0.1, momentum=0.9,
                    progress=False, log=None, **kw)
    return net, history


@pytest.mark.parametrize("n, crash_step", [(1, 7), (3, 11), (2, 5)])  # 5 batches per epoch
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, n, crash_step):
    ref, ref_hist = _run(tmp_path, n)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Crash):
        _run(tmp_path, n, checkpoint_dir=ckpt, checkpoint_every=3, loss_fn=CrashingLoss(crash_step * n + 1))
    # the newest checkpoint: every 3 steps, and at each epoch end (5 batches per epoch)
    assert load_latest(ckpt)["global_step"] == max(crash_step // 3 * 3, crash_step // 5 * 5)
    counting = CrashingLoss(at=None)
    net, hist = _run(tmp_path, n, checkpoint_dir=ckpt, checkpoint_every=3, resume=True, loss_fn=counting)
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(p, q)
    assert hist.train_loss == ref_hist.train_loss
    assert hist.test_acc == ref_hist.test_acc
    # it continued: only the steps after the checkpoint ran again (3 epochs of 5 batches, n shards each)
    resumed_at = max(crash_step // 3 * 3, crash_step // 5 * 5)
    assert counting.calls == (15 - resumed_at) * n


def test_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path):
    ref, _ = _run(tmp_path, 2)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Crash):
        _run(tmp_path, 2, checkpoint_dir=ckpt, checkpoint_every=2, loss_fn=CrashingLoss(9 * 2 + 1))
    newest = sorted(os.listdir(ckpt))[-1]
    with open(os.path.join(ckpt, newest), "r+b") as f:  # a kill in the middle of writing it
        f.truncate(100)
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        net, _ = _run(tmp_path, 2, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(p, q)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), 1, {"x": torch.ones(3)})

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(str(tmp_path), 2, {"x": torch.zeros(3)})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.pt"]
    assert torch.equal(load_latest(str(tmp_path))["x"], torch.ones(3))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in range(5):
        save_checkpoint(str(tmp_path), step, {"step": step}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000003.pt", "ckpt-00000004.pt"]
    assert load_latest(str(tmp_path))["step"] == 4


class PoisonAt(nn.Module):
    """Identity, except that on call `at` it makes the gradient of `weight` NaN."""

    def __init__(self, at):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5))
        self.calls, self.at = 0, at

    def forward(self, x):
        self.calls += 1
        scale = torch.tensor(float("nan")) if self.calls == self.at else torch.tensor(1.0)
        return x * (self.weight * scale)


def _poisoned(at):
    torch.manual_seed(0)
    return nn.Sequential(PoisonAt(at), nn.Linear(5, 3))


def test_nonfinite_gradient_raise_names_parameter_and_step(tmp_path):
    # replica 1 of 2 is poisoned on its 4th forward: step 3 (counting from 0)
    net = _poisoned(at=10**9)
    net_b = _poisoned(at=4)
    from manualdp import replicate, train_batch
    devices = cpu_devices(2)
    replicas = [replicate(net, devices[:1])[0], replicate(net_b, devices[:1])[0]]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    X, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    before = None
    with pytest.raises(NonFiniteGradientError, match=r"parameter '0.weight' at step 3"):
        for step in range(6):
            before = [p.detach().clone() for p in replicas[0].parameters()]
            train_batch(X, y, replicas, opts, devices, nonfinite="raise", step=step)
    for p, b in zip(replicas[0].parameters(), before):  # the bad step changed nothing
        assert torch.equal(p, b)


def test_nonfinite_gradient_skip_skips_the_update_on_every_replica(tmp_path):
    from manualdp import replicate, train_batch
    devices = cpu_devices(2)
    replicas = [replicate(_poisoned(10**9), devices[:1])[0], replicate(_poisoned(2), devices[:1])[0]]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    X, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    skipped = []
    for step in range(3):
        before = [[p.detach().clone() for p in r.parameters()] for r in replicas]
        result = train_batch(X, y, replicas, opts, devices, nonfinite="skip", step=step)
        skipped.append(result.skipped)
        changed = [any(not torch.equal(p, b) for p, b in zip(r.parameters(), bs)) for r, bs in zip(replicas, before)]
        assert changed == [not result.skipped] * 2
    assert skipped == [False, True, False]
    for p, q in zip(replicas[0].parameters(), replicas[1].parameters()):
        assert torch.equal(p, q) and torch.isfinite(p).all()


def test_checkpoint_options_need_a_directory():
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        train(dropout_mlp(), [], [], cpu_devices(1), 1, 0.1, resume=True, progress=False, log=None)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int or None, got 0"):
        train(dropout_mlp(), [], [], cpu_devices(1), 1, 0.1, checkpoint_dir="x", checkpoint_every=0, progress=False,
              log=None)


def test_mid_epoch_and_end_of_epoch_checkpoints_of_one_step_are_both_kept(tmp_path):
    # step 4 ends an epoch and is a multiple of checkpoint_every: two different states
    save_checkpoint(str(tmp_path), 4, {"which": "mid"})
    save_checkpoint(str(tmp_path), 4, {"which": "end"}, end_of_epoch=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004-epoch.pt", "ckpt-00000004.pt"]
    assert load_latest(str(tmp_path))["which"] == "end"
    save_checkpoint(str(tmp_path), 6, {"which": "later"})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004-epoch.pt", "ckpt-00000006.pt"]


def test_resume_with_no_checkpoint_says_so(tmp_path):
    logs = []
    torch.manual_seed(42)
    train(dropout_mlp(), _loader(), _loader(1), cpu_devices(2), 1, 0.1, checkpoint_dir=str(tmp_path / "none"),
          resume=True, progress=False, log=logs.append)
    assert logs[0].startswith("no checkpoint in") and "starting from the beginning" in logs[0]


def test_torchrun_checkpoints_are_not_resumed_by_a_single_process(tmp_path):
    os.makedirs(tmp_path / "rank0")
    with pytest.raises(ValueError, match="holds torchrun checkpoints"):
        train(dropout_mlp(), _loader(), _loader(1), cpu_devices(2), 1, 0.1, checkpoint_dir=str(tmp_path), resume=True,
              progress=False, log=None)


# ---------------------------------------------------------------- edge cases found in review

def test_stale_checkpoints_are_refused_unless_resuming(tmp_path):
    save_checkpoint(str(tmp_path), 12, {"run": "old"})
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(dropout_mlp(), _loader(), _loader(1), cpu_devices(2), 1, 0.1, checkpoint_dir=str(tmp_path),
              progress=False, log=None)


def test_saving_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (8, 12):
        save_checkpoint(str(tmp_path), step, {"run": "old"})
    path = save_checkpoint(str(tmp_path), 4, {"run": "new"}, keep=2)
    assert os.path.exists(path)


@pytest.mark.parametrize("before, after, option", [
    (dict(optimizer=torch.optim.Adam), dict(optimizer=torch.optim.AdamW), "optimizer 'Adam' -> 'AdamW'"),
    (dict(), dict(optimizer=torch.optim.Adam), "optimizer 'SGD' -> 'Adam'"),
    (dict(zero=1), dict(), "zero 1 -> None"),
    (dict(), dict(zero=2), "zero None -> 2"),
    (dict(zero=1), dict(zero=2), "zero 1 -> 2"),
])
def test_resume_refuses_a_changed_optimizer_or_zero_stage_in_one_line(tmp_path, before, after, option):
    from manualdp.support.checkpoint import ConfigChanged
    ckpt = str(tmp_path / "ckpt")
    train(dropout_mlp(), _loader(), _loader(1), cpu_devices(2), num_epochs=1, lr=0.01, progress=False, log=None,
          checkpoint_dir=ckpt, **before)
    files = {f: os.path.getmtime(os.path.join(ckpt, f)) for f in os.listdir(ckpt)}
    net = dropout_mlp()
    with pytest.raises(ConfigChanged) as e:
        train(net, _loader(), _loader(1), cpu_devices(2), num_epochs=2, lr=0.01, progress=False, log=None,
              checkpoint_dir=ckpt, resume=True, **after)
    assert option in str(e.value) and "\n" not in str(e.value)
    assert {f: os.path.getmtime(os.path.join(ckpt, f)) for f in os.listdir(ckpt)} == files
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), dropout_mlp().parameters()))


def test_a_resume_keeps_the_run_id_of_the_first_start(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Crash):
        _run(tmp_path, 2, checkpoint_dir=ckpt, checkpoint_every=2, loss_fn=CrashingLoss(5 * 2 + 1))
    first = load_latest(ckpt)["identity"]["run_id"]
    _run(tmp_path, 2, checkpoint_dir=ckpt, checkpoint_every=2, resume=True)
    assert load_latest(ckpt)["global_step"] == 15
    assert load_latest(ckpt)["identity"]["run_id"] == first
