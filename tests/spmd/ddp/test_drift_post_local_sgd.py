"""torch's post-local SGD hook parts the replicas on purpose (each rank steps alone between its model averager's
averages): the drift check must not call that drift. Adversary 70 (D31): a false alarm at step 8 with
`PeriodicModelAverager(period=3)`, where torch's DDP trains."""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import launch

STEPS = 12


def _train(wrapper) -> list[torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    model = wrapper(net)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every rank its own subgroup: the replicas part
    model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=3),
                             post_localSGD_hook)
    averager = PeriodicModelAverager(period=3, warmup_steps=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        averager.average_parameters(model.parameters())
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def _both() -> dict:
    return {"torch": _train(TorchDDP), "ours": _train(DistributedDataParallel)}


def test_post_local_sgd_with_a_periodic_averager_trains_as_torchs_without_a_drift_alarm():
    for got in launch(_both, 2, timeout=120):
        for ours, theirs in zip(got["ours"], got["torch"]):
            assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), (ours - theirs).abs().max()
