"""SPMD data parallelism: one process per device, talking through `torch.distributed`.

The multi-process twins of two single-controller pieces:

- `allreduce(tensor)` runs a schedule of `manualdp.schedule` on this rank only: of every
  round it keeps the transfers where this rank is `src` or `dst`, and turns them into
  `isend`/`irecv` messages (`plan`).
- `DistributedDataParallel(module)` fills gradient buckets from hooks during backward and
  allreduces each bucket on a background thread as soon as it is full, as torch's DDP does.

Every wait has a deadline (`timeout`, default: the process group's): a peer that dies or
hangs ends in a `manualdp.peers.PeerError` naming it, never in a hang.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets, flatten, unflatten_
from .peers import SerialWorker, check_timeout, group_timeout, talking_to, wait
from .schedule import ALGORITHMS, Schedule, chunk_bounds, get_schedule

__all__ = ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "allreduce", "Bucket", "DistributedDataParallel"]

DEFAULT_SEGMENT_BYTES = 1 << 20


class Message(NamedTuple):
    peer: int     # group rank of the other side
    lo: int       # first element of the slice of the flat buffer
    hi: int       # one past its last element
    send: bool    # True: send flat[lo:hi] to peer; False: receive flat[lo:hi] from peer
    reduce: bool  # for a receive: add into flat[lo:hi] (True) or overwrite it (False)


class Round(NamedTuple):
    sends: tuple[Message, ...]  # segments this rank sends, in posting order
    recvs: tuple[Message, ...]  # segments it receives, in posting order, which is also the order of the additions
    early: bool                 # its receives may be posted while the previous round runs (they cannot clobber it)
    scratch: int                # elements of scratch space its reducing receives land in


@functools.lru_cache(maxsize=256)  # training calls it with the same few bucket sizes every step
def plan(schedule: Schedule, rank: int, numel: int, segment_numel: int) -> tuple[Round, ...]:
    """Rank `rank`'s share of `schedule`: per round, the segments it sends and receives.

    In a round, consecutive chunks between the same two ranks merge into one message, and
    messages are cut into segments of at most `segment_numel` elements, ordered segment 0 of
    every message, then segment 1, ..., so the receiver adds one segment while the next is
    in flight. Both sides derive their lists from the same transfers in the same order, so
    every send meets its receive, in order. Empty chunks send nothing, on both sides.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    for name, value, low, high in (("rank", rank, 0, schedule.num_devices - 1), ("numel", numel, 0, None),
                                   ("segment_numel", segment_numel, 1, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f" and <= {high}" if high is not None else ""
            raise ValueError(f"{name} must be an int >= {low}{bound}, got {value!r}")
    bounds = chunk_bounds(numel, schedule.num_chunks)
    rounds: list[Round] = []
    previous: list[Message] = []  # the messages of the previous round
    for rnd in schedule.rounds:
        messages: list[Message] = []
        last: dict[tuple[int, bool, bool], int] = {}  # (peer, send, reduce) -> index of its latest message
        for t in rnd:
            if rank not in (t.src, t.dst):
                continue
            lo, hi = bounds[t.chunk]
            if lo == hi:
                continue
            send = t.src == rank
            key = (t.dst if send else t.src, send, t.reduce)
            j = last.get(key)
            if j is not None and messages[j].hi == lo:
                messages[j] = messages[j]._replace(hi=hi)
            else:
                last[key] = len(messages)
                messages.append(Message(key[0], lo, hi, send, t.reduce))
        segments = sorted(
            ((k, i, m._replace(lo=start, hi=min(start + segment_numel, m.hi)))
             for i, m in enumerate(messages) for k, start in enumerate(range(m.lo, m.hi, segment_numel))),
            key=lambda x: x[:2])
        sends = tuple(m for _, _, m in segments if m.send)
        recvs = tuple(m for _, _, m in segments if not m.send)
        # Reductions land in scratch space, so only overwrites can collide with the previous round;
        # a range sent to the very peer that will overwrite it is safe: that peer sends only
        # after it has received everything of the previous round.
        early = all(m.reduce or x.hi <= m.lo or m.hi <= x.lo or (x.send and x.peer == m.peer)
                    for m in recvs for x in previous)
        rounds.append(Round(sends, recvs, early, sum(m.hi - m.lo for m in recvs if m.reduce)))
        previous = messages
    return tuple(rounds)


_SCRATCH = threading.local()  # per thread: DDP's allreduce thread and the main thread must not share it


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """`numel` elements of reusable space on `like`'s device and dtype.

    Kept between calls: a fresh multi-MiB buffer every round costs page faults (the CPU
    allocator gives large blocks back to the system), more than the additions themselves.
    """
    cache = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (like.device, like.dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = like.new_empty(numel)
    return buf[:numel]


def _targets(flat: torch.Tensor, rnd: Round, scratch: torch.Tensor) -> list[torch.Tensor]:
    """Where each receive of `rnd` lands: scratch space for reductions (on flat's device), flat itself for overwrites."""
    out, at = [], 0
    for m in rnd.recvs:
        if m.reduce:
            out.append(scratch[at:at + m.hi - m.lo])
            at += m.hi - m.lo
        else:
            out.append(flat[m.lo:m.hi])
    return out


def _add(flat: torch.Tensor, m: Message, buf: torch.Tensor) -> None:
    if m.reduce:  # in schedule order, so the sum is the single controller's, bit for bit
        flat[m.lo:m.hi].add_(buf)


def _run_early(flat: torch.Tensor, rounds: tuple[Round, ...], peers: list[int], group, scratch,
               timeout: float | None) -> None:
    """Gloo: post each round's receives while the previous round runs.

    Gloo sends a message at once only to a receiver that has already said it is ready;
    otherwise the two sides exchange notifications first, a round trip through both
    processes' network threads. Receives posted one round ahead avoid that wait.
    """
    def recv(buf, peer):
        with talking_to(peer, timeout):
            return dist.irecv(buf, peer, group)

    def send(m):
        with talking_to(peers[m.peer], timeout):
            return dist.isend(flat[m.lo:m.hi], peers[m.peer], group)

    def post(i: int) -> list:
        bufs = _targets(flat, rounds[i], scratch[i % 2])
        return [(m, b, recv(b, peers[m.peer])) for m, b in zip(rounds[i].recvs, bufs)]

    pending = post(0) if rounds else []
    for i, rnd in enumerate(rounds):
        sends = [(peers[m.peer], send(m)) for m in rnd.sends]
        ahead = i + 1 < len(rounds) and rounds[i + 1].early
        following = post(i + 1) if ahead else None
        for m, buf, work in pending:
            wait(work, peers[m.peer], timeout)
            _add(flat, m, buf)
        for peer, work in sends:
            wait(work, peer, timeout)
        pending = following if ahead else (post(i + 1) if i + 1 < len(rounds) else [])


def _run_grouped(flat: torch.Tensor, rounds: tuple[Round, ...], peers: list[int], group, scratch,
                 timeout: float | None) -> None:
    """NCCL and others: each round's sends and receives as one group, so that two ranks exchanging never deadlock."""
    for i, rnd in enumerate(rounds):
        bufs = _targets(flat, rnd, scratch[i % 2])
        ops = [dist.P2POp(dist.isend, flat[m.lo:m.hi], peers[m.peer], group) for m in rnd.sends]
        ops += [dist.P2POp(dist.irecv, b, peers[m.peer], group) for m, b in zip(rnd.recvs, bufs)]
        if ops:
            others = {peers[m.peer] for m in rnd.sends + rnd.recvs}
            peer = next(iter(others)) if len(others) == 1 else None  # NCCL returns one work for the whole group
            with talking_to(peer, timeout):
                works = dist.batch_isend_irecv(ops)
            for work in works:
                wait(work, peer, timeout)
        for m, buf in zip(rnd.recvs, bufs):
            _add(flat, m, buf)


def _group_ranks(group) -> tuple[int, list[int]]:
    """This process's rank in `group` and the global rank of every member."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(or manualdp.spmd.init_from_env) first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")
    n = dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        return rank, list(range(n))
    return rank, [dist.get_global_rank(group, r) for r in range(n)]


def _check_algorithm(algorithm) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    return algorithm


def _check_segment_bytes(segment_bytes) -> int:
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1:
        raise ValueError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
    return segment_bytes


def allreduce(tensor: torch.Tensor, algorithm: str = "ring", group=None, *,
              segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
    """Sum `tensor` over the ranks of `group` (default: all), in place, with manualdp's schedules.

    Every rank must call it with a tensor of the same shape and dtype, as with
    `torch.distributed.all_reduce`. Afterwards the ranks hold bitwise identical sums. A peer
    silent for `timeout` seconds (default: the group's timeout), or gone, raises `PeerError`.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"tensor has dtype {tensor.dtype}; allreduce sums real numbers")
    if tensor.is_sparse:
        raise TypeError("tensor must be dense, got a sparse tensor")
    if any(st == 0 and s > 1 for s, st in zip(tensor.shape, tensor.stride())):
        raise ValueError("tensor has stride 0 (an expanded view); pass a tensor that owns its elements")
    _check_algorithm(algorithm)
    _check_segment_bytes(segment_bytes)
    timeout = check_timeout(timeout)
    rank, peers = _group_ranks(group)
    if len(peers) == 1 or tensor.numel() == 0:
        return
    timeout = timeout if timeout is not None else group_timeout(group)
    _allreduce(tensor, algorithm, group, rank, peers, segment_bytes, early=dist.get_backend(group) == "gloo",
               timeout=timeout)


def _allreduce(tensor: torch.Tensor, algorithm: str, group, rank: int, peers: list[int], segment_bytes: int,
               early: bool, timeout: float | None = None) -> None:
    rounds = plan(get_schedule(algorithm, len(peers)), rank, tensor.numel(), max(1, segment_bytes // tensor.element_size()))
    width = max((r.scratch for r in rounds), default=0)
    space = _scratch(2 * width, tensor)
    scratch = (space[:width], space[width:])  # rounds alternate halves: a round's receives may be posted early
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        (_run_early if early else _run_grouped)(flat, rounds, peers, group, scratch, timeout)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))


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
        algorithm: `naive`, `ring` or `tree` (see `manualdp.schedule`).
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
                 algorithm: str = "ring", broadcast_buffers: bool = True, process_group=None,
                 device_ids=None, output_device=None, find_unused_parameters: bool = False,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, timeout: float | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        assign_buckets([], bucket_cap_mb)  # validates bucket_cap_mb
        _check_algorithm(algorithm)
        _check_segment_bytes(segment_bytes)
        check_timeout(timeout)
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")
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
        self.rank, self._peers = _group_ranks(process_group)

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
        self.require_forward_param_sync = True  # as DDP: the last forward pass will be followed by a sync
        self._sync_this_backward = True  # decided by the forward pass, as in DDP

        self._check_same_model()
        self._broadcast(list(module.parameters()) + list(module.buffers()))

        self._buckets = [Bucket([params[i] for i in b]) for b in assign_buckets(params, bucket_cap_mb)]
        self._where = {}  # id(param) -> (bucket index, index in the bucket)
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._next_launch = 0  # buckets launch strictly in order, the same on every rank
        self._in_backward = False
        # One thread runs the buckets' allreduces in launch order while backward goes on; on a
        # GPU it must talk to this rank's device (the current device is per thread).
        device = self.device
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._executor = SerialWorker("manualdp-allreduce", initializer=init)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in params]

    # ---------------------------------------------------------------- construction

    def _check_same_model(self) -> None:
        """Raise on every rank unless every rank has the same parameter and buffer names, shapes and dtypes."""
        mine = [(kind, name, tuple(t.shape), str(t.dtype), t.requires_grad)
                for kind, named in (("parameter", self.module.named_parameters()), ("buffer", self.module.named_buffers()))
                for name, t in named]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
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

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` with rank 0's, one flat message per dtype."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype and t.numel()]
                if not same:
                    continue
                flat = flatten(same)
                root = self._peers[0]
                peer = root if self.rank != 0 else None
                with talking_to(peer, self.timeout):
                    work = dist.broadcast(flat, src=root, group=self.process_group, async_op=True)
                wait(work, peer, self.timeout)
                unflatten_(flat, same)

    # ---------------------------------------------------------------- training

    def forward(self, *inputs, **kwargs):
        if self._in_backward:
            # The end-of-backward callback never ran: the last backward raised part-way, some
            # buckets may have gone out and others not, so this rank is out of step with its peers.
            for bucket in self._buckets:
                bucket.reset()
            self._next_launch = 0
            self._in_backward = False
            raise RuntimeError("DistributedDataParallel: the previous backward pass failed part-way, after some "
                               "gradient buckets were sent; the ranks are out of step, so training cannot go on")
        if self.require_forward_param_sync and self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))
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
        bucket = self._buckets[b]
        if bucket.arrived[i]:
            raise RuntimeError("a gradient arrived twice in one backward pass (reentrant backward?), "
                               "which manualdp.DistributedDataParallel does not support")
        bucket.view(i).copy_(param.grad)
        bucket.used[i] = 1
        bucket.arrived[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the allreduce of every full bucket, in bucket order (every rank must send them in the same order)."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.future = self._executor.submit(allreduce, bucket.flat, self.algorithm, self.process_group,
                                                  segment_bytes=self.segment_bytes, timeout=self.timeout)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        """End of backward: send what is left, wait for every bucket, write the averages into `.grad`."""
        try:
            for bucket in self._buckets[self._next_launch:]:
                for i, arrived in enumerate(bucket.arrived):
                    if not arrived:  # unused here: contributes zero, but the bucket must still go out
                        bucket.view(i).zero_()
                bucket.pending = 0
            self._launch_ready()
            error = None
            for bucket in self._buckets:
                try:
                    bucket.future.result()
                except Exception as e:  # keep waiting: leave no allreduce running behind us
                    error = error or e
                    continue
                if error is None:
                    self._write_grads(bucket)
            if error is not None:
                raise error
        finally:
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
