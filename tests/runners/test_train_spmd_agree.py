"""Ranks that part ways are told why, on every rank: a full disk on one of them, settings that differ."""
import errno
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp.spmd import launch


def _data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                      batch_size=8)


def _train_with_a_full_disk_on_rank0(ckpt):
    from manualdp.runners.loop import train_spmd
    from manualdp.support import checkpoint as ck
    if dist.get_rank() == 0:
        real, calls = ck.atomic_write, []

        def filling(path, mode="wb"):  # the second checkpoint (end of epoch 2) finds the disk full
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(path, mode)
        ck.atomic_write = filling
    torch.manual_seed(0)
    try:
        train_spmd(nn.Linear(4, 2), _data(), _data(), 3, 0.1, checkpoint_dir=ckpt, timeout=20, progress=False,
                   log=None)
    except Exception as e:
        history = getattr(e, "history", None)  # the epochs finished so far, for the CLI to save
        return type(e).__name__, getattr(e, "errno", None), str(e), history and len(history.train_loss)
    return None


def test_a_full_disk_on_one_rank_is_named_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for rank, (kind, code, message, epochs) in enumerate(launch(_train_with_a_full_disk_on_rank0, 2, (ckpt,),
                                                                timeout=60)):
        assert kind == "OSError" and code == errno.ENOSPC, (rank, kind, message)
        assert "No space left on device" in message and os.path.join(ckpt, "rank0") in message, (rank, message)
        assert epochs == (2 if rank == 0 else 0)  # rank 0 recorded its epochs (rank 1's History is not kept)


def _train_with_settings_that_differ():
    import functools

    from manualdp.runners.loop import train_spmd
    rank = dist.get_rank()
    adam = functools.partial(torch.optim.Adam, betas=(0.9, 0.99 - 0.09 * rank))
    torch.manual_seed(0)
    try:
        train_spmd(nn.Linear(4, 2), _data(), _data(), 1, 0.1 * (rank + 1), optimizer=adam, timeout=20,
                   progress=False, log=None)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_given_different_learning_rates_or_betas_are_found_on_every_rank():
    for message in launch(_train_with_settings_that_differ, 2, timeout=60):
        assert message is not None and "training setup differs across ranks" in message
        assert "lr 0.1..0.2 (per rank: 0.1, 0.2)" in message, message
        assert "betas (group 0) [0.9 0.9]..[0.9 0.99] (per rank: [0.9 0.99], [0.9 0.9])" in message, message
