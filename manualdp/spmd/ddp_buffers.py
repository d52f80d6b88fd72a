"""Buffers across ranks (BatchNorm's running statistics, counters): what `DistributedDataParallel` copies, and when.

At construction every rank takes rank 0's parameters and buffers. Before each forward pass that
a synchronised backward follows, rank 0's buffers are copied to every rank again, unless
`forward_sync_buffers=False`. torch 2.13 renamed `broadcast_buffers` so: the old name still
works, with a `FutureWarning`, and `broadcast_buffers=False` also keeps the buffers out of the
copy at construction, which `forward_sync_buffers=False` does not. A buffer comm hook (torch's
private `_register_buffer_comm_hook`) replaces the copy by any collective, before or after forward.
"""
from __future__ import annotations

import warnings

from torch.nn.parallel.distributed import _BufferCommHookLocation  # torch's enum: its tests pass its values

from ..validate import a_callable, boolean
from .ddp_sync import broadcast_from_rank0, kept_named, state_tensors

__all__ = ["BufferSync", "PRE_FORWARD", "POST_FORWARD"]

PRE_FORWARD, POST_FORWARD = _BufferCommHookLocation.PRE_FORWARD, _BufferCommHookLocation.POST_FORWARD

# torch 2.13's words
DEPRECATED = ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
              "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely on "
              "buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` "
              "until `init_sync_buffers` is available.")
BOTH = ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is deprecated and "
        "its value is ignored when `forward_sync_buffers` is provided.")


class BufferSync:
    """The buffer half of `DistributedDataParallel` (a mixin: it reads the module, the group and the flags)."""

    _buffer_hook = None  # (state, hook, location) from `_register_buffer_comm_hook`, or None: rank 0's copy
    _buffer_futures: tuple = ()  # what the buffer hook returned this step, waited for at the end of backward

    def _settle_buffer_flags(self, broadcast_buffers: bool | None, forward_sync_buffers: bool | None,
                             stacklevel: int = 3) -> bool:
        """Set `forward_sync_buffers` as torch 2.13 does; True when buffers are copied at construction too."""
        for name, flag in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
            if flag is not None:
                boolean(name, flag)
        if broadcast_buffers is not None:
            warnings.warn(BOTH if forward_sync_buffers is not None else DEPRECATED, FutureWarning, stacklevel=stacklevel)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = forward_sync_buffers
            return True
        self.forward_sync_buffers = broadcast_buffers is not False
        return self.forward_sync_buffers

    @property
    def broadcast_buffers(self) -> bool:
        """torch's old name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _sync_buffers(self, where: _BufferCommHookLocation) -> None:
        """Before (`PRE_FORWARD`) or after forward: rank 0's buffers to every rank, or the buffer hook, when due."""
        hook = self._buffer_hook
        if not (self.require_forward_param_sync and self.forward_sync_buffers) or where != (hook[2] if hook else PRE_FORWARD):
            return
        if hook is None:
            self._default_broadcast_coalesced()
            return
        named = dict(kept_named(self.module.named_buffers(), self.parameters_to_ignore))
        if named:  # as torch: no buffers, no hook
            futures = hook[1](hook[0], named)
            self._buffer_futures = tuple(futures) if futures is not None else ()

    def _wait_buffer_futures(self) -> None:
        """End of backward: the futures the buffer hook returned are done, as torch waits for them there."""
        futures, self._buffer_futures = self._buffer_futures, ()
        for future in futures:
            future.wait()

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank: int = 0) -> None:
        """Copy `bufs` (default: the module's buffers) from group rank `authoritative_rank` to every rank.

        torch's name, which buffer hooks call. `bucket_size` is accepted and ignored: one message per dtype.
        """
        tensors = state_tensors(self.module, self.parameters_to_ignore) if bufs is None else list(bufs)
        broadcast_from_rank0(tensors, self.rank, self._peers, self.process_group, self.timeout, src=authoritative_rank)

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=POST_FORWARD) -> None:
        """torch's private API: sync buffers with `hook(state, {name: buffer})` instead of rank 0's copy.

        The hook runs before or after each forward that syncs (`comm_hook_location`, torch's
        `_BufferCommHookLocation`); futures it returns are waited for at the end of backward.
        """
        a_callable("hook", hook)
        if not isinstance(comm_hook_location, _BufferCommHookLocation):
            raise TypeError(f"comm_hook_location must be a _BufferCommHookLocation, got {comm_hook_location!r}")
        self._buffer_hook = (state, hook, comm_hook_location)
