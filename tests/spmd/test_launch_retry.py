"""`launch` starts the ranks once more when gloo's full mesh failed to form in its own group setup, and only then."""
import importlib
import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp

launching = importlib.import_module("manualdp.spmd.launch")  # the module (the package exports the function)

FLAKE = ('Traceback ...\n  File "launch.py", line 104, in _worker\n    dist.init_process_group(backend, ...)\n'
         'RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:9354.')


def _failing(messages):
    calls = []

    def run(*args):
        calls.append(args)
        if len(calls) <= len(messages):
            error = mp.ProcessRaisedException(messages[len(calls) - 1], 0, 1)
            if "connectFullMesh" in messages[len(calls) - 1]:  # as `_run` reports launch's own setup failing
                raise launching._MeshFlake(error, messages[len(calls) - 1]) from error
            raise error
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


def test_any_other_failure_is_raised_at_once(monkeypatch):
    run, calls = _failing(["RuntimeError: the user's own error in fn"])
    monkeypatch.setattr(launching, "_run", run)
    with pytest.raises(mp.ProcessRaisedException):
        launching.launch(_square, 2, (3,))
    assert len(calls) == 1


def _mesh_words_in_fn(counts, ranks):
    with open(os.path.join(counts, os.environ["RANK"]), "a") as f:
        f.write("x")
    if int(os.environ["RANK"]) in ranks:
        raise RuntimeError("sub-group setup: init_process_group of my side group failed in connectFullMesh")
    return 0


@pytest.mark.parametrize("ranks", [(0, 1), (1,)])
def test_an_error_of_fn_in_the_flake_s_words_runs_fn_once(tmp_path, ranks):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(mp.ProcessRaisedException, match="my side group"):
            launching.launch(_mesh_words_in_fn, 2, (str(tmp_path), ranks), timeout=120)
    assert not [w for w in caught if "gloo failed to connect" in str(w.message)]
    # A rank that had not reached fn when the first error came is killed before it counts: at most once each.
    ran = {name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)}
    assert ran and set(ran.values()) == {"x"}, ran


def _never_called():
    raise AssertionError("fn ran although the group did not form")


def test_the_bootstrap_says_in_launch_s_folder_that_its_own_setup_failed(monkeypatch, tmp_path):
    def flake(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
    monkeypatch.setattr(launching.dist, "init_process_group", flake)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the bootstrap sets RANK and the rest for its rank
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="connectFullMesh"):
            launching._worker(1, _never_called, 2, 0, (), 1, True, 5.0, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert sorted(os.listdir(tmp_path)) == ["init-failed1"]
    assert launching._mesh_flake(str(tmp_path), 1, 2).startswith("RuntimeError: Gloo connectFullMesh failed")


@pytest.mark.parametrize("notes, rank", [
    ({"init-failed1": "RuntimeError: The server socket has failed to bind"}, 1),  # not the mesh flake
    ({"init-failed1": "RuntimeError: connectFullMesh failed", "started0": ""}, 1),  # fn started on rank 0
    ({"init-failed1": "RuntimeError: connectFullMesh failed"}, 0),  # rank 0 failed elsewhere: in fn
])
def test_no_flake_when_fn_started_or_the_setup_failed_otherwise(tmp_path, notes, rank):
    for name, text in notes.items():
        (tmp_path / name).write_text(text)
    assert launching._mesh_flake(str(tmp_path), rank, 2) is None
