"""A comm hook on the drop-in's reducer: torch's `hook(state, bucket) -> Future[Tensor]` reduces each bucket.

The hook sees the bucket's gradients only (as a `GradBucket`, `spmd/comm_hooks.py`) and hands back their
averages; the two flags per parameter ("used", "ready") that the reducer sends beside them are
still summed by manualdp's allreduce. At the first synchronised step after a hook is registered
(before training, later, or between a forward pass and its backward, as torch's takes it: the hook
runs from that backward on) the ranks compare their hooks and states (`hook_identity.py`: what the
hook will compute, its code, defaults and bound arguments, never its module's name or its own name). A hook
registered on some ranks only makes their calls differ; each rank wrote what it registered, and when, to the
group's store (`publish`), so the refused call is named as the hooks that differ, on every rank (`hooks_named`), or,
where only a default argument differs, as that argument and its value on each rank. Torch's DDP trains on there
when the one hook happens to average too; we name it.

A hook that raises, or hands back the wrong thing, fails that step on every rank alike: its
rank still sends the bucket's flags, marked, so every peer learns of it in the same message and
raises too; nothing is left in flight, and the group's worker serves the next wrapper (torch's
second wrapper trains after a first one's hook failed). The flags' allreduce is checked (at two
ranks on gloo, nothing more travels): where the peers' hooks are in a collective of their own
(the hook failed before its own), the marker meets that collective, and the call check makes every
rank raise, the failed rank naming its hook's error, never pairing the marker with the wrong call.
A hook whose collectives are torch's, not manualdp's, cannot be told from: the failed rank names
its hook's error after the wrapper's timeout, and the peers' torch collective ends by torch's.
"""
from __future__ import annotations

import contextlib
import hashlib
import json

import torch.distributed as dist

from ..collectives import allreduce
from ..comm_hooks import GradBucket, hook_name, hook_result
from ..transport.agree import agree
from ..transport.call_check import differs
from ..transport.late import group_store
from ..transport.peers import DEFAULT_TIMEOUT, PeerError, is_refused_alike, refused_alike
from .hook_identity import code_identity, defaults_of, hook_identity, state_identity

__all__ = ["CommHook", "check_same_hook", "register_hook", "parts_replicas", "hook_identity", "hooks_named"]

_NONE = "none (manualdp's allreduce)"  # a rank without a comm hook
_LONGEST = 600  # characters of a hook's identity shown in full
_FAILED = -1024.0  # a failed hook's flags: a summed flag is at least 0 on every rank whose hook worked


class CommHook:
    """`hook(state, bucket)` as the reducer's per-bucket reduction."""

    def __init__(self, state: object, hook, reducer) -> None:
        self.state, self.hook, self.reducer = state, hook, reducer
        self.failure: Exception | None = None  # what failed this step (here or, by the flags, on a peer)

    def install(self) -> None:
        self.reducer.reduce = self.reduce
        self.reducer.reduces_to_average = True

    def reduce(self, index: int, bucket) -> None:
        """On the worker: the hook on the gradients, manualdp's allreduce on the flags."""
        r = self.reducer
        if index == 0:
            self.failure = None  # a new step
        if self.failure is None:
            try:
                view = GradBucket(index, bucket.grads, bucket.params, bucket.offsets, index == len(r.buckets) - 1)
                result = hook_result(self.hook, self.hook(self.state, view), bucket.grads.numel(),
                                     r.timeout or DEFAULT_TIMEOUT)
                if result.data_ptr() != bucket.grads.data_ptr():
                    bucket.grads.copy_(result)
            except PeerError:
                raise  # a peer did not answer: the ranks are out of step for good
            except Exception as e:
                if is_refused_alike(e):  # the hook's own collective met another call: a peer's failure marker?
                    raise refused_alike(RuntimeError(
                        f"comm hook {hook_name(self.hook)} at bucket {index}: its collective met another call on a "
                        f"peer (a peer whose hook failed sends its failure marker instead; its error is raised "
                        f"there), or the ranks' hooks call differently: {e}")) from e
                self.failure = e
        if self.failure is not None:
            bucket.flags.fill_(_FAILED)  # the flags still go out, so that the peers' allreduce pairs with ours
        self._send_flags(index, bucket)
        if self.failure is None and bucket.flags.numel() and bucket.flags.min().item() < 0:
            self.failure = RuntimeError(f"comm hook {hook_name(self.hook)} failed on another rank at bucket {index} "
                                        "of this step (its error is raised there)")
        if self.failure is not None:
            raise refused_alike(self.failure)

    def _send_flags(self, index: int, bucket) -> None:
        """The bucket's flags summed, checked: a failure marker (a failed hook's flags) never pairs with a peer's
        other call (its hook's own collective); both ranks raise instead, and this one names its failed hook."""
        r = self.reducer
        try:
            allreduce(bucket.flags, r.algorithms[index], r.group, segment_bytes=r.segment_bytes, timeout=r.timeout,
                      check=True)
        except (PeerError, ValueError) as e:
            if self.failure is None:
                raise
            # the peers are in a collective of their own hook (manualdp's: the call check names both; torch's:
            # no answer): the line names this rank's failed hook first
            failed = RuntimeError(f"comm hook {hook_name(self.hook)} failed on this rank at bucket {index} "
                                  f"({type(self.failure).__name__}: {self.failure}); its failure marker met "
                                  f"another call on a peer, its hook's own collective: {e}")
            raise (refused_alike(failed) if is_refused_alike(e) else failed) from self.failure


def register_hook(calls, reducer, state: object, hook, errors) -> None:
    """The wrapper's `register_comm_hook`: checked, then installed; the ranks compare hooks at the next step."""
    if not callable(hook):  # errors logged, as torch logs them (`_get_ddp_logging_data()["error"]`)
        raise errors(TypeError(f"hook must be callable, got {hook!r}"))
    if calls.comm_hook is not None:
        raise errors(RuntimeError("register_comm_hook can only be called once"))
    if reducer.in_backward:
        raise errors(RuntimeError("register_comm_hook must not be called during a backward pass"))
    calls.comm_hook = CommHook(state, hook, reducer)
    calls.comm_hook.install()
    when = f"between forward and backward of step {calls.steps - 1}" if calls.queued else f"before step {calls.steps}"
    publish(calls.number, reducer.group, calls.comm_hook, when)
    calls.started = False  # after training began (torch's takes it): the ranks compare hooks at the next step
    if calls.queued:  # between a forward and its backward: compared before this backward's buckets, which it reduces
        calls.compare_hooks_now()


# hooks that leave each rank its own gradients by design: `noop_hook` (manualdp's or torch's, for timing a step
# without communication) and torch's `post_localSGD_hook` (after its start step it averages within a subgroup only;
# a model averager such as `PeriodicModelAverager` brings the replicas together every few steps)
_PARTING = ("noop_hook", "post_localSGD_hook")


def parts_replicas(hook: CommHook | None) -> bool:
    """Whether `hook` parts the replicas on purpose (`_PARTING`): the drift check would call that drift."""
    return hook is not None and getattr(hook.hook, "__name__", None) in _PARTING


def check_same_hook(hook: CommHook | None, group, timeout) -> None:
    """On the worker, at the first synchronised step: the same comm hook on every rank, or all raise naming them."""
    mine, named = (described(hook, named=False), described(hook)) if hook is not None else (_NONE, _NONE)
    agree("DistributedDataParallel's comm hook", {"comm hook": mine}, group, timeout=timeout, check=True,
          shown={"named": named}, hint="call register_comm_hook with the same hook on every rank")


def described(hook: CommHook, named: bool = True, bare: bool = False) -> str:
    """What the ranks compare of a registered hook: the hook's identity (`named`: with its name; `bare`: without
    its defaults, `code_identity`), and its state's where it has one."""
    text = code_identity(hook.hook) if bare else hook_identity(hook.hook, named)
    text = text if hook.state is None else f"{text} with state {state_identity(hook.state)}"
    if len(text) > _LONGEST:  # a long list in the state: its head and a digest, not the whole of it in every line
        text = f"{text[:_LONGEST // 2]}... (sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]})"
    return text


def _key(number: int, rank: int) -> str:
    return f"manualdp/comm_hook/{number}/{rank}"


def publish(number: int, group, hook: CommHook, when: str) -> None:
    """Write to the group's store which hook this rank registered on wrapper `number`, and when (`hooks_named`)."""
    store = group_store(group if group is not None else dist.group.WORLD)
    if store is not None:
        record = {"compared": f"{described(hook, named=False)} {when}", "named": f"{described(hook)} {when}",
                  "code": f"{described(hook, bare=True)} {when}", "defaults": defaults_of(hook.hook)}
        store.set(_key(number, dist.get_rank(group)), json.dumps(record))


@contextlib.contextmanager
def hooks_named(number: int, group):
    """A refused call of wrapper `number`'s step, where the ranks registered other comm hooks, named as the hooks.

    The peer that registered a hook wrote it to the store before its first call with it, so every
    rank whose call was refused by that call reads it there.
    """
    try:
        yield
    except ValueError as error:
        store = group_store(group if group is not None else dist.group.WORLD)
        if store is None:
            raise
        keys = [_key(number, r) for r in range(dist.get_world_size(group))]
        none = {"compared": _NONE, "named": _NONE, "code": _NONE, "defaults": {}}
        try:
            records = [json.loads(store.get(k)) if store.check([k]) else none for k in keys]
        except Exception:  # noqa: BLE001 - the store gone with a peer: the refusal as it was
            raise error from error.__cause__
        if len({r["compared"] for r in records}) > 1:
            error.args = (f"rank {dist.get_rank(group)}: DistributedDataParallel's comm hook differs across ranks: "
                          f"{_what_differs(records)}", *error.args[1:])
        raise


def _what_differs(records: list[dict]) -> str:
    """The ranks' hooks, or (the same code registered at the same step) the default arguments that differ."""
    names = dict.fromkeys(k for r in records for k in r["defaults"])
    differ = [k for k in names if len({r["defaults"].get(k) for r in records}) > 1]
    if len({r["code"] for r in records}) > 1 or not differ:
        return (f"{differs('comm hook', [r['named'] for r in records])}; call register_comm_hook with the same hook at "
                "the same step on every rank")
    values = "; ".join(f"{k}: " + ", ".join(f"{_short(r['defaults'].get(k))} on rank {i}"
                                            for i, r in enumerate(records)) for k in differ)
    return (f"its default argument{'s' * (len(differ) > 1)} {values} (its code is the same on every rank: "
            f"{records[0]['code']}); a default is part of what a hook computes, so a per-rank value there could "
            "train each rank differently: pass a value that is meant to differ per rank another way (a closure's "
            "variable or the hook's state, which the ranks compare by class only, as torch's DDP compares nothing), "
            "or the same default on every rank")


def _short(text: str | None) -> str:
    """A rank's value of a default as the line shows it: cut to 80 characters."""
    text = "missing" if text is None else text
    return text if len(text) <= 80 else text[:77] + "..."
