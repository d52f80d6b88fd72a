"""ZeroRedundancyOptimizer on a process group of the even ranks of 4, whose ranks built their models from other seeds
(the behaviour pytorch's test_nondefault_process_group asks for): the group's rank 0's parameters are copied at
construction, so the replicas are equal after every step and equal a one-process run from that model; the odd ranks
take no part (before: the drift check refused the ranks' different starting weights at the first step)."""
import torch
import torch.distributed as dist
from torch import nn

from manualdp.distributed import ZeroRedundancyOptimizer
from manualdp.spmd import launch

EVEN = [0, 2]


def _net():
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def _train(net, opt, x, y, pg, steps=3):
    """`steps` steps on (x, y); after each, every rank of `pg` gathers the parameters (rank 0 of `pg` keeps them)."""
    seen = []
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = nn.functional.l1_loss(net(x), y)
            loss.backward()
            return loss
        opt.step(closure=closure)
        for p in net.parameters():
            copies = [torch.empty_like(p) for _ in EVEN] if dist.get_rank() == EVEN[0] else None
            dist.gather(p.detach(), copies, dst=EVEN[0], group=pg)
            seen.append(copies)
    return seen


def _job():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pg = dist.new_group(ranks=EVEN, backend="gloo")  # every rank creates it, as torch asks
    if rank not in EVEN:
        return None
    out = {}
    for data in ("same", "own"):
        torch.manual_seed(rank)  # each rank its own model
        net = _net()
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, process_group=pg,
                                      timeout=20)
        x, y = _batch(0 if data == "same" else rank)
        out[data] = (_train(net, opt, x, y, pg), [p.detach().clone() for p in net.parameters()])
    return out


def _reference():
    """Three steps of SGD with momentum, from the model global rank 0 builds, on the batch every rank is given."""
    torch.manual_seed(0)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(0)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.l1_loss(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def test_zero_on_a_group_of_the_even_ranks_seeded_apart_trains_the_groups_rank_0_model_alike_on_every_rank():
    results = launch(_job, 4, timeout=180)
    assert results[1] is None and results[3] is None
    for data in ("same", "own"):
        for copies in results[0][data][0]:  # after every step, every parameter
            torch.testing.assert_close(copies[1], copies[0], rtol=0, atol=0, msg=data)
    for rank in EVEN:
        for got, want in zip(results[rank]["same"][1], _reference()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
