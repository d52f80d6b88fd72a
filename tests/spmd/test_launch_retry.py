"""`launch` starts the ranks once more when gloo's full mesh failed to form (a torch flake), and only then."""
import importlib

import pytest
import torch.multiprocessing as mp

launching = importlib.import_module("manualdp.spmd.launch")  # the module (the package exports the function)

FLAKE = ('Traceback ...\n  File "launch.py", line 104, in _worker\n    dist.init_process_group(backend, ...)\n'
         'RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:9354.')


def _failing(messages):
    calls = []

    def run(*args):
        calls.append(args)
        if len(calls) <= len(messages):
            raise mp.ProcessRaisedException(messages[len(calls) - 1], 0, 1)
        return ["done"] * args[1]
    return run, calls


def _square(x):
    return x * x


def test_a_mesh_that_failed_to_form_is_started_again_once_with_a_warning(monkeypatch):
    run, calls = _failing([FLAKE])
    monkeypatch.setattr(launching, "_run", run)
    with pytest.warns(UserWarning, match="gloo failed to connect the 2 ranks as the group formed"):
        assert launching.launch(_square, 2, (3,)) == ["done", "done"]
    assert len(calls) == 2


def test_the_flake_twice_is_raised(monkeypatch):
    run, calls = _failing([FLAKE, FLAKE])
    monkeypatch.setattr(launching, "_run", run)
    with pytest.warns(UserWarning), pytest.raises(mp.ProcessRaisedException, match="connectFullMesh"):
        launching.launch(_square, 2, (3,))
    assert len(calls) == 2


@pytest.mark.parametrize("message", ["RuntimeError: the user's own error in fn",
                                     "RuntimeError: Gloo connectFullMesh failed (in fn's own new_group)"])
def test_any_other_failure_is_raised_at_once(monkeypatch, message):
    run, calls = _failing([message])
    monkeypatch.setattr(launching, "_run", run)
    with pytest.raises(mp.ProcessRaisedException):
        launching.launch(_square, 2, (3,))
    assert len(calls) == 1
