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

from ...validate import a_callable, boolean
from ..transport.agree import broadcast_from_rank0
from .init_sync import kept_named, state_tensors
from .feature import Feature

__all__ = ["BufferSync", "settle_buffer_flags", "PRE_FORWARD", "POST_FORWARD"]

PRE_FORWARD, POST_FORWARD = _BufferCommHookLocation.PRE_FORWARD, _BufferCommHookLocation.POST_FORWARD

# torch 2.13's words
DEPRECATED = ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
              "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely on "
              "buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` "
              "until `init_sync_buffers` is available.")
BOTH = ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is deprecated and "
        "its value is ignored when `forward_sync_buffers` is provided.")


def settle_buffer_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None,
                        stacklevel: int = 3) -> tuple[bool, bool]:
    """(`forward_sync_buffers` as torch 2.13 sets it, whether buffers are copied at construction too)."""
    for name, flag in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
        if flag is not None:
            boolean(name, flag)
    if broadcast_buffers is not None:
        warnings.warn(BOTH if forward_sync_buffers is not None else DEPRECATED, FutureWarning, stacklevel=stacklevel)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    synced = broadcast_buffers is not False
    return synced, synced


class BufferSync(Feature):
    """The module's buffers across the reducer's ranks: rank 0's copy, or a buffer comm hook."""

    def __init__(self, module, ignored: set[str], reducer) -> None:
        self.module, self.ignored, self.reducer = module, ignored, reducer
        self.hook = None  # (state, hook, location) from `register`, or None: rank 0's copy
        self.futures: tuple = ()  # what the buffer hook returned this step, waited for at the end of backward

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("hook", "futures")} | {"hook": None, "futures": ()}

    def sync(self, where: _BufferCommHookLocation, due: bool, before=None) -> None:
        """Before (`PRE_FORWARD`) or after forward, when `due`: rank 0's buffers to every rank, or the buffer hook.

        `before`: called first where rank 0's buffers are copied (the wrapper's step check: torch's broadcast
        has no check of its own, and a rank in a collective of its own would wait there for its timeout).
        """
        hook = self.hook
        if not due or where != (hook[2] if hook else PRE_FORWARD):
            return
        if hook is None:
            tensors = state_tensors(self.module, self.ignored)
            if tensors and before is not None:
                before()
            self.broadcast(tensors)
            return
        named = dict(kept_named(self.module.named_buffers(), self.ignored))
        if named:  # as torch: no buffers, no hook
            futures = hook[1](hook[0], named)
            self.futures = tuple(futures) if futures is not None else ()

    def backward_end(self, used=None) -> None:
        """End of backward: the futures the buffer hook returned are done, as torch waits for them there."""
        futures, self.futures = self.futures, ()
        for future in futures:
            future.wait()

    def broadcast(self, bufs=None, authoritative_rank: int = 0) -> None:
        """Copy `bufs` (default: the module's buffers) from group rank `authoritative_rank` to every rank."""
        r = self.reducer
        tensors = state_tensors(self.module, self.ignored) if bufs is None else list(bufs)
        broadcast_from_rank0(tensors, r.group, r.timeout, src=authoritative_rank)

    def register(self, state, hook, comm_hook_location=POST_FORWARD) -> None:
        """Sync buffers with `hook(state, {name: buffer})` instead of rank 0's copy (torch's private API).

        The hook runs before or after each forward that syncs (`comm_hook_location`, torch's
        `_BufferCommHookLocation`); futures it returns are waited for at the end of backward.
        """
        a_callable("hook", hook)
        if not isinstance(comm_hook_location, _BufferCommHookLocation):
            raise TypeError(f"comm_hook_location must be a _BufferCommHookLocation, got {comm_hook_location!r}")
        self.hook = (state, hook, comm_hook_location)
