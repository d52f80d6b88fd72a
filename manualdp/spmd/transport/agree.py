"""How ranks agree: compare what each is about to do, and all raise naming who differs; start from rank 0's state.

Ranks that disagree (another model, another bucket size, another hook) would pair wrong
messages, and gloo would abort or, worse, sum the wrong numbers. So every wrapper and runner
first calls `agree` with the fields that must match. The ranks sum a table of one 64-bit
digest each, a message of 8 bytes per rank; only when two digests differ do they send each
other their fields, so that every rank raises the same error, in one format:

    rank 1: DistributedDataParallel's layout differs across ranks: bucket_cap_mb 1..25 (per rank:
    25, 1); algorithm ring..tree (per rank: ring, tree); every rank must construct the wrapper
    with the same arguments and the same model

(the form in which the call check names a differing field too, `call_check.differs`).

`broadcast_from_rank0` then gives every rank the same starting point: rank 0's tensors.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ...buckets import flatten, unflatten_
from .call_check import differs, same_call
from .group import after_wrappers, group_state
from .p2p import run_allreduce
from .peers import group_timeout, refused_alike, talking_to, wait
from .plan import DEFAULT_SEGMENT_BYTES

__all__ = ["ANY", "agree", "check_same_model", "broadcast_from_rank0"]

ANY = "<any>"  # a field value that matches every other: this rank does not constrain the field
SHOWN_FIELDS = 8  # the error names this many differing fields at most, then counts the rest
SHOWN_CHARS = 200  # each value is cut to this many characters


def agree(what: str, fields: dict, group=None, *, hint: str = "every rank must pass the same",
          error: type[Exception] = ValueError, timeout: float | None = None, shown: dict | None = None,
          check: bool = False, call_step: int = -1, identity: int = 0) -> None:
    """Raise `error` on every rank of `group` unless every rank passes equal `fields` (name -> value).

    Args:
        what: what is compared, a singular noun: "rank 1: {what} differs across ranks: ...".
        fields: the values to compare, by name; compared as `str` (lists as `[1 2 3]`). A value
            `ANY` matches every other. A field that a rank lacks shows as "missing".
        hint: the end of the error: what the user must do.
        error: the exception class every rank raises.
        timeout: seconds to wait for a silent peer (`PeerError`); default: the group's.
        shown: more of this rank's state, printed in the error (per rank) but not compared.
        check: first compare the calls themselves (`call_check.same_call`, a round trip): a rank that
            is in another collective altogether raises instead of pairing its messages with these;
            `call_step` and `identity`: the step and wrapper fields that check compares (`allreduce`'s).

    Every rank must call it at the same point of the program with the same `what`; the exchange
    is run inline, so call it where the group's other collectives are ordered (on the group's
    worker from a wrapper's hook, on the main thread at construction).
    """
    state = group_state(group)
    n = len(state.peers)
    mine = {str(k): _full(v) for k, v in fields.items()}
    if n == 1:
        return
    timeout = timeout if timeout is not None else group_timeout(group)
    after_wrappers(state)  # at once on the worker itself
    nccl = dist.get_backend(state.pg()) == "nccl"
    table = torch.zeros(n, dtype=torch.int64, device=torch.cuda.current_device() if nccl else "cpu")
    table[state.rank] = _digest(mine)
    if check:
        same_call(state, table, "naive", DEFAULT_SEGMENT_BYTES, timeout, step=call_step, identity=identity)
    run_allreduce(table, "naive", state, DEFAULT_SEGMENT_BYTES, timeout)
    if len(set(table.tolist())) == 1:
        return
    everyone: list = [None] * n
    dist.all_gather_object(everyone, (mine, {str(k): _cut(_full(v)) for k, v in (shown or {}).items()}), group=group)
    differ = []
    for field in dict.fromkeys(k for theirs, _ in everyone for k in theirs):
        values = [theirs.get(field, "missing") for theirs, _ in everyone]
        if len({v for v in values if v != ANY}) > 1:
            differ.append(differs(field, [_cut(v) for v in values], wildcard=ANY))
    # the same fields in another order (a field a rank leaves out where another has ANY does not count)
    common = set.intersection(*({k for k, v in theirs.items() if v != ANY} for theirs, _ in everyone))
    orders = [[k for k in theirs if k in common] for theirs, _ in everyone]
    if not differ and any(order != orders[0] for order in orders):
        at = next(i for i in range(max(map(len, orders)))
                  if len({order[i] if i < len(order) else "missing" for order in orders}) > 1)
        differ.append(differs(f"field {at}", [order[at] if at < len(order) else "missing" for order in orders]))
    if not differ:  # only wildcards differed
        return
    more = len(differ) - SHOWN_FIELDS
    listed = "; ".join(differ[:SHOWN_FIELDS]) + (f"; and {more} more field{'s' * (more > 1)}" if more > 0 else "")
    extra = "".join(f"; {field} (per rank: {', '.join(theirs.get(field, 'none') for _, theirs in everyone)})"
                    for field in dict.fromkeys(k for _, theirs in everyone for k in theirs))
    # every rank raises this, and nothing is in flight: the group's worker may go on (`peers.refused_alike`)
    raise refused_alike(error(f"rank {state.rank}: {what} differs across ranks: {listed}{extra}; {hint}"))


def _full(value) -> str:
    """A value as the ranks compare it, whole: lists in brackets without quotes, tensors by their values."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()  # its values, not its device
    return "[" + " ".join(map(_full, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


def _cut(text: str) -> str:
    """A compared value as the error shows it: cut to `SHOWN_CHARS` (the comparison saw it whole)."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _digest(fields: dict[str, str]) -> int:
    """64 bits of a hash of `fields`, in their order, as a signed int64."""
    data = repr(list(fields.items())).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def check_same_model(module: nn.Module, group=None, *, what: str = "the model", timeout: float | None = None,
                     check: bool = False) -> None:
    """Raise on every rank unless every rank's `module` has the same parameter and buffer names, shapes and dtypes.

    `check`: compare the calls first (`agree`'s), so that a rank in another collective is named at once.
    """
    fields = {"parameters and buffers": sum(1 for _ in module.named_parameters())
                                        + sum(1 for _ in module.named_buffers())}
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            fields[f"{kind} {name}"] = (f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                                        + (" frozen" if kind == "parameter" and not t.requires_grad else ""))
    agree(what, fields, group, hint="every rank must build the same model", timeout=timeout, check=check)


def broadcast_from_rank0(tensors: list[torch.Tensor], group=None, timeout: float | None = None, src: int = 0) -> None:
    """Overwrite `tensors` with those of the group's rank `src` (default 0), one flat message per dtype and device.

    torch's broadcast, not the p2p executor: a wrapper's worker may run the executor's messages on
    this group meanwhile (a forward pass copies rank 0's buffers while the step's call check runs).
    """
    state = group_state(group)
    rank, peers = state.rank, state.peers
    if len(peers) == 1:
        return
    timeout = timeout if timeout is not None else group_timeout(group)
    held = []
    with torch.no_grad():
        # in the order they first appear: the same on every rank (a module may span several devices)
        for dtype, device in dict.fromkeys((t.dtype, t.device) for t in tensors):
            same = [t for t in tensors if t.dtype == dtype and t.device == device and t.numel()]
            if not same:
                continue
            flat = flatten(same)
            root = peers[src]
            peer = root if rank != src else None
            with talking_to(peer, timeout):
                work = dist.broadcast(flat, src=root, group=group, async_op=True)
            wait(work, peer, timeout)
            # .data: autograd may have saved these buffers (BatchNorm, two forwards before one backward)
            unflatten_(flat, [t.data for t in same])
            held.append((work, flat))
    # Held until this thread's next broadcast: gloo's thread lets go of a finished work a moment
    # after `wait` returns, and if its reference to `flat` were the last one, freeing it would need
    # the interpreter, which, when the script has just ended, aborts the process ("terminate called
    # without an active exception"; 6 of 40 processes that ended after a forward pass, torch's DDP 4).
    state.local.broadcast = held
