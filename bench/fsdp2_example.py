"""An FSDP2 training script in the shape of pytorch/examples' `distributed/FSDP2`, with torch's `fully_shard` and ours.

    python bench/fsdp2_example.py --world-size 2                       # both, compared number by number
    python bench/fsdp2_example.py --world-size 3 --mixed-precision --explicit-prefetching --repeats 3

The script is the user's: a small transformer (embedding tied to the output head) built on the meta
device, each block a unit, then the root; `to_empty` and the modules' own `reset_parameters`; with
`--mixed-precision`, bf16 parameters and fp32 reduction (`MixedPrecisionPolicy`); with
`--explicit-prefetching`, each block prefetches the next two in forward and the previous one in
backward, and the root is unsharded before each forward; `clip_grad_norm_`; a DCP checkpoint of the
model and optimizer (`get_model_state_dict`, `get_optimizer_state_dict`) after `--steps` steps, a
second run that builds the model again and resumes from it, and a full state dict at the end; and the
example's other resume: full tensors saved with `torch.save`, cut by `distribute_tensor` and loaded with
`load_state_dict(..., assign=True)` into a model that stays on the meta device. The only line that
differs between the two implementations is the import of `fully_shard` and `FSDPModule` (`_api`).

It prints, per implementation, the loss of every step, the median step time, whether each resumed
run equals an uninterrupted one bitwise (torch's `assign=True` unties the head from the embedding,
and its optimizer load then raises: its first line is shown), and the largest difference of the final
full state dict from torch's (0 at 2 ranks: bitwise). Every rank runs in its own process, gloo on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from manualdp.runners.cli import positive  # noqa: E402

VOCAB, SEQ, DIM, HEADS = 32, 12, 24, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return h + self.down(nn.functional.gelu(self.up(self.mlp_norm(h))))


class Transformer(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.embed.weight  # tied

    def forward(self, x):
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _api(impl: str):
    """The one line a user changes."""
    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule, fully_shard
    else:
        from manualdp.distributed import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def _build(impl: str, config: dict, to_empty: bool = True):
    """Meta device, shard bottom-up, prefetch, `to_empty` (unless not): the model, before initialisation."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    fully_shard, FSDPModule = _api(impl)
    with torch.device("meta"):
        model = Transformer(config["layers"])
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              } if config["mixed_precision"] else {}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers)
    if config["explicit_prefetching"]:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
            layer.set_modules_to_backward_prefetch(layers[i - 1:i] if i else [])
    if to_empty:
        model.to_empty(device="cpu")
    return model


def _steps(model, optim, config: dict, first: int, count: int) -> tuple[list[float], list[float]]:
    """`count` steps from step `first`: losses (the mean over ranks) and step times."""
    rank = dist.get_rank()
    losses, times = [], []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (config["batch_size"], SEQ), generator=g)
        start = time.perf_counter()
        if config["explicit_prefetching"]:
            model.unshard()
        out = model(x)
        loss = nn.functional.cross_entropy(out[:, :-1].float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, times


def train(impl: str, config: dict, folder: str) -> dict:
    """One rank: train, checkpoint, train on; resume from the checkpoint in a new model; compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    torch.set_num_threads(1)
    steps = config["steps"]
    torch.manual_seed(0)
    model = _build(impl, config)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, times = _steps(model, optim, config, 0, steps)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
             checkpoint_id=folder)
    whole = StateDictOptions(full_state_dict=True)  # the example's other checkpoint: full tensors, to a file
    saved = io.BytesIO()
    torch.save((get_model_state_dict(model, options=whole), get_optimizer_state_dict(model, optim, options=whole)),
               saved)
    more, more_times = _steps(model, optim, config, steps, steps)
    full = {k: v.float()
            for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}

    resumed = _build(impl, config)
    resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_optim)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_optim, state["optim"])
    again, _ = _steps(resumed, resumed_optim, config, steps, steps)
    resumed_full = get_model_state_dict(resumed, options=StateDictOptions(full_state_dict=True))
    same = all(torch.equal(full[k], v.float()) for k, v in resumed_full.items()) and again == more
    saved.seek(0)
    try:
        assigned, assigned_optim = _resume_by_assign(impl, config, *torch.load(saved, weights_only=True))
    except RuntimeError as e:  # torch's: assign=True unties the head from the embedding, which then has no state
        assign = str(e).splitlines()[0]
    else:
        again, _ = _steps(assigned, assigned_optim, config, steps, steps)
        assigned_full = get_model_state_dict(assigned, options=StateDictOptions(full_state_dict=True))
        assign = all(torch.equal(full[k], v.float()) for k, v in assigned_full.items()) and again == more
    return {"losses": losses + more, "step_s": statistics.median(times + more_times), "resume_bitwise": same,
            "assign_resume": assign, "full": full}


def _resume_by_assign(impl: str, config: dict, model_state: dict, optim_state: dict):
    """The example's resume from full tensors: each cut into a DTensor like the meta model's own and loaded with
    `assign=True` (a meta tensor cannot be copied into); the optimizer's through `set_optimizer_state_dict`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.tensor import distribute_tensor
    model = _build(impl, config, to_empty=False)  # on the meta device it stays: the load puts the shards in
    meta = model.state_dict()
    model.load_state_dict({k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
                           for k, v in model_state.items() if k != "output.weight"},  # tied: the embedding's
                          strict=False, assign=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_optimizer_state_dict(model, optim, optim_state, options=StateDictOptions(full_state_dict=True))
    return model, optim


def run(world_size: int, layers: int = 2, batch_size: int = 8, steps: int = 3, repeats: int = 1,
        mixed_precision: bool = False, explicit_prefetching: bool = False, timeout: float = 600.0) -> dict:
    """Both implementations, `repeats` times each (taking turns), each run in fresh processes."""
    from manualdp.spmd import launch
    config = {"world_size": world_size, "layers": layers, "batch_size": batch_size, "steps": steps,
              "mixed_precision": mixed_precision, "explicit_prefetching": explicit_prefetching}
    runs: dict[str, list] = {"torch": [], "manualdp": []}
    for repeat in range(repeats):
        for impl in (("torch", "manualdp") if repeat % 2 == 0 else ("manualdp", "torch")):
            folder = tempfile.mkdtemp(prefix="fsdp2-example-")
            try:
                runs[impl].append(launch(train, world_size, (impl, config, folder), timeout=timeout))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    theirs = runs["torch"][0][0]["full"]
    rows = []
    for impl, results in runs.items():
        first = results[0][0]
        diff = max(float((first["full"][k] - theirs[k]).abs().max()) for k in theirs)
        rows.append({"impl": impl, "losses": first["losses"],
                     "step_s": statistics.median(r[0]["step_s"] for r in results),
                     "resume_bitwise": all(rank["resume_bitwise"] for r in results for rank in r),
                     "assign_resume": first["assign_resume"] if isinstance(first["assign_resume"], str) else all(
                         rank["assign_resume"] is True for r in results for rank in r),
                     "ranks_equal": all(torch.equal(rank["full"][k], first["full"][k])
                                        for r in results for rank in r for k in theirs),
                     "max_diff_vs_torch": diff})
    base = rows[0]["step_s"]
    for row in rows:
        row["time_vs_torch"] = row["step_s"] / base
    return {"config": config, "rows": rows}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [f"# {c['world_size']} ranks, {c['layers']} blocks, batch {c['batch_size']} per rank, "
             f"2 x {c['steps']} steps, mixed precision {c['mixed_precision']}, "
             f"explicit prefetching {c['explicit_prefetching']}",
             f"{'impl':9} {'step ms':>8} {'/torch':>7} {'resume bitwise':>15} {'assign resume':>14} "
             f"{'ranks equal':>12} {'max |diff| vs torch':>20}  losses"]
    for r in result["rows"]:
        assign = "raises" if isinstance(r["assign_resume"], str) else str(r["assign_resume"])
        lines.append(f"{r['impl']:9} {1e3 * r['step_s']:8.2f} {r['time_vs_torch']:7.2f} "
                     f"{str(r['resume_bitwise']):>15} {assign:>14} {str(r['ranks_equal']):>12} "
                     f"{r['max_diff_vs_torch']:20.3g}  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    lines += [f"# {r['impl']}'s assign resume raises: {r['assign_resume']}" for r in result["rows"]
              if isinstance(r["assign_resume"], str)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/fsdp2_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=positive(int), default=2)
    p.add_argument("--layers", type=positive(int), default=2, help="transformer blocks (default 2)")
    p.add_argument("--batch-size", type=positive(int), default=8, help="sequences per rank (default 8)")
    p.add_argument("--steps", type=positive(int), default=3, help="steps before and after the checkpoint (default 3)")
    p.add_argument("--repeats", type=positive(int), default=1, help="runs of each implementation (default 1)")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 parameters, fp32 reduction")
    p.add_argument("--explicit-prefetching", action="store_true", help="prefetch by hand, as the example's flag")
    args = p.parse_args(argv)
    if args.world_size > 4:
        p.error(f"--world-size: at most 4 processes on this machine, got {args.world_size}")
    result = run(args.world_size, args.layers, args.batch_size, args.steps, args.repeats, args.mixed_precision,
                 args.explicit_prefetching)
    print(format_table(result))
    ours = next(r for r in result["rows"] if r["impl"] == "manualdp")
    return 0 if ours["resume_bitwise"] and ours["assign_resume"] is True and ours["ranks_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
