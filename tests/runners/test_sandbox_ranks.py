"""The sandbox's `ranks` request (`sandbox_child.main`): the book's hook on as many ranks as the grader asks (2 to 4),
and nothing left in TMPDIR afterwards (the child's fork server's folder goes with the child's)."""
import os
import pathlib
import time

from manualdp.runners.grader import sandbox
from manualdp.runners.grader.sandbox import Child

HOOK = pathlib.Path(__file__).resolve().parents[2] / "book" / "solutions" / "hook.py"


def test_the_ranks_run_at_the_world_size_asked_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    with Child(str(HOOK), "fp16_compress_hook", 30, time.monotonic() + 300, 4096) as child:
        assert child.start()["ok"]
        reply = child.request({"op": "ranks", "job": "hook", "timeout": 120, "world_size": 3}, 150, "3 ranks")
        assert [sorted(rank) for rank in reply["ranks"]] == [["fp16_compress_hook"]] * 3, reply
        assert all(len(rank["fp16_compress_hook"]["steps"]) == 2 for rank in reply["ranks"])
        assert child.request({"op": "ranks", "job": "hook", "timeout": 120, "world_size": 5}, 30, "5 ranks") == {
            "error": "world_size must be one of (2, 3, 4), got 5"}
        tmp = child.tmp  # in its folder, or in /tmp where that is too long for the ranks' sockets (pytest's is)
    assert list(tmp_path.iterdir()) == [] and not os.path.exists(tmp)
