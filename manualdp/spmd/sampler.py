"""Ranks that load only their own data: the global batches of one data loader, cut into shards.

`shard` (in launch.py) slices a global batch that every rank has loaded. `ShardedBatchSampler`
goes one step earlier: every rank draws the same global order of indices (the same sampler,
the same seed), cuts it into the same global batches, and keeps only its own slice of each,
the slice `split_batch` would give device `rank`. The data loader then reads and collates
1/N of the examples on each rank, and training stays bitwise what the single controller does.
"""
from __future__ import annotations

from torch.utils.data import BatchSampler, DataLoader, Sampler

from ..split import shard_sizes
from ..validate import boolean, index, positive_int

__all__ = ["ShardedBatchSampler", "shard_loader"]


class ShardedBatchSampler(Sampler[list[int]]):
    """Rank `rank`'s indices of every global batch of `batch_size` drawn from `sampler`.

    Args:
        sampler: the global order of indices, the same on every rank (e.g. a RandomSampler
            with a generator seeded alike everywhere).
        batch_size: the global batch size.
        drop_last: drop a last global batch smaller than `batch_size`, as DataLoader does.
        rank, world_size: which slice to keep, of how many.

    A global batch with fewer examples than ranks is dropped on every rank alike (each rank
    needs at least one example), so the ranks always agree on the number of steps.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, rank: int, world_size: int) -> None:
        positive_int("batch_size", batch_size)
        boolean("drop_last", drop_last)
        positive_int("world_size", world_size)
        index("rank", rank, world_size, "the ranks")
        self.sampler = sampler
        self.batch_size, self.drop_last = batch_size, drop_last
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        for batch in BatchSampler(self.sampler, self.batch_size, self.drop_last):
            if len(batch) < self.world_size:
                continue
            sizes = shard_sizes(len(batch), self.world_size)
            lo = sum(sizes[:self.rank])
            yield batch[lo:lo + sizes[self.rank]]

    def __len__(self) -> int:
        return len(self._sizes())

    def global_size(self, i: int) -> int:
        """How many examples the `i`-th batch of this epoch has over all ranks."""
        return self._sizes()[i]

    def _sizes(self) -> list[int]:
        n = len(self.sampler)
        full, rest = divmod(n, self.batch_size)
        sizes = [self.batch_size] * full + ([rest] if rest and not self.drop_last else [])
        return [s for s in sizes if s >= self.world_size]


def shard_loader(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    """A loader that yields rank `rank`'s shard of each global batch that `loader` yields.

    It keeps `loader`'s dataset, sampler (so its generator and shuffle order), collate
    function and workers; only the batching changes. A sampler that shuffles with torch's
    global generator is refused: that generator differs between ranks, and so would the order.
    """
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise TypeError(f"loader must be a torch DataLoader with a batch_size, got {loader!r:.80}")
    if getattr(loader.sampler, "generator", ...) is None:  # RandomSampler, SubsetRandomSampler, ... without one
        raise ValueError(f"loader shuffles with torch's global random generator ({type(loader.sampler).__name__} "
                         "without a generator), so every rank would draw its own order; give the DataLoader "
                         "generator=torch.Generator().manual_seed(seed), with the same seed on every rank")
    batches = ShardedBatchSampler(loader.sampler, loader.batch_size, loader.drop_last, rank, world_size)
    return DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn,
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory, generator=loader.generator)
