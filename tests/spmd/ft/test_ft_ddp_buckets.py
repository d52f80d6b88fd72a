"""`FaultTolerantDDP` on the drop-in's reducer: each bucket averaged through the manager during backward.

In this process, on a quorum of one whose `average` stands for two members (the other sending
three times each buffer: (x + 3x) / 2); with replica processes (soak, the end of this file), the
averages at 2 and 3 replicas against the mean of the members' own gradients, and a bucket that
fails or whose sender is killed.
"""
import threading

import pytest
import torch
from torch import nn

from manualdp.buckets import assign_buckets
from manualdp.spmd.ft import Coordinator, FaultTolerantDDP, Manager
from manualdp.spmd.ft.average import average_and_vote
from tests.spmd.ft.harness import agreed_steps, reference_ddp, replicas



@pytest.fixture
def coordinator():
    """A coordinator of this test's own: a run's committed step stays in its store."""
    with Coordinator(0) as c:
        yield c


def make(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)


def two_members(manager: Manager, fail_at: int | None = None, nan_at: int | None = None) -> list[tuple[str, int]]:
    """Make `manager.average` stand for two members; each call's (thread, elements) goes into the list returned.

    `fail_at`: that call (0: the first) fails, as a member gone mid-bucket makes it. `nan_at`: that call's
    average comes back with a NaN (corrupted on the way, after its norm was taken), and True; so does the
    average again that a non-finite one calls for (`average_fitting`, each share divided first).
    """
    calls, real = [], manager.average

    def average(t: torch.Tensor, divide_first: bool = False) -> bool:
        again = divide_first and len(calls) - 1 == nan_at
        calls.append((threading.current_thread().name, t.numel()))
        if len(calls) - 1 == fail_at:
            manager._ok = False  # what a failed allreduce leaves (Manager.average)
            return False
        if not real(t):  # the quorum of one's own (it refuses a step not under way)
            return False
        t.add_(t * 3).div_(2)
        if len(calls) - 1 == nan_at or again:
            t.view(-1)[0] = float("nan")
        return True

    manager.average = average
    return calls


def loss_of(net: nn.Module, k: int) -> torch.Tensor:
    X, y = data(k)
    return ((net(X) - y) ** 2).mean()


def test_each_bucket_is_averaged_on_the_worker_during_backward_and_equals_the_flat_path(coordinator):
    net, flat_net = make(), make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        for k in range(2):
            ft.start_step()
            loss_of(ft, k).backward()
            # during backward: one average per parameter (a bucket each), in reverse order, on the buckets' thread
            assert calls == [("manualdp-ft-buckets", p.numel()) for p in reversed(list(net.parameters()))]
            averaged = [p.grad.clone() for p in net.parameters()]
            totals = torch.tensor([2.0, 5.0], dtype=torch.float64)
            calls.clear()
            assert ft.step(also=(totals,))
            assert totals.tolist() == [4.0, 10.0]  # averaged with the step, after the guard's norms
            assert [n for _, n in calls] == [1, 2] and all(t == threading.main_thread().name for t, _ in calls)
            calls.clear()
            # the flat path on a model in the same state: one buffer, the same averages, bitwise
            flat_net.zero_grad(set_to_none=True)
            manager.start_step()
            loss_of(flat_net, k).backward()
            grads = [p.grad for p in flat_net.parameters()]
            mine = [g.clone() for g in grads]
            assert average_and_vote(manager, grads)
            assert all(torch.equal(a, b) and torch.equal(a, 2 * m) for a, b, m in zip(averaged, grads, mine))
            calls.clear()
            torch.optim.SGD(flat_net.parameters(), lr=0.1).step()
            assert all(torch.equal(a, b) for a, b in zip(net.parameters(), flat_net.parameters()))
            assert all(p.grad is None for p in net.parameters())
        assert manager.step == 4  # two steps of each


def test_a_bucket_whose_average_fails_discards_the_step_and_the_next_one_commits(coordinator):
    net = make()
    before = [p.detach().clone() for p in net.parameters()]
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager, fail_at=1)  # the second bucket: the first was averaged already
        ft.start_step()
        loss_of(ft, 0).backward()
        totals = torch.tensor([1.0], dtype=torch.float64)
        assert ft.step(also=(totals,)) is False
        # every bucket still asks (nothing goes after a failure), as on the others, then the guard's norms; not `also`
        assert [n for _, n in calls] == [2, 8, 4, 12, 1] and calls[-1][0] == threading.main_thread().name
        assert manager.step == 0 and totals.tolist() == [1.0]
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before)) and all(
            p.grad is None for p in net.parameters())
        ft.start_step()  # the same batch again
        loss_of(ft, 0).backward()
        assert ft.step() and manager.step == 1
        assert not any(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_a_bucket_whose_average_comes_back_non_finite_discards_the_step_and_the_next_one_commits(coordinator, caplog):
    net = make()
    before = [p.detach().clone() for p in net.parameters()]
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager, nan_at=2)  # the third bucket: its norm, taken before, was finite
        ft.start_step()
        loss_of(ft, 0).backward()
        totals = torch.tensor([1.0], dtype=torch.float64)
        with caplog.at_level("WARNING", logger="manualdp.spmd.ft"):
            assert ft.step(also=(totals,)) is False
        assert "step 0 discarded: bucket 2's average came back non-finite" in caplog.text
        # every bucket went (bucket 2 twice: again divided first), then the guard's norms (it judged them
        # finite), not `also`: the vote discards
        assert [n for _, n in calls] == [2, 8, 4, 4, 12, 1]
        assert manager.step == 0 and totals.tolist() == [1.0]
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before)) and all(
            p.grad is None for p in net.parameters())
        ft.start_step()  # the same batch again, averaged whole this time
        loss_of(ft, 0).backward()
        assert ft.step() and manager.step == 1
        assert all(torch.isfinite(p).all() for p in net.parameters())
        assert not any(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_no_sync_accumulates_locally_and_the_synced_backward_averages_the_sum(coordinator):
    net, plain = make(), make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager)
        calls = two_members(manager)
        ft.start_step()
        with ft.no_sync():
            for k in range(2):
                loss_of(ft, k).backward()
        assert calls == []  # nothing averaged inside no_sync, as the drop-in
        loss_of(ft, 2).backward()
        # the default caps: this small model is one bucket (the first, of at most 1 MiB)
        assert len(ft.reducer.buckets) == 1 and [n for _, n in calls] == [sum(p.numel() for p in net.parameters())]
        for k in range(3):
            loss_of(plain, k).backward()  # plain accumulation: the sum of the three
        assert all(torch.equal(p.grad, 2 * q.grad) for p, q in zip(net.parameters(), plain.parameters()))
        assert ft.step()


def test_a_quorum_that_must_be_entered_first_is_averaged_after_backward_on_the_main_thread(coordinator):
    """Entering may load a received state, which would break backward: the buckets wait for step()."""
    net, plain = make(), make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        ft.start_step()
        manager.quorum_ready = lambda: False  # as a quorum asked ahead that is not on the fast path answers
        loss_of(ft, 0).backward()
        assert calls == []
        assert all(torch.equal(p.grad, q) for p, q in zip(net.parameters(), torch.autograd.grad(
            loss_of(plain, 0), list(plain.parameters()))))  # this replica's own, until the step averages them
        mine = [p.grad.clone() for p in net.parameters()]
        entered = []
        manager._settle = lambda enter=True: entered.append(enter)  # what `average_late` asks for first
        assert ft.step()
        assert entered[0] is True and all(t == threading.main_thread().name for t, _ in calls)
        assert [n for _, n in calls] == [p.numel() for p in reversed(list(net.parameters()))] + [1]
        for q, g in zip(plain.parameters(), mine):
            q.grad = 2 * g  # (x + 3x) / 2
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), plain.parameters()))


def test_a_backward_that_raises_part_way_is_discarded_by_step_and_the_next_one_commits(coordinator):
    net = make()
    before = [p.detach().clone() for p in net.parameters()]
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        ft.start_step()
        X, y = data(0)
        hidden = net[1](net[0](X))
        hidden.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a user's hook")))
        with pytest.raises(RuntimeError, match="a user's hook"):
            ((net[2](hidden) - y) ** 2).mean().backward()
        assert ft.step() is False and manager.step == 0  # it waits for the buckets sent on the worker
        assert [n for _, n in calls] == [2, 8]  # the last layer's buckets went; the first layer's never will
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        ft.start_step()
        loss_of(ft, 0).backward()
        assert ft.step() and manager.step == 1


class Branches(nn.Module):
    """A layer used only where the input says so: unused on this replica in a step, maybe used on another."""

    def __init__(self) -> None:
        super().__init__()
        self.always, self.sometimes = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x, both: bool):
        return self.always(x) + (self.sometimes(x) if both else 0)


def test_a_parameter_unused_here_gets_the_members_average_as_the_flat_path_gave_it(coordinator):
    net = Branches()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        calls = two_members(manager)
        ft.start_step()
        ft(torch.randn(4, 3), both=False).sum().backward()
        assert len(calls) == 4  # its buckets went too: the members' calls match whoever used what
        # zeros from this replica, averaged: a gradient, never None (the others' shards may have used it)
        assert all(p.grad is not None and not p.grad.any() for p in net.sometimes.parameters())
        assert ft.step()


def test_misuse_is_one_line_naming_it(coordinator):
    net = make()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=-1)
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=None)
        loss_of(ft, 0).backward()  # before start_step: nothing averaged, and the step says so
        with pytest.raises(RuntimeError, match=r"step\(\) without a step under way: call start_step\(\)"):
            ft.step()
        ft.start_step()  # then the loop goes on as usual
        loss_of(ft, 0).backward()
        assert ft.step() and manager.step == 1


class Backwards(nn.Module):
    """Two layers applied in the other order than registered: the gradients come in another order than reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(300, 300), nn.Linear(300, 300)

    def forward(self, x):
        return self.first(self.second(x))


def test_buckets_are_the_drop_ins_in_reverse_order_never_rebuilt_in_the_order_gradients_came(coordinator):
    net = Backwards()
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, bucket_cap_mb=0.5)
        layout = assign_buckets(list(net.parameters()), 0.5)
        assert ft.reducer.layout == layout == [[3, 2, 1], [0]]  # reverse order, not the gradients' order
        for _ in range(2):
            ft.start_step()
            ft(torch.randn(2, 300)).sum().backward()
            assert ft.step()
        assert ft.reducer.layout == layout  # a joiner cuts the same buckets, with no broadcast to join


# ---------------------------------------------------------------- replica processes (soak)

@pytest.mark.soak
@pytest.mark.parametrize("n", [2, 3])
def test_the_buckets_averages_are_the_mean_of_the_members_own_gradients(tmp_path, n):
    """Bitwise at 2 (a + b is b + a); at 3 the members' sums may go in another order than a one-process sum's."""
    steps = 3
    with replicas(tmp_path) as run:
        for i in range(n):
            run.start(id="abc"[i], index=i, steps=steps, min_replicas=n, bucket_cap_mb=None, grads=True)
        results = run.finish()
    records = {rid: runs[0]["records"] for rid, runs in results.items()}
    for b in range(steps):
        mine = [[torch.tensor(g, dtype=torch.float64) for g in records[rid][b]["grads"]["mine"]] for rid in records]
        expected = [sum(g[k] for g in mine) / n for k in range(len(mine[0]))]
        for rid in records:
            got = [torch.tensor(g, dtype=torch.float64) for g in records[rid][b]["grads"]["averaged"]]
            for x, e in zip(got, expected):
                torch.testing.assert_close(x, e, rtol=0 if n == 2 else 1e-15, atol=0 if n == 2 else 1e-15)
    steps_seen = agreed_steps(results, steps)
    final = torch.tensor(results["a"][0]["final"], dtype=torch.float64)
    torch.testing.assert_close(final, reference_ddp(steps_seen, seed=0, config={}), rtol=0, atol=1e-12)


@pytest.mark.soak
@pytest.mark.parametrize("fault", ["fail_allreduce", "kill_allreduce"])
def test_a_later_buckets_failure_discards_the_step_on_every_member_and_the_run_goes_on(tmp_path, fault):
    """One bucket per parameter; c's message fails (it lives on) or c is killed, past the first buckets' messages."""
    steps, at = 4, 2
    with replicas(tmp_path) as run:
        run.start_together([dict(id=rid, index=i, steps=steps, bucket_cap_mb=None, timeout=4,
                                 **({"fault": fault, "at": at, "skip": 12} if rid == "c" else {}))
                            for i, rid in enumerate("abc")])
        results = run.finish(timeout=120)
    assert (results["c"][0].get("final") is None) == (fault == "kill_allreduce"), run.logs()
    survivors = "ab" if fault == "kill_allreduce" else "abc"
    for rid in survivors:
        attempts = [x for x in results[rid][0]["records"] if x["batch"] == at]
        assert [x["committed"] for x in attempts] == [False, True], attempts
        assert attempts[0]["members"] == ["a", "b", "c"]
    steps_seen = agreed_steps(results, steps)  # c too, for the steps before it was killed
    final = torch.tensor(results["a"][0]["final"], dtype=torch.float64)
    torch.testing.assert_close(final, reference_ddp(steps_seen, seed=0, config={}), rtol=0, atol=1e-12)
