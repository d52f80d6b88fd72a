"""`DistributedDataParallel`: a drop-in for torch's, allreducing with manualdp's schedules.

During backward, a hook copies each parameter's finished gradient into its bucket; a full
bucket is handed to the process group's worker thread, which runs `manualdp.spmd.collectives.allreduce`
(or the registered comm hook) on it while backward goes on (torch's reducer does the same
from C++, with asynchronous collectives and no Python thread). At the end of backward the
averages are written into `.grad`. Every wrapper on one process group shares one worker, so
their messages never interleave.

The ranks compare their calls once per step, not once per bucket: the forward pass (or else
the first gradient hook) queues `check_same_call` for the whole step ahead of the buckets, so
it runs while forward and backward compute, and the buckets go out unchecked (their sizes were
compared at construction). A forward without a backward leaves it queued for the next step's.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from ..buckets import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_CAP_MB, assign_buckets
from ..validate import (boolean, initialized, nn_module, non_negative_int, one_of,
                        positive_int, positive_number, timeout_seconds)
from .ddp_buffers import POST_FORWARD, PRE_FORWARD, BufferSync
from .ddp_checks import StepChecks, module_device, refuse_in_backward_optimizers
from .ddp_join import UnevenInputs
from .ddp_private import PrivateAPI
from .ddp_sync import (KeptModule, broadcast_from_rank0, check_same_layout, check_same_model, kept_named,
                       state_tensors)
from .hooks import GradBucket, hook_result
from .collectives import allreduce
from .p2p import DEFAULT_SEGMENT_BYTES, check_same_call
from .peers import DEFAULT_TIMEOUT, SerialWorker, group_ranks, group_timeout
from .tune import ENGINE_ALGORITHMS, resolve

__all__ = ["Bucket", "DistributedDataParallel", "NoParametersError", "check_same_model", "check_same_layout",
           "broadcast_from_rank0", "group_worker"]


class NoParametersError(ValueError, RuntimeError):
    """The module has no parameter that requires grad (torch raises RuntimeError, manualdp ValueError)."""


class Bucket:
    """Gradients of a few parameters, flattened into one buffer and allreduced together."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params  # parameters whose gradients live here, in the order they sit in `flat`
        self.offsets = [0]  # where each parameter's gradient starts in `flat` (one extra entry: the end)
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        # the gradients, then two flags per parameter ("used", "ready"); after the allreduce their sums
        k = len(params)
        self.flat = torch.zeros(self.offsets[-1] + 2 * k, dtype=params[0].dtype, device=params[0].device)
        self.grads = self.flat[:self.offsets[-1]]  # what a comm hook sees
        self.flags = self.flat[self.offsets[-1]:]  # reduced apart from the gradients when a comm hook runs
        # This rank's flags while gradients arrive, written into `flags` once, by `seal`: a write
        # into a tensor element is a torch call, two per parameter per step otherwise.
        self.used_here = [0] * k  # 1 where this rank's backward produced gradient i (or a no_sync one did)
        self.ready_here = [0] * k  # 1 where gradient i's hook fired in this rank's backward pass
        self.used = self.flags[:k]  # `used_here` once sealed; after the allreduce, how many ranks used gradient i
        self.ready = self.flags[k:]  # `ready_here` once sealed; after the allreduce, how many ranks' hooks fired
        # Each parameter's slice of `flat`, made once: slicing and reshaping in every hook costs as
        # much as copying a small gradient.
        self.views = [self.flat[a:b].view(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.arrived = [False] * len(params)  # whose gradient this backward pass has copied into `flat`
        self.sparse = [False] * len(params)  # whose gradient came sparse (densified here, sparse again after)
        self.pending = len(params)  # gradients still to arrive before the bucket can be sent
        self.future: concurrent.futures.Future | None = None  # the running allreduce, or None

    def view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s slice of `flat`, shaped like the parameter."""
        return self.views[i]

    def mark_ready(self, i: int, grad: torch.Tensor | None) -> bool:
        """Copy parameter `i`'s finished gradient in; True when it was the last one missing."""
        if self.arrived[i]:
            raise RuntimeError("a gradient arrived twice in one backward pass (reentrant backward?), "
                               "which manualdp.DistributedDataParallel does not support")
        if grad is None:  # the hook fired but autograd produced nothing: as if unused here
            self.view(i).zero_()
        else:
            self.sparse[i] = grad.is_sparse
            view = self.view(i)
            if grad.is_sparse:
                view.copy_(grad.to_dense())
            elif grad.data_ptr() != view.data_ptr():  # gradient_as_bucket_view: already in place
                view.copy_(grad)
            self.used_here[i] = 1
        self.ready_here[i] = 1
        self.arrived[i] = True
        self.pending -= 1
        return self.pending == 0

    def fill_missing(self, used_earlier: set[int]) -> None:
        """End of backward: unused parameters send their accumulated gradient (or zeros); the bucket is ready.

        `used_earlier`: ids of parameters used in a `no_sync` step since the last sync; they count as
        used, as torch keeps its used map across `no_sync` iterations (pytorch#69031).
        """
        for i, arrived in enumerate(self.arrived):
            if arrived:
                continue
            p = self.params[i]
            if p.grad is None:
                self.view(i).zero_()
            elif p.grad.data_ptr() != self.view(i).data_ptr():
                self.view(i).copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            if id(p) in used_earlier:
                self.used_here[i] = 1
        self.pending = 0

    def seal(self) -> None:
        """Every gradient is in: write this rank's flags into `flat`, to be summed with the gradients."""
        self.flags.copy_(torch.tensor(self.used_here + self.ready_here, dtype=self.flags.dtype))

    def reset(self) -> None:
        """Forget this backward pass: no gradient has arrived, nothing is running."""
        self.flags.zero_()
        self.used_here = [0] * len(self.params)
        self.ready_here = [0] * len(self.params)
        self.arrived = [False] * len(self.params)
        self.pending = len(self.params)
        self.future = None


# id(process group) -> its SerialWorker: one ordered queue per group. Only the id is kept: a
# process group held past destroy_process_group aborts the interpreter when it is freed at exit.
_WORKERS: dict[int, SerialWorker] = {}


def group_worker(group=None) -> SerialWorker:
    """The one thread that runs, in submission order, every wrapper's collectives on `group`."""
    pg = group if group is not None else dist.group.WORLD
    worker = _WORKERS.get(id(pg))
    if worker is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else None
        # On a GPU the thread must talk to this rank's device (the current device is per thread).
        init = (lambda: torch.cuda.set_device(device)) if device is not None else None
        worker = _WORKERS[id(pg)] = SerialWorker("manualdp-allreduce", initializer=init)
    return worker


class DistributedDataParallel(nn.Module, UnevenInputs, StepChecks, BufferSync, PrivateAPI):
    """A drop-in for `torch.nn.parallel.DistributedDataParallel`, allreducing with manualdp's schedules.

    The positional arguments come in torch's order.

    Args:
        module: the model, on this rank's device (or, as in torch, spread over several devices of one type).
        device_ids: `None`, or `[device]` for a module on one GPU; inputs are moved there. As in
            torch, `device_ids` and `output_device` must be None for CPU and multi-device modules.
        output_device: accepted for compatibility; outputs stay on the module's device.
        dim: accepted for compatibility: one device per process, so nothing is scattered.
        broadcast_buffers: torch's deprecated name for `forward_sync_buffers` (a `FutureWarning`);
            `False` also keeps the buffers out of the copy at construction (see `ddp_buffers`).
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
            transport (`manualdp.spmd.tune`).
        segment_bytes: messages are cut into segments of this size, see `allreduce`.
        rebuild_buckets: after the first synchronised backward, rebuild the buckets in the order
            the gradients became ready there (rank 0's order, on every rank), as DDP does, also with
            a comm hook; not inside `Join`. `False` keeps reverse parameter order and equal caps:
            the single controller's buckets, bit for bit.
        debug: before each bucket's allreduce the ranks compare (step, bucket, element count,
            dtype, parameters) and all raise on a mismatch, naming the first parameter that
            differs and each rank's unused parameters. Default: on when the environment
            variable `MANUALDP_DEBUG` (or `TORCH_DISTRIBUTED_DEBUG=DETAIL`) is set.
        timeout: seconds to wait for a silent peer before raising `PeerError` (default: the
            process group's timeout).

    Sparse gradients are densified for the allreduce and written back sparse. With
    `find_unused_parameters`, a parameter that no rank used keeps its `.grad` untouched (None
    after `zero_grad()`), as with DDP; one that only some ranks used gets their average, the
    others counting as zero.
    """

    # Compare the ranks' calls once per step (`_check_step`). Turned off only on an instance, to
    # measure what the check costs (bench/faults.py --check-cost): a mismatch then aborts in gloo.
    check_calls = True

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 *, device_mesh=None, bucket_cap_mb_list: list[float] | None = None, algorithm: str = "auto",
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None, debug: bool | None = None,
                 rebuild_buckets: bool = True, forward_sync_buffers: bool | None = None) -> None:
        super().__init__()
        UnevenInputs.__init__(self)
        initialized("module", nn_module("module", module))  # as torch: run a forward pass before wrapping
        non_negative_int("dim", dim)
        positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
        if bucket_cap_mb_list is not None:
            if not isinstance(bucket_cap_mb_list, (list, tuple)):
                raise TypeError(f"bucket_cap_mb_list must be None or a list of MiB, got {bucket_cap_mb_list!r}")
            for cap in bucket_cap_mb_list:
                positive_number("bucket_cap_mb_list", cap)
        one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
        positive_int("segment_bytes", segment_bytes)
        timeout = timeout_seconds("timeout", timeout)
        for name, flag in (("init_sync", init_sync),
                           ("find_unused_parameters", find_unused_parameters), ("check_reduction", check_reduction),
                           ("gradient_as_bucket_view", gradient_as_bucket_view), ("static_graph", static_graph),
                           ("rebuild_buckets", rebuild_buckets)):
            boolean(name, flag)
        if debug is not None:
            boolean("debug", debug)
        if device_mesh is not None:
            if process_group is not None:  # torch's words
                raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
            if not hasattr(device_mesh, "get_group") or not hasattr(device_mesh, "ndim"):
                raise TypeError(f"device_mesh must be None or a DeviceMesh, got {device_mesh!r}")
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            process_group = device_mesh.get_group()
        # names set by `_set_params_and_buffers_to_ignore_for_model`: neither synchronised nor checked
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        kept = kept_named(module.named_parameters(), self.parameters_to_ignore)
        params = [p for _, p in kept if p.requires_grad]
        if not params:
            raise NoParametersError("module has no parameters that require grad: nothing to synchronise "
                                    "(DistributedDataParallel is not needed when a module doesn't have any "
                                    "parameter that requires a gradient)")
        self.device = module_device([p for _, p in kept], device_ids, output_device)
        refuse_in_backward_optimizers(kept)
        init_buffers = self._settle_buffer_flags(broadcast_buffers, forward_sync_buffers)
        self.rank, self._peers = group_ranks(process_group)

        self.module = module
        # the group itself, as torch exposes it (torch's own helpers take `ddp.process_group`)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = len(self._peers)
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.device_mesh = device_mesh
        self.algorithm = algorithm
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_bytes_cap_list = [int(cap * 2**20) for cap in bucket_cap_mb_list or ()]  # as torch keeps it
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_bucket_size = 250 * 1024 * 1024  # torch's attribute, for torch's _sync_module_states
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.segment_bytes = segment_bytes
        self.timeout = float(timeout) if timeout is not None else group_timeout(process_group)
        self.move_inputs = device_ids is not None
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.recorder = None  # optional `manualdp.support.trace.Trace`: each bucket's ready, allreduce and wait
        self.require_forward_param_sync = True  # as DDP: the last forward pass will be followed by a sync
        self._sync_this_backward = True  # decided by the forward pass, as in DDP
        self._comm_hook = None  # (state, hook) from register_comm_hook, or None: manualdp's allreduce
        self._hooks_compared = False  # the ranks compare their comm hooks at the first synchronised step
        self.debug = debug if debug is not None else (os.environ.get("MANUALDP_DEBUG", "0") not in ("", "0")
                                                      or os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL")
        self._step = 0  # synchronised backward passes so far: part of the desync fingerprint
        self._static_used = None  # static_graph: (bucket, index) of the parameters the first iteration used
        self._static_gap = None  # static_graph: what had not arrived when a parameter the first iteration left out did
        self._joined = False  # True while Join shadows this rank's steps
        self._divisor = self.world_size  # what the bucket sums are divided by (fewer ranks under Join)
        self._join_divide_by_initial = True  # under Join: divide by the initial world size, not the ranks left
        self._authoritative_rank = 0  # the group rank whose model every rank took at the end of the last Join
        self._active = self.world_size  # ranks training this step (fewer once some have joined)
        # Without find_unused_parameters, a backward pass that left a parameter without a gradient on
        # some rank: the error the next forward raises on every rank, as torch's reducer does.
        self._unfinished: str | None = None

        self._params = params
        self._caps = list(bucket_cap_mb_list) if bucket_cap_mb_list else bucket_cap_mb
        if rebuild_buckets and not bucket_cap_mb_list and bucket_cap_mb == DEFAULT_BUCKET_CAP_MB:
            self._caps = [FIRST_BUCKET_CAP_MB, DEFAULT_BUCKET_CAP_MB]  # DDP's small first bucket
        self._ready = [] if rebuild_buckets else None  # ids of the parameters in the order their gradients came
        layout = assign_buckets(params, self._caps)
        if init_sync:
            check_same_model(KeptModule(module, self.parameters_to_ignore) if self.parameters_to_ignore else module,
                             process_group, self.world_size)
            # Before "auto" calibrates: a rank asking for another algorithm would not join that collective.
            check_same_layout(self._comm_layout(layout, rebuild_buckets) | {"buffers copied at construction": init_buffers},
                              process_group, self.world_size)
            broadcast_from_rank0(state_tensors(module, self.parameters_to_ignore, params=True, buffers=init_buffers),
                                 self.rank, self._peers, process_group, self.timeout)
        self._set_buckets(layout)
        if init_sync and algorithm == "auto":  # otherwise each bucket's is `algorithm`, compared above
            check_same_layout({"bucket algorithms": self._algorithms}, process_group, self.world_size)
        self._start()

    def _set_buckets(self, layout: list[list[int]]) -> None:
        """Buckets of `self._params` as `layout` groups them, each with its schedule."""
        self._layout = layout
        self._buckets = [Bucket([self._params[i] for i in b]) for b in layout]
        # "auto" may calibrate the first time, a collective: every rank resolves here, together.
        self._algorithms = [resolve(self.algorithm, b.flat.numel(), b.flat.element_size(), self.process_group,
                                    self.timeout, self.segment_bytes) for b in self._buckets]

    def _comm_layout(self, layout: list[list[int]], rebuild_buckets: bool) -> dict:
        """What every rank's wrapper must agree on for their messages to pair up (see `check_same_layout`)."""
        groups = [[self._params[i] for i in b] for b in layout]
        return {"buckets": len(groups),
                "bucket elements": [sum(p.numel() for p in g) for g in groups],
                "bucket dtypes": [str(g[0].dtype).replace("torch.", "") for g in groups],
                "bucket_cap_mb": self.bucket_cap_mb, "bucket caps (MiB)": self._caps, "algorithm": self.algorithm, "segment_bytes": self.segment_bytes,
                "rebuild_buckets": rebuild_buckets, "broadcast_buffers": self.forward_sync_buffers,
                "gradient_as_bucket_view": self.gradient_as_bucket_view, "static_graph": self.static_graph,
                "find_unused_parameters": self.find_unused_parameters, "debug": self.debug}

    def _start(self) -> None:
        """The per-process state that neither deepcopy nor pickle carries: lookup table, worker, hooks."""
        self._locate()
        # each parameter's index among those synchronised, in module order: torch's reducer's index
        kept = [p for _, p in kept_named(self.module.named_parameters(), self.parameters_to_ignore) if p.requires_grad]
        self._index = {id(p): k for k, p in enumerate(kept)}
        self._used_in_no_sync: set[int] = set()  # ids of parameters used by no_sync steps since the last sync
        self._next_launch = 0  # buckets launch strictly in order, the same on every rank
        self._in_backward = False
        self._step_check: concurrent.futures.Future | None = None  # this step's call check, queued ahead of its buckets
        self._executor = group_worker(self.process_group)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self))
                       for bucket in self._buckets for p in bucket.params]

    def _locate(self) -> None:
        """Where each parameter sits in the buckets, and their names; `.grad` into the buckets if they are views."""
        self._where = {}  # id(param) -> (bucket index, index in the bucket)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
                if self.gradient_as_bucket_view and p.grad is not None:
                    bucket.view(i).copy_(p.grad)
                    p.grad = bucket.view(i)
        names = {id(p): name for name, p in self.module.named_parameters()}
        self._names = [[names[id(p)] for p in bucket.params] for bucket in self._buckets]  # for error messages

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_executor", "_hooks", "_where", "_names", "_used_in_no_sync", "_join_config", "_ready",
                    "_step_check", "_buffer_hook", "_buffer_futures"):
            state.pop(key, None)
        state["process_group"] = None  # a process group does not pickle; the copy uses the default one
        state["device_mesh"] = None  # nor does a mesh's
        state["_comm_hook"], state["_hooks_compared"] = None, False
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        UnevenInputs.__init__(self)
        for bucket in self._buckets:
            bucket.reset()
        self.rank, self._peers = group_ranks(None)
        self.process_group = dist.group.WORLD
        self.world_size = self._divisor = self._active = len(self._peers)
        self._ready = None  # a copy keeps the buckets it was made with
        self._start()

    # ---------------------------------------------------------------- training

    def forward(self, *inputs, **kwargs):
        if self._unfinished is not None and torch.is_grad_enabled() and self.require_backward_grad_sync:
            raise self._logged(RuntimeError(self._unfinished))
        if self._in_backward:
            # The end-of-backward callback never ran: the last backward raised part-way, some
            # buckets may have gone out and others not, so this rank is out of step with its peers.
            self._reset_backward()
            raise self._logged(RuntimeError("DistributedDataParallel: the previous backward pass failed part-way, after "
                                            "some gradient buckets were sent; the ranks are out of step, so training "
                                            "cannot go on"))
        Join.notify_join_context(self)  # inside a Join: tell the joined ranks that this one still trains
        self._sync_buffers(PRE_FORWARD)
        if self._join_config.enable:
            # Joined ranks must know whether this step syncs, and how many ranks still train.
            self._active, _ = self._agree_on_step(1, int(self.require_backward_grad_sync))
            self._divisor = self.world_size if self._join_divide_by_initial else self._active
        if self.move_inputs:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        self._sync_this_backward = self.require_backward_grad_sync
        if torch.is_grad_enabled() and self._sync_this_backward and self._step_check is None:
            self._step_check = self._check_step()  # runs on the worker while this forward and backward compute
        out = self.module(*inputs, **kwargs)
        self._sync_buffers(POST_FORWARD)
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
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
        if not callable(hook):  # errors logged, as torch logs them (`_get_ddp_logging_data()["error"]`)
            raise self._logged(TypeError(f"hook must be callable, got {hook!r}"))
        if self._comm_hook is not None:
            raise self._logged(RuntimeError("register_comm_hook can only be called once"))
        if self._hooks_compared:
            raise self._logged(RuntimeError("register_comm_hook must be called before training (the first forward or "
                                            "backward pass that synchronises gradients), as torch's DDP asks: the "
                                            "ranks compare hooks there"))
        self._comm_hook = (state, hook)

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Hook: `param.grad` is final for this backward pass; copy it into its bucket."""
        if not self._sync_this_backward:
            self._used_in_no_sync.add(id(param))
            return
        if self._ready is not None:
            self._ready.append(id(param))
        if not self._in_backward:
            self._in_backward = True
            # Runs when the whole backward pass is done, also when some hooks never fire.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self._step_check is None:  # a backward whose forward did not queue it (the module called directly)
                self._step_check = self._check_step()
        b, i = self._where[id(param)]
        if self._static_used is not None:
            self._note_static(b, i)
        with torch.no_grad():  # backward(create_graph=True) runs hooks with grad on; the bucket is plain data
            full = self._buckets[b].mark_ready(i, param.grad)
        if full:
            if self.recorder is not None:
                self.recorder.instant(f"bucket {b} ready", "compute", bucket=b)
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the allreduce of every full bucket, in bucket order (every rank must send them in the same order)."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.seal()
            run = self._reduce if self.recorder is None else _recorded(self._reduce, self.recorder, self._next_launch)
            bucket.future = self._executor.submit(run, self._next_launch, bucket)
            self._next_launch += 1

    def _check_step(self) -> concurrent.futures.Future | None:
        """Queue the step's call check on the worker, ahead of the step's buckets.

        One `check_same_call` for all buckets (their total size, bucket 0's algorithm): a rank
        that is out of step, or calls some other allreduce meanwhile, meets this fixed-size
        table instead of a bucket, and every rank raises in one line. Queued by the forward
        pass, it runs while forward and backward compute. At the first synchronised step the
        ranks also compare their comm hooks: one rank's hook would send other messages.
        """
        if not self._hooks_compared:  # the first synchronised step: torch sets up in-backward optimizers here
            refuse_in_backward_optimizers(kept_named(self.module.named_parameters(), self.parameters_to_ignore))
        hooks, self._hooks_compared = not self._hooks_compared, True
        calls = self.check_calls and not self.debug  # debug: each bucket is checked, in more words
        if self.world_size == 1 or not (hooks or calls):
            return None
        first, total = self._buckets[0].flat, sum(b.flat.numel() for b in self._buckets)
        recorder, call = self.recorder, (first, self._algorithms[0], self.segment_bytes, self.process_group, self.timeout)
        compare_hooks = self._check_same_hook if hooks else lambda: None

        def run() -> None:
            compare_hooks()
            if calls:
                with recorder.span("step check", "comm", cat="comm") if recorder is not None else contextlib.nullcontext():
                    check_same_call(*call, numel=total)
        return self._executor.submit(run)

    def _reduce(self, index: int, bucket: Bucket) -> None:
        """On the worker: sum `bucket.flat` over the group, or run the comm hook and sum only the used flags."""
        if self._step_check is not None:
            self._step_check.result()  # done (the worker runs in order); raises if the ranks called differently
        if self.debug:
            self._check_in_step(index, bucket)
        if self._comm_hook is None:
            allreduce(bucket.flat, self._algorithms[index], self.process_group, segment_bytes=self.segment_bytes,
                      timeout=self.timeout, check=False)
            return
        state, hook = self._comm_hook
        view = GradBucket(index, bucket.grads, bucket.params, bucket.offsets, index == len(self._buckets) - 1)
        result = hook_result(hook, hook(state, view), bucket.grads.numel(), self.timeout or DEFAULT_TIMEOUT)
        if result.data_ptr() != bucket.grads.data_ptr():
            bucket.grads.copy_(result)
        allreduce(bucket.flags, self._algorithms[index], self.process_group, segment_bytes=self.segment_bytes,
                  timeout=self.timeout, check=False)

    @torch.no_grad()  # backward(create_graph=True) runs this callback with grad on; buckets are plain data
    def _finish_backward(self) -> None:
        """End of backward: send what is left, wait for every bucket, write the averages into `.grad`."""
        try:
            used = frozenset((b, i) for b, bucket in enumerate(self._buckets) for i, a in enumerate(bucket.arrived) if a)
            for bucket in self._buckets[self._next_launch:]:
                bucket.fill_missing(self._used_in_no_sync)  # unused here: the bucket must still go out
            self._launch_ready()
            error = None
            for b, bucket in enumerate(self._buckets):
                try:
                    with _waiting(self.recorder, b):
                        bucket.future.result()
                except Exception as e:  # keep waiting: leave no allreduce running behind us
                    error = error or e
                    continue
                if error is None:
                    self._write_grads(bucket)
            if error is not None:
                raise self._logged(error)
            self._wait_buffer_futures()
            self._step += 1
            if self.static_graph:
                self._check_static(used)
            elif not self.find_unused_parameters:
                self._check_all_ready()
        finally:
            self._reset_backward()
        if self._ready is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        """After the first synchronised backward: buckets in the order its gradients became ready, as DDP.

        Ranks may have seen different orders, so rank 0's is broadcast and every rank builds the
        same buckets. Unused parameters go last, in reverse order.
        """
        ready, self._ready = self._ready, None
        if self._join_config.enable:  # a comm hook's state is per bucket: torch's hooks expect this rebuild too
            return
        index = {id(p): k for k, p in enumerate(self._params)}
        seen = [index[i] for i in dict.fromkeys(ready)]
        order = seen + sorted(set(range(len(self._params))) - set(seen), reverse=True)
        agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
        self._executor.submit(broadcast_from_rank0, [agreed], self.rank, self._peers, self.process_group,
                              self.timeout).result()  # on the worker: in line with every other collective of the group
        layout = assign_buckets(self._params, self._caps, order=agreed.tolist())
        if layout == self._layout:
            return
        static = None if self._static_used is None else [id(self._buckets[b].params[i]) for b, i in self._static_used]
        self._set_buckets(layout)
        self._locate()
        if static is not None:
            self._static_used = frozenset(self._where[i] for i in static)

    def _reset_backward(self) -> None:
        """Forget the backward pass: every bucket empty, none launched."""
        for bucket in self._buckets:
            bucket.reset()
        self._used_in_no_sync.clear()
        self._next_launch = 0
        self._in_backward = False
        self._step_check = None

    def _write_grads(self, bucket: Bucket) -> None:
        divisor = 1 if self._comm_hook is not None else self._divisor  # a hook hands back averages
        with torch.no_grad():
            used = bucket.used.tolist()
            for i, p in enumerate(bucket.params):
                if used[i] == 0:  # no rank used it: leave .grad alone, as DDP does, so optimizers skip it
                    continue
                view = bucket.view(i)
                if bucket.sparse[i]:
                    p.grad = (view / divisor).to_sparse(p.grad.sparse_dim() if p.grad is not None else 1)
                elif self.gradient_as_bucket_view:
                    view.div_(divisor)
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view / divisor
                else:
                    torch.div(view, divisor, out=p.grad)

    def __del__(self) -> None:
        for handle in self.__dict__.get("_hooks", ()):
            handle.remove()  # the module may outlive its wrapper: its backward must stop syncing


def _weak_hook(wrapper: DistributedDataParallel):
    """A gradient hook that calls `wrapper` without keeping it alive."""
    ref = weakref.ref(wrapper)

    def hook(param: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._grad_ready(param)
    return hook


def _to_device(obj, device: torch.device):
    """`obj` with every tensor inside (lists, tuples, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------- optional timeline (manualdp.support.trace)

def _recorded(fn, recorder, b: int):
    """`fn` that records its run as bucket `b`'s allreduce on the communication track."""
    def run(*args, **kwargs):
        with recorder.span(f"bucket {b} allreduce", "comm", cat="comm", bucket=b):
            return fn(*args, **kwargs)
    return run


def _waiting(recorder, b: int):
    if recorder is None:
        return contextlib.nullcontext()
    return recorder.span(f"bucket {b} wait", "compute", cat="wait", bucket=b)
