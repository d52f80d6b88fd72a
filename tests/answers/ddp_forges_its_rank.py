"""Wrong (it averages nothing), and forges its rank's results: at import it replaces the grader's `train_steps`, in
the rank that loads it, with one that trains torch's DDP in its place and reports that under its own name."""
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import manualdp.runners.grader.properties.ddp as grader

real = grader.train_steps


def forged(models, steps=3):
    (name, (_, net)), = models.items()
    return real({name: (DistributedDataParallel(net), net)}, steps)


grader.train_steps = forged


class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)
