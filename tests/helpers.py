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


def seeded_mlp(dtype=torch.float64):
    """mlp(), built right after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return mlp(dtype)


def bn_mlp(dtype=torch.float64):
    """6 -> 16 -> BatchNorm -> tanh -> 4, not seeded."""
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def seeded_bn_mlp(dtype=torch.float64):
    """bn_mlp(), built right after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return bn_mlp(dtype)


def small_mlp():
    """6 -> 8 -> 4 with tanh, float64, built right after torch.manual_seed(0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def uneven_mlp():
    """6 -> 8 -> 5 -> 4 with tanh, float64, built right after torch.manual_seed(0).

    56 + 45 + 24 = 125 elements, 2 mod 3, and the layers' sizes divide by neither 2 nor 3: uneven shards.
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def dropout_mlp(hidden=12):
    """5 -> hidden -> ReLU -> Dropout(0.2) -> 3, float32, built right after torch.manual_seed(0).

    Dropout draws from the global RNG while it trains: a resumed run must restore that too.
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 3))


class Branchy(nn.Module):
    """`body`, and `side` added while `use_side`: when it is off, `side` gets no gradient. Seeded (0) as it is built."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.side = nn.Linear(6, 4).double(), nn.Linear(6, 4).double()
        self.use_side = True

    def forward(self, x):
        return self.body(x) + (self.side(x) if self.use_side else 0)


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


class Crash(Exception):
    """What CrashingLoss raises."""


class CrashingLoss(nn.CrossEntropyLoss):
    """A loss that raises on its `at`-th call: a run killed in the middle of training."""

    def __init__(self, at):
        super().__init__(reduction="sum")
        self.calls, self.at = 0, at

    def forward(self, out, y):
        self.calls += 1
        if self.at is not None and self.calls == self.at:
            raise Crash()
        return super().forward(out, y)


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
            assert torch.allclose(row[0], other, rtol=0, atol=atol), (
                f"step {step}: max diff {(row[0] - other).abs().max()}")



def error_of(fn) -> str | None:
    """"Type: message" of what `fn()` raised, or None: what a rank saw, to be compared in the parent."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(e).__name__}: {e}"
    return None
