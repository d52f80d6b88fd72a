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


def _sleep_forever(folder):
    import os
    import time
    with open(os.path.join(folder, "pid.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, "pid.part"), os.path.join(folder, "pid"))  # never seen half-written
    time.sleep(600)


def test_launch_kills_ranks_that_do_not_finish(tmp_path):
    import os
    with pytest.raises(TimeoutError, match="did not finish"):
        launch(_sleep_forever, 1, (str(tmp_path),), init=False, timeout=5)
    if (tmp_path / "pid").exists():  # under load the rank may be killed before fn starts: nothing left then either
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping (no bound on how long it took)
            os.kill(int((tmp_path / "pid").read_text()), 0)


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
