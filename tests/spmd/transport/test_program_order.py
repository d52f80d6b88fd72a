"""Collectives go out in the order the program calls them, also beside a wrapper's worker thread."""
import torch

from manualdp.spmd import launch


def _loss_averaged_between_forward_and_backward(steps: int):
    import torch.distributed as dist
    import torch.nn as nn

    from manualdp.spmd import DistributedDataParallel, allreduce
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Sequential(nn.Linear(20, 50), nn.ReLU(), nn.Linear(50, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sums, losses = [], []
    for step in range(steps):
        loss = net(torch.randn(8, 20) * (dist.get_rank() + 1)).pow(2).mean()  # queues the step's call check
        total = loss.detach().clone().reshape(1)
        allreduce(total)  # on the main thread, before backward: must not race the queued check
        sums.append(total.item())
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return sums, losses


def test_a_loss_averaged_between_forward_and_backward_goes_out_after_the_steps_call_check():
    results = launch(_loss_averaged_between_forward_and_backward, 2, (200,), timeout=120)  # an abort fails launch
    (sums0, mine0), (sums1, mine1) = results
    assert sums0 == sums1 == [(torch.tensor(a) + torch.tensor(b)).item() for a, b in zip(mine0, mine1)]


def _mismatch_beside_a_wrapper():
    import torch.distributed as dist
    import torch.nn as nn

    from manualdp.spmd import DistributedDataParallel, allreduce
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Linear(4, 2))
    loss = net(torch.ones(3, 4)).sum()
    try:
        allreduce(torch.ones(5 + dist.get_rank()))  # queued behind the step's check, on the wrapper's worker
        error = None
    except ValueError as e:
        error = str(e)
    loss.backward()  # the worker goes on: the step's buckets still go out
    return error, net.module.weight.grad.tolist()


def test_a_mismatched_call_on_the_wrappers_worker_raises_in_the_caller_and_the_wrapper_goes_on():
    (error0, grad0), (error1, grad1) = launch(_mismatch_beside_a_wrapper, 2, (), timeout=60)
    assert "elements 5..6 (per rank: 5, 6)" in error0 and "elements 5..6 (per rank: 5, 6)" in error1
    assert grad0 == grad1 == [[3.0] * 4] * 2


def _step_against_allreduce_then_in_step():
    import torch.distributed as dist
    import torch.nn as nn

    from manualdp.spmd import DistributedDataParallel, allreduce
    torch.manual_seed(0)
    rank = dist.get_rank()
    net = DistributedDataParallel(nn.Linear(8, 2), timeout=20)
    net(torch.randn(4, 8)).sum().backward()
    try:  # rank 0 steps its wrapper (its worker fails for good) while rank 1 calls allreduce
        if rank == 0:
            net(torch.randn(4, 8)).sum().backward()
        else:
            allreduce(torch.ones(5), "ring", timeout=20)
        first = None
    except ValueError as e:
        first = str(e)
    after = []
    for _ in range(2):  # back in step: both go out, also past rank 0's failed worker
        t = torch.ones(4) * (rank + 1)
        allreduce(t, "ring", timeout=20)
        after.append(t.tolist())
    return first, after


def test_after_a_wrappers_step_met_an_allreduce_both_raise_and_calls_in_step_go_out():
    for first, after in launch(_step_against_allreduce_then_in_step, 2, (), timeout=90):
        assert first is not None and "allreduce called differently across ranks" in first
        assert after == [[3.0] * 4] * 2


def _allreduce_after_the_worker_ended():
    import torch.distributed as dist
    import torch.nn as nn

    from manualdp.spmd import DistributedDataParallel, allreduce
    from manualdp.spmd.transport.group import group_state
    net = DistributedDataParallel(nn.Linear(2, 2))
    net(torch.ones(1, 2)).sum().backward()
    worker = group_state().worker
    worker.shutdown()  # as at interpreter exit: the thread ends and takes no more calls
    worker._thread.join(10)
    t = torch.ones(2) * (dist.get_rank() + 1)
    allreduce(t, "ring", timeout=10)  # waited for the ended worker forever
    return t.tolist()


def test_an_allreduce_after_the_wrappers_worker_ended_goes_out_at_once():
    assert launch(_allreduce_after_the_worker_ended, 2, (), timeout=60) == [[3.0, 3.0]] * 2
