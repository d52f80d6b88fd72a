"""The drop-in's reducer: rung 4's buckets, plus what torch's features need to see and change.

As in rung 4 (`ladder/bucketed.py`): a hook copies each finished gradient into its bucket; full
buckets are reduced, strictly in order, on the group's worker while backward goes on; at the
end of backward the missing gradients are filled in, every bucket is waited for and the
averages go into `.grad`. Rung 5 = rung 4's `Bucket`
- + two flags per parameter ("used", "ready") summed with the gradients (`FlaggedBucket`), so
  every rank learns which parameters some rank left unused (unused parameters, static graph);
- + a per-bucket reduction that a comm hook replaces (`reduce`), and a divisor that Join changes;
- + sparse gradients, `.grad` as a view into the bucket, and buckets rebuilt after the first
  step in the order the gradients arrived (rank 0's), as torch's DDP does;
- + the wrapper's features, an ordered list of `Feature` objects whose named hooks the reducer
  calls, in list order, at five moments of a step (`use`, `feature.py`).

What a feature may read or call (nothing else; the ddp tests hold them to it):
- its settings: `group`, `rank`, `peers`, `device`, `timeout`, `segment_bytes`, `gradient_as_bucket_view`, `recorder`;
- `buckets` (each a `FlaggedBucket`), `layout`, `algorithms`, `names` (per bucket), `params`, `steps`, `state`;
- `locate(param)` -> (bucket, index in it); `index(param)`: torch's index (position in `params`); `name(index)`;
- `arrived()`: the indices of the parameters whose gradient this backward pass produced;
- `divisor` (what the sums are divided by) and `active` (ranks training this step), set by Join;
- `syncing` (this backward syncs; False under `no_sync`), `in_backward`;
- `reduce(index, bucket)`: the reduction, on the worker; `allreduce_bucket` unless a comm hook replaced it
  (then `reduces_to_average`: its results are averages already);
- `may_rebuild` () -> bool (False under Join) and `logged` (error) -> error, set by the wrapper;
- `submit(fn, *args)`, `shadow_step()`, `reset()`, `remove_hooks()`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import weakref

import torch
from torch import nn

from ...buckets import assign_buckets
from .bucket import FlaggedBucket
from .feature import HOOKS, Feature
from ..transport.agree import broadcast_from_rank0
from ..transport.group import group_state
from ..transport.p2p import run_allreduce
from ..auto.tune import resolve

__all__ = ["Reducer"]


# What a copy (deepcopy, pickle) of a reducer leaves behind: per-process state and the features' wiring.
_NOT_COPIED = ("group", "state", "worker", "hooks", "_where", "names", "_names", "_position", "reduces_to_average",
               "used_in_no_sync", "ready_order", "reduce", "features", "feature_hooks", "may_rebuild", "logged")


class Reducer:
    """The buckets of `params` (grouped as `layout`) and their reduction across `group` during backward.

    Args:
        params: the parameters to average, in torch's order; module: the model (for names).
        layout: indices into `params` per bucket; caps: the caps it came from (rebuilt with them).
        group, rank, peers: the process group, this rank and the group's global ranks.
        algorithm, segment_bytes, timeout: how each bucket is allreduced (`collectives.allreduce`).
        gradient_as_bucket_view: `.grad` is a view into its bucket; rebuild: rebuild after the first step.
    """
    group_state = staticmethod(group_state)  # ft/'s reducer, whose group changes each quorum, brings its own

    def __init__(self, params: list[nn.Parameter], module: nn.Module, layout: list[list[int]], caps, *, group,
                 rank: int, peers: list[int], device: torch.device, algorithm: str, segment_bytes: int,
                 timeout: float, gradient_as_bucket_view: bool, rebuild: bool) -> None:
        self.params, self.caps, self.group, self.rank, self.peers = params, caps, group, rank, peers
        self.device, self.algorithm, self.segment_bytes, self.timeout = device, algorithm, segment_bytes, timeout
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.recorder = None  # optional `manualdp.support.trace.Trace`: each bucket's ready, allreduce and wait
        self.steps = 0  # synchronised backward passes so far
        self.divisor = self.active = len(peers)  # fewer under Join
        self.syncing = True  # whether this backward pass syncs (decided by the forward pass, as in DDP)
        self.set_layout(layout)
        self.start(module, rebuild)

    def set_layout(self, layout: list[list[int]]) -> None:
        """Buckets of `params` as `layout` groups them, each with its schedule."""
        self.layout = layout
        self.buckets = [FlaggedBucket([self.params[i] for i in b]) for b in layout]
        # "auto" may calibrate the first time, a collective: every rank resolves here, together.
        self.algorithms = [resolve(self.algorithm, b.flat.numel(), b.flat.element_size(), self.group,
                                   self.timeout, self.segment_bytes) for b in self.buckets]

    def start(self, module: nn.Module, rebuild: bool) -> None:
        """The per-process state that neither deepcopy nor pickle carries: lookup tables, worker, hooks, wiring."""
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._position = {id(p): k for k, p in enumerate(self.params)}
        self._locate()
        self.used_in_no_sync: set[int] = set()  # ids of parameters used by no_sync steps since the last sync
        self.ready_order = [] if rebuild else None  # ids of the parameters in the order their gradients came
        self._next = 0  # buckets launch strictly in order, the same on every rank
        self.in_backward = False
        self.state = self.group_state(self.group)  # the group's worker, scratch space, byte counter
        self.worker = self.state.worker
        self.reduce = self.allreduce_bucket
        self.reduces_to_average = False  # True where `reduce` hands back averages (a comm hook), not sums
        self.use([])
        self.may_rebuild = lambda: True
        self.logged = lambda error: error
        ref = weakref.ref(self)  # the module may outlive this reducer: its hooks must not keep it alive

        def hook(param: nn.Parameter) -> None:
            live = ref()
            if live is not None:
                live.grad_ready(param)
        self.hooks = [p.register_post_accumulate_grad_hook(hook) for bucket in self.buckets for p in bucket.params]

    def _locate(self) -> None:
        """Where each parameter sits in the buckets, and their names; `.grad` into the buckets if they are views."""
        self._where = {}  # id(param) -> (bucket index, index in the bucket)
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
                if self.gradient_as_bucket_view and p.grad is not None:
                    bucket.view(i).copy_(p.grad)
                    p.grad = bucket.view(i)
        self.names = [[self._names[id(p)] for p in bucket.params] for bucket in self.buckets]  # for error messages

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in _NOT_COPIED}

    def use(self, features: list[Feature]) -> None:
        """The wrapper's features, in order: at each moment of a step their hooks are called in this order."""
        self.features = list(features)
        # per hook, the features that override it: a gradient hook calls only what does something
        self.feature_hooks = {name: [getattr(f, name) for f in self.features
                                     if getattr(type(f), name, None) is not getattr(Feature, name)] for name in HOOKS}

    def locate(self, param: nn.Parameter) -> tuple[int, int]:
        return self._where[id(param)]

    def index(self, param: nn.Parameter) -> int:
        return self._position[id(param)]

    def name(self, index: int) -> str:
        return self._names[id(self.params[index])]

    def arrived(self) -> frozenset[int]:
        return frozenset(self._position[id(p)] for bucket in self.buckets
                         for p, came in zip(bucket.params, bucket.arrived) if came)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run `fn` on the group's worker, after every collective queued before it."""
        return self.worker.submit(fn, *args)

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def grad_ready(self, param: nn.Parameter) -> None:
        """Hook: `param.grad` is final for this backward pass; copy it into its bucket."""
        if not self.syncing:
            self.used_in_no_sync.add(id(param))
            return
        if self.ready_order is not None:
            self.ready_order.append(id(param))
        if not self.in_backward:
            self.in_backward = True
            # Runs when the whole backward pass is done, also when some hooks never fire.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            for fn in self.feature_hooks["backward_start"]:
                fn()
        b, i = self._where[id(param)]
        for fn in self.feature_hooks["grad_ready"]:
            fn(param)
        full = self.buckets[b].mark_ready(i, param.grad)
        if full:
            if self.recorder is not None:
                self.recorder.instant(f"bucket {b} ready", "compute", bucket=b)
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the reduction of every full bucket, in bucket order (every rank must send them in the same order)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            bucket.seal()
            run = self._reduce if self.recorder is None else _recorded(self._reduce, self.recorder, self._next)
            bucket.future = self.worker.submit(run, self._next, bucket)
            self._next += 1

    def _reduce(self, index: int, bucket: FlaggedBucket) -> None:
        for fn in self.feature_hooks["before_reduce"]:
            fn(index, bucket)
        self.reduce(index, bucket)

    def allreduce_bucket(self, index: int, bucket: FlaggedBucket) -> None:
        """On the worker: sum `bucket.flat`, gradients and flags, over the group."""
        # Straight to the executor: the arguments were checked at construction, and the ranks' calls
        # once per step (`step_check.CallCheck`), alone or carried by each bucket (`bucket.check`).
        run_allreduce(bucket.flat, self.algorithms[index], self.state, self.segment_bytes, self.timeout,
                      check=bucket.check)

    @torch.no_grad()  # backward(create_graph=True) runs this callback with grad on; buckets are plain data
    def finish_backward(self) -> None:
        """End of backward: send what is left, wait for every bucket, write the averages into `.grad`."""
        try:
            used = self.arrived()
            for bucket in self.buckets[self._next:]:
                bucket.fill_missing(self.used_in_no_sync)  # unused here: the bucket must still go out
            self._launch_ready()
            error = None
            for b, bucket in enumerate(self.buckets):
                try:
                    with _waiting(self.recorder, b):
                        bucket.future.result()
                except Exception as e:  # keep waiting: leave no allreduce running behind us
                    error = error or e
                    continue
                if error is None:
                    self.write_grads(bucket)
            if error is not None:
                raise self.logged(error)
            self.steps += 1
            for fn in self.feature_hooks["backward_end"]:
                fn(used)
        finally:
            self.reset()
        if self.ready_order is not None:
            self._rebuild()

    def shadow_step(self) -> None:
        """A joined rank's step: zero buckets reduced with the training ranks', their averages into `.grad`."""
        for b, bucket in enumerate(self.buckets):
            bucket.flat.zero_()
            bucket.future = self.worker.submit(self._reduce, b, bucket)
        try:
            for bucket in self.buckets:
                bucket.future.result()
            for bucket in self.buckets:
                self.write_grads(bucket)
        finally:
            self.reset()

    def _rebuild(self) -> None:
        """After the first synchronised backward: buckets in the order its gradients became ready, as DDP.

        Ranks may have seen different orders, so rank 0's is broadcast and every rank builds the
        same buckets. Unused parameters go last, in reverse order.
        """
        ready, self.ready_order = self.ready_order, None
        # under Join; a comm hook's state is per bucket: torch's hooks expect this rebuild too
        if not self.may_rebuild():
            return
        seen = [self._position[i] for i in dict.fromkeys(ready)]
        order = seen + sorted(set(range(len(self.params))) - set(seen), reverse=True)
        agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
        # on the worker: in line with every other collective of the group
        self.worker.submit(broadcast_from_rank0, [agreed], self.group, self.timeout).result()
        layout = assign_buckets(self.params, self.caps, order=agreed.tolist())
        if layout != self.layout:
            self.set_layout(layout)
            self._locate()

    def reset(self) -> None:
        """Forget the backward pass: every bucket empty, none launched."""
        for bucket in self.buckets:
            bucket.reset()
        self.used_in_no_sync.clear()
        self._next = 0
        self.in_backward = False
        for fn in self.feature_hooks["reset"]:
            fn()

    def write_grads(self, bucket: FlaggedBucket) -> None:
        """The bucket's sums, divided by `divisor` (by 1 where a comm hook handed back averages), into `.grad`."""
        divisor = 1 if self.reduces_to_average else self.divisor
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


# ---------------------------------------------------------------- optional timeline (manualdp.support.trace)

def _recorded(fn, recorder, b: int):
    """`fn` that records its run as bucket `b`'s allreduce on the communication track."""
    def run(*args, **kwargs):
        with recorder.span(f"bucket {b} allreduce", "comm", cat="comm", bucket=b):
            return fn(*args, **kwargs)
    return run


def _waiting(recorder, b: int):
    none = recorder is None
    return contextlib.nullcontext() if none else recorder.span(f"bucket {b} wait", "compute", cat="wait", bucket=b)
