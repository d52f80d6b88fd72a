"""`SyncBatchNorm`: BatchNorm whose batch statistics are taken over every rank's samples.

Each rank takes its own per-channel count, mean and sum of squared deviations (M2), and the
ranks' rows are summed over the process group with manualdp's allreduce (each rank fills its
row of a table, zeros elsewhere: an all-gather); every rank then combines them as Chan et
al.'s parallel variance does. Raw sums of x and x² would be simpler, but E[x²] - E[x]² loses
every digit of the variance when the mean is large against the spread (float32 around 1e4).
That sum is an autograd function whose backward is the same allreduce of the gradients, so
autograd derives the rest of BatchNorm's backward by itself. Both go through the group's one
ordered worker, so they never interleave with the DDP wrapper's bucket messages in the same
backward pass. In eval mode nothing is pooled, as in torch: the running statistics, or
without them this rank's batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..validate import boolean, nn_module, non_negative_number, positive_int, positive_number
from .transport.group import group_worker
from .collectives import allreduce

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class _GroupSum(torch.autograd.Function):
    """Sum a tensor over the group; the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _summed(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


def _summed(tensor: torch.Tensor, group) -> torch.Tensor:
    out = tensor.detach().clone()
    group_worker(group).submit(allreduce, out, "ring", group).result()
    return out


class SyncBatchNorm(nn.Module):
    """BatchNorm over the samples of all ranks (any input `(N, C, ...)`), with torch's parameter names.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance before its square root.
        momentum: weight of the new batch in the running statistics; None: a cumulative average.
        affine: learn a per-channel scale (`weight`) and shift (`bias`).
        track_running_stats: keep running statistics and use them in eval mode.
        process_group: the ranks whose samples are pooled (default: all).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None) -> None:
        super().__init__()
        positive_int("num_features", num_features)
        positive_number("eps", eps)
        if momentum is not None:
            non_negative_number("momentum", momentum)
        boolean("affine", affine)
        boolean("track_running_stats", track_running_stats)
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats, self.process_group = affine, track_running_stats, process_group
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) needs input (N, {self.num_features}, ...), "
                             f"got shape {tuple(x.shape)}")
        shape = [1, -1] + [1] * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        if self.training or not self.track_running_stats:
            pool = self.training and _distributed(self.process_group)  # eval never waits for other ranks
            mean, var, n = _batch_stats(x, dims, self.process_group, pool)
            if self.training and self.track_running_stats:
                self._update_running(mean.detach(), var.detach() * n.detach() / (n.detach() - 1).clamp_min(1))
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """`module` with every BatchNorm layer replaced by a SyncBatchNorm holding the same state."""
        return convert_sync_batchnorm(module, process_group)


def _batch_stats(x: torch.Tensor, dims: list[int], group, pool: bool):
    """Per-channel mean and biased variance of this rank's batch, or with `pool` of every rank's; and the count."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    n = torch.full((1,), x.numel() // x.shape[1], dtype=x.dtype, device=x.device)
    mean = x.sum(dims) / n.clamp_min(1)
    m2 = (x - mean.view(shape)).square().sum(dims)
    if pool:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        row = torch.cat([n, mean, m2]).unsqueeze(0)
        table = _GroupSum.apply(nn.functional.pad(row, (0, 0, rank, world - rank - 1)), group)  # row r: rank r's
        c = x.shape[1]
        counts, means, m2s = table[:, :1], table[:, 1:c + 1], table[:, c + 1:]
        n = counts.sum(0)
        mean = (counts * means).sum(0) / n
        m2 = (m2s + counts * (means - mean).square()).sum(0)  # Chan et al.: each rank's M2 about the global mean
    return mean, m2 / n.clamp_min(1), n


def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """`module` with every BatchNorm layer replaced by a SyncBatchNorm holding the same state."""
    nn_module("module", module)
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, process_group)
        like = module.weight if module.affine else module.running_mean
        if like is not None:
            sync.to(device=like.device, dtype=like.dtype)  # dtype= leaves the integer batch count alone
        sync.load_state_dict(module.state_dict())
        if module.affine:
            sync.weight.requires_grad_(module.weight.requires_grad)
            sync.bias.requires_grad_(module.bias.requires_grad)
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
