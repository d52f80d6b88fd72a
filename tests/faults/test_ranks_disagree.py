"""Ranks that disagree are told, on every rank: no abort inside gloo, no wrong sum."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from manualdp.spmd import launch


def _mismatched_calls():
    """On 2 ranks: allreduce with another algorithm, size or dtype on rank 1; then one that agrees."""
    from manualdp.spmd.collectives import allreduce
    rank = torch.distributed.get_rank()
    out = {}
    cases = {
        "algorithm": (torch.ones(6), "ring" if rank == 0 else "tree"),
        "size": (torch.ones(6 if rank == 0 else 9), "ring"),
        "dtype": (torch.ones(6, dtype=torch.float32 if rank == 0 else torch.float64), "ring"),
    }
    for name, (t, algorithm) in cases.items():
        before = t.clone()
        try:
            allreduce(t, algorithm, timeout=20)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + "_unchanged"] = torch.equal(t, before)
    t = torch.full((5,), float(rank + 1))
    allreduce(t, "ring", timeout=20)  # the group still works after a refused call
    out["after"] = t.tolist()
    return out


def test_mismatched_allreduce_calls_raise_on_every_rank_and_write_nothing():
    results = launch(_mismatched_calls, 2, timeout=60)
    for r, out in enumerate(results):
        assert "algorithm ring..tree" in out["algorithm"] and f"rank {r}" in out["algorithm"]
        assert "elements 6..9" in out["size"]
        assert "dtype float32..float64" in out["dtype"]
        assert all(out[k + "_unchanged"] for k in ("algorithm", "size", "dtype"))
        assert out["after"] == [3.0] * 5


def _short_rank():
    """train_spmd where rank 1's loader has one batch more than rank 0's."""
    from manualdp.runners.loop import train_spmd
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    n = 32 if rank == 0 else 40  # 4 batches against 5
    data = DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)),
                      batch_size=8)
    try:
        train_spmd(net, data, data, 1, 0.1, progress=False, log=None, timeout=20)
        return None
    except ValueError as e:
        return str(e)


def test_a_rank_that_runs_out_of_batches_is_told_on_every_rank():
    results = launch(_short_rank, 2, timeout=90)
    for r, message in enumerate(results):
        assert message is not None and "allreduce called differently across ranks" in message, message
        assert "out of step" in message and f"rank {r}" in message


def _mismatched_wrappers():
    """DDP wrappers built with another bucket size, algorithm, segment size or flag on rank 1; then alike."""
    from manualdp.spmd.ddp.wrapper import DistributedDataParallel
    rank = torch.distributed.get_rank()
    out = {}
    cases = {"bucket_cap_mb": {"bucket_cap_mb": 25.0 if rank == 0 else 0.0003},
             "algorithm": {"algorithm": "ring" if rank == 0 else "tree"},
             "auto": {"algorithm": "auto" if rank == 0 else "naive"},
             "segment_bytes": {"segment_bytes": 1 << 20 if rank == 0 else 64},
             "broadcast_buffers": {"broadcast_buffers": rank == 0},
             "rebuild_buckets": {"rebuild_buckets": rank == 0}}
    group = torch.distributed.new_group()
    for name, kw in cases.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 3))
        try:
            DistributedDataParallel(net, timeout=20, process_group=group, **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # Refused at construction, nothing was sent: the same group then serves a wrapper that agrees.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 3))
    model = DistributedDataParallel(net, timeout=20, process_group=group, algorithm="ring", bucket_cap_mb=0.0003)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    local = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).sum().backward()
    for g in (p.grad for p in net.parameters()):
        torch.distributed.all_reduce(g, group=group)
    out["grads_are_the_mean"] = all(torch.allclose(a, b / 2, atol=1e-6)
                                    for a, b in zip(local, (p.grad for p in net.parameters())))
    return out


def test_wrappers_with_another_communication_layout_are_refused_at_construction_on_every_rank():
    results = launch(_mismatched_wrappers, 2, timeout=90)
    for r, out in enumerate(results):
        assert out["bucket_cap_mb"].startswith(f"rank {r}: DistributedDataParallel's layout differs across ranks")
        assert "bucket_cap_mb 25.0..0.0003 (per rank: 25.0, 0.0003)" in out["bucket_cap_mb"], out
        assert "buckets 1..4 (per rank: 1, 4)" in out["bucket_cap_mb"], out  # 0.0003 MiB: one bucket per parameter
        assert "bucket elements" in out["bucket_cap_mb"], out
        assert "algorithm ring..tree (per rank: ring, tree)" in out["algorithm"], out
        assert "algorithm auto..naive (per rank: auto, naive)" in out["auto"], out
        assert "segment_bytes 64..1048576 (per rank: 1048576, 64)" in out["segment_bytes"], out
        assert "broadcast_buffers True..False (per rank: True, False)" in out["broadcast_buffers"], out
        assert "rebuild_buckets True..False (per rank: True, False)" in out["rebuild_buckets"], out
        for name in ("algorithm", "segment_bytes", "broadcast_buffers", "rebuild_buckets"):
            # only what differs
            assert "bucket_cap_mb" not in out[name] and "bucket elements" not in out[name], out[name]
        assert out["grads_are_the_mean"]


def _resume_cases(tmp):
    """Eval-kill (rank 0 has an empty folder) and a damaged newest file on rank 1 only, under 2 ranks."""
    import glob
    import os
    import warnings

    from manualdp.runners.loop import train_spmd
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)),
                      batch_size=8)
    out = {}

    def run(ckpt, epochs, **kw):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        logs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_spmd(net, data, data, epochs, 0.1, progress=False, log=logs.append, timeout=20,
                       checkpoint_dir=ckpt, **kw)
        return [p.detach().clone() for p in net.parameters()], logs, [str(w.message) for w in caught]

    straight, _, _ = run(None, 2)
    ckpt = os.path.join(tmp, "evalkill")
    run(ckpt, 1)
    torch.distributed.barrier()
    if rank == 0:  # killed during the first evaluation: its folder exists, no checkpoint in it
        for f in glob.glob(os.path.join(ckpt, "rank0", "*.pt")):
            os.remove(f)
    torch.distributed.barrier()
    params, logs, _ = run(ckpt, 2, resume=True)
    out["evalkill_logs"] = logs
    out["evalkill_equal"] = all(torch.equal(a, b) for a, b in zip(params, straight))

    ckpt = os.path.join(tmp, "damaged")
    run(ckpt, 1, checkpoint_every=2)
    torch.distributed.barrier()
    if rank == 1:
        newest = glob.glob(os.path.join(ckpt, "rank1", "*-epoch.pt"))[0]  # the end of the epoch: the newest
        outer = torch.load(newest, weights_only=False)
        payload = bytearray(outer["payload"])
        payload[len(payload) // 2] ^= 0x10
        outer["payload"] = bytes(payload)
        torch.save(outer, newest)
    torch.distributed.barrier()
    params, logs, caught = run(ckpt, 2, checkpoint_every=2, resume=True)
    out["damaged_logs"], out["damaged_warnings"] = logs, caught
    out["damaged_equal"] = all(torch.equal(a, b) for a, b in zip(params, straight))
    return out


def test_resume_after_an_eval_kill_or_a_damaged_file_on_one_rank_equals_a_straight_run(tmp_path):
    results = launch(_resume_cases, 2, (str(tmp_path),), timeout=150)
    assert any("starting from the beginning" in line for line in results[0]["evalkill_logs"])
    assert any("checksum mismatch" in w for w in results[1]["damaged_warnings"])
    assert any("resumed from" in line and "ckpt-00000004.pt" in line for line in results[0]["damaged_logs"])
    for r in range(2):
        assert results[r]["evalkill_equal"] and results[r]["damaged_equal"]


def test_check_same_layout_refuses_bad_arguments_before_any_communication():
    import pytest

    from manualdp.spmd.ddp.wrapper import check_same_layout
    with pytest.raises(TypeError, match="layout must be a dict"):
        check_same_layout([("buckets", 1)], None, 2)
    with pytest.raises(TypeError, match="layout must be a dict"):
        check_same_layout({1: "buckets"}, None, 2)
    with pytest.raises(ValueError, match="world_size"):
        check_same_layout({"buckets": 1}, None, 0)


def _checks_per_step():
    """A 3-bucket wrapper for 3 steps: what goes through the worker, in order (a bucket: its size, whether it carries
    a call check), and the agreements' own call checks (the drift check's: the step each compares)."""
    from manualdp.spmd.ddp import reducer, step_check as ddp_debug
    from manualdp.spmd.ddp.wrapper import DistributedDataParallel
    from manualdp.spmd.transport import agree
    seen = []
    check, reduce, agreed = ddp_debug.check_same_call, reducer.run_allreduce, agree.same_call
    ddp_debug.check_same_call = lambda t, *a, numel=None, **k: (seen.append(("check", numel)),
                                                                 check(t, *a, numel=numel, **k))[1]
    agree.same_call = lambda *a, step=-1, **k: (seen.append(("agree", step)), agreed(*a, step=step, **k))[1]
    # buckets go straight to the executor, carrying the step's call check on gloo
    reducer.run_allreduce = lambda t, *a, **k: (seen.append(("bucket", t.numel(), k.get("check") is not None)),
                                                reduce(t, *a, **k))[1]
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
        model = DistributedDataParallel(net, bucket_cap_mb=0.005, algorithm="ring", rebuild_buckets=False)
        sizes = [b.flat.numel() for b in model._buckets]
        for step in range(3):
            if step == 2 and torch.distributed.get_rank() == 0:
                model(torch.randn(8, 4))  # a forward without backward, on one rank only: its check waits for this step
            model(torch.randn(8, 4)).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        return seen, sizes, grads
    finally:
        ddp_debug.check_same_call, reducer.run_allreduce, agree.same_call = check, reduce, agreed


def test_on_gloo_each_bucket_carries_the_steps_call_check_and_no_check_goes_alone_also_at_a_drift_check():
    # At two ranks the check is the tag each bucket's data travels on: nothing is exchanged for it alone (issue 44).
    # The replicas' drift check at its due steps (0, 1, 2, 4, ...: all three here) is two agreements (which wrapper,
    # then the digests) whose own call checks carry the step about to begin, so a rank out of step is named by its
    # step there, and no lone check of the step's calls goes first (was: one before each due check after the first,
    # and that step's buckets carried none); the first step's comparison of comm hooks is an agreement too; a second
    # forward before the backward begins no step of its own (nor a drift check), so the steps pair.
    results = launch(_checks_per_step, 2, timeout=60)
    for seen, sizes, _ in results:
        assert len(sizes) == 3
        checked = [("bucket", n, True) for n in sizes]
        drift = [[("agree", step), ("agree", step)] for step in (1, 2, 3)]
        built, hooks = [("agree", -1)], [("agree", -1)]  # the construction's comparison, the first step's hooks'
        assert seen == built + drift[0] + hooks + checked + drift[1] + checked + drift[2] + checked, seen
    assert torch.equal(results[0][2], results[1][2])  # the steps paired up: equal averaged gradients
