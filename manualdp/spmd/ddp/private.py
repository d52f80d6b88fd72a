"""torch's private `DistributedDataParallel` methods that torch's own tests call, where manualdp
can offer them honestly.

- `_get_ddp_logging_data()`: torch's debugging dictionary. torch fills a C++ logger with its
  settings, run-time timings and the last error; manualdp keeps no timings, so it reports the
  fields in `LOGGED_FIELDS` only, under torch's names (a conformance test that reads another
  field is left out for it, by name, in bench/conformance.py).
- `_remove_autograd_hooks()`: the wrapper's gradient hooks come off the module's parameters.
- `_register_builtin_comm_hook(dist.BuiltinCommHookType.X)`: torch's C++ hooks, as manualdp's own.
- `_set_params_and_buffers_to_ignore_for_model(module, names)`: names a later wrapper neither syncs nor checks.
- `_register_buffer_comm_hook`, `_default_broadcast_coalesced`: the buffer comm hook (`buffers.py`).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ...validate import iterable, nn_module
from .. import comm_hooks as hooks
from .buffers import POST_FORWARD

__all__ = ["PrivateAPI", "ErrorLog", "LOGGED_FIELDS"]

# What `_get_ddp_logging_data()` holds. `iteration` counts the synchronised backward passes;
# `has_error`/`error`: the last error the wrapper raised while training; `comm_hook` is absent
# while none is registered, as in torch.
LOGGED_FIELDS = ("world_size", "rank", "module_name", "backend_name", "broadcast_buffers", "find_unused_parameters",
                 "gradient_as_bucket_view", "static_graph", "num_parameter_tensors", "total_parameter_size_bytes",
                 "has_sync_bn", "join_uneven_inputs", "comm_hook", "iteration", "has_error", "error")

_BUILTIN = {"ALLREDUCE": hooks.allreduce_hook, "FP16_COMPRESS": hooks.fp16_compress_hook}


class ErrorLog:
    """The last error the wrapper raised while training: call it on an error before raising it, as torch logs them."""

    def __init__(self) -> None:
        self.last: str | None = None

    def __call__(self, error: Exception) -> Exception:
        self.last = str(error)
        return error


class PrivateAPI:
    """torch's private methods on `DistributedDataParallel` (a mixin: it reads the wrapper's public settings
    and parts)."""

    _comm_hook_name: str | None = None  # what torch logs: the hook's __qualname__, or the built-in type

    def _get_ddp_logging_data(self) -> dict:
        """torch's debugging dictionary, with the fields manualdp knows (`LOGGED_FIELDS`)."""
        params, hook, error = self.reducer.params, self.calls.comm_hook, self.errors.last
        data = {"world_size": self.world_size, "rank": self.rank, "module_name": type(self.module).__name__,
                "backend_name": dist.get_backend(self.process_group),
                "broadcast_buffers": int(self.forward_sync_buffers),
                "find_unused_parameters": int(self.find_unused_parameters),
                "gradient_as_bucket_view": int(self.gradient_as_bucket_view), "static_graph": int(self.static_graph),
                "num_parameter_tensors": len(params),
                "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
                # torch's nn.SyncBatchNorm or manualdp's (spmd/syncbn.py imports this package's ddp)
                "has_sync_bn": int(any(type(m).__name__ == "SyncBatchNorm" for m in self.module.modules())),
                "join_uneven_inputs": int(self.uneven.used), "iteration": self.reducer.steps,
                "has_error": int(error is not None)}
        if hook is not None:
            data["comm_hook"] = self._comm_hook_name or getattr(hook.hook, "__qualname__", hooks.hook_name(hook.hook))
        if error is not None:
            data["error"] = error
        return data

    def _remove_autograd_hooks(self) -> None:
        """Take this wrapper's gradient hooks off the module's parameters: their backward no longer syncs here."""
        self.reducer.remove_hooks()

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's built-in hooks by type (`dist.BuiltinCommHookType.ALLREDUCE` or `FP16_COMPRESS`), as manualdp's."""
        name = getattr(comm_hook_type, "name", None)
        if name not in _BUILTIN:
            raise ValueError(f"comm_hook_type must be one of dist.BuiltinCommHookType.{', '.join(_BUILTIN)}, "
                             f"got {comm_hook_type!r}")
        self.register_comm_hook(self.process_group, _BUILTIN[name])
        self._comm_hook_name = str(comm_hook_type)

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=POST_FORWARD) -> None:
        """torch's private API: sync buffers with `hook(state, {name: buffer})` instead of rank 0's copy."""
        self.buffer_sync.register(state, hook, comm_hook_location)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank: int = 0) -> None:
        """Copy `bufs` (default: the module's buffers) from group rank `authoritative_rank` to every rank.

        torch's name, which buffer hooks call. `bucket_size` is accepted and ignored: one message per dtype.
        """
        self.buffer_sync.broadcast(bufs, authoritative_rank)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """torch's (private) way to exclude parameters and buffers, by full name, from a later wrapper's syncing."""
        nn_module("module", module)
        names = list(iterable("params_and_buffers_to_ignore", params_and_buffers_to_ignore))
        if isinstance(params_and_buffers_to_ignore, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"params_and_buffers_to_ignore must hold full names (str), got {names!r}")
        module._ddp_params_and_buffers_to_ignore = names
