"""`DistributedDataParallel`: a drop-in for torch's, allreducing with manualdp's schedules.

Rung 5 of the ladder: rung 4's buckets (`reducer.py`) plus torch's features, each in a file of
its own that talks to the reducer through its public names: Join (`join.py`), comm hooks
(`comm_hook.py`), unused parameters and static graph (`graph.py`), the ranks' call check and
debug mode (`step_check.py`), buffer sync (`buffers.py`), torch's private methods (`private.py`).
This file is the wrapper: its arguments checked once, forward, `no_sync`, comm hooks, copies.
"""
from __future__ import annotations

import contextlib
import os
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from ...buckets import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB, assign_buckets
from ...validate import (boolean, initialized, nn_module, non_negative_int, one_of,
                        positive_int, positive_number, timeout_seconds)
from .buffers import POST_FORWARD, PRE_FORWARD, BufferSync, settle_buffer_flags
from .graph import GraphChecks, mesh_group, module_device, refuse_in_backward_optimizers, to_device
from .step_check import CallCheck, Desync
from .comm_hook import hooks_named, parts_replicas, register_hook
from .join import JoinableWrapper, UnevenInputs
from .private import ErrorLog, PrivateAPI
from .init_sync import NOT_COPIED, check_same_layout, compare_and_copy, kept_named
from ..transport.p2p import DEFAULT_SEGMENT_BYTES
from ..transport.group import group_state
from ..transport.peers import group_ranks, group_timeout
from .reducer import Reducer
from ..ladder.drift import DRIFT_CHECK_EVERY, DriftCheck
from ..ladder.identity import take_number
from ..ladder.loading import check_loadable, unchanged_if_refused
from ..auto.tune import ENGINE_ALGORITHMS

__all__ = ["DistributedDataParallel", "NoParametersError"]


class NoParametersError(ValueError, RuntimeError):
    """The module has no parameter that requires grad (torch raises RuntimeError, manualdp ValueError)."""


class DistributedDataParallel(nn.Module, JoinableWrapper, PrivateAPI):
    """A drop-in for `torch.nn.parallel.DistributedDataParallel`, allreducing with manualdp's schedules.

    The positional arguments come in torch's order.

    Args:
        module: the model, on this rank's device (or, as in torch, spread over several devices of one type).
        device_ids: `None`, or `[device]` for a module on one GPU; inputs are moved there. As in
            torch, `device_ids` and `output_device` must be None for CPU and multi-device modules.
        output_device: accepted for compatibility; outputs stay on the module's device.
        dim: accepted for compatibility: one device per process, so nothing is scattered.
        broadcast_buffers: torch's deprecated name for `forward_sync_buffers` (a `FutureWarning`);
            `False` also keeps the buffers out of the copy at construction (see `buffers.py`).
        init_sync: check that the ranks hold the same model and communication layout (buckets,
            algorithm, segment size, flags; every rank raises on a difference) and broadcast rank 0's state.
        process_group: the group to average over (default: all ranks).
        bucket_cap_mb: gradients are fused into buckets of at most this many MiB, in reverse
            parameter order; `None` gives one bucket per parameter. With the default (25), the
            first bucket holds at most 1 MiB, as in DDP, so the first allreduce starts early.
        find_unused_parameters: allow parameters that a backward pass leaves without a gradient.
            Without it (and without `static_graph`), such a parameter makes the next forward
            raise on every rank, naming it, as torch's DDP does.
        check_reduction: deprecated in torch; ignored.
        gradient_as_bucket_view: `.grad` becomes a view into the bucket: no copy in or out.
        static_graph: the set of parameters used may not change after the first iteration
            (torch's errors otherwise); manualdp's buckets are static anyway.
        device_mesh: a one-dimensional `DeviceMesh`; its group replaces `process_group`.
        forward_sync_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank
            before each forward pass, as DDP does (default True). Buffers are copied at construction either way.
        bucket_cap_mb_list: a cap per bucket, in MiB (bucket 0 fills first); the last cap holds
            for every later bucket. Replaces `bucket_cap_mb` when given.
        algorithm: a schedule of `manualdp.schedule` (`naive`, `ring`, `halving_doubling`, `tree`), or
            `auto` (default): for each bucket, the one the cost model predicts fastest on this
            transport (`manualdp.spmd.auto.tune`).
        segment_bytes: messages are cut into segments of this size, see `allreduce`.
        rebuild_buckets: after the first synchronised backward, rebuild the buckets in the order
            the gradients became ready there (rank 0's order, on every rank), as DDP does, also with
            a comm hook; not inside `Join`. `False` keeps reverse parameter order and equal caps:
            the single controller's buckets, bit for bit.
        debug: before each bucket's allreduce the ranks compare (step, bucket, element count,
            dtype, parameters) and all raise on a mismatch, naming the first parameter that
            differs and each rank's unused parameters. Default: on when the environment
            variable `MANUALDP_DEBUG` (or `TORCH_DISTRIBUTED_DEBUG=DETAIL`) is set.
        timeout: seconds to wait for a silent peer before raising `PeerError` (default: the process group's timeout).
        drift_check_every: compare the replicas' parameters (a digest each) at synchronised forward
            passes 0, 1, 2, 4, ... below it and every this many after; every rank raises naming the first that differs
            (`manualdp.spmd.ladder.drift`); 0 turns the check off. Not under an enabled `Join`.

    Sparse gradients are densified for the allreduce and written back sparse. With
    `find_unused_parameters`, a parameter that no rank used keeps its `.grad` untouched (None
    after `zero_grad()`), as with DDP; one that only some ranks used gets their average, the
    others counting as zero.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 *, device_mesh=None, bucket_cap_mb_list: list[float] | None = None, algorithm: str = "auto",
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, debug: bool | None = None,
                 rebuild_buckets: bool = True, forward_sync_buffers: bool | None = None,
                 drift_check_every: int = DRIFT_CHECK_EVERY) -> None:
        super().__init__()
        self.drift = DriftCheck(drift_check_every)  # checked first
        JoinableWrapper.__init__(self)
        initialized("module", nn_module("module", module))  # as torch: run a forward pass before wrapping
        non_negative_int("dim", dim)
        positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
        if bucket_cap_mb_list is not None and not isinstance(bucket_cap_mb_list, (list, tuple)):
            raise TypeError(f"bucket_cap_mb_list must be None or a list of MiB, got {bucket_cap_mb_list!r}")
        for cap in bucket_cap_mb_list or ():
            positive_number("bucket_cap_mb_list", cap)
        one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
        positive_int("segment_bytes", segment_bytes)
        timeout = timeout_seconds("timeout", timeout)
        for name, flag in (("init_sync", init_sync), ("find_unused_parameters", find_unused_parameters),
                           ("check_reduction", check_reduction), ("gradient_as_bucket_view", gradient_as_bucket_view),
                           ("static_graph", static_graph), ("rebuild_buckets", rebuild_buckets)):
            boolean(name, flag)
        if debug is not None:
            boolean("debug", debug)
        if device_mesh is not None:
            process_group = mesh_group(device_mesh, process_group)
        # names set by `_set_params_and_buffers_to_ignore_for_model`: neither synchronised nor checked
        self.parameters_to_ignore = ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        kept = kept_named(module.named_parameters(), ignored)
        params = [p for _, p in kept if p.requires_grad]
        if not params:
            raise NoParametersError("module has no parameters that require grad: nothing to synchronise "
                                    "(DistributedDataParallel is not needed when a module doesn't have any "
                                    "parameter that requires a gradient)")
        self.device = module_device([p for _, p in kept], device_ids, output_device)
        refuse_in_backward_optimizers(kept)
        self.forward_sync_buffers, init_buffers = settle_buffer_flags(broadcast_buffers, forward_sync_buffers)
        self.rank, peers = group_ranks(process_group)

        self.module = module
        # the group itself, as torch exposes it (torch's own helpers take `ddp.process_group`)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = len(peers)
        self.device_ids, self.output_device, self.dim, self.device_mesh = device_ids, output_device, dim, device_mesh
        self.algorithm, self.bucket_cap_mb, self.segment_bytes = algorithm, bucket_cap_mb, segment_bytes
        self.bucket_bytes_cap_list = [int(cap * 2**20) for cap in bucket_cap_mb_list or ()]  # as torch keeps it
        self.broadcast_bucket_size = 250 * 1024 * 1024  # torch's attribute, for torch's _sync_module_states
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.timeout = float(timeout) if timeout is not None else group_timeout(process_group)
        self.move_inputs = device_ids is not None
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # as DDP: the last forward pass will be followed by a sync
        self.debug = debug if debug is not None else (os.environ.get("MANUALDP_DEBUG", "0") not in ("", "0")
                                                      or os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL")
        caps = list(bucket_cap_mb_list) if bucket_cap_mb_list else bucket_cap_mb
        if rebuild_buckets and not bucket_cap_mb_list and bucket_cap_mb == DEFAULT_BUCKET_CAP_MB:
            caps = [FIRST_BUCKET_CAP_MB, DEFAULT_BUCKET_CAP_MB]  # DDP's small first bucket
        layout = assign_buckets(params, caps)
        number = take_number(group_state(process_group))  # which wrapper of the group: compared at every step
        if init_sync:
            compare_and_copy(self, module, ignored, [[params[i] for i in b] for b in layout], caps, rebuild_buckets,
                             {"buffers copied at construction": init_buffers, "wrapper number": number})
        self.reducer = Reducer(params, module, layout, caps, group=self.process_group, rank=self.rank, peers=peers,
                               device=self.device, algorithm=algorithm, segment_bytes=segment_bytes,
                               timeout=self.timeout, gradient_as_bucket_view=gradient_as_bucket_view,
                               rebuild=rebuild_buckets)
        if init_sync and algorithm == "auto":  # otherwise each bucket's is `algorithm`, compared above
            check_same_layout({"bucket algorithms": self.reducer.algorithms}, process_group, self.world_size)
        self.errors = ErrorLog()
        self.graph = GraphChecks(self.reducer, self.rank, static_graph, find_unused_parameters, self.errors)
        self.calls = CallCheck(self.reducer, module, ignored, self.world_size, self.debug, number)
        self.buffer_sync = BufferSync(module, ignored, self.reducer)
        self.uneven = UnevenInputs(self.reducer, module, ignored)
        self._wire()

    def _wire(self) -> None:
        """Hand the reducer its features, in the order their hooks run (again after a copy, which carries no wiring)."""
        r = self.reducer
        r.logged = self.errors
        r.may_rebuild = _outside_join(self)  # under Join, torch keeps the first buckets
        self.graph.logged = self.errors
        r.use([self.calls,  # the step's call check: queued as backward starts, waited for before each bucket
               # debug mode: each bucket compared
               *([Desync(r, self.world_size, self.uneven.is_joined, self.calls)] if self.debug else []),
               self.buffer_sync,  # a buffer comm hook's futures, waited for at the end of backward
               self.graph])  # unused parameters and static graph, checked at the end of backward

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, with the whole state dict checked before any tensor is written: a refused load changes nothing."""
        check_loadable(self, state_dict, strict, "DistributedDataParallel", assign=assign)
        with unchanged_if_refused(self, objects=assign):  # what torch refuses that the check did not foresee
            return super().load_state_dict(state_dict, strict, assign)

    def __getstate__(self):
        if self.process_group is not dist.group.WORLD:  # the copy would average over another group
            raise self.errors(RuntimeError(NOT_COPIED))
        state = dict(self.__dict__)
        state.pop("_join_config", None)
        state["process_group"] = None  # a process group does not pickle; the copy uses the default one
        state["device_mesh"] = None  # nor does a mesh's
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        JoinableWrapper.__init__(self)
        r = self.reducer
        self.rank, peers = group_ranks(None)
        r.rank, r.peers = self.rank, peers
        self.process_group = r.group = dist.group.WORLD
        self.world_size = r.divisor = r.active = len(r.peers)
        for bucket in r.buckets:
            bucket.reset()
        r.start(self.module, rebuild=False)  # a copy keeps the buckets it was made with
        self.calls.number = take_number(group_state(None))  # a wrapper of its own: every rank copies alike
        self._wire()

    # ---------------------------------------------------------------- what torch's wrapper has

    # An optional `manualdp.support.trace.Trace`: each bucket's ready, allreduce and wait.
    recorder = property(lambda self: self.reducer.recorder,
                        lambda self, trace: setattr(self.reducer, "recorder", trace))
    # Compare the ranks' calls once per step (`step_check.py`); turned off only to measure what the check costs.
    check_calls = property(lambda self: self.calls.enabled, lambda self, on: setattr(self.calls, "enabled", on))

    # torch's old name for `forward_sync_buffers`
    broadcast_buffers = property(lambda self: self.forward_sync_buffers,
                                 lambda self, value: setattr(self, "forward_sync_buffers", value))
    # What torch's tests (the rank whose model every rank took at the end of the last Join), ours and the
    # benchmarks read
    _authoritative_rank = property(lambda self: self.uneven.authoritative_rank)
    _buckets = property(lambda self: self.reducer.buckets)
    _layout = property(lambda self: self.reducer.layout)
    _algorithms = property(lambda self: self.reducer.algorithms)

    # ---------------------------------------------------------------- training

    def forward(self, *inputs, **kwargs):
        if self.graph.unfinished is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
            raise self.errors(RuntimeError(self.graph.unfinished))
        if self.reducer.in_backward:
            # The end-of-backward callback never ran: the last backward raised part-way, some
            # buckets may have gone out and others not, so this rank is out of step with its peers.
            self.reducer.reset()
            raise self.errors(RuntimeError("DistributedDataParallel: the previous backward pass failed part-way, after "
                                           "some gradient buckets were sent; the ranks are out of step, so training "
                                           "cannot go on"))
        syncs, joined = torch.is_grad_enabled() and self.require_backward_grad_sync, self._join_config.enable
        if syncs and not joined:
            named = self.calls.refuse_replaced()  # a parameter replaced after wrapping on any rank: every rank raises
            if not parts_replicas(self.calls.comm_hook):  # the no-op hook parts the replicas on purpose: no drift
                with hooks_named(self.calls.number, self.process_group):  # it met a peer's hook check: hooks named
                    self.drift.tick(named, self.process_group, who="DistributedDataParallel", timeout=self.timeout,
                                    number=self.calls.number, names=self.calls.built.names, step=self.reducer.steps,
                                    call_step=self.calls.steps + 1, early=not self.calls.debug)  # out of step: named
        Join.notify_join_context(self)  # inside a Join: tell the joined ranks that this one still trains
        r = self.reducer
        if any(b.flat.dtype != b.params[0].dtype for b in r.buckets):  # model.double(): buckets anew, not float32
            r.set_layout(r.layout), r._locate()  # (torch's DDP goes on in the old dtype, silently off)
        due = self.require_forward_param_sync and self.forward_sync_buffers
        self.buffer_sync.sync(PRE_FORWARD, due, before=self.calls.settle if syncs and not joined else None)
        if joined:  # joined ranks must know whether this step syncs, and how many ranks still train
            self.uneven.training_step(self.require_backward_grad_sync)
        if self.move_inputs:
            inputs, kwargs = to_device((inputs, kwargs), self.device)
        r.syncing = self.require_backward_grad_sync
        if syncs:
            self.calls.queue()  # runs on the worker while this forward and backward compute
        out = self.module(*inputs, **kwargs)
        self.buffer_sync.sync(POST_FORWARD, due)
        self.require_forward_param_sync = syncs
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes of forwards run inside skip the allreduce."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook) -> None:
        """Average each bucket with `hook(state, bucket) -> Future[Tensor]`, torch's comm-hook signature."""
        register_hook(self.calls, self.reducer, state, hook, self.errors)

    def __del__(self) -> None:
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.remove_hooks()  # the module may outlive its wrapper: its backward must stop syncing


def _outside_join(wrapper: DistributedDataParallel):
    """() -> whether `wrapper` was never taken by an enabled Join, without keeping it alive."""
    ref = weakref.ref(wrapper)
    return lambda: (live := ref()) is None or not live._join_config.enable

