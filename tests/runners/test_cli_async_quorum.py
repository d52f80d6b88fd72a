"""`manualdp train --fault-tolerant ... --async-quorum`: the flag reaches the replica's Manager, or is refused."""
import pytest
import torch

from manualdp.runners.cli import main

TRAIN = ["train", "--num-train", "64", "--num-test", "32", "--batch-size", "32", "--epochs", "1", "--model", "mlp",
         "--no-progress"]


class _Seen(ConnectionError):
    """Raised by the fake Manager: the replica stops there, in one line, before it trains."""


@pytest.mark.parametrize("flag, expected", [([], False), (["--async-quorum"], True)])
def test_the_async_quorum_flag_reaches_the_manager(monkeypatch, capsys, flag, expected):
    import manualdp.spmd.ft as ft

    seen = {}

    def fake_manager(*args, **kwargs):
        seen.update(kwargs)
        raise _Seen("no coordinator here (a test's fake Manager)")

    monkeypatch.setattr(ft, "Manager", fake_manager)
    threads = torch.get_num_threads()
    try:
        code = main([*TRAIN, "--fault-tolerant", "127.0.0.1:1", "--replica-id", "a", "--timeout", "1", *flag])
    finally:
        torch.set_num_threads(threads)
    assert code == 1 and seen["async_quorum"] is expected
    assert "a test's fake Manager" in capsys.readouterr().err


def test_the_async_quorum_flag_without_fault_tolerance_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main([*TRAIN, "--async-quorum"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--async-quorum need --fault-tolerant HOST:PORT" in err[-1], err


def test_the_help_says_what_async_quorum_does(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--async-quorum" in capsys.readouterr().out
