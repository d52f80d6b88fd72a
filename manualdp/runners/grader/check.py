"""`manualdp check EXERCISE FILE.py`: grade your own code with the properties that hold manualdp's.

    manualdp check split_batch my_split.py
    manualdp check allreduce my_allreduce.py
    manualdp check schedule my_ring.py [--plot ring.png]
    manualdp check ddp my_ddp.py
    manualdp check cost my_cost.py
    manualdp check hook my_hook.py
    manualdp check buckets my_buckets.py
    manualdp check zero1 my_zero1.py
    manualdp check checkpoint my_checkpoint.py
    manualdp check diloco my_outer_step.py

FILE.py defines what the exercise asks for (`EXERCISES`), with manualdp's signature where manualdp has one:
`split_batch(X, y, devices)`, `allreduce(tensors)`, `schedule(n)` returning the rounds (a `Schedule`, or
a list of rounds of `Transfer(src, dst, chunk, reduce)`), a class `DDP(module)`, `cost(schedule, nbytes,
alpha, beta, gamma)`, a comm hook `fp16_compress_hook(process_group, bucket)`, `zero1_step(params,
grads, momenta, lr, momentum)`, or `save_checkpoint` and `load_checkpoint`. The exit status is 0 when every
check passes, 1 otherwise, and the first failing case is told in one paragraph: the input, what
was expected, what came back. The properties are `manualdp.runners.grader.properties`, the very ones
tests/ holds manualdp to; the exercises are in the book (book/), reference solutions in
book/solutions/.

FILE.py never runs in this process: `sandbox.Child` runs it in a child process, with a deadline per
call (`--timeout`) and for the whole check (`--total`) and capped memory (`--memory`); this process
draws the inputs, sends them, and judges what comes back.
"""
from __future__ import annotations

import argparse
import os
import stat
import textwrap
import time

from .sandbox import Child, Stopped

__all__ = ["EXERCISES", "main"]

EXERCISES = {  # name -> what FILE.py must define
    "split_batch": "a function split_batch(X, y, devices) -> (X_shards, y_shards)",
    "allreduce": "a function allreduce(tensors) that sums a list of per-device tensors in place",
    "schedule": "a function schedule(n) -> the rounds of an allreduce on n devices",
    "ddp": "a class DDP(module) that averages gradients over the ranks, as torch's DDP",
    "cost": "a function cost(schedule, nbytes, alpha, beta, gamma) -> the schedule's alpha-beta-gamma time in seconds",
    "hook": "a comm hook fp16_compress_hook(process_group, bucket) -> a future of the bucket's average, sent in "
            "float16",
    "buckets": "a class BucketedDDP(module, bucket_cap_mb) whose buckets are sent when full, during backward "
               "(async all_reduce), with finish_gradient_synchronization()",
    "zero1": "a function zero1_step(params, grads, momenta, lr, momentum): one ZeRO-1 step of SGD with momentum",
    "checkpoint": "functions save_checkpoint(path, model, optimizer, step) and load_checkpoint(path, model, optimizer) "
                  "-> step, whose resume equals the uninterrupted run bitwise",
    "diloco": "a function outer_step(theta, replicas, buffer, lr, momentum) -> (new_theta, new_buffer), DiLoCo's outer "
              "step",
}
NAMES = {"split_batch": "split_batch", "allreduce": "allreduce", "schedule": "schedule", "ddp": "DDP", "cost": "cost",
         "hook": "fp16_compress_hook", "buckets": "BucketedDDP", "zero1": "zero1_step",
         "checkpoint": ("save_checkpoint", "load_checkpoint"), "diloco": "outer_step"}
OWN = ("cost", "hook", "buckets", "diloco")  # exercises whose answer the library holds: the file must write its own
SIZE = 1 << 20  # the buffer whose bytes a schedule's report counts (divisible by 4 and 8 devices)
DDP_TIMEOUT = 90.0  # seconds for the ranks of the ddp and hook checks
HOOK_WORLDS = (2, 3)  # the hook check's numbers of ranks


class Failed(Exception):
    """The file cannot be graded, or a check failed: the message says why."""


def load(path: str, name: str | tuple[str, ...], args) -> Child:
    """A child process (`sandbox.Child`) that has loaded the file at `path`, which defines `name` (or every name)."""
    try:
        mode = os.stat(path).st_mode  # stat, not open: a FIFO would block
    except FileNotFoundError:
        raise Failed(f"{path}: no such file") from None
    except OSError as e:
        raise Failed(f"{path}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise Failed(f"{path} is a folder, not a Python file: give the file that defines what the exercise asks for")
    if not stat.S_ISREG(mode):
        raise Failed(f"{path} is not a regular file ({_kind(mode)}): give a Python file")
    child = Child(path, name, args.timeout, args.deadline, args.memory)
    try:
        loaded = child.start()
    except BaseException:
        child.close()
        raise
    if "import_raised" in loaded:
        child.close()
        e = loaded["import_raised"]
        hint = (". Is there a self-test at the end of the file? Put it under `if __name__ == \"__main__\":`, "
                "which the grader does not run" if e["raised"] in ("SystemExit", "KeyboardInterrupt") else "")
        raise Failed(f"importing the file raised {e['raised']}: {e['message']}"
                     + (f" (at {e['at']})" if e["at"] else "") + hint)
    if "missing" in loaded:
        child.close()
        raise Failed(f"the file defines no {loaded['missing']!r}: the exercise asks for {EXERCISES[_exercise(name)]}")
    if "error" in loaded:
        child.close()
        raise Failed(loaded["error"])
    if "own" in loaded:
        child.close()
        raise Failed(f"the file's {loaded['own'][0]} is built on {loaded['own'][1]}, the library's own: write it "
                     f"yourself, in the file (the exercise asks for {EXERCISES[_exercise(name)]})")
    taken = _taken(loaded, child.path) if _exercise(name) in OWN else None
    if taken:
        child.close()
        raise Failed(f"the file's {taken[0]} is not written in it but taken from {taken[1]}: write it yourself, in "
                     f"the file (the exercise asks for {EXERCISES[_exercise(name)]})")
    return child


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((word for test, word in kinds if test(mode)), "not a file")


def _exercise(name: str) -> str:
    return next(k for k, v in NAMES.items() if v == name)


def _taken(loaded: dict, path: str) -> tuple[str, str] | None:
    """(name, where it comes from) of a graded function the file imports rather than defines, as the child's `load`
    answer tells where each was defined (`defined_in`, `module`); None if each is the file's own."""
    files, modules = loaded.get("defined_in") or {}, loaded.get("module") or {}
    for name, file in files.items():
        module = modules.get(name)
        if file is not None and file != path or file is None and module not in (None, "exercise"):
            return name, module if module not in (None, "exercise") else file
    return None


def _hypothesis(prop, fn, strategies: dict, examples: int) -> None:
    """Run `prop(fn, **drawn)` on `examples` inputs that hypothesis draws; raise the smallest failure's Mismatch."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings

    def test(**drawn):
        prop(fn, **drawn)

    # no explain phase: it re-runs the shrunk failure many times over to annotate a report the grader does not print
    run = settings(database=None, derandomize=True, deadline=None, max_examples=examples, verbosity=Verbosity.quiet,
                   report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                   phases=[p for p in Phase if p.name != "explain"])(given(**strategies)(test))
    run()


def check_split_batch(path: str, args) -> str:
    from .properties import STRATEGIES, split_devices_property, split_property, split_sizes_property

    def both(fn, **drawn):
        split_property(fn, **drawn)
        split_devices_property(fn, **drawn)

    with load(path, "split_batch", args) as child:
        _hypothesis(both, child, STRATEGIES["split_batch"], args.examples)
        split_sizes_property(child)  # then, once, a million rows and 16 devices
    return (f"{args.examples} batches drawn by hypothesis (1 to 8 devices, up to 48 rows), then a million rows on 3 "
            "devices and 16 devices: every shard holds its "
            "near-equal slice of X and y, in memory of its own, and lies on its device (told apart by alternating "
            "cpu and meta devices)")


def check_allreduce(path: str, args) -> str:
    from .properties import STRATEGIES, allreduce_property, allreduce_sizes_property

    with load(path, "allreduce", args) as child:
        _hypothesis(allreduce_property, child, STRATEGIES["allreduce"], args.examples)  # its small failures first
        allreduce_sizes_property(child)  # then, once, a million elements and sums that overflow
    return (f"{args.examples} lists of tensors drawn by hypothesis (1 to 8 devices, any shape up to 100,000 elements, "
            "0-dim too, float and int dtypes, integers over their whole range, transposed views), then a million "
            "elements on 2 and 3 devices and int16 and int32 sums that overflow: every device's own tensor holds the "
            "sum, bitwise identical (integers summed in their own dtype, wrapping around, as torch's all_reduce)")


def schedule_sizes(powers_of_two: bool) -> list[int]:
    """The numbers of devices the schedule exercise runs: 1 to 16, or its powers of two."""
    return [1, 2, 4, 8, 16] if powers_of_two else list(range(1, 17))


def check_schedule(path: str, plot_path: str, args) -> str:
    from ...cost import traffic
    from ..explain import plot_schedule
    from .properties import Mismatch, schedule_property

    sizes = schedule_sizes(args.powers_of_two)
    with load(path, "schedule", args) as fn:
        for n in sizes:
            try:
                schedule_property(fn, n)
            except Mismatch as e:
                drawn = _draw(fn, n, plot_path) if n <= 8 else None
                raise Failed(str(e) + (f" (drawn in {drawn})" if drawn else "")) from None
        told = "1, 2, 4, 8 and 16 (powers of two)" if args.powers_of_two else "1 to 16"
        lines = [f"schedule(n) for n = {told}: every transfer valid, and every device ends with every device's "
                 "contribution to every chunk exactly once.",
                 f"bytes per device for a buffer of S = {SIZE} bytes, against 2(n-1)/n * S, the least an allreduce "
                 "can send (the ring's):",
                 "  {:>7}{:>8}{:>12}{:>15}{:>15}".format("devices", "rounds", "most sent", "most received",
                                                        "2(n-1)/n * S")]
        for n in (4, 8):
            sched = schedule_property(fn, n)
            t = traffic(sched, SIZE, 4)
            bound = 2 * (n - 1) * SIZE // n
            ratio = max(t["sent"]) / bound
            lines.append("  {:>7}{:>8}{:>12}{:>15}{:>15}".format(n, len(sched.rounds), max(t["sent"]),
                                                               max(t["received"]), bound)
                         + ("   at the formula" if ratio <= 1.0001 else f"   {ratio:.2f} times the formula"))
        plot_schedule(schedule_property(fn, 4), plot_path, "your schedule on 4 devices")
    lines.append(f"drawn on 4 devices: {plot_path}")
    return "\n".join(lines)


def _draw(fn, n: int, plot_path: str) -> str | None:
    """Draw a failing schedule when its transfers can be drawn; the path, or None."""
    from ...cost import check_schedule
    from ..explain import plot_schedule
    from .properties import as_schedule

    try:
        sched = as_schedule(fn.call(n)[2], n, "")
        check_schedule(sched)
        plot_schedule(sched, plot_path, f"your schedule on {n} devices")
    except (Exception, Stopped):  # noqa: BLE001 (what cannot be drawn was already told in words)
        return None
    return plot_path


def _ranks(path: str, exercise: str, args) -> list[dict]:
    """What each of 2 ranks, started by the file's child, returned from `sandbox_child.RANK_JOBS[exercise]`."""
    with load(path, NAMES[exercise], args) as child:  # its errors are told here, before any rank starts
        return _run_ranks(child, exercise, 2)


def _run_ranks(child: Child, exercise: str, world: int) -> list[dict]:
    """`world` ranks of the exercise's job, started by `child` (`sandbox_child`'s `ranks`); Failed if one failed."""
    reply = child.request({"op": "ranks", "job": exercise, "world_size": world, "timeout": DDP_TIMEOUT},
                          DDP_TIMEOUT + 30, f"running the {world} ranks")
    if reply.get("timeout"):
        raise Failed(f"the {world} ranks did not finish in {DDP_TIMEOUT:.0f} s: a rank waits for a message another "
                     "never sends (do all ranks make the same collective calls, in the same order?)")
    if "rank_died" in reply or "error" in reply:
        raise Failed(f"a rank died: {reply['rank_died']}" if "rank_died" in reply else reply["error"])
    ranks = reply.get("ranks")
    if not (isinstance(ranks, list) and len(ranks) == world and all(isinstance(r, dict) for r in ranks)):
        raise Failed(f"the ranks sent back {str(ranks)[:200]} instead of their results")
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise Failed(str(errors[0]))
    return ranks


def check_ddp(path: str, args) -> str:
    from ...spmd.launch import launch
    from .properties import ddp_mismatch, torch_ddp_job

    ranks = _ranks(path, "ddp", args)
    reference = launch(torch_ddp_job, 2, timeout=DDP_TIMEOUT)  # torch's DDP, in ranks the file never ran in
    try:
        ddp_mismatch([{"DDP": mine["DDP"], **ref} for mine, ref in zip(ranks, reference)], "DDP")
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise Failed(f"the ranks sent back results in another shape than train_steps' ({type(e).__name__}: {e})")
    return ("DDP equals torch's DDP on 2 ranks, fed the same data (a model with a layer used twice and a frozen layer, "
            "float64, to 1e-12): the parameters after construction, and after each of 3 steps the gradients when "
            "backward returned and the parameters after the optimizer step")


def check_hook(path: str, args) -> str:
    from ...spmd.launch import launch
    from .properties import LOSS_SCALE, hook_mismatch, torch_hook_job

    name = NAMES["hook"]
    with load(path, name, args) as child:  # its errors are told here, before any rank starts
        for world in HOOK_WORLDS:  # two sizes: a hook that divides by 2 is right on 2 ranks only
            ranks = _run_ranks(child, "hook", world)
            reference = launch(torch_hook_job, world, timeout=DDP_TIMEOUT)  # torch's own hook, in ranks of ours
            try:
                hook_mismatch([{name: mine[name], **ref} for mine, ref in zip(ranks, reference)], name)
            except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
                raise Failed(f"the ranks sent back results in another shape than the grader's ({type(e).__name__}: "
                             f"{e})")
    return (f"{name} on torch's DDP equals torch's fp16_compress_hook on 2 ranks, to 1e-6, and on 3, to float16's "
            f"precision (where a right hook may round in another order than torch's), for a float32 MLP with a bucket "
            f"per layer or two: the gradients and parameters of an ordinary step, and of a step whose loss is scaled "
            f"by {LOSS_SCALE:.0f}, where the sum of the ranks' float16 gradients would overflow")


def check_buckets(path: str, args) -> str:
    from .properties import buckets_mismatch
    from .properties.buckets import CAP_BYTES

    name = NAMES["buckets"]
    ranks = _ranks(path, "buckets", args)
    try:
        buckets_mismatch(ranks, name)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RuntimeError) as e:
        raise Failed(f"the ranks sent back results in another shape than the grader's ({type(e).__name__}: {e})")
    return (f"{name} on 2 ranks, a model with a layer used twice, a frozen layer and one never called, float64, 3 "
            f"steps: the gradients equal one process's on the whole batch (to 1e-12), the parameter never used keeps "
            f"no gradient, every all_reduce is within the cap of {CAP_BYTES} bytes (or one gradient alone), "
            "asynchronous, and a bucket goes out before the last gradient is ready")


def check_cost(path: str, args) -> str:
    from .properties import STRATEGIES, book_schedules, cost_property, cost_sweep_property

    with load(path, NAMES["cost"], args) as child:
        _hypothesis(cost_property, child, STRATEGIES["cost"], args.examples)  # its small failures read best: first
        cost_sweep_property(child)  # then every size the report names, whatever hypothesis drew
    return (f"{args.examples} schedules drawn by hypothesis (the book's collectives on 1 to 16 devices, and random "
            "valid schedules of 2 to 6 devices, 1 to 6 chunks, up to 4 rounds, empty rounds too), buffers of 0 to 1 "
            f"GiB and constants from 0, then the book's {len(book_schedules())} schedules (each collective's every "
            "algorithm on each n from 1 to 16 devices): your time equals manualdp.cost.cost's, to 1e-9")


def check_zero1(path: str, args) -> str:
    from .properties import STRATEGIES, zero1_property, zero1_sizes_property

    with load(path, NAMES["zero1"], args) as child:
        _hypothesis(zero1_property, child, STRATEGIES["zero1"], args.examples)
        zero1_sizes_property(child)  # then, once, a million parameters and 16 devices
    return (f"{args.examples} runs drawn by hypothesis (1 to 8 devices, 0 to 64 float64 parameters, 1 to 3 steps, "
            "momentum 0 to 0.99), then a million parameters on 3 devices and 16 devices: every device's parameters "
            "equal plain data parallelism's SGD to 1e-10 and are bitwise identical, and device i's momentum buffer is "
            "that of its own chunk")


def check_checkpoint(path: str, args) -> str:
    from .properties import STRATEGIES, resume_in_a_new_process_property, resume_property

    with load(path, NAMES["checkpoint"], args) as child:
        _hypothesis(resume_property, child, STRATEGIES["checkpoint"], args.examples)
        resume_in_a_new_process_property(child)
    return (f"{args.examples} runs drawn by hypothesis (2 to 8 steps, SGD with momentum or Adam, dropout, random "
            "batches; stopped after any step and resumed in a new model and optimizer, torch seeded anew by a seed "
            "drawn apart from the run's), and one resumed in a new process from the file moved to a new name (its "
            "seeds drawn at random): every resumed run ends bitwise equal to the uninterrupted one")


def check_diloco(path: str, args) -> str:
    from .properties.diloco import outer_step_property, outer_step_sizes_property, strategies

    def drawn(fn, inputs, lr, mu):
        outer_step_property(fn, *inputs, lr, mu)

    with load(path, NAMES["diloco"], args) as child:
        _hypothesis(drawn, child, strategies(), args.examples)
        outer_step_sizes_property(child)  # then, once, 16 replicas and a million elements
    return (f"{args.examples} outer steps drawn by hypothesis (1 to 16 replicas, 0-dim to 3-dim float64 tensors, "
            "lr 0.01 to 1, mu 0 to 0.99, a zero or a running momentum buffer), then 16 replicas and a million "
            "elements: the new theta and momentum equal Nesterov SGD on the average change, to 1e-10 relative, and "
            "the replicas' tensors are left as they were")


def main(argv: list[str] | None = None) -> int:
    """`manualdp check EXERCISE FILE.py`: 0 when every check passes, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="manualdp check", description="Grade your own code with the property tests that hold manualdp's.",
        epilog="The exercises: " + "; ".join(f"{k}: {v}" for k, v in EXERCISES.items()))
    parser.add_argument("exercise", choices=list(EXERCISES))
    parser.add_argument("file", help="your Python file")
    parser.add_argument("--examples", type=int, default=100, help="inputs hypothesis draws (default 100)")
    parser.add_argument("--plot", metavar="PATH", help="schedule: where to draw it (default: FILE with .png)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each call of your code may take, and importing your file (default 60; ddp "
                             f"and hook: their ranks take up to {DDP_TIMEOUT:.0f})")
    parser.add_argument("--total", type=float, default=600.0, help="seconds for the whole check (default 600)")
    parser.add_argument("--memory", type=int, default=4096, metavar="MB",
                        help="memory your code's process may map, in MiB (default 4096)")
    parser.add_argument("--powers-of-two", action="store_true",
                        help="schedule: run n = 1, 2, 4, 8 and 16 only (exercise 2.2, halving-doubling)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    for option, value in (("--timeout", args.timeout), ("--total", args.total)):
        if not value > 0:
            parser.error(f"{option} must be > 0 seconds, got {value}")
    if args.memory < 256:
        parser.error(f"--memory must be at least 256 MiB (Python and torch need that much), got {args.memory}")
    plot_path = args.plot or os.path.splitext(args.file)[0] + ".png"
    if args.exercise != "schedule" and (args.plot or args.powers_of_two):
        parser.error("--plot and --powers-of-two are for the schedule exercise")
    if not plot_path.lower().endswith(".png"):
        parser.error(f"--plot: {plot_path!r} must end in .png")
    try:
        import hypothesis  # noqa: F401 (only to say what is missing)
    except ImportError:
        print("manualdp check runs manualdp's property tests, which need hypothesis: pip install hypothesis "
              "(or pip install -e \".[test]\" in a checkout)")
        return 1
    from .properties import Mismatch

    args.deadline = time.monotonic() + args.total
    label = f"{args.exercise} ({args.file})"
    try:
        report = {"split_batch": lambda: check_split_batch(args.file, args),
                  "allreduce": lambda: check_allreduce(args.file, args),
                  "schedule": lambda: check_schedule(args.file, plot_path, args),
                  "ddp": lambda: check_ddp(args.file, args), "cost": lambda: check_cost(args.file, args),
                  "hook": lambda: check_hook(args.file, args),
                  "buckets": lambda: check_buckets(args.file, args), "zero1": lambda: check_zero1(args.file, args),
                  "checkpoint": lambda: check_checkpoint(args.file, args),
                  "diloco": lambda: check_diloco(args.file, args)}[args.exercise]()
    except (Failed, Mismatch, Stopped) as e:
        print(textwrap.fill(f"FAIL {label}: {e}", width=100, break_long_words=False, break_on_hyphens=False))
        return 1
    except Exception as e:  # noqa: BLE001 (hypothesis' own complaints: a flaky function, ...)
        print(textwrap.fill(f"FAIL {label}: {type(e).__name__}: {e}", width=100))
        return 1
    first, *rest = report.split("\n")
    print("\n".join([textwrap.fill(f"PASS {label}: {first}", width=100), *rest]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
