"""ZeRO-2's gradients: reduce-scattered bucket by bucket during backward; a rank keeps only its shard.

At stage 1 DDP allreduces every gradient, so every rank holds the whole gradient although it
steps only its shard. Stage 2 never builds the whole gradient on a rank:
1. a hook copies each finished gradient into its bucket and frees `.grad` at once;
2. a full bucket is reduce-scattered on the process group's worker thread while backward goes
   on, and this rank adds its part of the sum into its gradient shard;
3. the next bucket fills a second buffer, and the one after reuses the first once it is sent.
After backward a rank holds its shard, 1/N of the gradient, summed over the ranks and over
the backward passes since `zero_grad`, and no bucket; `zero.py`'s step divides it and steps with it.

Each parameter's `.grad` is then a `ShardedAway`: a tensor of the gradient's shape and dtype
with no storage, which refuses every operation in one line. Left None, torch's
`clip_grad_norm_(model.parameters())` would find no gradient, return 0 and clip nothing; this
way it raises and names the optimizer's `clip_grad_norm_`, which reduces the norm over the ranks.
The next backward drops it before autograd accumulates (a hook on the gradient, run first).

A bucket is a run of consecutive parameters of one flat buffer of `manualdp.shards.ShardPlan`,
taken in reverse as DDP takes them (backward produces the last layers' gradients first), so it
is one range of the buffer. The ranks' shards cut it into parts; each part is summed into the
rank that owns it by the book's tree reduce. A bucket is usually smaller than a shard, so one
or two ranks own it: a ring over such uneven chunks would pass a whole part through n-1 ranks
one after another, where the tree takes log2(n) rounds. Either way every rank sends each
gradient element it does not own once: (n-1)/n of the gradient, as a ring reduce-scatter.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ...buckets import assign_buckets
from ...shards import ShardPlan
from ..collectives import reduce
from ..transport.group import group_worker

__all__ = ["ScatterBucket", "plan_buckets", "GradientShards", "ShardedAway", "real_grad", "holders_of"]


class ShardedAway(torch.Tensor):
    """What `.grad` holds at stage 2 after backward: the gradient's shape and dtype, no data; any use raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"ZeroRedundancyOptimizer(stage=2): a parameter's .grad is not on this rank ({func} "
                           "called on it): backward reduce-scattered it and each rank holds its shard; clip with "
                           "the optimizer's clip_grad_norm_(max_norm), which reduces the norm over the ranks, "
                           "read it with gradient_bytes(), or use stage=1")

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"ShardedAway(shape={tuple(self.shape)}, dtype={self.dtype}: reduce-scattered at stage 2)"


def real_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad`, or None where it is a `ShardedAway`."""
    return None if isinstance(p.grad, ShardedAway) else p.grad


class ScatterBucket(NamedTuple):
    buffer: int                        # the flat buffer it is a range of
    lo: int                            # that range: [lo, hi)
    hi: int
    params: list[int]                  # its parameters (the plan's indices), in the order backward fills them
    parts: list[tuple[int, int, int]]  # (owner, lo, hi) relative to lo: the part of each rank's shard in it


def plan_buckets(plan: ShardPlan, params: list[torch.Tensor], bucket_cap_mb: float) -> list[ScatterBucket]:
    """Each buffer of `plan`, last one first, cut into runs of parameters of about `bucket_cap_mb` MiB, from its end."""
    buckets = []
    for b in reversed(range(len(plan.buffers))):
        members = plan.buffers[b]
        for run in assign_buckets([params[j] for j in members], bucket_cap_mb):  # reverse order
            js = [members[i] for i in run]
            lo, hi = plan.where[js[-1]][1], plan.where[js[0]][2]
            owned = [(d, *plan.bounds(b, d)) for d in range(plan.num_devices)]
            parts = [(d, max(a, lo) - lo, min(z, hi) - lo) for d, a, z in owned if max(a, lo) < min(z, hi)]
            buckets.append(ScatterBucket(b, lo, hi, js, sorted(parts, key=lambda part: part[1])))
    return buckets


class GradientShards:
    """This rank's shard of the gradient of `params`, summed bucket by bucket during backward.

    Args:
        plan, params: the optimizer's layout and its parameters, in the plan's order.
        buckets: from `plan_buckets` (every rank has the same).
        rank, group, timeout: where this rank's shard is, and the group the gradients are summed over.
        on_first_grad: a weak reference to what to call at each backward's first gradient, before
            any bucket is sent (the optimizer tells a `Join` there that this rank still trains).
    """

    def __init__(self, plan: ShardPlan, params: list[torch.Tensor], buckets: list[ScatterBucket], rank: int, group,
                 timeout: float | None, on_first_grad) -> None:
        self.plan, self.params, self.buckets, self.rank = plan, params, buckets, rank
        self.group, self.timeout, self.on_first_grad = group, timeout, on_first_grad
        self.worker = group_worker(group)  # the one thread that runs this group's collectives in order
        self.bucket_of = {j: k for k, bucket in enumerate(buckets) for j in bucket.params}
        self.index = {id(p): j for j, p in enumerate(params)}
        self.largest: dict[tuple, int] = {}  # per buffer (dtype, k % 2), the elements of the largest bucket k in it
        for k, bucket in enumerate(buckets):
            slot = (params[bucket.params[0]].dtype, k % 2)
            self.largest[slot] = max(self.largest.get(slot, 0), bucket.hi - bucket.lo)
        self.shards: list[torch.Tensor | None] = [None] * len(plan.buffers)  # this rank's sums, per buffer
        self.used = [False] * len(params)  # which parameters had a gradient here since zero_grad
        def drop_stand_in(p: torch.Tensor):  # before autograd adds the new gradient into .grad
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if isinstance(p.grad, ShardedAway):
                    p.grad = None
                return grad
            return hook
        take = _TakeGrad(self)
        self.handles = [p.register_post_accumulate_grad_hook(take) for p in params]
        self.handles += [p.register_hook(drop_stand_in(p)) for p in params]
        self.released = False  # a newer optimizer over these parameters took their gradients (`release`)
        self.in_backward = False
        self._reset()

    def _reset(self) -> None:
        """Forget the backward pass: nothing arrived, nothing is being sent, no bucket buffer is held."""
        self.missing = [len(bucket.params) for bucket in self.buckets]  # gradients each bucket waits for
        self.arrived = [False] * len(self.params)  # its gradient came in this backward pass
        self.taken = [False] * len(self.params)    # it is copied into its bucket
        self.next = 0          # the bucket being filled: they are sent in order, the same on every rank
        self.view = None       # its buffer
        self.buffers: dict[tuple, torch.Tensor] = {}  # (dtype, k % 2) -> the buffer buckets k, k+2, ... reuse
        self.sending: dict[tuple, object] = {}        # (dtype, k % 2) -> the future of the last bucket sent from it
        self.running: list = []

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Autograd's hook: `p.grad` is final for this backward pass."""
        if p.grad is None:  # another hook took it
            return
        if not self.in_backward:
            self.in_backward = True
            if (notify := self.on_first_grad()) is not None:
                notify()
            self._allocate()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        j = self.index[id(p)]
        k = self.bucket_of[j]
        self.arrived[j] = True
        self.missing[k] -= 1
        if k == self.next:  # a later bucket's gradient waits in .grad until that bucket is filled
            self._take(j)
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._send()
            if self.next < len(self.buckets):  # the next bucket takes the gradients that came early
                for i in self.buckets[self.next].params:
                    if self.arrived[i]:
                        self._take(i)

    def _end_of_backward(self) -> None:
        """After the whole backward pass: send what is left (a parameter unused here sends zeros), then wait."""
        try:
            self._flush(own=True)
        finally:
            self.in_backward = False
            self._reset()
        self.stand_in()

    def stand_in(self) -> None:
        """Every parameter without a `.grad` gets a `ShardedAway`: its gradient is in the shards."""
        for p in self.params:
            if p.grad is None:
                p.grad = ShardedAway(p)

    def reduce_zeros(self) -> None:
        """A rank out of data under `Join`: zeros into every bucket, as the training ranks send theirs.

        The shards are dropped first: they hold this step's sums only (this rank's old ones would add in).
        """
        self.shards = [None] * len(self.shards)
        self._allocate()
        try:
            self._flush(own=False)
        finally:
            self._reset()

    def _flush(self, own: bool) -> None:
        while self.next < len(self.buckets):
            for j in self.buckets[self.next].params:
                if not self.taken[j]:
                    self._take(j, zeros=not own)
            self._send()
        for future in self.running:
            future.result()  # raises the reduce's error (a PeerError naming a silent rank)

    def _allocate(self) -> None:
        for b, shard in enumerate(self.shards):
            if shard is None:
                lo, hi = self.plan.bounds(b, self.rank)
                like = self.params[self.plan.buffers[b][0]]
                self.shards[b] = torch.zeros(hi - lo, dtype=like.dtype, device=like.device)

    @torch.no_grad()  # backward(create_graph=True) runs hooks with grad on; the bucket is plain data
    def _take(self, j: int, zeros: bool = False) -> None:
        """Copy parameter j's gradient into the bucket being filled, and free it (zeros if it has none)."""
        bucket, p = self.buckets[self.next], self.params[j]
        if self.view is None:
            self.view = self._buffer(bucket)
        _, start, end = self.plan.where[j]
        into = self.view[start - bucket.lo:end - bucket.lo]
        if zeros or real_grad(p) is None:
            into.zero_()
        else:
            into.copy_(p.grad.reshape(-1))
            p.grad = None
            self.used[j] = True
        self.taken[j] = True

    def _buffer(self, bucket: ScatterBucket) -> torch.Tensor:
        """A buffer for the bucket being filled: one of two per dtype, taken over once its last bucket is sent."""
        like = self.params[bucket.params[0]]
        slot = (like.dtype, self.next % 2)
        if slot in self.sending:
            self.sending.pop(slot).result()
        if slot not in self.buffers:
            self.buffers[slot] = torch.empty(self.largest[slot], dtype=like.dtype, device=like.device)
        return self.buffers[slot][:bucket.hi - bucket.lo]

    def _send(self) -> None:
        """Reduce-scatter the bucket being filled on the worker thread; the next one starts filling."""
        bucket = self.buckets[self.next]
        if self.view is None:
            self.view = self._buffer(bucket)
        future = self.worker.submit(self._reduce, bucket, self.view)
        self.sending[self.params[bucket.params[0]].dtype, self.next % 2] = future
        self.running.append(future)
        self.next, self.view = self.next + 1, None

    def _reduce(self, bucket: ScatterBucket, view: torch.Tensor) -> None:
        """On the worker: sum each rank's part of the bucket into that rank; add this rank's into its shard."""
        for owner, lo, hi in bucket.parts:
            reduce(view[lo:hi], owner, "tree", self.group, timeout=self.timeout)
            if owner == self.rank:
                at = bucket.lo + lo - self.plan.bounds(bucket.buffer, self.rank)[0]
                self.shards[bucket.buffer][at:at + hi - lo].add_(view[lo:hi])

    def check_finished(self) -> None:
        """Raise if the last backward pass never finished: some buckets may have gone out, others not."""
        if self.in_backward:
            sent = self.next
            self.in_backward = False
            self._reset()
            raise RuntimeError(f"ZeroRedundancyOptimizer: the last backward pass failed part-way, after {sent} of "
                               f"{len(self.buckets)} gradient buckets were sent; the ranks are out of step, so "
                               "training cannot go on")

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the shards (`set_to_none`) or zero them, as `Optimizer.zero_grad` does `.grad`."""
        self.check_finished()
        if set_to_none:
            self.shards = [None] * len(self.shards)
            self.used = [False] * len(self.params)
            for p in self.params:
                if isinstance(p.grad, ShardedAway):
                    p.grad = None
        for shard in self.shards:
            if shard is not None:
                shard.zero_()

    def held(self) -> list[torch.Tensor]:
        """The gradient tensors this holds now: the shards and the bucket buffers."""
        return [s for s in self.shards if s is not None] + list(self.buffers.values())

    def adopt(self, old: GradientShards) -> None:
        """Take over what `old` (the same plan, fewer buffers) has summed so far, and remove its hooks."""
        old.check_finished()
        self.shards[:len(old.shards)] = old.shards
        self.used[:len(old.used)] = old.used
        old.release()

    def release(self) -> None:
        """Remove the hooks: from now on another `GradientShards` takes these parameters' gradients."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.released = [], True


class _TakeGrad:
    """The hook that hands each finished `.grad` to its `GradientShards`; weak, so a dropped optimizer takes none."""

    def __init__(self, shards: GradientShards) -> None:
        self.shards = weakref.ref(shards)

    def __call__(self, p: torch.Tensor) -> None:
        if (shards := self.shards()) is not None:
            shards._grad_ready(p)


def holders_of(params: list[torch.Tensor]) -> list[GradientShards]:
    """The live `GradientShards` whose hooks take any of `params`' gradients (found among the tensors' own hooks)."""
    found = {}
    for p in params:
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            if isinstance(hook, _TakeGrad) and (shards := hook.shards()) is not None:
                found[id(shards)] = shards
    return list(found.values())
