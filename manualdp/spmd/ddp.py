"""`DistributedDataParallel`: a drop-in for torch's, allreducing with manualdp's schedules.

During backward, a hook copies each parameter's finished gradient into its bucket; a full
bucket is handed to a worker thread that runs `manualdp.spmd.p2p.allreduce` on it while
backward goes on (torch's reducer does the same from C++, with asynchronous collectives
and no Python thread). At the end of backward the averages are written into `.grad`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets, flatten, unflatten_
from ..validate import boolean, nn_module, one_of, positive_int, positive_number, timeout_seconds
from .p2p import DEFAULT_SEGMENT_BYTES, allreduce
from .peers import SerialWorker, group_ranks, group_timeout, talking_to, wait
from .tune import ENGINE_ALGORITHMS, resolve

__all__ = ["Bucket", "DistributedDataParallel", "check_same_model", "broadcast_from_rank0"]


class Bucket:
    """Gradients of a few parameters, flattened into one buffer and allreduced together."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params  # parameters whose gradients live here, in the order they sit in `flat`
        self.offsets = [0]  # where each parameter's gradient starts in `flat` (one extra entry: the end)
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        # the gradients, then one "used here" flag per parameter; after the allreduce their sums
        self.flat = torch.zeros(self.offsets[-1] + len(params), dtype=params[0].dtype, device=params[0].device)
        self.used = self.flat[self.offsets[-1]:]  # flag i: 1 where this rank's backward produced gradient i
        self.arrived = [False] * len(params)  # whose gradient this backward pass has copied into `flat`
        self.pending = len(params)  # gradients still to arrive before the bucket can be sent
        self.future: concurrent.futures.Future | None = None  # the running allreduce, or None

    def view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s slice of `flat`, shaped like the parameter."""
        return self.flat[self.offsets[i]:self.offsets[i + 1]].view(self.params[i].shape)

    def mark_ready(self, i: int, grad: torch.Tensor) -> bool:
        """Copy parameter `i`'s finished gradient in; True when it was the last one missing."""
        if self.arrived[i]:
            raise RuntimeError("a gradient arrived twice in one backward pass (reentrant backward?), "
                               "which manualdp.DistributedDataParallel does not support")
        self.view(i).copy_(grad)
        self.used[i] = 1
        self.arrived[i] = True
        self.pending -= 1
        return self.pending == 0

    def fill_missing(self) -> None:
        """End of backward: parameters this rank did not use contribute zeros, and the bucket is ready."""
        for i, arrived in enumerate(self.arrived):
            if not arrived:
                self.view(i).zero_()
        self.pending = 0

    def reset(self) -> None:
        """Forget this backward pass: no gradient has arrived, nothing is running."""
        self.used.zero_()
        self.arrived = [False] * len(self.params)
        self.pending = len(self.params)
        self.future = None


class DistributedDataParallel(nn.Module):
    """A drop-in for `torch.nn.parallel.DistributedDataParallel`, allreducing with manualdp's schedules.

    Args:
        module: the model, with all its parameters on one device (this rank's).
        bucket_cap_mb: gradients are fused into buckets of at most this many MiB, in reverse
            parameter order; `None` gives one bucket per parameter.
        algorithm: a schedule of `manualdp.schedule` (`naive`, `ring`, `halving_doubling`, `tree`), or
            `auto` (default): for each bucket, the one the cost model predicts fastest on this
            transport (`manualdp.spmd.tune`).
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank
            before each forward pass, as DDP does.
        process_group: the group to average over (default: all ranks).
        device_ids: `None`, or `[device]`, the module's device; inputs are moved there.
        output_device: accepted for compatibility; outputs stay on the module's device.
        find_unused_parameters: accepted for compatibility; unused parameters always work.
        segment_bytes: messages are cut into segments of this size, see `allreduce`.
        timeout: seconds to wait for a silent peer before raising `PeerError` (default: the
            process group's timeout).

    Limitations: dense gradients only; every rank must run backward through at least one
    parameter in every synchronised step (else its peers wait for it). A parameter that
    no rank used keeps its `.grad` untouched (None after `zero_grad()`), as with DDP; one
    that only some ranks used gets their average, the others counting as zero.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                 algorithm: str = "auto", broadcast_buffers: bool = True, process_group=None,
                 device_ids=None, output_device=None, find_unused_parameters: bool = False,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
        super().__init__()
        nn_module("module", module)
        positive_number("bucket_cap_mb", bucket_cap_mb, none_ok=True)
        one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
        positive_int("segment_bytes", segment_bytes)
        timeout = timeout_seconds("timeout", timeout)
        boolean("broadcast_buffers", broadcast_buffers)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no parameters that require grad: nothing to synchronise")
        devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
        if len(devices) != 1:
            raise ValueError(f"module must live on one device, its parameters and buffers are on {sorted(map(str, devices))}")
        self.device = devices.pop()
        if device_ids is not None:
            if not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1:
                raise ValueError(f"device_ids must be None or a list of one device, got {device_ids!r}")
            wanted = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else torch.device("cuda", device_ids[0])
            if wanted != self.device:
                raise ValueError(f"device_ids={device_ids!r}, but the module is on {self.device}")
        self.rank, self._peers = group_ranks(process_group)

        self.module = module
        self.process_group = process_group
        self.world_size = len(self._peers)
        self.algorithm = algorithm
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = bucket_cap_mb
        self.segment_bytes = segment_bytes
        self.timeout = float(timeout) if timeout is not None else group_timeout(process_group)
        self.move_inputs = device_ids is not None
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.recorder = None  # optional `manualdp.support.trace.Trace`: each bucket's ready, allreduce and wait
        self.require_forward_param_sync = True  # as DDP: the last forward pass will be followed by a sync
        self._sync_this_backward = True  # decided by the forward pass, as in DDP

        check_same_model(module, process_group, self.world_size)
        broadcast_from_rank0(list(module.parameters()) + list(module.buffers()), self.rank, self._peers,
                             process_group, self.timeout)

        self._buckets = [Bucket([params[i] for i in b]) for b in assign_buckets(params, bucket_cap_mb)]
        self._where = {}  # id(param) -> (bucket index, index in the bucket)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        # One schedule per bucket, decided now, together: "auto" may calibrate, a collective.
        self._algorithms = [resolve(algorithm, b.flat.numel(), b.flat.element_size(), process_group, self.timeout)
                            for b in self._buckets]
        self._next_launch = 0  # buckets launch strictly in order, the same on every rank
        self._in_backward = False
        # One thread runs the buckets' allreduces in launch order while backward goes on; on a
        # GPU it must talk to this rank's device (the current device is per thread).
        device = self.device
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._executor = SerialWorker("manualdp-allreduce", initializer=init)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in params]

    # ---------------------------------------------------------------- training

    def forward(self, *inputs, **kwargs):
        if self._in_backward:
            # The end-of-backward callback never ran: the last backward raised part-way, some
            # buckets may have gone out and others not, so this rank is out of step with its peers.
            self._reset_backward()
            raise RuntimeError("DistributedDataParallel: the previous backward pass failed part-way, after some "
                               "gradient buckets were sent; the ranks are out of step, so training cannot go on")
        if self.require_forward_param_sync and self.broadcast_buffers:
            broadcast_from_rank0(list(self.module.buffers()), self.rank, self._peers, self.process_group, self.timeout)
        if self.move_inputs:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        self._sync_this_backward = self.require_backward_grad_sync
        out = self.module(*inputs, **kwargs)
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

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Hook: `param.grad` is final for this backward pass; copy it into its bucket."""
        if not self._sync_this_backward:
            return
        if param.grad is not None and param.grad.is_sparse:
            raise RuntimeError("manualdp.DistributedDataParallel supports dense gradients only")
        if not self._in_backward:
            self._in_backward = True
            # Runs when the whole backward pass is done, also when some hooks never fire.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b, i = self._where[id(param)]
        if self._buckets[b].mark_ready(i, param.grad):
            if self.recorder is not None:
                self.recorder.instant(f"bucket {b} ready", "compute", bucket=b)
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the allreduce of every full bucket, in bucket order (every rank must send them in the same order)."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            run = allreduce if self.recorder is None else _recorded(allreduce, self.recorder, self._next_launch)
            bucket.future = self._executor.submit(run, bucket.flat, self._algorithms[self._next_launch],
                                                  self.process_group,
                                                  segment_bytes=self.segment_bytes, timeout=self.timeout)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        """End of backward: send what is left, wait for every bucket, write the averages into `.grad`."""
        try:
            for bucket in self._buckets[self._next_launch:]:
                bucket.fill_missing()  # unused here: zeros, but the bucket must still go out
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
                raise error
        finally:
            self._reset_backward()

    def _reset_backward(self) -> None:
        """Forget the backward pass: every bucket empty, none launched."""
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._in_backward = False

    def _write_grads(self, bucket: Bucket) -> None:
        with torch.no_grad():
            used = bucket.used.tolist()
            for i, p in enumerate(bucket.params):
                if used[i] == 0:  # no rank used it: leave .grad alone, as DDP does, so optimizers skip it
                    continue
                if p.grad is None:
                    p.grad = bucket.view(i) / self.world_size
                else:
                    torch.div(bucket.view(i), self.world_size, out=p.grad)

    def __del__(self) -> None:
        for handle in self.__dict__.get("_hooks", ()):
            handle.remove()  # the module may outlive its wrapper: its backward must stop syncing
        executor = self.__dict__.get("_executor")
        if executor is not None:
            executor.shutdown()


def check_same_model(module: nn.Module, group, world_size: int) -> None:
    """Raise on every rank unless every rank has the same parameter and buffer names, shapes and dtypes."""
    mine = [(kind, name, tuple(t.shape), str(t.dtype), t.requires_grad)
            for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
            for name, t in named]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if len(theirs) != len(everyone[0]):
            detail = f"rank 0 has {len(everyone[0])} parameters and buffers, rank {r} has {len(theirs)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b)
            detail = f"entry {i} is {everyone[0][i]} on rank 0 but {theirs[i]} on rank {r}"
        raise ValueError(f"DistributedDataParallel: the model differs across ranks ({detail}); "
                         "every rank must build the same model")

def broadcast_from_rank0(tensors: list[torch.Tensor], rank: int, peers: list[int], group, timeout) -> None:
    """Overwrite `tensors` with those of the group's rank 0, one flat message per dtype."""
    if len(peers) == 1:
        return
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype and t.numel()]
            if not same:
                continue
            flat = flatten(same)
            root = peers[0]
            peer = root if rank != 0 else None
            with talking_to(peer, timeout):
                work = dist.broadcast(flat, src=root, group=group, async_op=True)
            wait(work, peer, timeout)
            unflatten_(flat, same)


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
