"""Chapter 7's exercise 3: what a resume does without the random number generators' states, with and without dropout."""
import warnings
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import manualdp
from manualdp import cpu_devices
from manualdp.support import checkpoint
from tests.helpers import Crash, CrashingLoss


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 4, (80,), generator=g))


def _run(dropout, loss_fn=None, **options):
    """Chapter 7's run: 3 epochs of 5 shuffled batches on 2 simulated devices, SGD with momentum."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1) if dropout else nn.Identity(), nn.Linear(16, 4))
    data = _data()
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
    manualdp.train(net, loader, DataLoader(data, batch_size=40), cpu_devices(2), num_epochs=3, lr=0.1, momentum=0.9,
                   loss_fn=loss_fn or nn.CrossEntropyLoss(reduction="sum"), progress=False, **options)
    return [p.detach().clone() for p in net.parameters()]


def _killed_in_step_9(dropout, ckpt):
    try:
        _run(dropout, CrashingLoss(2 * 8 + 1), checkpoint_dir=ckpt, checkpoint_every=3, log=None)
    except Crash:
        pass


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_resume_that_forgets_the_rng_is_exact_without_dropout_and_not_with_it(tmp_path):
    for dropout in (False, True):
        ckpt = str(tmp_path / f"dropout{dropout}")
        uninterrupted = _run(dropout)
        _killed_in_step_9(dropout, ckpt)
        with mock.patch.object(checkpoint, "set_rng_state", lambda state: None):  # the resume forgets the RNGs
            forgot = _run(dropout, checkpoint_dir=ckpt, checkpoint_every=3, resume=True, log=None)
        # without dropout nothing draws from torch's RNG: the loader's order has a generator of its own, restored
        assert _equal(forgot, uninterrupted) == (not dropout)
        if dropout:  # other masks: close, not equal
            assert max((p - q).abs().max().item() for p, q in zip(forgot, uninterrupted)) < 0.5
    ckpt = str(tmp_path / "remembers")
    _killed_in_step_9(True, ckpt)
    remembered = _run(True, checkpoint_dir=ckpt, checkpoint_every=3, resume=True, log=None)
    assert _equal(remembered, uninterrupted)  # the same kill, resumed with the RNGs: bitwise the uninterrupted run


def test_a_checkpoint_saved_without_rng_is_refused_saying_what_it_lacks_and_why(tmp_path):
    ckpt, save = str(tmp_path / "ckpt"), checkpoint.save_checkpoint

    def without_rng(directory, step, state, **kw):
        return save(directory, step, {k: v for k, v in state.items() if k != "rng"}, **kw)

    with mock.patch.object(checkpoint, "save_checkpoint", without_rng):
        _killed_in_step_9(True, ckpt)
    logs, counting = [], CrashingLoss(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(True, counting, checkpoint_dir=ckpt, checkpoint_every=3, resume=True, log=logs.append)
    skipped = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    assert len(skipped) == 2 and all("it lacks rng, which an exact resume needs" in m for m in skipped)
    assert logs[0].startswith("no checkpoint in") and counting.calls == 15 * 2  # the resume began again at step 0
