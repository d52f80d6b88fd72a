"""PyTorch's own DDP tests, run in place from the torch wheel, against torch's DDP and against manualdp's.

    python bench/conformance.py                 # every selected test, world size 2, gloo on CPU
    python bench/conformance.py --fast          # the handful the test suite runs
    python bench/conformance.py -k join -k hook # only tests whose name contains one of these

The tests are `DistributedTest._DistTestBase` of `torch/testing/_internal/distributed/
distributed_test.py`, driven by torch's own multi-process machinery (`TestDistBackend`:
one spawned process per rank, a file rendezvous, exit codes collected by the parent). Each
test runs twice: as the control, and with `DistributedDataParallel` swapped for manualdp's
in the ranks' processes (the name the test module imported and `torch.nn.parallel`'s).
A DDP test is one whose name says so or whose code (or a helper's) builds a DistributedDataParallel.
Tests whose code reads torch's private internals (`PRIVATE`; names in comments and docstrings
do not count) are left out, each with the name it reads and why manualdp does not offer it; so
are tests that read fields of `_get_ddp_logging_data()` that manualdp does not keep, and the few
in `IMPLEMENTATION`, which assert how torch implements DDP (its profiler events).
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import os
import re
import sys
import textwrap
import time
import unittest

if not __package__:  # run as `python bench/NAME.py`: `import bench.*` needs the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment  # noqa: E402

# torch's test module reads these when it is imported (here, and again in every spawned rank).
# They are set only while it is imported here and while a test runs (`_test_environment`), so
# importing this module leaves the caller's environment as it was: a WORLD_SIZE left behind
# would make every later `manualdp train` believe it runs under torchrun.
TEST_ENVIRONMENT = {"BACKEND": "gloo", "WORLD_SIZE": "2"}


def _test_environment(**extra):
    """torch's test settings (unless already set) and `extra`, for a block."""
    return environment(**({k: os.environ.get(k, v) for k, v in TEST_ENVIRONMENT.items()} | extra))


_importing = _test_environment()
_importing.__enter__()

import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

_importing.__exit__(None, None, None)

from manualdp.spmd.ddp.wrapper import DistributedDataParallel as ManualDDP  # noqa: E402
from manualdp.spmd.ddp.private import LOGGED_FIELDS  # noqa: E402
from manualdp.validate import positive_int  # noqa: E402

__all__ = ["TorchDDPTests", "select", "run_one", "main", "FAST", "IMPLEMENTATION"]

SWAP = "MANUALDP_CONFORMANCE_SWAP"  # set to 1 in the ranks' environment: they use manualdp's wrapper
# A DDP test: its name says so, or its code (or a helper's) builds a DistributedDataParallel.
WHICH = re.compile(r"ddp|distributeddataparallel|join|comm_hook|no_sync|uneven|sync_bn|syncbatchnorm", re.I)
BUILDS_DDP = re.compile(r"(?<!\w)DistributedDataParallel\(")
# A test whose code reads one of these checks torch's implementation, not DDP's behaviour; why
# manualdp leaves each out. Names count only in code (not in comments or docstrings) and as
# whole words (`_sync_buffers` is not read by `forward_sync_buffers`).
PRIVATE = {
    "reducer": "torch's C++ reducer object, which manualdp does not have (its buckets live in Python)",
    "_set_static_graph": "static graph switched on after construction; manualdp takes `static_graph=` only",
    "_delay_all_reduce": "torch's delayed-allreduce internals",
    "_register_fused_optim": "fuses a torch functional optimizer into torch's reducer",
    "_get_data_parallel_params": "a torch helper over torch's `_ddp_ignored` marks",
    "_set_ddp_runtime_logging_sample_rate": "torch's runtime timing sampler, which manualdp does not have",
    "_module_wait_for_copy_hook": "torch's mixed-precision internals",
    "_set_ddp_sink_clone": "torch's `_DDPSink` autograd function, which manualdp does not use",
    "_apply_optimizer_in_backward": "torch's in-backward optimizers; manualdp refuses parameters that carry them",
    "_check_sync_bufs": "torch's buffer-sync internals",
    "_DDPSink": "torch's `_DDPSink` autograd function, which manualdp does not use",
    "_MixedPrecision": "torch's prototype mixed precision, which manualdp does not offer",
    "mixed_precision": "torch's prototype mixed precision, which manualdp does not offer",
    "_get_active_ddp_module": "torch's dynamo hook-up",
    "_build_debug_param_to_name_mapping": "torch's reducer's debug tables",
    "_ddp_init_helper": "torch's reducer construction",
    "_sync_buffers": "torch's buffer-sync method",
    "_passing_sync_batchnorm_handle": "torch's SyncBatchNorm hand-off",
    "_ddp_with_replicated_tensor": "torch's replicated-tensor internals",
    "_register_accum_grad_hook": "torch's compiled-autograd hooks",
    "_check_reducer_finalized": "torch's reducer state",
    "_set_sparse_metadata": "torch's reducer's sparse metadata",
    "_update_process_group": "swaps torch's reducer's process group",
    "_compute_bucket_assignment_by_size": "torch's C++ bucket assignment",
    "_verify_param_shape_across_processes": "torch's C++ model check",
}
# Tests that read no private name but assert how torch implements DDP, not what DDP does.
IMPLEMENTATION = {
    "test_ddp_profiling_torch_profiler": "asserts torch's implementation: exactly one `gloo:all_reduce` profiler event "
    "per iteration and the reducer's `search_unused_parameters` range; manualdp allreduces by its own point-to-point "
    "schedules (isend/irecv), by design, so those events are not there to count",
}
# Quick ones that cover construction, plain training, no_sync and the keywords.
FAST = ("test_DistributedDataParallelCPU", "test_ddp_join_model_equivalence", "test_accumulate_gradients_no_sync",
        "test_ddp_hook_parity_allreduce")


SHIM = "MANUALDP_CONFORMANCE_CPU_SHIM"  # "0": no device shim, GPU tests skip
FACTORIES = ("randn", "rand", "randint", "zeros", "ones", "empty", "full", "tensor", "arange", "as_tensor",
             "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like")


def _cpu(device):
    """Any device a test names (an index, 'cuda:1', a cuda torch.device) is the CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapper


def _to_cpu(fn):
    def to(self, *args, **kwargs):
        return fn(self, *[_cpu(a) for a in args], **{k: _cpu(v) if k == "device" else v for k, v in kwargs.items()})
    return to


class TorchDDPOnCpu(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP with device_ids and output_device dropped: under the shim every module is on the CPU."""

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        super().__init__(module, None, None, *args, **kwargs)


class ManualDDPOnCpu(ManualDDP):
    """manualdp's DDP with device_ids and output_device dropped, as `TorchDDPOnCpu`."""

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        super().__init__(module, None, None, *args, **kwargs)


def _install_cpu_shim() -> None:
    """In a rank's process: the tests that ask for one GPU per rank get the CPU, for both wrappers alike."""
    world = int(os.environ.get("WORLD_SIZE", TEST_ENVIRONMENT["WORLD_SIZE"]))
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: world
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.to = _to_cpu(torch.Tensor.to)
    torch.nn.Module.to = _to_cpu(torch.nn.Module.to)
    for name in FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def _install(cls) -> None:
    distributed_test.DistributedDataParallel = cls
    torch.nn.parallel.DistributedDataParallel = cls
    torch.nn.parallel.distributed.DistributedDataParallel = cls


class TorchDDPTests(TestDistBackend, DistributedTest._DistTestBase):
    """torch's DDP tests as torch's CI spawns them; the ranks swap the wrapper when SWAP is set."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        torch.set_num_threads(1)
        ours = os.environ.get(SWAP) == "1"
        if os.environ.get(SHIM, "1") == "1":
            _install_cpu_shim()
            _install(ManualDDPOnCpu if ours else TorchDDPOnCpu)
        elif ours:
            _install(ManualDDP)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


@functools.lru_cache(maxsize=None)
def _source(name: str) -> str:
    """The code of torch's test helper `name`, without comments and docstrings (prose names no API)."""
    tree = _Prose().visit(ast.parse(textwrap.dedent(inspect.getsource(_helper(name)))))
    return ast.unparse(tree)


class _Prose(ast.NodeTransformer):
    def visit_Expr(self, node):  # a string standing alone (a docstring) is prose
        return None if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) else node


def _helper(name: str):
    """The function `name` of torch's test code: a `self._*` method or a module-level function, or None."""
    found = getattr(DistributedTest._DistTestBase, name, None) or vars(distributed_test).get(name)
    module = getattr(found, "__module__", None) or ""
    return found if inspect.isfunction(found) and module.startswith("torch.testing._internal") else None


def _with_helpers(name: str, seen: set[str] | None = None) -> str:
    """The code of test `name` and of torch's test helpers it calls, theirs too: private reads hide there."""
    seen = set() if seen is None else seen
    seen.add(name)
    source = _source(name)
    called = set(re.findall(r"self\.(_\w+)\(", source)) | set(re.findall(r"(?<![.\w])(\w+)\(", source))
    return source + "".join(_with_helpers(h, seen) for h in sorted(called - seen) if _helper(h) is not None)


def _reads(code: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", code) is not None


def logging_fields_read(code: str) -> set[str]:
    """The fields of `_get_ddp_logging_data()` that `code` reads (`.get('x')`, `['x']`, `'x' in ...`)."""
    data = r"(?:ddp_logging_data|_get_ddp_logging_data\(\))"
    return (set(re.findall(data + r"(?:\.get\(|\[)\s*'(\w+)'", code))
            | set(re.findall(r"'(\w+)'\s+(?:not\s+)?in\s+" + data, code)))


def why_left_out(name: str) -> str | None:
    """Why test `name` is not run against manualdp, or None."""
    code = _with_helpers(name)
    decorators = inspect.getsource(getattr(DistributedTest._DistTestBase, name)).split("def ", 1)[0]
    private = next((p for p in PRIVATE if _reads(code, p)), None)
    if private is not None:
        return f"reads torch private `{private}`: {PRIVATE[private]}"
    missing = sorted(logging_fields_read(code) - set(LOGGED_FIELDS)) if _reads(code, "_get_ddp_logging_data") else []
    if missing:
        return f"reads `_get_ddp_logging_data` fields manualdp does not keep: {', '.join(missing)}"
    if name in IMPLEMENTATION:
        return IMPLEMENTATION[name]
    if "skip_if_no_gpu" in decorators or "skipIf(IS_LINUX" in decorators:
        # TEST_CUDA and IS_LINUX are fixed when torch's module is imported: no shim reaches them
        return "skips on every CPU-only Linux machine, under the shim too"
    if 'skipIf(BACKEND != "nccl"' in decorators:
        return "skips with gloo: it tests NCCL's metadata"
    return None


def select() -> tuple[list[str], dict[str, str]]:
    """The DDP tests of `_DistTestBase`, and those left out with the reason (a private name read, torch's
    implementation asserted, or CUDA only)."""
    chosen, left_out = [], {}
    for name in sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_")):
        if not (WHICH.search(name) or BUILDS_DDP.search(_with_helpers(name))):
            continue
        why = why_left_out(name)
        if why is None:
            chosen.append(name)
        else:
            left_out[name] = why
    return chosen, left_out


def first_error_line(text: str) -> str:
    """The exception line of the first traceback in a test's output (the ranks' errors come inside the parent's)."""
    lines = [l.strip() for l in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith("File ")
                                      or not re.match(r"^[\w.]+(Error|Exception|Exit)\b", lines[j])):
                j += 1
            if j < len(lines):
                return lines[j][:160]
    return (lines[-1] if lines else "")[:160]


def run_one(name: str, manualdp: bool) -> tuple[str, str]:
    """Run test `name` once (2 ranks); ('pass' | 'fail' | 'skip', first line of the error)."""
    result = unittest.TestResult()
    with _test_environment(**{SWAP: "1" if manualdp else "0"}):
        TorchDDPTests(name).run(result)
    if result.skipped:
        return "skip", result.skipped[0][1].splitlines()[0][:160]
    problems = result.errors + result.failures
    if problems:
        text = problems[0][1]
        # The parent's RuntimeError carries the rank's traceback; its last exception is the cause.
        inner = text.split("exception:", 1)[1] if "exception:" in text else text
        return "fail", first_error_line(inner)
    return "pass", ""


def main(argv: list[str] | None = None) -> int:
    """Run the selected tests twice each and print the table and the counts."""
    parser = argparse.ArgumentParser(prog="bench/conformance.py", description=__doc__.splitlines()[0])
    parser.add_argument("-k", action="append", default=[], help="only tests whose name contains this (repeatable)")
    parser.add_argument("--fast", action="store_true", help=f"only the fast subset: {', '.join(FAST)}")
    parser.add_argument("--list", action="store_true", help="print the selection and the tests left out, run nothing")
    parser.add_argument("--limit", type=int, default=None, help="run at most this many tests")
    parser.add_argument("--json", default=None, help="also write the rows, the counts and the left-out list here")
    parser.add_argument("--shard", default="0/1", help="K/N: run only every N-th test from the K-th (parallel runs)")
    args = parser.parse_args(argv)
    if args.limit is not None:
        positive_int("--limit", args.limit)
    chosen, left_out = select()
    if args.fast:
        chosen = [n for n in chosen if n in FAST]
    if args.k:
        chosen = [n for n in chosen if any(k.lower() in n.lower() for k in args.k)]
    k, _, n = args.shard.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        parser.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    chosen = chosen[int(k)::int(n)][:args.limit]
    print(f"left out ({len(left_out)}):")
    for name, why in left_out.items():
        print(f"  {name}: {why}")
    if args.list:
        print(f"selected ({len(chosen)}):", *chosen, sep="\n  ")
        return 0
    width = max([len(n) for n in chosen] + [4])
    print(f"{'test':<{width}}  torch  manualdp  error")
    counts = {"control": 0, "ours": 0, "both": 0}
    rows = []
    for name in chosen:
        start = time.monotonic()
        control, control_error = run_one(name, manualdp=False)
        ours, our_error = run_one(name, manualdp=True)
        counts["control"] += control == "pass"
        counts["ours"] += ours == "pass"
        counts["both"] += control == ours == "pass"
        error = our_error if ours != "pass" else control_error
        rows.append({"test": name, "torch": control, "manualdp": ours, "error": error})
        print(f"{name:<{width}}  {control:<5}  {ours:<8}  {error}  ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"selected: {len(chosen)}  control-passed: {counts['control']}  manualdp-passed: {counts['ours']}  "
          f"manualdp-passed where control passed: {counts['both']}")
    if args.json is not None:
        summary = {"selected": len(chosen), "control_passed": counts["control"], "manualdp_passed": counts["ours"],
                   "manualdp_passed_where_control_passed": counts["both"]}
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__, "counts": summary,
                       "rows": rows, "left_out": left_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
