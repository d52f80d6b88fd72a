"""The refusals of replica groups, each one line: an id taken twice, a group that lost a rank, a group of another size.

In this process, over in-process coordinators (a few seconds): the command line's status for a replica id
started twice (2, as every other refusal of a newcomer), and the lines themselves.
"""
import pytest
import torch

from manualdp.runners.cli import main
from manualdp.spmd.ft import Coordinator, Manager
from manualdp.spmd.ft.admission import Misfit, canonical, check, differences, publish
from manualdp.spmd.ft.group import GroupBroken, GroupManager
from manualdp.spmd.ft.group_lanes import gloo_words


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


def _one_process_settings(coordinator, lr=0.1):
    """What a one-process replica of the command line requires of the run (its runner's, its method's, its SGD's)."""
    from manualdp.runners.ft_train import shared_settings
    from manualdp.spmd.ft.ddp import optimizer_settings

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 2)), batch_size=32)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=lr)
    with Manager("one", "127.0.0.1", coordinator.port, timeout=5) as manager:
        return {**shared_settings(manager, loader, 1, RUN), "method": "ddp", **optimizer_settings(sgd)}


RUN = {"model": "mlp", "dataset": "fashion_mnist", "num_train": 64, "num_test": 32, "batch_size": 32, "seed": 0}


def _group_settings(size, lr=0.1):
    """What a replica group of `size` ranks of the command line requires (ft_group_train's, and GroupManager's)."""
    return {"num_epochs": 1, "batch_size": 32, "lr": lr, "optimizer": "SGD", "guard": True, **RUN, "group_size": size}


def test_a_group_against_one_process_replicas_is_told_the_size_only(coordinator):
    one = _one_process_settings(coordinator)
    assert differences(_group_settings(2), one) == "group_size 2 != (one process)"
    assert differences(one, _group_settings(2)) == "group_size (one process) != 2"


def test_a_group_of_another_size_is_told_the_size_and_the_real_differences(coordinator):
    assert differences(_group_settings(2), _group_settings(1)) == "group_size 2 != 1"
    assert differences(_group_settings(3, lr=0.2), _group_settings(2)) == "group_size 3 != 2, lr 0.2 != 0.1"
    assert differences(_group_settings(2, lr=0.2), _one_process_settings(coordinator)) == \
        "group_size 2 != (one process), lr 0.2 != 0.1"
    assert differences(_group_settings(2, lr=0.2), _group_settings(2)) == "lr 0.2 != 0.1"  # same size: as before


def test_a_group_size_misfit_is_refused_in_one_line_naming_the_size(store):
    s = store()
    publish(s, "one", canonical(_group_settings(1)))
    with pytest.raises(Misfit) as info:
        check(s, "B", canonical(_group_settings(2)))
    assert str(info.value).startswith("replica 'B' refused by the run: group_size 2 != 1: start it with the run's")


# gloo's words when a peer's process died (torch 2.13), and a timeout's, several lines with a C++ trace
CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
          "[127.0.0.1]:31939. This is typically caused by a remote worker crashing. Check the logs of the remote "
          "worker before reporting an error. GLHF!")
TIMED_OUT = ("\n[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv "
             "operation to complete\nException raised from wait at unbound_buffer.cc:81 (most recent call first):\n"
             "frame #0: c10::Error::Error(...)\nframe #1: gloo::transport::tcp::UnboundBuffer::waitRecv(...)")


class _NoLane:
    def drop(self):
        pass


def _broken_on(rank, size, step, error):
    """What `GroupManager._broken` returns on `rank` of a group of `size` at `step` (a rank without a leader's role)."""
    manager = object.__new__(GroupManager)  # the line alone: no process group, no coordinator
    manager.id, manager.rank, manager.size, manager.step = "A", rank, size, step
    manager._lane, manager._manager, manager._in_step = _NoLane(), None, True
    return manager._broken(error)


@pytest.mark.parametrize("message, tail", [(CLOSED, "gloo: Connection closed by peer [127.0.0.1]:31939)"),
                                           (TIMED_OUT, "gloo: Timed out waiting 60000ms for recv operation to "
                                                       "complete)")])
def test_group_broken_is_one_line_naming_the_group_rank_step_and_lost_rank(message, tail):
    error = _broken_on(1, 2, 7, RuntimeError(message))
    assert isinstance(error, GroupBroken)
    line = str(error)
    assert "\n" not in line and "GLHF" not in line and "frame #" not in line and ".cc:" not in line, line
    assert line.startswith("replica group 'A', rank 1: another rank of the group failed at step 7 (rank 0 of 2; "), line
    assert tail in line and line.endswith("the group left the quorum as a whole: start all its ranks again"), line
    assert len(line) < 240, line


def test_group_broken_in_a_larger_group_names_no_rank_it_cannot_know():
    line = str(_broken_on(0, 4, 3, RuntimeError(CLOSED)))
    assert line.startswith("replica group 'A', rank 0: another rank of the group failed at step 3 (gloo: "), line


def test_gloo_words_keep_a_short_first_sentence():
    assert gloo_words(RuntimeError(CLOSED)) == "Connection closed by peer [127.0.0.1]:31939"
    assert gloo_words(RuntimeError("")) == "RuntimeError"
    long = gloo_words(RuntimeError("x" * 500))
    assert len(long) == 80 and long.endswith("...")
