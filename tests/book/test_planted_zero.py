"""ZeRO's corners that planted bugs slipped past (issue 20): each test fails with one of them."""
import torch
from torch import nn

from manualdp import cpu_devices, replicate, train_batch
from manualdp.zero import ShardedOptimizer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (9,), generator=g))
            for _ in range(steps)]


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_a_loaded_state_brings_back_the_schedulers_learning_rate():
    """A resumed run steps with the lr its scheduler had reached, not the one the optimizer was built with."""
    devices = cpu_devices(3)
    first, again = replicate(_net(), devices), replicate(_net(), devices)
    zero = ShardedOptimizer(first, torch.optim.SGD, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.1)
    (X, y), (X2, y2) = _batches(2)
    train_batch(X, y, first, zero.per_device(), devices)
    scheduler.step()
    resumed = ShardedOptimizer(again, torch.optim.SGD, lr=0.1, momentum=0.9)
    for r in again:
        r.load_state_dict(first[0].state_dict())
    resumed.load_state_dict(zero.state_dict())
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in zero.param_groups] == [0.1 * 0.1]
    train_batch(X2, y2, first, zero.per_device(), devices)
    train_batch(X2, y2, again, resumed.per_device(), devices)
    torch.testing.assert_close(_flat(again[0]), _flat(first[0]), rtol=0, atol=0)


def test_a_zero_3_run_stopped_after_a_checkpoint_resumes_from_it_exactly(tmp_path):
    """The loss is called once per device: 3 devices x 7 steps + 1 stops in step 8, after the checkpoint of step 6.

    (Stopping at call 7 stops in step 3, before any checkpoint: the 'resumed' run then starts
    afresh and equals the uninterrupted one whatever the checkpoint holds.)
    """
    from tests.book.test_zero import _resume_loaders, _Stop, _StopAt, _uneven_net

    from manualdp import train
    kw = dict(optimizer=torch.optim.Adam, progress=False, nonfinite=None, zero=3)
    whole = _uneven_net()
    train(whole, *_resume_loaders(), cpu_devices(3), 2, 1e-2, log=None, **kw)
    ckpt = str(tmp_path / "ckpt")
    try:
        train(_uneven_net(), *_resume_loaders(), cpu_devices(3), 2, 1e-2, checkpoint_dir=ckpt, checkpoint_every=3,
              loss_fn=_StopAt(7 * 3 + 1), log=None, **kw)
    except _Stop:
        pass
    else:
        raise AssertionError("the run was not stopped")
    resumed, said = _uneven_net(), []
    train(resumed, *_resume_loaders(), cpu_devices(3), 2, 1e-2, checkpoint_dir=ckpt, checkpoint_every=3, resume=True,
          log=said.append, **kw)
    assert any("resumed from" in line and "step 6" in line for line in said), said
    assert torch.equal(_flat(resumed), _flat(whole)), "a resumed ZeRO-3 run differs from an uninterrupted one"
