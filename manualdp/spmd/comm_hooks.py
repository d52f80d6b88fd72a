"""Communication hooks: how a bucket of gradients becomes their average, as a plug-in.

A hook is `hook(state, bucket) -> torch.futures.Future` of the averaged flat gradients, with
torch's signature, so torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`) run on
manualdp's wrapper and these run on torch's (`torch_ddp.register_comm_hook(None,
allreduce_hook)`). One exception: torch's DDP refuses any hook named `bf16_compress_hook`
without NCCL, ours as its own. manualdp's wrapper calls hooks on its per-group worker thread,
one bucket at a time in bucket order, so a hook may block; it checks what the future holds
(`hook_result`). `state` is the process group (or None: all ranks) unless the hook says otherwise.
The annotations are torch's (`dist.GradBucket`), as torch's DDP insists; manualdp's wrapper
passes its own `GradBucket`, which has the same methods.
"""
import functools
import threading

import torch
import torch.distributed as dist

from ..validate import positive_int
from .collectives import allreduce
from .transport.peers import PeerError

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook",
           "PowerSGDState", "powerSGD_hook", "hook_name", "hook_result"]


class GradBucket:
    """What a hook sees of one bucket, with the methods of torch's `dist.GradBucket`.

    Args:
        index: the bucket's position in launch order.
        buffer: the flat gradients (a view into the wrapper's bucket, until a hook's `set_buffer` replaces it).
        params: the parameters whose gradients `buffer` holds, in order.
        offsets: where each one starts in `buffer` (one extra entry: the end).
        last: True for the bucket that goes out last in a backward pass.
    """

    def __init__(self, index: int, buffer: torch.Tensor, params: list, offsets: list[int], last: bool) -> None:
        self._index, self._buffer, self._params, self._offsets, self._last = index, buffer, params, offsets, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make `tensor` the bucket's buffer, as torch's does (`fp16_compress_wrapper` hands its hook a float16 one)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self._buffer = tensor  # replaced, not copied into: the hook then computes in `tensor`'s dtype, as in torch's

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of `buffer()`, shaped like the parameters."""
        return [self._buffer[lo:hi].view(p.shape) for p, lo, hi in zip(self._params, self._offsets, self._offsets[1:])]


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _size(group) -> int:
    return dist.get_world_size(group)


def allreduce_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The default: sum over the group with manualdp's ring, then divide."""
    tensor = bucket.buffer()
    allreduce(tensor, "ring", group)
    return _done(tensor.div_(_size(group)))


def _compressed(dtype: torch.dtype, group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    # Divide before the sum, in the narrow type: the sum of n gradients may overflow fp16.
    small = tensor.to(dtype).div_(_size(group))
    allreduce(small, "ring", group)
    return _done(tensor.copy_(small))


def fp16_compress_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Allreduce in float16: half the bytes, about three significant digits."""
    return _compressed(torch.float16, group, bucket)


def bf16_compress_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Allreduce in bfloat16: half the bytes, float32's range, about two digits."""
    return _compressed(torch.bfloat16, group, bucket)


def noop_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication: each rank keeps its own gradients. Times a step without the allreduce."""
    return _done(bucket.buffer())


class PowerSGDState:
    """The memory of `powerSGD_hook` across steps.

    Args:
        process_group: the group to average over (None: all ranks).
        matrix_approximation_rank: r, the rank of each gradient's low-rank approximation.
        warm_start: start each step's power iteration from the last step's Q.
        use_error_feedback: add what the approximation lost last step to this step's gradient.
        seed: every rank draws the first Q from this seed, so the ranks' Qs agree.
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, warm_start: bool = True,
                 use_error_feedback: bool = True, seed: int = 0) -> None:
        positive_int("matrix_approximation_rank", matrix_approximation_rank)
        self.process_group = process_group
        self.rank = matrix_approximation_rank
        self.warm_start = warm_start
        self.use_error_feedback = use_error_feedback
        self.seed = seed
        self.errors: dict[int, torch.Tensor] = {}  # bucket index -> what the approximation missed
        self.qs: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, gradient) -> last Q
        self.members: dict[int, tuple[int, ...]] = {}  # bucket index -> ids of its parameters, when last seen


def _orthonormalize(m: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of `m`, in place."""
    for i in range(m.shape[1]):
        col = m[:, i]
        col /= col.norm().clamp_min(1e-8)
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1:]
            rest -= torch.outer(col, col @ rest)


def powerSGD_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD (Vogels et al. 2019): allreduce P = MQ and Q = MᵀP instead of each n×m gradient M."""
    group, n = state.process_group, _size(state.process_group)
    buffer = bucket.buffer()
    _forget_if_rebuilt(state, bucket)
    if state.use_error_feedback:
        error = state.errors.get(bucket.index())
        if error is None or error.shape != buffer.shape:  # a new bucket
            error = state.errors[bucket.index()] = torch.zeros_like(buffer)
        buffer.add_(error)
    before = buffer.clone()  # the gradient the approximation should have given
    olds = torch.split(before, [g.numel() for g in bucket.gradients()])
    for g, (grad, old) in enumerate(zip(bucket.gradients(), olds)):
        if grad.dim() < 2 or min(grad.shape[0], grad.shape[1:].numel()) <= state.rank:
            allreduce(grad, "ring", group)  # vectors and thin matrices: compression would not save bytes
            grad.div_(n)
            old.copy_(grad.view(-1))  # sent exactly: nothing to feed back
            continue
        m = grad.view(grad.shape[0], -1)
        q = state.qs.get((bucket.index(), g)) if state.warm_start else None
        if q is None or q.shape != (m.shape[1], state.rank):
            generator = torch.Generator().manual_seed(state.seed + 1000 * bucket.index() + g)
            q = torch.randn(m.shape[1], state.rank, generator=generator, dtype=m.dtype).to(m.device)
        # P phase: project onto Q, average P, orthonormalize.
        p = m @ q
        allreduce(p, "ring", group)
        p.div_(n)
        _orthonormalize(p)
        # Q phase: project back, average Q; the approximation is P Qᵀ.
        q = m.t() @ p
        allreduce(q, "ring", group)
        q.div_(n)
        state.qs[(bucket.index(), g)] = q
        m.copy_(p @ q.t())
    if state.use_error_feedback:
        error.copy_(before - buffer)
    return _done(buffer)


def _forget_if_rebuilt(state: PowerSGDState, bucket: dist.GradBucket) -> None:
    """The wrapper rebuilt its buckets (after the first step, as torch's DDP and manualdp's do): the state
    kept under this bucket's index belongs to other parameters, so it starts afresh."""
    members = tuple(id(p) for p in bucket.parameters())
    before = state.members.get(bucket.index())
    state.members[bucket.index()] = members
    if before is not None and before != members:
        state.errors.pop(bucket.index(), None)
        for key in [k for k in state.qs if k[0] == bucket.index()]:
            del state.qs[key]


# ---------------------------------------------------------------- what manualdp's wrapper expects back

def hook_name(hook) -> str:
    """`module.name` of a hook (of the function a `functools.partial` wraps): the same on every rank."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def hook_result(hook, future, numel: int, timeout: float) -> torch.Tensor:
    """The flat tensor that `hook`'s `future` holds for a bucket of `numel` gradients, checked.

    A future still pending after `timeout` seconds raises `PeerError`: what it waits for, most
    likely a peer, did not answer.
    """
    name = hook_name(hook)
    if not isinstance(future, torch._C.Future):  # torch.futures.Future, or one from Work.get_future()
        raise TypeError(f"comm hook {name} must return a torch.futures.Future, got {type(future).__name__}")
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise PeerError(dist.get_rank(), None, True, timeout, f"the future of comm hook {name} never completed")
    value = future.value()
    value = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value  # gloo's [tensor]
    wanted = f"a floating-point tensor of the bucket's {numel} elements"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"comm hook {name}: its future must hold {wanted}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"comm hook {name}: its future must hold {wanted}, got a {value.dtype} tensor")
    if value.numel() != numel:
        raise ValueError(f"comm hook {name}: its future must hold {wanted}, got {value.numel()} elements "
                         f"(shape {tuple(value.shape)})")
    return value.reshape(-1)
