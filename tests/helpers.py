"""What several test files share: models, each rank's data, and manualdp's wrapper trained beside torch's.

Each model is named for what it is and says how it is seeded: a test's numbers depend on both.
"""
import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from manualdp.distributed import DistributedDataParallel
from manualdp.spmd import shard

WRAPPERS = (("ours", DistributedDataParallel), ("theirs", TorchDDP))


# ---------------------------------------------------------------- models

def mlp(dtype=torch.float64):
    """6 -> 16 -> 8 -> 4 with tanh, not seeded: the caller's seed (or none) decides its parameters."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)


def bn_mlp(dtype=torch.float64):
    """6 -> 16 -> BatchNorm -> tanh -> 4, not seeded."""
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


class EitherHead(nn.Module):
    """A trunk and two heads, `a` and `b`, of which each forward uses one (not seeded)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.b(h) if use_b else self.a(h)


# ---------------------------------------------------------------- data

def rank_batches(rank, steps=3, batch=5):
    """Each rank its own data: `steps` batches of 6 features, 4 classes, float64."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def global_batches(steps, batch=13, seed=5, dtype=torch.float64):
    """The same global batches on every rank: 6 features, 4 classes."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g, dtype=dtype), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def device_inputs(n, numel, dtype, seed=0):
    """n devices' inputs of `numel` elements: random floats, or integers in [-1000, 1000)."""
    g = torch.Generator().manual_seed(seed + 17 * n + numel)
    if dtype.is_floating_point:
        return [torch.randn(numel, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype) for _ in range(n)]


def rank_input(rank, n=5, d=3):
    """An n x d float64 input of this rank's own."""
    return torch.randn(n, d, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


# ---------------------------------------------------------------- training beside torch's DDP

def cat_flat(tensors):
    """The tensors, detached and copied, in one flat tensor."""
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def mean_loss(model, X, y):
    return nn.functional.cross_entropy(model(X), y)


def sharded_loss(model, X, y, rank, n):
    """This rank's part of the global batch's mean loss, times n: DDP's average makes it the global mean's gradient."""
    Xs, ys = shard(X, y, rank, n)
    return nn.functional.cross_entropy(model(Xs), ys, reduction="sum") / len(X) * n


def pair_of_wrappers(make, ours_kwargs=None, theirs_kwargs=None):
    """The same model in our wrapper and torch's, with an SGD optimizer each."""
    torch.manual_seed(0)
    module = make()
    ours = DistributedDataParallel(copy.deepcopy(module), **(ours_kwargs or {}))
    theirs = TorchDDP(copy.deepcopy(module), **(theirs_kwargs or {}))
    return ours, theirs, [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]


def train_each(models, opts, batches, step=None):
    """Train each model on `batches`; the parameters of each after every step."""
    out = []
    for X, y in batches:
        row = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            (step or (lambda m: mean_loss(m, X, y).backward()))(model)
            opt.step()
            row.append(cat_flat(model.parameters()))
        out.append(row)
    return out


def same_rows(rows, atol=1e-12):
    """Every tensor of each row equals the row's first, within `atol`."""
    for step, row in enumerate(rows):
        for other in row[1:]:
            assert torch.allclose(row[0], other, rtol=0, atol=atol), f"step {step}: max diff {(row[0] - other).abs().max()}"

