"""What every rung of the ladder keeps, whatever it sends: `Rung`, the base of rung 1 and so of every rung.

A rung is used exactly as torch's DDP is, and these rules make it train as torch's DDP does
with its defaults. The rungs (`naive.py` and the ones above it) add only how the gradients are
averaged: their hooks and what the end of backward does.

Ranks agree before data moves. At construction they compare the model (names, shapes,
dtypes) and the rung's settings (which rung, `algorithm`, rung 4's `bucket_cap_mb`), then take
rank 0's parameters and buffers; a module whose parameters another rung already averages is
refused, and so is a pickle of a rung (it holds the group's connections); a deep copy, made on every
rank alike, is a new rung of its own over a deep copy of the module, as torch's DDP copies. Each
step they compare the step itself before its first allreduce (`check_step`): a rank that
skipped a backward pass, or ran one more, or ran another number of forward passes, makes every
rank raise, naming the rank and the field, instead of averaging gradients of two different steps.
A forward pass with grad and no backward (a validation pass without `torch.no_grad()`) counts as
a step here, where torch's DDP takes it: a rung cannot tell it from a skipped backward before its
peers have waited out their timeout, so every rank raises at once, in one line naming it (`steps_named`).

Two more rules:
- a parameter that no rank's backward pass reached keeps its `.grad` as it was (None stays None,
  so optimizers with weight decay or momentum leave it alone). This is torch's rule: its reducer
  sums a "used" flag per parameter (set when the parameter's autograd hook fires) across the
  ranks with the gradients, and where the sum is 0 "we keep its grad untouched"
  (`Reducer::copy_bucket_to_grad`, `global_unused`); a parameter some rank used gets the average,
  the ranks that did not use it counting the `.grad` they hold, or zeros. Each rung learns the sum
  its own way, at no extra message where it can (`unused_everywhere`);
- before each forward pass with grad enabled, rank 0's buffers (BatchNorm's running statistics)
  are copied to every rank, as torch's DDP does with `broadcast_buffers=True`, its default, by
  manualdp's own broadcast (`copy_buffers`), whose call check carries the step: a rank that runs
  one forward pass more raises naming the step, as a skipped backward does. Unlike torch's DDP,
  a forward pass with no grad copies nothing: one rank may evaluate alone (torch's DDP would
  wait for the others forever).

Each rung also has a number, the order in which it was built among the wrappers of its group
(`identity.py`), compared with each step: two rungs called in another order on one rank raise,
naming both. And at its forward passes with grad 0, 1, 2, 4, ... and every `drift_check_every`, the
ranks compare a digest of every parameter (`drift.py`): replicas that drifted apart raise.

A rung lives while someone holds it or the graph of its forward pass awaits backward
(`_keep_alive`); its hooks hold it weakly (`weak_hook`), so that once it is gone its module is
a plain module again.
"""
from __future__ import annotations

import contextlib
import re
import weakref
from copy import deepcopy as _deepcopy

import torch
from torch import nn

from ...validate import boolean, nn_module, one_of, timeout_seconds
from ..collectives import ENGINE_ALGORITHMS, allreduce, broadcast
from ..transport.agree import agree, broadcast_from_rank0, check_same_model
from ..transport.call_check import same_call
from ..transport.group import group_state
from ..transport.peers import group_ranks, group_timeout
from ..transport.plan import DEFAULT_SEGMENT_BYTES
from .drift import DRIFT_CHECK_EVERY, DriftCheck
from .identity import BuiltWith, frozen_alike, naming_wrappers, replaced_line, take_number
from .loading import check_loadable, unchanged_if_refused

__all__ = ["Rung", "weak_hook", "steps_named"]

_STEPS = re.compile(r"\bstep \S+\.\.\S+ \(per rank")  # a refused call check whose step field differs

# id(parameter) -> (the parameter, the rung that averages it), both held weakly: not on the parameter itself,
# which must stay picklable (`pickle.dumps(module)`, `torch.save(module)`)
_RUNGS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _keep_alive(out, rung: "Rung") -> None:
    """Let the autograd graph of `out` hold `rung` until backward has run: `NaiveDDP(net)(x).sum().backward()`
    must average, though no one else holds the rung."""
    if isinstance(out, torch.Tensor):
        if out.grad_fn is not None:
            out.grad_fn.metadata["manualdp_rung"] = rung
    elif isinstance(out, (list, tuple)):
        for x in out:
            _keep_alive(x, rung)
    elif isinstance(out, dict):
        for x in out.values():
            _keep_alive(x, rung)


def weak_hook(rung: "Rung"):
    """A gradient hook that calls `rung._on_grad` while the rung lives, and does nothing after."""
    ref = weakref.ref(rung)

    def hook(p: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._on_grad(p)
    return hook


class Rung(nn.Module):
    """The rules every rung keeps: the ranks agree at construction and at each step, rank 0's buffers, unused ones.

    Args:
        module: the model, on this rank's device.
        algorithm: the allreduce schedule (`manualdp.schedule`; "auto" lets the cost model pick).
        group: the process group (default: all ranks); timeout: seconds to wait for a peer.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward pass with grad
            enabled, as torch's DDP (default True); they are copied at construction either way.
        drift_check_every: compare the replicas' parameters (a digest each) at forward passes with grad 0, 1, 2,
            4, ... below it and every this many after; every rank raises naming the first that differs
            (`drift.py`); 0: never.
    """

    def __init__(self, module: nn.Module, *, algorithm: str = "ring", group=None, timeout: float | None = None,
                 broadcast_buffers: bool = True, drift_check_every: int = DRIFT_CHECK_EVERY):
        super().__init__()
        self.drift = DriftCheck(drift_check_every)
        self.module = nn_module("module", module)
        self.algorithm = one_of("algorithm", algorithm, ENGINE_ALGORITHMS)
        self.group, self.timeout = group, timeout_seconds("timeout", timeout)
        self.broadcast_buffers = boolean("broadcast_buffers", broadcast_buffers)
        self.rank, peers = group_ranks(group)
        self.world_size = len(peers)
        self.state = group_state(group)
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones need no sync
        if not self.params:
            raise ValueError("module has no parameter that requires grad: nothing to average "
                             f"({type(module).__name__})")
        self._refuse_wrapped(module)
        self.number = take_number(self.state)  # which wrapper of this group it is: compared with every step
        # the same model and settings on every rank, from rank 0's state: else the messages below would pair up wrong
        check_same_model(module, group, what=f"{type(self).__name__}'s model", timeout=self.timeout)
        agree(f"{type(self).__name__}'s settings", self.settings(), group, timeout=self.timeout,
              hint="every rank must construct the same rung with the same arguments")
        broadcast_from_rank0([*module.parameters(), *module.buffers()], group, self.timeout)
        # copied from rank 0 before each forward pass (torch's DDP also lists them once, at construction)
        self.synced_buffers = list(module.buffers()) if broadcast_buffers else []
        named = list(module.named_parameters())  # a parameter replaced after wrapping is refused (`forward`)
        self.built = BuiltWith([(n, p) for n, p in named if p.requires_grad], named)
        self.position = {id(p): k for k, p in enumerate(self.params)}  # where each parameter sits in `params`
        self.reached = [False] * len(self.params)  # whose hook this backward pass fired on this rank
        self.steps = 0  # forward passes with grad enabled so far: compared at every backward (`check_step`)
        for p in self.params:  # so that a second rung over these parameters is refused (`_refuse_wrapped`)
            _RUNGS[id(p)] = (weakref.ref(p), weakref.ref(self))

    def settings(self) -> dict:
        """What every rank's rung must agree on at construction, besides the model: the rung and its arguments."""
        return {"rung": type(self).__name__, "wrapper number": self.number, "algorithm": self.algorithm,
                "broadcast_buffers": self.broadcast_buffers, "drift_check_every": self.drift.every}

    def _refuse_wrapped(self, module: nn.Module) -> None:
        """Refuse a module whose parameters another live rung already averages: each would average them again."""
        for name, p in module.named_parameters():
            held, rung = _RUNGS.get(id(p), (lambda: None, lambda: None))
            other = rung() if held() is p else None
            if other is not None and any(q is p for q in other.params):
                raise ValueError(f"rank {self.rank}: {type(self).__name__}: parameter {name} of "
                                 f"{type(module).__name__} is already averaged by a {type(other).__name__}: "
                                 "wrap a module once, with one rung (a rung over a rung, or two rungs over one "
                                 "module, would average it twice)")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, with the whole state dict checked before any tensor is written: a refused load changes nothing."""
        check_loadable(self, state_dict, strict, type(self).__name__, assign=assign)
        with unchanged_if_refused(self, objects=assign):  # what torch refuses that the check did not foresee
            return super().load_state_dict(state_dict, strict, assign)

    def rebuild_kwargs(self) -> dict:
        """The keywords this rung was built with: a deep copy is built with them."""
        return {"algorithm": self.algorithm, "group": self.group, "timeout": self.timeout,
                "broadcast_buffers": self.broadcast_buffers, "drift_check_every": self.drift.every}

    def __deepcopy__(self, memo):
        # The group's connections are not copied: the copy is a new rung of its own (its own number) over a deep copy
        # of the module, built as any rung is, so every rank must copy alike, as it would build one.
        copy = type(self)(_deepcopy(self.module, memo), **self.rebuild_kwargs())
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        raise TypeError(f"rank {self.rank}: a {type(self).__name__} cannot be pickled (it holds the group's "
                        "connections): save its module's state_dict()")

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._refuse_replaced()
        with steps_named(type(self).__name__):  # its check may meet a peer's step check
            self.drift.tick(self.module.named_parameters, self.group, who=type(self).__name__, timeout=self.timeout,
                            number=self.number, names=self.built.names, call_step=self.steps + 1)
        self.steps += 1
        if self.synced_buffers:  # as torch's DDP: rank 0's running statistics everywhere, before a training forward
            self.copy_buffers()
        out = self.module(*args, **kwargs)
        _keep_alive(out, self)
        return out

    def _refuse_replaced(self) -> None:
        """Raise on every rank if a parameter of some rank's module is no longer the one the rung was built with: it
        would never be averaged (`identity.BuiltWith`: this rank's check carries the mark, which refuses the peers'
        next call; torch's DDP finds the old parameter unused and raises at the next forward pass)."""
        mark, who = self.built.mark(self.module.named_parameters(), self.rank), type(self).__name__
        if mark is None:
            return
        if self.world_size > 1:
            timeout = self.timeout if self.timeout is not None else group_timeout(self.group)
            with naming_wrappers(self.built.names, who):
                same_call(self.state, self.params[0], self.algorithm, DEFAULT_SEGMENT_BYTES, timeout, step=self.steps,
                          identity=mark)
        if frozen_alike(mark):  # frozen on every rank: nobody waits for it
            return
        raise RuntimeError(replaced_line(self.rank, who, dict.fromkeys(range(self.world_size), mark), self.built.names))

    def check_step(self, flag: bool = False) -> bool:
        """Before a backward pass's first allreduce: every rank is at the same step, or every rank raises.

        One call check (`transport.call_check.same_call`, fixed-size headers, a round trip) of
        the step's whole size with this rank's count of forward passes: a rank that skipped a
        backward pass (or ran one more) would otherwise pair its gradients with another step's.
        Returns whether any rank raised `flag` (a bit the headers carry uncompared).
        """
        if self.world_size == 1:
            return flag
        timeout = self.timeout if self.timeout is not None else group_timeout(self.group)
        with steps_named(type(self).__name__), naming_wrappers(self.built.names, type(self).__name__):
            return same_call(self.state, self.params[0], self.algorithm, DEFAULT_SEGMENT_BYTES, timeout,
                             numel=sum(p.numel() for p in self.params), step=self.steps, identity=self.number,
                             flag=flag)

    def copy_buffers(self) -> None:
        """Before a forward pass with grad: rank 0's buffers to every rank, with the step compared on the way.

        One `collectives.broadcast` per device (one in all, as a rule) of the buffers' bytes
        side by side, whatever their dtypes; the first carries the step check's header
        (`check_step`'s fields, for a broadcast) beside its data, so that a rank that runs one
        forward pass more raises naming the step, as a skipped backward does, instead of pairing
        its copy with the peers' step check.
        """
        if self.world_size == 1:
            return
        timeout = self.timeout if self.timeout is not None else group_timeout(self.group)
        with torch.no_grad():
            for k, device in enumerate(dict.fromkeys(b.device for b in self.synced_buffers)):
                same = [b for b in self.synced_buffers if b.device == device and b.numel()]
                places, end = [], 0
                for b in same:  # each at an offset of a multiple of 16 bytes, so that its bytes can be viewed as it
                    places.append(end)
                    end += -(-b.numel() * b.element_size() // 16) * 16
                flat = torch.empty(end, dtype=torch.uint8, device=device)
                for b, at in zip(same, places):
                    flat[at:at + b.numel() * b.element_size()].copy_(b.reshape(-1).view(torch.uint8))
                with steps_named(type(self).__name__), naming_wrappers(self.built.names, type(self).__name__):
                    broadcast(flat, 0, "tree", self.group, timeout=timeout, check=k == 0, step=self.steps,
                              identity=self.number)
                for b, at in zip(same, places):  # .data: autograd may have saved them (two forwards, one backward)
                    b.data.copy_(flat[at:at + b.numel() * b.element_size()].view(b.dtype).view(b.shape))

    def take_reached(self) -> list[bool]:
        """Whose hook this backward pass fired on this rank, in `params` order; forgotten for the next pass."""
        reached, self.reached = self.reached, [False] * len(self.params)
        return reached

    def unused_everywhere(self, reached: list[bool], someone_left_one: bool) -> list[tuple[torch.Tensor, object]]:
        """(parameter, a copy of its `.grad` or None) for each parameter that no rank's backward pass reached.

        Rungs 1 and 2 check the step after backward, so every rank knows there whether any rank
        left a parameter out (`check_step`'s flag): usually none did, and this costs nothing.
        Else the ranks sum their flags, one small allreduce. `restore` gives the copies back.
        """
        if not someone_left_one:
            return []
        flags = torch.tensor(reached, dtype=torch.int32, device=self.params[0].device)
        allreduce(flags, self.algorithm, self.group, timeout=self.timeout, check=False)
        return [(p, None if p.grad is None else p.grad.clone())
                for p, count in zip(self.params, flags.tolist()) if count == 0]

    @staticmethod
    def restore(untouched: list[tuple[torch.Tensor, object]]) -> None:
        """Put back the `.grad` of the parameters no rank used: None stays None, as with torch's DDP."""
        for p, grad in untouched:
            p.grad = None if grad is None else p.grad.copy_(grad)


@contextlib.contextmanager
def steps_named(who: str):
    """A refused check whose steps differ, explained: on a rung, unlike torch's DDP, a forward with grad is a step."""
    try:
        yield
    except ValueError as error:
        message = str(error.args[0]) if error.args else ""
        if _STEPS.search(message):
            error.args = (f"{message}; on {who} every forward pass with grad begins a step: a rank that ran one and no "
                          "backward (run it under torch.no_grad()) or skipped a backward is a step ahead",
                          *error.args[1:])
        raise
