"""`average_and_vote`, the step the room's wrappers end with, and the wrappers on a quorum of one, in this process.

The replicas' processes hold them to torch's and to the formulas bitwise (soak: test_ft_kill.py,
test_ft_local_sgd.py, test_ft_cli_rejoin.py).
"""
import torch
from torch import nn

from manualdp.spmd.ft import Coordinator, DiLoCo, FaultTolerantDDP, Manager
from manualdp.spmd.ft.average import average_and_vote


class TwoMembers:
    """A manager's `average` and `should_commit`, as if one more member had sent `other` times each buffer."""

    def __init__(self, other: float, commit: bool) -> None:
        self.other, self.commit, self.buffers = other, commit, []

    def average(self, flat: torch.Tensor) -> bool:
        self.buffers.append((flat.dtype, flat.numel()))
        flat.add_(flat * self.other).div_(2)
        return True

    def should_commit(self, ok: bool) -> bool:
        return ok and self.commit


def test_one_buffer_per_dtype_after_each_of_also_and_the_averages_written_back_only_if_committed():
    tensors = [torch.ones(2, 3), torch.full((4,), 2.0, dtype=torch.float64), torch.full((2,), 4.0)]
    totals = torch.tensor([6.0, 8.0], dtype=torch.float64)
    before = [t.clone() for t in tensors + [totals]]
    discarding = TwoMembers(3.0, commit=False)
    assert not average_and_vote(discarding, tensors, also=(totals,))
    assert discarding.buffers == [(torch.float64, 2), (torch.float32, 8), (torch.float64, 4)]
    assert all(torch.equal(a, b) for a, b in zip(tensors + [totals], before))  # a discarded step changes nothing
    assert average_and_vote(TwoMembers(3.0, commit=True), tensors, also=(totals,))
    assert all(torch.equal(a, 2 * b) for a, b in zip(tensors + [totals], before))  # (x + 3x) / 2, in place


def test_on_a_quorum_of_one_fault_tolerant_ddp_steps_as_sgd_and_diloco_as_its_formula(coordinator):
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    plain = nn.Linear(3, 2).double()
    plain.load_state_dict(net.state_dict())
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with Manager("one", "127.0.0.1", coordinator.port, timeout=10) as manager:
        ft = FaultTolerantDDP(net, torch.optim.SGD(net.parameters(), lr=0.1), manager)
        sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
        for _ in range(2):
            ft.start_step()
            ((ft(X) - y) ** 2).mean().backward()
            totals = torch.tensor([3.0, 1.0], dtype=torch.float64)
            assert ft.step(also=(totals,)) and totals.tolist() == [3.0, 1.0]
            sgd.zero_grad()
            ((plain(X) - y) ** 2).mean().backward()
            sgd.step()
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
        assert manager.step == 2 and all(p.grad is None for p in net.parameters())
    # another run (another method): another coordinator, whose store holds no settings of a run yet (admission.py)
    with Coordinator(0) as other, Manager("two", "127.0.0.1", other.port, timeout=10) as manager:
        ft = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), manager, 2, outer_lr=0.7, outer_momentum=0.9)
        theta, b = [p.detach().clone() for p in net.parameters()], None
        for _ in range(2):  # two blocks of H = 2 steps alone
            for j in range(2):
                ft.start_step()
                ((ft(X) - y) ** 2).mean().backward()
                sgd.zero_grad()
                ((plain(X) - y) ** 2).mean().backward()
                sgd.step()
                assert ft.step() is (None if j == 0 else True)
            delta = [t - p.detach() for t, p in zip(theta, plain.parameters())]  # the average change of one
            b = delta if b is None else [0.9 * m + d for m, d in zip(b, delta)]
            theta = [t - 0.7 * (d + 0.9 * m) for t, d, m in zip(theta, delta, b)]  # Nesterov
            with torch.no_grad():
                for p, t in zip(plain.parameters(), theta):
                    p.copy_(t)
            for p, t in zip(net.parameters(), theta):
                torch.testing.assert_close(p.detach(), t, rtol=0, atol=1e-15)
