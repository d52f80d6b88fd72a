"""One parameter of `fully_shard` in its two forms, as torch's FSDP2's `FSDPParam`.

Each parameter lives in two forms:

- its *shard*: this rank's rows of it (its slices along dim 0, or the dim `shard_placement_fn` chose, cut as
  `torch.chunk` cuts: ceil(rows / W) rows per rank, the last ranks may get fewer or none; even on a dim past 0,
  which torch's refuses), an `nn.Parameter` holding a DTensor placed `Shard(dim)` on a 1-D
  mesh of the group (over tensor parallelism: the rows of tp's piece, on the (dp, tp) mesh, `fsdp_tp.py`).
  That is what `module.parameters()` yields between steps and what the optimizer
  steps; torch's own utilities (`clip_grad_norm_`, `torch.distributed.checkpoint`, state dicts) see
  a sharded tensor and reduce or gather over the mesh themselves;
- its *full* form: a plain `nn.Parameter` of the whole shape, put in the module's place while
  forward and backward run, its memory given back between uses.

"Freed" is `untyped_storage().resize_(0)`: the full parameter (and what autograd saved of it) keeps
its shape and place and holds no memory. The copy-out of an all-gather (`fsdp_collectives.py`) writes
through `.data`, which leaves alone the version counter that autograd checks on saved tensors (torch's
FSDP2 does the same).

The user's own parameter, which a shard replaces, is emptied and marked: an optimizer built from it
before `fully_shard` refuses to step. A unit gathers and frees its parameters together (`fsdp_unit.py`).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .fsdp_tp import local_grad, local_of, tp_piece, tp_spec, unsharded

__all__ = ["Param", "owner_of", "watch_optimizers", "SLOTS"]

OWNER = "_manualdp_fsdp_owner"  # attribute of a shard, or of an original a shard replaced: its `_Owner`
SLOTS = "_manualdp_fsdp_slots"  # in a submodule's __dict__: its sharded parameter names -> the unit holding each
REPLACED = "_manualdp_fsdp_replaced"  # attribute of an original parameter that fully_shard replaced by a shard
FULL = "_manualdp_fsdp_full"  # attribute of a full form: what the modules hold while a unit is gathered


class _Owner:
    """Points a parameter at its `Param`; pickled or deep-copied, it becomes None: a copy of a shard is a plain
    DTensor parameter (pickling the `Param` would take its unit and module along)."""

    def __init__(self, param: "Param") -> None:
        self.param = param

    def __reduce__(self):
        return _nothing, ()

    def __deepcopy__(self, memo):
        return None


def _nothing() -> None:
    return None


def owner_of(t: torch.Tensor) -> "Param | None":
    """The `Param` that holds `t` (a shard), or that replaced it (an original parameter); None for others."""
    owner = getattr(t, OWNER, None)
    return owner.param if isinstance(owner, _Owner) else None


def set_owner(t: torch.Tensor, param: "Param") -> None:
    setattr(t, OWNER, _Owner(param))


class Param:
    """One parameter of a unit: where it sits, its shard (a DTensor parameter) and its full form while gathered."""

    def __init__(self, slots: list[tuple[nn.Module, str]], value: torch.Tensor, requires_grad: bool, mesh,
                 rank: int, world_size: int, name: str, dim: int = 0) -> None:
        self.slots, self.name, self.requires_grad, self.dim = slots, name, requires_grad, dim
        self.shape, self.dtype, self.device = value.shape, value.dtype, value.device
        # over tensor parallelism (a DTensor already) the rows cut are those of tp's local piece (`fsdp_tp.py`)
        self.tp = tp_spec(value, mesh) if isinstance(value, DTensor) else None
        value = local_of(value)
        self.mesh, self.local_shape = mesh, value.shape
        # "rows" are the slices along the shard dim (`shard_placement_fn`'s Shard(dim); dim 0 by default)
        self.rows = value.shape[dim]
        self.row_numel = math.prod(size for d, size in enumerate(value.shape) if d != dim)
        self.chunk_rows = -(-self.rows // world_size)  # ceil: torch.chunk's rows per rank (rank 0's, the padded size)
        self.start = min(rank * self.chunk_rows, self.rows)  # this rank's first row
        self.local_rows = min(self.chunk_rows, self.rows - self.start)
        self.padded = self.chunk_rows * self.row_numel  # this parameter's elements in every rank's segment
        with torch.no_grad():
            self.sharded = nn.Parameter(self.as_shard(self.cut(value)), requires_grad=requires_grad)
        set_owner(self.sharded, self)
        self.full: nn.Parameter | None = None  # made at the first gather (after `to_empty` on a meta model)
        self.full_local: torch.Tensor | None = None  # the full form's storage (over tp: its local tensor's)
        self.original: nn.Parameter | None = None  # the parameter the user's model held before
        self.accumulated: torch.Tensor | None = None  # gradients kept with sync off, in the reduce dtype

    def local(self) -> torch.Tensor:
        """This rank's rows (the DTensor's local tensor), detached."""
        return self.sharded._local_tensor.detach()  # not to_local(): an autograd.Function, refused under jvp

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `full` (a tensor of the parameter's shape, or over tp of its piece's), a contiguous
        copy."""
        if self.tp is not None and full.shape == self.shape:  # the whole parameter (`init_full`): tp's piece first
            full = tp_piece(full, self.tp)
        return full.detach().narrow(self.dim, self.start, self.local_rows).clone(memory_format=torch.contiguous_format)

    def as_shard(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows) as this parameter's shard: a DTensor of its global shape."""
        if self.tp is None:
            return _as_shard(local, self.mesh, self.shape, self.dim)
        return DTensor.from_local(local, self.tp.mesh, self.tp.placements, run_check=False, shape=self.shape,
                                  stride=self.tp.stride)

    def full_grad(self) -> torch.Tensor | None:
        """The full form's gradient as the collectives take it (over tp: its local tensor in tp's placements)."""
        grad = self.full.grad if self.full is not None else None
        return grad if self.tp is None else local_grad(grad, self.tp)

    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (of the parameter's layout) with the shard dim first: the collectives' layout, rows of `row_numel`."""
        return t.movedim(self.dim, 0) if self.dim else t

    def from_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (this rank's rows, the collectives' layout) in the parameter's layout, contiguous."""
        moved = self.as_rows(torch.empty(self.local_shape, device="meta")).shape[1:]
        rows = flat.view(self.local_rows, *moved)
        return rows.movedim(0, self.dim).contiguous() if self.dim else rows

    def make_full(self, dtype: torch.dtype, on_grad) -> torch.Tensor:
        """The full-shape parameter the modules use in forward (memory freed), made once per dtype and device;
        `on_grad(full)` runs once autograd has accumulated its gradient. Returns the tensor its all-gather fills: the
        parameter itself, or over tp the local tensor of the DTensor parameter (`full_local`)."""
        device = self.sharded.device
        if self.full is None or self.full.dtype != dtype or self.full.device != device:
            local = torch.empty(self.local_shape, dtype=dtype, device=device)
            self.full = nn.Parameter(local, requires_grad=self.requires_grad) if self.tp is None else \
                unsharded(local, self.tp, self.shape, self.requires_grad)
            self.full_local = local_of(self.full)
            self.full_local.untyped_storage().resize_(0)
            setattr(self.full, FULL, True)
            if self.requires_grad:
                self.full.register_post_accumulate_grad_hook(on_grad)
        return self.full_local

    def set_trainable(self, requires_grad: bool) -> None:
        """Train this parameter or not from the next gather on: the full form is made again (it holds no memory now),
        with the gradient hook only if it trains; gradients kept with sync off are dropped (a frozen parameter
        gets no gradient)."""
        self.requires_grad, self.full, self.accumulated = requires_grad, None, None

    def carry_requires_grad(self) -> None:
        """While gathered, `model.parameters()` yields the full form: a `requires_grad_` the user set on it goes to
        the shard, which the next gather follows (one set on the shard then too is overruled: the modules' is kept)."""
        if self.full is not None and self.full.requires_grad != self.requires_grad:
            self.sharded.requires_grad_(self.full.requires_grad)

    def put(self, t: torch.Tensor) -> None:
        """Put `t` (the shard or the full form) in every module slot this parameter has."""
        for sub, attr in self.slots:
            sub._parameters[attr] = t

    def occupy(self, unit) -> None:
        """Put the shard in the slots, each marked as held by `unit`."""
        for sub, attr in self.slots:
            sub._parameters[attr] = self.sharded
            sub.__dict__.setdefault(SLOTS, {})[attr] = unit

    def vacate(self) -> None:
        """Unmark the slots: another unit takes this parameter."""
        for sub, attr in self.slots:
            del sub.__dict__[SLOTS][attr]

    def replaces(self, original: nn.Parameter) -> None:
        """`original` is what the user's model held: emptied, marked, pointing here (its values are in the shards)."""
        self.original = original
        set_owner(original, self)
        setattr(original, REPLACED, True)
        if not isinstance(original, DTensor):  # a DTensor's is left: no one holds it once the shard takes its slots
            original.data = original.detach().new_empty(0)  # of its class: a tensor subclass takes no plain data

    def adopt(self, slot: tuple[nn.Module, str] | None = None) -> None:
        """Take as the shard whatever the modules hold now, in `slot` or the first slot (`to_empty`, `_apply`,
        `load_state_dict(assign=True)` may have put a new parameter there); every slot then holds it."""
        sub, attr = slot if slot is not None else self.slots[0]
        now = sub._parameters.get(attr)
        if now is self.full:
            return
        if now is not self.sharded:
            if not isinstance(now, DTensor) or now.shape != self.shape:
                raise TypeError(f"{self.name}: fully_shard expected its shard (a DTensor of shape {tuple(self.shape)}) "
                                f"in the module, found {type(now).__name__}: replace a sharded parameter with "
                                "one of the same kind (to_empty, load_state_dict) or shard the module after")
            if not isinstance(now, nn.Parameter):
                now = nn.Parameter(now, requires_grad=self.requires_grad)
            self.sharded = now
            set_owner(now, self)
            self.put(now)
        self.dtype, self.device = self.sharded.dtype, self.sharded.device  # `model.double()` changes them in place

    def take_up_replaced(self) -> bool:
        """If the user put a plain tensor parameter in this one's place after `fully_shard` (e.g. an init assigning
        `module.w = nn.Parameter(...)`), shard it (its rows on this rank) as torch's lazy init does; whether it did."""
        sub, attr = self.slots[0]
        now = sub._parameters.get(attr)
        if now is self.sharded or now is self.full:
            return False
        mesh = self.sharded.device_mesh
        if isinstance(now, DTensor) and now.shape == self.shape and now.device_mesh == mesh \
                and now.placements == self.sharded.placements:
            fresh = now if isinstance(now, nn.Parameter) else nn.Parameter(now, requires_grad=now.requires_grad)
        elif isinstance(now, torch.Tensor) and not isinstance(now, DTensor) and now.shape == self.shape \
                and self.tp is None:
            fresh = nn.Parameter(_as_shard(self.cut(now), mesh, self.shape, self.dim), requires_grad=now.requires_grad)
            if isinstance(now, nn.Parameter):
                self.replaces(now)  # an optimizer built from it refuses to step (it would train nothing)
        else:
            what = f"{type(now).__name__} of shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) \
                else type(now).__name__
            placed = f" placed {now.placements}" if isinstance(now, DTensor) else ""
            raise ValueError(f"{self.name} was replaced after fully_shard by a {what}{placed}: replace it with a "
                             f"tensor of its shape {tuple(self.shape)} (or a DTensor placed as its shard "
                             f"{self.sharded.placements}), or shard the module after")
        self.sharded = fresh
        set_owner(fresh, self)
        self.put(fresh)
        self.dtype, self.device, self.full, self.accumulated = now.dtype, now.device, None, None
        self.requires_grad = now.requires_grad
        return True

    def has_extension(self) -> bool:
        """Whether torch's all-gather extension hooks are set on this shard's local tensor (or its class)."""
        local = self.sharded._local_tensor
        return hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather")

    def add_grad(self, grad: torch.Tensor, mesh) -> None:
        """Add `grad` (this rank's rows of the summed gradient) to the shard's `.grad`, a DTensor made at first."""
        own = self.sharded
        if own.grad is None:
            own.grad = self.as_shard(grad)
        else:
            own.grad.to_local().add_(grad)

    def forget_gradients(self) -> None:
        """Drop the full form's gradient and what gradient sync off kept."""
        if self.full is not None:
            self.full.grad = None
        self.accumulated = None


def _as_shard(local: torch.Tensor, mesh, shape: torch.Size, dim: int) -> DTensor:
    """`local` (this rank's rows) as a DTensor of global `shape`, placed `Shard(dim)` on `mesh` (HSDP's 2-D mesh:
    `(Replicate(), Shard(dim))`, as torch's)."""
    stride = torch.empty(shape, device="meta").stride()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(dim)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


_watching = False


def watch_optimizers() -> None:
    """Once: make any optimizer step refuse a parameter that fully_shard replaced by its shard (built too early)."""
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_refuse_replaced)
        _watching = True


def _refuse_replaced(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, FULL, False):
                raise ValueError(f"{type(optimizer).__name__} holds a gathered full parameter of fully_shard (shape "
                                 f"{tuple(p.shape)}), not its shard: it was built while the unit was gathered "
                                 "(after a forward, before its backward, or after unshard()); build it from "
                                 "model.parameters() before the first forward or after a backward")
            if getattr(p, REPLACED, False):
                raise ValueError(f"{type(optimizer).__name__} holds a parameter that fully_shard replaced by its "
                                 f"shard (shape {tuple(p.shape)}, emptied): build the optimizer after fully_shard, "
                                 "from model.parameters()")
