"""The refusals of replica groups, each one line: an id taken twice, a group that lost a rank, a group of another size.

In this process, over in-process coordinators (a few seconds): the command line's status for a replica id
started twice (2, as every other refusal of a newcomer), and the lines themselves.
"""
import pytest
import torch

from manualdp.runners.cli import main
from manualdp.spmd.ft import Coordinator, Manager
from manualdp.spmd.ft.admission import Misfit


@pytest.fixture(scope="module")
def coordinator():
    with Coordinator(0) as c:
        yield c


def test_a_replica_id_taken_by_a_live_replica_is_a_misfit_naming_it(coordinator):
    with Manager("twin", "127.0.0.1", coordinator.port, timeout=5):
        with pytest.raises(Misfit, match=r"^replica_id 'twin' is already taken by a live replica .*: give each "
                                         r"replica its own id, or stop the other first$"):
            Manager("twin", "127.0.0.1", coordinator.port, timeout=5)


def test_the_command_line_refuses_a_replica_id_taken_with_status_2_in_one_line(coordinator, capsys):
    threads = torch.get_num_threads()
    with Manager("a", "127.0.0.1", coordinator.port, timeout=5):
        try:
            code = main(["train", "--fault-tolerant", f"127.0.0.1:{coordinator.port}", "--replica-id", "a",
                         "--timeout", "5", "--num-train", "64", "--num-test", "32", "--batch-size", "32",
                         "--epochs", "1", "--model", "mlp", "--no-progress"])
        finally:
            torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("manualdp train: error: replica_id 'a' is already taken") and "own id" in last, last
