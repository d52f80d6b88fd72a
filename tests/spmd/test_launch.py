"""Starting ranks: joining torchrun's group (init_from_env), ranks on this machine (launch), each rank's shard."""
import pytest
import torch
from hypothesis import given, strategies as st

from manualdp.spmd import init_from_env, launch, shard
from manualdp.split import split_batch


def test_init_from_env_outside_torchrun_says_so(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_from_env()


@pytest.mark.parametrize("kwargs, words", [
    ({"backend": "mpi2"}, "backend"), ({"timeout": 0}, "timeout"), ({"timeout": "10"}, "timeout"),
])
def test_init_from_env_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        init_from_env(**kwargs)


def _sleep_forever():
    import time
    time.sleep(600)


def test_launch_kills_ranks_that_do_not_finish():
    import time
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        launch(_sleep_forever, 1, init=False, timeout=5)
    assert time.monotonic() - start < 15


@given(batch=st.integers(1, 40), n=st.integers(1, 6))
def test_shard_is_split_batch_shard(batch, n):
    X, y = torch.randn(batch, 3), torch.arange(batch)
    if batch < n:
        with pytest.raises(ValueError, match="smaller than"):
            shard(X, y, 0, n)
        return
    Xs, ys = split_batch(X, y, ["cpu"] * n)
    for r in range(n):
        a, b = shard(X, y, r, n)
        assert torch.equal(a, Xs[r]) and torch.equal(b, ys[r])


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _first_returns_at_once():
    import os
    import time
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("pid0", str(os.getpid()))
        return "returned"
    pid = int(store.get("pid0"))  # waits for rank 0 to have returned (its key is set just before)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _alive(pid):  # before: rank 0 exited at once, under this rank's receives
        time.sleep(0.01)
    return _alive(pid)


def test_a_rank_that_returned_stays_until_every_rank_has_so_no_peer_loses_its_last_receive():
    assert launch(_first_returns_at_once, 2, timeout=60) == ["returned", True]
