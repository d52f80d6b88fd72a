"""What a `DistributedDataParallel` step checks at run time, in torch's words where torch has some.

- at the first synchronised step: every rank runs the same comm hook (or none);
- `debug`: before each bucket, every rank shows (step, bucket, size, parameters) to every rank;
- `static_graph`: the parameters used must stay those of the first iteration;
- otherwise, without `find_unused_parameters`: every rank's backward must reach every parameter;
- at construction: the module's devices against `device_ids`, and no in-backward optimizers.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .hooks import hook_name
from .collectives import allreduce

__all__ = ["StepChecks", "unfinished_message", "module_device", "refuse_in_backward_optimizers"]


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

    def _note_static(self, b: int, i: int) -> None:
        """static_graph, in a gradient hook: torch's reduction stops at the first parameter the first iteration
        did not use; what had not arrived by then is what torch's next forward names."""
        if (b, i) not in self._static_used and self._static_gap is None:
            self._static_gap = sorted(self._index[id(self._buckets[c].params[j])]
                                      for c, j in self._static_used if not self._buckets[c].arrived[j])

    def _check_static(self, used: frozenset) -> None:
        """static_graph: the parameters used must be those of the first iteration, as torch insists.

        A parameter newly used raises at once; one no longer used, at the next forward, as torch's
        reducer does. Either way the reduction is unfinished in torch's eyes, so every later forward
        raises too.
        """
        gap, self._static_gap = self._static_gap, None
        if self._static_used is None:
            self._static_used = used
            return
        by_index = {self._index[id(self._buckets[b].params[i])]: self._names[b][i] for b, i in self._static_used}
        if used - self._static_used:
            self._unfinished = unfinished_message("static", self.rank, [(k, by_index[k]) for k in gap])
            raise self._logged(RuntimeError(
                f"{GRAPH_CHANGED} Newly used: {sorted(self._names[b][i] for b, i in used - self._static_used)}"))
        if self._static_used - used:
            missing = sorted(self._index[id(self._buckets[b].params[i])] for b, i in self._static_used - used)
            self._unfinished = (unfinished_message("static", self.rank, [(k, by_index[k]) for k in missing])
                                + f"\nNot used in this iteration: {sorted(by_index[k] for k in missing)}")

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
            unfinished_message("unused", self.rank, here)
            + f"\nOn all {self._active} ranks, those which did not receive grad somewhere (ranks where they did): "
            + ", ".join(f"{name} ({count} of {self._active})" for _, name, count, _ in missing))


# torch's words (its reducer's, in libtorch); `unfinished_message` puts them together as torch does.
GRAPH_CHANGED = ("Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, "
                 "but then got used in the second iteration. this is not compatible with static_graph set to True.")
UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one. "
UNFINISHED_BECAUSE = {
    "unused": "This error indicates that your module has parameters that were not used in producing loss. You can "
              "enable unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
              "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs "
              "participate in calculating loss. \nIf you already have done the above, then the distributed data "
              "parallel module wasn't able to locate the output tensors in the return value of your module's "
              "`forward` function. Please include the loss function and the structure of the return value of "
              "`forward` of your module when reporting this issue (e.g. list, dict, iterable).",
    "static": "This error indicates that your training graph has changed in this iteration, e.g., one parameter is "
              "used in first iteration, but then got unused in the second iteration. this is not compatible with "
              "static_graph set to True."}
DEBUG_HINT = ("\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL "
              "to print out information about which particular parameters did not receive gradient on this rank as "
              "part of this error")


def unfinished_message(why: str, rank: int, missing: list[tuple[int, str]]) -> str:
    """torch's error at the forward after an unfinished reduction; `missing`: (index, name) of what this rank lacked.

    As torch: the indices, then the hint to set TORCH_DISTRIBUTED_DEBUG, or with it set, the
    names first. manualdp names them in both cases (a line after torch's text).
    """
    indices = f"\nParameter indices which did not receive grad for rank {rank}: " + " ".join(str(k) for k, _ in missing)
    names = f"\nParameters which did not receive grad for rank {rank}: " + ", ".join(name for _, name in missing)
    if dist.get_debug_level() == dist.DebugLevel.OFF:
        return UNFINISHED + UNFINISHED_BECAUSE[why] + indices + DEBUG_HINT + names
    return UNFINISHED + UNFINISHED_BECAUSE[why] + names + indices


def module_device(params: list, device_ids, output_device) -> torch.device:
    """The device of the module's first parameter, after torch's checks of `device_ids` and `output_device`.

    As torch: the parameters may span several devices of one type (model parallelism), and then,
    as for a CPU module, `device_ids` and `output_device` must be None.
    """
    if device_ids is not None and (not isinstance(device_ids, (list, tuple)) or len(device_ids) > 1):
        raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids!r}.")
    devices = list(dict.fromkeys(p.device for p in params))
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError("DistributedDataParallel's input module must be on the same type of devices, but input "
                         f"module parameters locate in {types}.")
    if (not device_ids or devices[0].type == "cpu" or len(devices) > 1) and (device_ids or output_device is not None):
        raise ValueError("DistributedDataParallel device_ids and output_device arguments only work with "
                         "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                         f"{device_ids}, output_device {output_device}, and module parameters {set(devices)}.")
    if device_ids:
        wanted = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else torch.device("cuda", device_ids[0])
        if wanted != devices[0]:
            raise ValueError(f"device_ids={device_ids!r}, but the module is on {devices[0]}")
    return devices[0]


def refuse_in_backward_optimizers(named_params) -> None:
    """Raise if a parameter carries torch's in-backward optimizers (`_apply_optimizer_in_backward`).

    Their hook steps the parameter with this rank's own gradient and clears it before the
    allreduce, so training would go on silently wrong; torch's DDP reworks them, manualdp does not.
    """
    carrying = [name for name, p in named_params if hasattr(p, "_in_backward_optimizers")]
    if carrying:
        raise ValueError(f"module: parameters {carrying} carry optimizers that step inside backward "
                         "(torch.distributed.optim._apply_optimizer_in_backward), which manualdp's "
                         "DistributedDataParallel does not support: each rank would step on its own gradient, "
                         "before the average. Step a plain optimizer after backward() instead.")
