"""Unused-parameter detection and static graph for `DistributedDataParallel`, in torch's words.

After each synchronised backward (`GraphChecks`, on the reducer's summed "ready" flags):
- `static_graph`: the parameters used must stay those of the first iteration;
- otherwise, without `find_unused_parameters`: every rank's backward must reach every parameter;
- at construction: the module's devices against `device_ids`, the mesh, and no in-backward optimizers; and
  inputs moved to the module's device (`to_device`).
What the ranks compare during a step (calls, comm hooks, debug mode) is in `step_check.py`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .feature import Feature

__all__ = ["GraphChecks", "unfinished_message", "mesh_group", "module_device", "to_device",
           "refuse_in_backward_optimizers"]


class GraphChecks(Feature):
    """After each synchronised backward: unused-parameter detection, or static graph's rule.

    Args:
        reducer: the drop-in's `Reducer`; rank: this rank; logged: (error) -> error, the wrapper's error log.
        static_graph, find_unused_parameters: the wrapper's flags (neither: every parameter must be used).
    """

    def __init__(self, reducer, rank: int, static_graph: bool, find_unused_parameters: bool, logged) -> None:
        self.reducer, self.rank, self.logged = reducer, rank, logged
        self.static_graph, self.find_unused_parameters = static_graph, find_unused_parameters
        # The error the next forward raises on every rank, as torch's reducer does: a backward pass
        # left a parameter without a gradient on some rank (or, with static_graph, changed the graph).
        self.unfinished: str | None = None
        # static_graph: indices of the parameters the first iteration used
        self.static_used: frozenset[int] | None = None
        # what had not arrived when a parameter the first iteration left out did
        self.static_gap: list[int] | None = None

    def grad_ready(self, param) -> None:
        if self.static_graph:
            self.note_static(param)

    def backward_end(self, used: frozenset[int]) -> None:
        self.check_static(used) if self.static_graph else self.check_all_ready(used)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "logged"}

    def note_static(self, param) -> None:
        """static_graph, in a gradient hook: torch's reduction stops at the first parameter the first iteration
        did not use; what had not arrived by then is what torch's next forward names."""
        if (self.static_used is not None and self.static_gap is None
                and self.reducer.index(param) not in self.static_used):
            self.static_gap = sorted(self.static_used - self.reducer.arrived())

    def check_static(self, used: frozenset[int]) -> None:
        """static_graph: the parameters used must be those of the first iteration, as torch insists.

        A parameter newly used raises at once; one no longer used, at the next forward, as torch's
        reducer does. Either way the reduction is unfinished in torch's eyes, so every later forward
        raises too.
        """
        gap, self.static_gap = self.static_gap, None
        if self.static_used is None:
            self.static_used = used
            return
        name = self.reducer.name
        if used - self.static_used:
            self.unfinished = unfinished_message("static", self.rank, [(k, name(k)) for k in gap])
            raise self.logged(RuntimeError(f"{GRAPH_CHANGED} Newly used: "
                                           f"{sorted(name(k) for k in used - self.static_used)}"))
        if self.static_used - used:
            missing = sorted(self.static_used - used)
            self.unfinished = (unfinished_message("static", self.rank, [(k, name(k)) for k in missing])
                               + f"\nNot used in this iteration: {sorted(name(k) for k in missing)}")

    def check_all_ready(self, used: frozenset[int]) -> None:
        """Without find_unused_parameters every rank's backward must reach every parameter, as torch requires.

        The ready flags were summed with the gradients, so every rank finds the same parameters
        missing and the next forward raises on all of them (torch's reducer raises there too).
        """
        if self.find_unused_parameters:
            return
        r = self.reducer
        missing = sorted((r.index(p), r.names[b][i], int(count), bucket.arrived[i])
                         for b, bucket in enumerate(r.buckets)
                         for i, (p, count) in enumerate(zip(bucket.params, bucket.ready.tolist()))
                         if count < r.active)
        if not missing:
            return
        here = [(k, name) for k, name, _, arrived in missing if not arrived]  # what torch's message names
        self.unfinished = (
            unfinished_message("unused", self.rank, here)
            + f"\nOn all {r.active} ranks, those which did not receive grad somewhere (ranks where they did): "
            + ", ".join(f"{name} ({count} of {r.active})" for _, name, count, _ in missing))


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
        wanted = (torch.device(device_ids[0]) if not isinstance(device_ids[0], int)
                  else torch.device("cuda", device_ids[0]))
        if wanted != devices[0]:
            raise ValueError(f"device_ids={device_ids!r}, but the module is on {devices[0]}")
    return devices[0]


def mesh_group(device_mesh, process_group):
    """The process group of a one-dimensional `device_mesh`, in place of `process_group` (torch's words)."""
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if not hasattr(device_mesh, "get_group") or not hasattr(device_mesh, "ndim"):
        raise TypeError(f"device_mesh must be None or a DeviceMesh, got {device_mesh!r}")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group()


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


def to_device(obj, device: torch.device):
    """`obj` with every tensor inside (lists, tuples, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
