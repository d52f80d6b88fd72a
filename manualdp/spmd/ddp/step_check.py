"""The drop-in's debug checks: the ranks compare their calls, as each bucket goes out, or in more words in debug mode.

On gloo each bucket's allreduce carries the call check with its data (`call_check.make_check`: size,
dtype, algorithm, call number, the step, and the wrapper's number as its identity): at two ranks as the tag
the data travels on, so nothing more is sent while the ranks agree; from three ranks on as fixed-size headers beside
its first round. Where a bucket cannot carry it (NCCL, a comm hook, the buffers' copy before a
forward, which has no check of its own), the forward pass (or else the first gradient hook)
queues `check_same_call` for the whole step ahead of the buckets, and they go out unchecked.
A forward without a backward leaves the step's check queued for the next step's. In debug mode
every bucket is compared instead, in more words (`Desync`).

The check compares the step too, as the ladder's rungs do: the number of forward passes that began
a synchronised step (a joined rank's shadow step counts as one). A backward pass that no forward
began (one rank's second `loss.backward()` of one forward, `retain_graph`) carries the step it
belongs to, which its peers have left: every rank raises, naming the step, instead of pairing it
with the peers' next step. A forward with grad and no backward begins no step of its own: the
check it queued stays queued, so a validation pass on one rank is no error, as with torch's DDP.
"""
from __future__ import annotations

import concurrent.futures
import contextlib

from ..transport.agree import ANY, agree
from ..transport.call_check import check_same_call, make_check
from .graph import refuse_in_backward_optimizers
from .comm_hook import check_same_hook, hooks_named
from .init_sync import kept_named
from .feature import Feature
from ..ladder.identity import BuiltWith, frozen_alike, naming_wrappers, replaced_line

__all__ = ["CallCheck", "Desync"]


class CallCheck(Feature):
    """The step's call check: carried by each bucket (`carried`), or queued on the reducer's worker ahead of them.

    Alone, one `check_same_call` for all buckets (their total size, bucket 0's algorithm). Either
    way a rank that is out of step, or calls some other allreduce meanwhile, meets a call of
    another fingerprint instead of its peers' bucket, and every rank raises in one line. At the
    first synchronised step the ranks also compare their comm hooks, and in-backward optimizers are refused.
    """

    def __init__(self, reducer, module, ignored: set[str], world_size: int, debug: bool, number: int) -> None:
        self.reducer, self.module, self.ignored = reducer, module, ignored
        kept = kept_named(module.named_parameters(), ignored)
        self.built = BuiltWith([(n, p) for n, p in kept if p.requires_grad], kept)  # the parameters as built
        self.names = self.built.names  # a rank's `replaced_mark` names one of them
        self.number = number  # which wrapper of its group it is (`ladder.identity`): compared with the step
        self.world_size, self.debug = world_size, debug
        # off only to measure what the check costs (bench/faults.py): a mismatch then aborts in gloo
        self.enabled = True
        self.started = False  # the first synchronised step has come: the hooks were compared
        self.comm_hook = None  # the registered `CommHook`, compared at the first step
        self.future: concurrent.futures.Future | None = None  # this step's check, or None
        self.queued = False  # this step's check is queued, or its buckets carry it
        self.alone = False  # this step's calls are compared by a check of their own, not carried by the buckets
        self.steps = 0  # forward passes (or joined ranks' shadow steps) that began a synchronised step: compared

    def backward_start(self) -> None:
        self.queue(new_step=False)  # a backward whose forward did not queue it: it belongs to the last step

    def __getstate__(self):
        return self.__dict__ | {"future": None, "comm_hook": None, "started": False, "queued": False, "alone": False}

    def queue(self, new_step: bool = True, force: bool = False) -> None:
        """Queue the step's check, unless this step already has it; `new_step`: a forward pass begins the step;
        `force`: compare the calls in debug mode too."""
        if not self.queued:
            self.queued = True
            self.steps += new_step
            self.future = self._submit(force)
        elif force and not self.alone:  # the buckets were to carry it, but something unchecked goes first
            self.future = self._submit(force)

    def compare_hooks_now(self) -> None:
        """A comm hook registered between forward and backward: the hooks and calls compared before its buckets."""
        self.future = self._submit(force=True)

    def settle(self) -> None:
        """Queue the step's check now and wait for it (before the buffers' copy, which has no check of its own)."""
        self.queue(force=True)
        self.before_reduce(0, None)

    def carried(self) -> bool:
        """Whether each bucket carries the step's call check with its data (gloo, manualdp's own allreduce): at two
        ranks as the tag its data travels on (no message more), from three on as headers beside its first round."""
        r = self.reducer
        return self.enabled and not self.debug and self.comm_hook is None and self.world_size > 1 and r.state.early

    def before_reduce(self, index: int, bucket) -> None:
        if self.future is not None:
            self.future.result()  # done (the worker runs in order); raises if the ranks called differently
        if bucket is not None and not self.alone and self.carried():
            r, algorithm = self.reducer, self.reducer.algorithms[index]
            if index > 0 and (error := r.buckets[index - 1].future.exception()) is not None:
                raise error  # every rank refused the bucket before (or the worker stopped): send nothing more
            bucket.check = _Named(make_check(r.state, bucket.flat, algorithm, r.segment_bytes, r.timeout,
                                             schedule=algorithm, step=self.steps, identity=self.number), self.names,
                                  self.number, r.group)

    def reset(self) -> None:
        self.future, self.queued, self.alone = None, False, False

    def _submit(self, force: bool = False) -> concurrent.futures.Future | None:
        r = self.reducer
        if not self.started:  # the first synchronised step: torch sets up in-backward optimizers here
            refuse_in_backward_optimizers(kept_named(self.module.named_parameters(), self.ignored))
        hooks, self.started = not self.started, True
        # debug: each bucket is checked, in more words; else each bucket carries the check where it can
        calls = self.enabled and (force or not (self.debug or self.carried()))
        self.alone = calls
        if self.world_size == 1 or not (hooks or calls):
            return None
        first, total = r.buckets[0].flat, sum(b.flat.numel() for b in r.buckets)
        recorder, call = r.recorder, (first, r.algorithms[0], r.segment_bytes, r.group, r.timeout)
        comm_hook, step, number = self.comm_hook, self.steps, self.number

        def run() -> None:  # the hooks' comparison is a checked call too: out of step, named; a hook on one rank too
            with hooks_named(number, r.group), naming_wrappers(self.names):
                if hooks:
                    check_same_hook(comm_hook, r.group, r.timeout)
                if calls:
                    with (recorder.span("step check", "comm", cat="comm") if recorder is not None
                          else contextlib.nullcontext()):
                        check_same_call(*call, numel=total, step=step, identity=number)
        return r.submit(run)

    def refuse_replaced(self) -> list:
        """The module's kept (name, parameter) pairs, unless one is no longer what the wrapper was built with: then
        this rank's check (sent with its `replaced_mark`) refuses the peers' next call, and every rank raises naming
        it (also when every rank sent the same mark, and the check passed)."""
        named = kept_named(self.module.named_parameters(), self.ignored)
        mark, r = self.built.mark(named, self.reducer.rank), self.reducer
        if mark is None:
            return named
        if self.world_size > 1:
            def run() -> None:
                with naming_wrappers(self.names):
                    check_same_call(r.buckets[0].flat, r.algorithms[0], r.segment_bytes, r.group, r.timeout,
                                    step=self.steps, identity=mark)
            try:
                r.submit(run).result()
            except ValueError as e:
                raise r.logged(e) from None
        if frozen_alike(mark):  # frozen on every rank: nobody waits for it
            return named
        marks = dict.fromkeys(range(self.world_size), mark)
        raise r.logged(RuntimeError(replaced_line(r.rank, "DistributedDataParallel", marks, self.names)))


class _Named:
    """A call check carried by a bucket, whose refusal names the wrappers and their steps (`naming_wrappers`)."""

    def __init__(self, check, names: list[str] | None, number: int, group) -> None:
        self.check, self.names, self.number, self.group = check, names, number, group

    def __getattr__(self, name: str):
        return getattr(self.check, name)

    def __call__(self) -> None:
        self._named(self.check)

    def landed(self) -> None:
        self._named(self.check.landed)

    def _named(self, fn) -> None:
        # The naming context is entered only for a refusal: agreeing calls, every bucket of every step, pay nothing.
        try:
            fn()
        except ValueError:
            with hooks_named(self.number, self.group), naming_wrappers(self.names):
                raise


class Desync(Feature):
    """Debug mode: before each bucket, every rank shows (step, bucket, size, parameters) to every rank."""

    def __init__(self, reducer, world_size: int, joined, calls: CallCheck) -> None:
        self.reducer, self.world_size = reducer, world_size
        self.joined = joined  # () -> whether Join shadows this rank's steps
        self.calls = calls  # its `steps`: the step each backward pass belongs to (an extra backward: the last one)

    def before_reduce(self, index: int, bucket) -> None:
        """Every rank must be about to reduce the same bucket of the same step; else all raise."""
        names = self.reducer.names[index]
        r = self.reducer
        agree("DistributedDataParallel desync: the bucket to reduce", {
            "step": ANY if self.joined() else self.calls.steps,  # a joined rank shadows whichever step the others do
            "bucket": index, "numel": bucket.offsets[-1], "dtype": str(bucket.flat.dtype), "params": names},
            r.group, error=RuntimeError, timeout=r.timeout, hint="every rank must run the same steps on the same model",
            check=True,  # the calls compared first: a rank in a collective of its own is named, not waited for
            shown={"unused parameters": [n for n, arrived in zip(names, bucket.arrived) if not arrived] or "none",
                   "joined": self.joined()})
