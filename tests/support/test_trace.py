"""The timeline: Chrome trace JSON whose events are well formed, nested and ordered; the overlap summary."""
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp import cpu_devices, train
from manualdp.spmd import launch
from manualdp.spmd.ladder.drift import due
from manualdp.support.trace import COMM, Trace, plot_trace

BATCH, EXAMPLES = 13, 60


def _data():
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(EXAMPLES, 6, generator=g), torch.randint(0, 4, (EXAMPLES,), generator=g))
    return DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=30)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def test_summary_counts_the_communication_hidden_behind_backward():
    t = Trace()
    t.add("backward", "dev0", 5_000, 20_000)
    t.add("bucket 0 allreduce", "comm", 0, 10_000, cat=COMM)       # 5 ms of 10 under backward
    t.add("bucket 1 allreduce", "comm", 18_000, 30_000, cat=COMM)  # 2 ms of 12 under backward
    s = t.summary(steps=2)
    assert s["comm_ms_per_step"] == pytest.approx(22 / 2)
    assert s["overlap_fraction"] == pytest.approx(7 / 22)
    assert s["exposed_comm_ms_per_step"] == pytest.approx(15 / 2)


def _spans(data, pid=0):
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["pid"] == pid}
    spans = {}
    for e in data["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == pid:
            spans.setdefault(names[e["tid"]], []).append(e)
    return spans


def test_single_controller_trace_has_one_ordered_track_per_device(tmp_path):
    path = tmp_path / "trace.json"
    train_iter, test_iter = _data()
    history = train(_net(), train_iter, test_iter, cpu_devices(3), 2, 0.1, trace=str(path), progress=False, log=None)
    data = json.loads(path.read_text())
    spans = _spans(data)
    steps = 2 * -(-EXAMPLES // BATCH)
    assert sorted(spans) == ["comm", "dev0", "dev1", "dev2"]
    for d in range(3):
        track = sorted(spans[f"dev{d}"], key=lambda e: e["ts"])
        assert [e["name"] for e in track if e["name"] != "evaluate"] == ["forward", "backward", "step"] * steps
        for a, b in zip(track, track[1:]):  # one device does one thing at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    comm = sorted(spans["comm"], key=lambda e: e["ts"])
    assert len(comm) == steps
    backwards = sorted((e for d in range(3) for e in spans[f"dev{d}"] if e["name"] == "backward"),
                       key=lambda e: e["ts"])
    firsts = sorted((e for e in spans["dev0"] if e["name"] == "step"), key=lambda e: e["ts"])
    for s, c in enumerate(comm):  # the allreduce starts when the last replica's backward ends, the step follows
        last = max(backwards[3 * s:3 * s + 3], key=lambda e: e["ts"] + e["dur"])
        assert c["ts"] == pytest.approx(last["ts"] + last["dur"]) and c["ts"] + c["dur"] <= firsts[s]["ts"] + 1e-3
    assert history.config["timeline"]["steps"] == steps
    assert history.config["timeline"]["overlap_fraction"] == 0.0
    assert json.loads(json.dumps(history.trace)) == data  # the events in memory, for a plot that cannot read a FIFO
    plot_trace(data, str(tmp_path / "trace.png"))
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"


def _spmd_job(path):
    from manualdp import train_spmd
    train_iter, test_iter = _data()
    history = train_spmd(_net(), train_iter, test_iter, 1, 0.1, bucket_cap_mb=0.002, trace=path, progress=False,
                         log=None)
    return (history.config["timeline"], history.trace) if history is not None else None


def test_spmd_trace_has_each_buckets_ready_allreduce_and_wait_in_order(tmp_path):
    path = str(tmp_path / "trace.json")
    summaries = launch(_spmd_job, 2, (path,), timeout=120.0)
    data = json.loads(open(path).read())
    steps = -(-EXAMPLES // BATCH)
    assert {e["pid"] for e in data["traceEvents"]} == {0, 1}
    for rank in (0, 1):
        spans = _spans(data, rank)
        allreduces = sorted((e for e in spans["comm"] if "bucket" in e["args"]), key=lambda e: e["ts"])
        buckets = sorted({e["args"]["bucket"] for e in allreduces})
        assert len(buckets) >= 2 and len(allreduces) == steps * len(buckets)
        # each bucket's allreduce carries the step's call check (on gloo): no exchange of its own to show, also at the
        # replicas' drift check's due steps (1, 2, 4, ...: `drift.due`), whose own call check compares the step
        # (issue 44)
        assert sum(due(s, 100) for s in range(1, steps)) >= 2  # the case: due steps after the first
        lone = [e for e in spans["comm"] if e["name"] == "step check"]
        assert not lone, lone
        waits = sorted((e for e in spans["compute"] if e["cat"] == "wait"), key=lambda e: e["ts"])
        ready = sorted((e for e in data["traceEvents"] if e["ph"] == "i" and e["pid"] == rank), key=lambda e: e["ts"])
        for s in range(steps):
            for b in buckets:
                send = [e for e in allreduces if e["args"]["bucket"] == b][s]
                wait = [e for e in waits if e["args"]["bucket"] == b][s]
                first_ready = [e for e in ready if e["args"]["bucket"] == b]
                assert any(r["ts"] <= send["ts"] for r in first_ready), "a bucket was sent before it was ready"
                assert (send["ts"] <= wait["ts"] + wait["dur"]
                        and send["ts"] + send["dur"] <= wait["ts"] + wait["dur"] + 1e-3)
    s, events = summaries[0]
    assert json.loads(json.dumps(events)) == data  # rank 0 keeps every rank's events in memory, for the plot
    assert 0.0 <= s["overlap_fraction"] <= 1.0 and s["steps"] == steps
    assert s["exposed_comm_ms_per_step"] <= s["comm_ms_per_step"] + 1e-9
