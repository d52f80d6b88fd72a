"""torch's all-gather extensions in `fully_shard`: a shard whose tensor (or its class, a tensor subclass such as
torch's `TwoTensor`) defines the pair

- `fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)` (or torch's older `(self, mesh)`):
  (the tensors to all-gather instead of the shard, metadata);
- `fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None)`: from each input's all-gathered output
  (the ranks' inputs one after the other), (the full parameter, the inner tensors to free between uses); given
  `out` (the full parameter it made the first time), it refills that one and returns None.

As torch's FSDP2 does: the pre-hook runs at each all-gather of the unit, the post-hook when the unit waits for it.
The hooks' inputs move after the unit's flat all-gather (one flat all-gather per input dtype), whose tail carries
which parameters define the pair: a pair set on some ranks only is refused on every rank before they move
(`fsdp_collectives._check_extension`). The outputs are kept between gathers, their memory freed, and filled in
place: a post-hook may keep views of them in the full parameter and refill nothing (torch's tests' `TwoTensor` does).
The full parameter's gradient is reduce-scattered as any other's.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..collectives import all_gather
from .fsdp_param import FULL, Param

__all__ = ["Extended", "pair_state", "extension_code", "start_extensions", "gather_inputs", "finish_extensions",
           "free_extensions", "HALF", "UNPADDED", "RAISED"]

HALF = 251  # the extension code of a rank whose unit has a parameter with one hook of the pair only
UNPADDED = 252  # ... whose pre-hook returned inputs of an uneven shard's size, not the padded one torch's requires
RAISED = 253  # ... whose pre-hook raised (or returned what it may not): the peers must not wait in the all-gather
PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


class Extended:
    """What one parameter with the pair keeps between its gathers."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local                      # the shard's tensor the hooks are called on
        self.metadata = None                    # the pre-hook's, for the post-hook
        self.sizes: list[torch.Size] = []       # the pre-hook's inputs' shapes
        self.inputs: list[torch.Tensor] = []    # this gather's inputs, flat, until all-gathered
        self.outputs: list[torch.Tensor] = []   # each input's all-gathered output (W times its numel), kept
        self.inner: list[torch.Tensor] = []     # what the post-hook said to free between uses
        self.nbytes: list[int] = []             # the inner tensors' storage sizes, given back at each gather
        self.pending = False                    # outputs filled, post-hook not run yet
        self.full: nn.Parameter | None = None    # the full parameter the post-hook made
        self.on_grad = False                    # whether it has the unit's gradient hook


def pair_state(p: Param) -> int:
    """0: the shard defines neither hook; 1: both; HALF: one only (torch's asserts both)."""
    local = p.sharded._local_tensor
    has = hasattr(local, PRE), hasattr(local, POST)
    return 0 if not any(has) else 1 if all(has) else HALF


def extension_code(params: list[Param]) -> int:
    """Which of `params` define the pair, as a small integer that every dtype holds exactly (the all-gather's tail):
    0 for none, 1 to 250 for some, HALF if one defines one hook only."""
    states = [pair_state(p) for p in params]
    if HALF in states:
        return HALF
    return sum(i + 1 for i, s in enumerate(states) if s) % (HALF - 1) + 1 if any(states) else 0


def start_extensions(unit) -> dict[Param, Extended]:
    """Run the pre-hook of each of the unit's parameters that define the pair (on the main thread, before its
    all-gather is submitted): their states, holding this gather's inputs."""
    out, states = {}, unit.extended
    for p in unit.params:
        if pair_state(p) != 1:
            if states.pop(p, None) is not None:  # the pair removed: a plain full parameter, made at this gather
                p.full = None
            continue
        local = p.sharded._local_tensor
        st = states.get(p)
        if st is None or st.local is not local:  # a new shard (`to_empty`, `load_state_dict`): made again
            st = states[p] = Extended(local)
            p.full = None
        if p.dim:
            raise NotImplementedError(f"{_name(unit, p)}: fsdp_pre_all_gather/fsdp_post_all_gather on a parameter "
                                      f"sharded on dim {p.dim}: shard it on dim 0")
        try:
            inputs, st.metadata = _call_pre(unit, p, local)
        except Exception as e:  # noqa: BLE001 - carried in the all-gather's tail, raised on every rank
            unit.extension, unit.extension_code, unit.extension_error = _name(unit, p), RAISED, e
            continue
        padded = (p.chunk_rows, *p.shape[1:])
        if p.local_rows != p.chunk_rows and any(tuple(t.shape) != padded for t in inputs):
            # not raised here: the ranks whose shards are whole would wait in the all-gather; its tail carries it
            unit.extension, unit.extension_code = _name(unit, p), UNPADDED
        st.sizes = [t.shape for t in inputs]
        st.inputs = [t.detach().reshape(-1) for t in inputs]
        out[p] = st
    return out


def _call_pre(unit, p: Param, local: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    hook = getattr(local, PRE)
    n = len(inspect.signature(hook).parameters)
    mesh = unit.mesh[unit.mesh.mesh_dim_names[-1]] if unit.mesh.ndim > 1 else unit.mesh  # the shards' mesh, as torch
    if n == 1:
        got = hook(mesh)
    elif n == 5:
        stride = torch.empty(p.shape, device="meta").stride()
        got = hook(mesh, p.shape, stride, p.slots[0][0], unit.mp_policy)
    else:
        raise TypeError(f"{_name(unit, p)}: fsdp_pre_all_gather takes {n} arguments; expected (mesh, outer_size, "
                        "outer_stride, module, mp_policy) or (mesh)")
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], (tuple, list))
            and got[0] and all(isinstance(t, torch.Tensor) for t in got[0])):
        raise TypeError(f"{_name(unit, p)}: fsdp_pre_all_gather must return (a tuple of tensors, metadata), got "
                        f"{type(got).__name__}")
    return list(got[0]), got[1]


@torch.no_grad()
def gather_inputs(unit, extended: dict[Param, Extended], segment) -> None:  # on the worker thread
    """All-gather every pre-hook input of `extended`, one flat all-gather per dtype, into each one's kept output
    (in rank order). `segment(rank, W)`: which segment of a flat buffer is that rank's own."""
    W = unit.world_size
    by_dtype: dict[torch.dtype, list[tuple[Extended, int]]] = {}
    for st in extended.values():
        for i, t in enumerate(st.inputs):
            by_dtype.setdefault(t.dtype, []).append((st, i))
    for dtype, parts in by_dtype.items():
        S = sum(st.inputs[i].numel() for st, i in parts)
        flat = torch.zeros(W * S, dtype=dtype, device=parts[0][0].inputs[parts[0][1]].device)
        own, at = flat.view(W, S)[segment(unit.rank, W)], 0
        for st, i in parts:  # copy-in
            n = st.inputs[i].numel()
            own[at:at + n].copy_(st.inputs[i])
            at += n
        all_gather(flat, group=unit.group, timeout=unit.timeout)
        in_order, at = flat.view(W, S)[[segment(r, W) for r in range(W)]], 0
        for st, i in parts:  # copy-out, into the kept outputs (their memory given back first)
            n = st.inputs[i].numel()
            if len(st.outputs) <= i:
                st.outputs.append(torch.empty(W * n, dtype=dtype, device=flat.device))
            _alloc(st)
            st.outputs[i].copy_(in_order[:, at:at + n].reshape(-1))
            at += n
    for st in extended.values():
        st.inputs, st.pending = [], True


def finish_extensions(unit) -> None:
    """Run the post-hook of each parameter whose outputs were filled (on the main thread, once the all-gather is
    waited for): the first time it makes the full parameter, then it refills it."""
    for p, st in unit.extended.items():
        if not st.pending:
            continue
        st.pending = False
        outs = tuple(t.view(-1, *s[1:]) for t, s in zip(st.outputs, st.sizes))
        dtype = unit.param_dtype or p.dtype
        hook = getattr(st.local, POST)
        if p.full is None and st.full is not None:  # `requires_grad_` after fully_shard: refilled, as torch's
            p.full = _trainable(unit, p, st)
        if p.full is not None and getattr(p.full, FULL, False):
            _alloc(st)
            with torch.no_grad():  # through .data: autograd's saved full parameter keeps its version
                hook(outs, st.metadata, dtype, out=_writable(p.full))
            continue
        got = hook(outs, st.metadata, dtype)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], torch.Tensor)):
            raise TypeError(f"{_name(unit, p)}: fsdp_post_all_gather must return (the full tensor, the inner tensors "
                            f"to free), got {type(got).__name__}")
        st.full = _full(unit, p, got[0])
        p.full = _trainable(unit, p, st)
        st.inner = [t for t in got[1] if isinstance(t, torch.Tensor)]
        st.nbytes = [t.untyped_storage().nbytes() for t in st.inner]


def _full(unit, p: Param, made: torch.Tensor) -> nn.Parameter:
    """The post-hook's tensor as the full parameter, as torch's: its first rows (padding dropped) in `p`'s shape."""
    padded_rows = unit.world_size * p.chunk_rows
    if made.dim() != len(p.shape) or made.shape[1:] != p.shape[1:] or not p.rows <= made.shape[0] <= padded_rows:
        raise ValueError(f"{_name(unit, p)}: fsdp_post_all_gather returned a tensor of shape {tuple(made.shape)}, "
                         f"not the parameter's {tuple(p.shape)}: return the all-gathered parameter")
    stride = torch.empty(p.shape, device="meta").stride()
    full = nn.Parameter(torch.as_strided(made, p.shape, stride, 0), requires_grad=p.requires_grad)
    setattr(full, FULL, True)
    return full


def _trainable(unit, p: Param, st: Extended) -> nn.Parameter:
    """`st`'s full parameter, trained as `p` is now, with the unit's gradient hook once it trains."""
    st.full.requires_grad_(p.requires_grad)
    if p.requires_grad and not st.on_grad:
        st.full.register_post_accumulate_grad_hook(unit.grad_ready)
        st.on_grad = True
    return st.full


def _writable(full: nn.Parameter) -> torch.Tensor:
    """`full` through `.data` (as the plain copy-out writes: autograd's saved tensors keep their version) where
    `.data` keeps its class (a plain parameter's is a plain tensor), else `full` itself."""
    data = full.data
    return data if type(data) is type(full) or type(full) is nn.Parameter else full


def free_extensions(unit) -> None:
    """Give back the memory of the outputs and of what the post-hooks said to free (the full parameters')."""
    for st in unit.extended.values():
        st.pending = False  # freed before the post-hook ran (`Unit.free` after a prefetch): the next gather fills
        for t in st.outputs + st.inner:
            t.untyped_storage().resize_(0)


def _alloc(st: Extended) -> None:
    """Give the outputs (their own storage, whole) and the inner tensors (the sizes they had) their memory back."""
    sizes = [t.numel() * t.element_size() for t in st.outputs] + st.nbytes
    for t, n in zip(st.outputs + st.inner, sizes):
        if t.untyped_storage().nbytes() < n:
            t.untyped_storage().resize_(n)


def _name(unit, p: Param) -> str:
    return f"{unit.name}.{p.name}" if unit.name else p.name
