"""Checkpoints know whose they are: checksum, run identity, lock, orphans, write errors."""
import errno
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from manualdp import cpu_devices, train
from manualdp.support import checkpoint as ck
from manualdp.support.checkpoint import lock_path, read_checkpoint, save_checkpoint
from tests.helpers import dropout_mlp


def _loader(seed=0):
    g = torch.Generator().manual_seed(123)
    data = TensorDataset(torch.randn(70, 5, generator=g), torch.randint(0, 3, (70,), generator=g))
    return DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _run(epochs=2, net=None, **kw):
    torch.manual_seed(42)
    net = net or dropout_mlp()
    kw = {"lr": 0.1, **kw}
    history = train(net, _loader(), _loader(1), cpu_devices(2), num_epochs=epochs, momentum=0.9,
                    progress=False, log=None, **kw)
    return net, history


def _ckpts(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".pt"))


def _flip_a_bit_in_the_parameters(path):
    """Flip one mantissa bit of a weight inside the saved payload: the file still loads as torch."""
    outer = torch.load(path, weights_only=False)
    state = torch.load(io.BytesIO(outer["payload"]), weights_only=False)
    weight = state["model"]["0.weight"]
    raw = weight.view(torch.int32)
    raw.view(-1)[3] ^= 1 << 5
    buffer = io.BytesIO()
    torch.save(state, buffer)
    outer["payload"] = buffer.getvalue()  # the checksum stays the old one
    torch.save(outer, path)


def test_a_flipped_bit_falls_back_to_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    ref, ref_hist = _run(epochs=3)
    ckpt = str(tmp_path / "ckpt")
    _run(epochs=2, checkpoint_dir=ckpt)
    newest = os.path.join(ckpt, _ckpts(ckpt)[-1])
    _flip_a_bit_in_the_parameters(newest)
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        read_checkpoint(newest)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        net, hist = _run(epochs=3, checkpoint_dir=ckpt, resume=True)
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(p, q)
    assert hist.test_acc == ref_hist.test_acc


def test_a_valid_file_of_another_model_falls_back_with_a_warning(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(epochs=2, checkpoint_dir=ckpt)
    first, newest = (os.path.join(ckpt, f) for f in _ckpts(ckpt))
    other = read_checkpoint(first)
    other["model"] = dropout_mlp(hidden=7).state_dict()
    del other["path"]
    save_checkpoint(ckpt, 10**6, other)  # newest by name, valid torch, wrong content
    with pytest.warns(UserWarning, match="does not fit"):
        _, hist = _run(epochs=3, checkpoint_dir=ckpt, resume=True)
    assert len(hist.test_acc) == 3


@pytest.mark.parametrize("change, words", [
    ({"lr": 0.2}, ["lr 0.1 -> 0.2"]),
    ({"config": {"seed": 1, "batch_size": 32}}, ["batch_size None -> 32", "seed None -> 1"]),
])
def test_resume_refuses_a_changed_configuration_naming_every_option(tmp_path, change, words):
    ckpt = str(tmp_path / "ckpt")
    _run(epochs=1, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="configuration changed") as e:
        _run(epochs=2, checkpoint_dir=ckpt, resume=True, **change)
    assert all(w in str(e.value) for w in words) and "num_epochs may change" in str(e.value)
    assert "\n" not in str(e.value)


def test_resume_may_change_the_number_of_epochs(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(epochs=1, checkpoint_dir=ckpt)
    _, hist = _run(epochs=2, checkpoint_dir=ckpt, resume=True)
    assert len(hist.test_acc) == 2


def test_a_second_run_on_a_folder_in_use_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        open(lock_path(ckpt), "w").write(json.dumps({"pid": live.pid, "host": os.uname().nodename}))
        with pytest.raises(ValueError, match=f"in use by process {live.pid}"):
            _run(epochs=1, checkpoint_dir=str(ckpt))
        assert _ckpts(ckpt) == []
    finally:
        live.kill()
        live.wait()
    # Now the lock is a dead run's: it is taken over, and released at the end.
    with pytest.warns(UserWarning, match="stale lock"):
        _run(epochs=1, checkpoint_dir=str(ckpt))
    assert len(_ckpts(ckpt)) == 1 and not os.path.exists(lock_path(ckpt))


def test_orphan_temporary_files_are_removed_on_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    _run(epochs=1, checkpoint_dir=str(ckpt))
    orphan = ckpt / "ckpt-00000009.pt.abc123.tmp"
    orphan.write_bytes(b"x" * 1000)
    _run(epochs=2, checkpoint_dir=str(ckpt), resume=True)
    assert not orphan.exists()


def test_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        save_checkpoint(str(tmp_path), 3, {"x": torch.ones(3)})
    assert str(tmp_path / "ckpt-00000003.pt") in str(e.value) and "No space left on device" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_ctrl_c_while_a_checkpoint_is_written_ends_after_it_is_whole(tmp_path, monkeypatch):
    # CI saw Ctrl-C land inside torch's zip writer: its own "unexpected pos" error replaced the KeyboardInterrupt
    # (a traceback, exit status 1, instead of `manualdp train`'s line naming the checkpoint `--resume` continues from)
    import signal

    real_save, calls = torch.save, []

    def save_with_ctrl_c(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second save writes the file: Ctrl-C arrives in the middle of it
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save_with_ctrl_c)
    state = {"w": torch.arange(6.0)}
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 4, state)
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert len(calls) == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert torch.equal(read_checkpoint(ck.checkpoint_path(str(tmp_path), 4))["w"], state["w"])
