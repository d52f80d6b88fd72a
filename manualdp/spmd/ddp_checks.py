"""What a `DistributedDataParallel` step checks at run time, in torch's words where torch has some.

- at the first synchronised step: every rank runs the same comm hook (or none);
- `debug`: before each bucket, every rank shows (step, bucket, size, parameters) to every rank;
- `static_graph`: the parameters used must stay those of the first iteration;
- otherwise, without `find_unused_parameters`: every rank's backward must reach every parameter.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .hooks import hook_name
from .collectives import allreduce

__all__ = ["StepChecks"]


class StepChecks:
    """The run-time checks of `DistributedDataParallel` (a mixin: they read the wrapper's buckets)."""

    def _check_same_hook(self) -> None:
        """On the worker, at the first synchronised step: the same comm hook on every rank, or all raise naming them.

        A hook on one rank only would send other messages than its peers' allreduce (gloo aborts).
        The ranks sum a table of one fingerprint each, and only on a mismatch gather the names.
        """
        mine = hook_name(self._comm_hook[1]) if self._comm_hook is not None else "none (manualdp's allreduce)"
        table = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        table[self.rank] = zlib.crc32(mine.encode())
        allreduce(table, "naive", self.process_group, timeout=self.timeout, check=False)
        if len(set(table.tolist())) == 1:
            return
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        raise ValueError(f"rank {self.rank}: DistributedDataParallel: the ranks registered different comm hooks ("
                         + ", ".join(f"rank {r}: {name}" for r, name in enumerate(everyone))
                         + "); call register_comm_hook with the same hook on every rank")

    def _check_in_step(self, index: int, bucket) -> None:
        """Debug mode: every rank must be about to reduce the same bucket of the same step; else all raise."""
        mine = {"step": self._step, "bucket": index, "numel": bucket.offsets[-1], "dtype": str(bucket.flat.dtype),
                "params": self._names[index], "joined": self._joined,
                "unused": [n for n, arrived in zip(self._names[index], bucket.arrived) if not arrived]}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        training = [(r, f) for r, f in enumerate(everyone) if not f["joined"]]
        keys = ("bucket", "numel", "dtype", "params") + (("step",) if len(training) == self.world_size else ())
        first_rank, first = training[0] if training else (0, everyone[0])
        for r, theirs in training:
            wrong = [k for k in keys if theirs[k] != first[k]]
            if not wrong:
                continue
            a, b = first["params"], theirs["params"]
            differs = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            named = (f"parameter {differs} of the bucket is {a[differs] if differs < len(a) else 'missing'!r} on rank "
                     f"{first_rank} but {b[differs] if differs < len(b) else 'missing'!r} on rank {r}")
            unused = "; ".join(f"rank {q}: {f['unused'] or 'none'}" for q, f in enumerate(everyone))
            raise RuntimeError(
                f"DistributedDataParallel desync: rank {first_rank} is at step {first['step']} bucket {first['bucket']} "
                f"({first['numel']} elements, {first['dtype']}), rank {r} at step {theirs['step']} bucket "
                f"{theirs['bucket']} ({theirs['numel']} elements, {theirs['dtype']}); differing: {', '.join(wrong)}; "
                f"{named}. Unused parameters: {unused}")

    def _check_static(self, used: frozenset) -> None:
        """static_graph: the parameters used must be those of the first iteration, as torch insists."""
        if self._static_used is None:
            self._static_used = used
            return
        names = lambda keys: sorted(self._names[b][i] for b, i in keys)  # noqa: E731
        if used - self._static_used:
            raise RuntimeError("Your training graph has changed in this iteration, e.g., one parameter is unused "
                               "in first iteration, but then got used in the second iteration. this is not "
                               "compatible with static_graph set to True. Newly used: "
                               f"{names(used - self._static_used)}")
        if self._static_used - used:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. "
                               "This error indicates that your training graph has changed in this iteration, e.g., "
                               "one parameter is used in first iteration, but then got unused in the second "
                               "iteration. this is not compatible with static_graph set to True.\nParameters which "
                               f"did not receive grad for rank {self.rank}: {names(self._static_used - used)}")

    def _check_all_ready(self) -> None:
        """Without find_unused_parameters every rank's backward must reach every parameter, as torch requires.

        The ready flags were summed with the gradients, so every rank finds the same parameters
        missing and the next forward raises on all of them (torch's reducer raises there too).
        """
        missing = sorted((self._index[id(p)], self._names[b][i], int(count), bucket.arrived[i])
                         for b, bucket in enumerate(self._buckets)
                         for i, (p, count) in enumerate(zip(bucket.params, bucket.ready.tolist()))
                         if count < self._active)
        if not missing:
            return
        here = [(k, name) for k, name, _, arrived in missing if not arrived]  # what torch's message names
        self._unfinished = (
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. You can enable unused "
            "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "DistributedDataParallel, and by making sure all `forward` function outputs participate in calculating "
            f"loss.\nParameter indices which did not receive grad for rank {self.rank}: "
            + " ".join(str(k) for k, _ in here)
            + f"\nParameters which did not receive grad for rank {self.rank}: " + ", ".join(name for _, name in here)
            + f"\nOn all {self._active} ranks, those which did not receive grad somewhere (ranks where they did): "
            + ", ".join(f"{name} ({count} of {self._active})" for _, name, count, _ in missing))
