"""`manualdp coordinator` and `manualdp train --fault-tolerant`: what they refuse, and a quick run with a kill.

A run by the commands with a replica killed and started again: chapter 8 of the book (3 replicas,
tests/test_book.py) and test_ft_cli_rejoin.py (3 and 2 replicas, soak: bench/soak_tests.sh).
"""
import socket

import pytest
import torch

from manualdp.runners.cli import main
from manualdp.runners.ft_train import check_replica_id, parse_address

FT = ["train", "--fault-tolerant", "127.0.0.1:29510", "--replica-id", "a"]


@pytest.mark.parametrize("argv, words", [
    (["train", "--fault-tolerant", "localhost"], ["--fault-tolerant", "HOST:PORT", "'localhost'"]),
    (["train", "--fault-tolerant", ":29510"], ["--fault-tolerant", "a host", "':29510'"]),
    (["train", "--fault-tolerant", "h:port"], ["--fault-tolerant", "port number", "'h:port'"]),
    (["train", "--fault-tolerant", "h:70000"], ["--fault-tolerant", "from 1 to 65535", "70000"]),
    (["train", "--fault-tolerant", "h:0"], ["--fault-tolerant", "from 1 to 65535", "got 0"]),
    ([*FT[:3], "--replica-id", ""], ["--replica-id", "non-empty", "''"]),
    ([*FT[:3], "--replica-id", "a b"], ["--replica-id", "'a b'"]),
    ([*FT, "--min-replicas", "0"], ["--min-replicas", "from 1", "got 0"]),
    ([*FT, "--min-replicas", "two"], ["--min-replicas", "'two'"]),
    (FT[:3], ["--fault-tolerant needs --replica-id"]),
    (["train", "--replica-id", "a"], ["--replica-id need --fault-tolerant"]),
    (["train", "--min-replicas", "2"], ["--min-replicas need --fault-tolerant"]),
    ([*FT, "--zero", "1"], ["--zero with --fault-tolerant"]),
    # a group of one rank is a one-process replica: --zero 3 is told what it needs, not only that it is refused
    ([*FT, "--zero", "3"], ["--zero with --fault-tolerant", "replica of one process", "--nproc-per-node 2 or more"]),
    ([*FT, "--devices", "2"], ["--devices with --fault-tolerant", "one process and one device"]),
    ([*FT, "--algorithm", "auto"], ["--algorithm auto with --fault-tolerant"]),
    ([*FT, "--checkpoint-dir", "c", "--checkpoint-every", "2"], ["--checkpoint-every with --fault-tolerant"]),
    ([*FT, "--checkpoint-dir", "c", "--resume"], ["--resume with --fault-tolerant", "by itself"]),
    ([*FT, "--bucket-mb", "1"], ["--bucket-mb with --fault-tolerant"]),
    ([*FT, "--local-sgd", "0"], ["--local-sgd", "must be > 0", "0"]),
    ([*FT, "--diloco", "x"], ["--diloco", "'x'"]),
    ([*FT, "--local-sgd", "2", "--diloco", "2"], ["--diloco", "not allowed with", "--local-sgd"]),
    (["train", "--diloco", "2"], ["--diloco need --fault-tolerant"]),
    ([*FT, "--outer-lr", "0.5"], ["--outer-lr 0.5 needs --diloco"]),
    ([*FT, "--local-sgd", "2", "--outer-momentum", "0.5"], ["--outer-momentum 0.5 needs --diloco"]),
    ([*FT, "--diloco", "2", "--outer-momentum", "1"], ["--outer-momentum", "below 1", "got 1"]),
    ([*FT, "--diloco", "2", "--outer-lr", "-1"], ["--outer-lr", "> 0", "-1"]),
    (["coordinator", "--port", "65536"], ["--port", "from 0 to 65535", "65536"]),
    (["coordinator", "--port", "x"], ["--port", "'x'"]),
    (["coordinator"], ["--port"]),
])
def test_the_fault_tolerant_options_are_refused_in_one_line_naming_the_argument_and_value(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert "error:" in last and all(w in last for w in words), last


def test_parse_address_and_replica_id():
    assert parse_address("127.0.0.1:29510") == ("127.0.0.1", 29510)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("", "host", "host:", ":1", "h:-1", "h:1.5", "h:65536", None):
        with pytest.raises(ValueError, match="HOST:PORT|port"):
            parse_address(bad)
    assert check_replica_id("node-3") == "node-3"
    for bad in ("", "a/b", " ", None):
        with pytest.raises(ValueError, match="non-empty name"):
            check_replica_id(bad)


def test_a_replica_with_no_coordinator_fails_in_one_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = torch.get_num_threads()
    try:
        code = main(["train", "--fault-tolerant", f"127.0.0.1:{port}", "--replica-id", "a", "--timeout", "1",
                     "--num-train", "64", "--num-test", "32", "--batch-size", "32", "--epochs", "1", "--model", "mlp",
                     "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"manualdp train: error: replica 'a': cannot reach the coordinator at 127.0.0.1:{port}")


@pytest.mark.parametrize("kwargs, words", [
    ({"sync": "fedavg"}, ["sync must be one of", "'fedavg'"]),
    ({"sync": "ddp", "sync_every": 3}, ["sync_every must be 1 for sync='ddp'", "3"]),
    ({"sync": "local_sgd", "sync_every": 0}, ["sync_every", "positive int", "0"]),
    ({"sync": "diloco", "sync_every": 2, "outer_lr": float("inf")}, ["outer_lr", "inf"]),
    ({"sync": "diloco", "sync_every": 2, "outer_momentum": 1.5}, ["outer_momentum", "1.5"]),
])
def test_train_replica_refuses_a_bad_sync_in_one_line_before_it_trains(kwargs, words):
    from manualdp.runners.ft_train import train_replica
    from manualdp.spmd.ft import Coordinator, Manager

    net = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8).long()),
                                         batch_size=4)
    before = [p.detach().clone() for p in net.parameters()]
    coordinator = Coordinator(0)
    try:
        with Manager("a", "127.0.0.1", coordinator.port, timeout=5) as manager:
            with pytest.raises(ValueError) as info:
                train_replica(net, loader, loader, 1, 0.1, manager, progress=False, log=None, **kwargs)
            assert manager.step == 0 and manager.quorum is None  # refused before asking for a quorum
    finally:
        coordinator.close()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
