"""`manualdp check EXERCISE FILE.py`: grade your own code with the properties that hold manualdp's.

    manualdp check split_batch my_split.py
    manualdp check allreduce my_allreduce.py
    manualdp check schedule my_ring.py [--plot ring.png]
    manualdp check ddp my_ddp.py

FILE.py defines what the exercise is named, with manualdp's signature: `split_batch(X, y, devices)`,
`allreduce(tensors)`, `schedule(n)` returning the rounds (a `Schedule`, or a list of rounds of
`Transfer(src, dst, chunk, reduce)`), or a class `DDP(module)`. The exit status is 0 when every
check passes, 1 otherwise, and the first failing case is told in one paragraph: the input, what
was expected, what came back. The properties are `manualdp.runners.properties`, the very ones
tests/ holds manualdp to; the exercises are in the book (book/), reference solutions in
book/solutions/.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import textwrap
import threading

__all__ = ["EXERCISES", "main"]

EXERCISES = {  # name -> what FILE.py must define
    "split_batch": "a function split_batch(X, y, devices) -> (X_shards, y_shards)",
    "allreduce": "a function allreduce(tensors) that sums a list of per-device tensors in place",
    "schedule": "a function schedule(n) -> the rounds of an allreduce on n devices",
    "ddp": "a class DDP(module) that averages gradients over the ranks, as torch's DDP",
}
NAMES = {"split_batch": "split_batch", "allreduce": "allreduce", "schedule": "schedule", "ddp": "DDP"}
SIZE = 1 << 20  # the buffer whose bytes a schedule's report counts (divisible by 4 and 8 devices)
DDP_TIMEOUT = 90.0  # seconds for the two ranks of the ddp check


class Failed(Exception):
    """The file cannot be graded, or a check failed: the message says why."""


def load(path: str, name: str):
    """`name` as defined by the Python file at `path`."""
    if not os.path.isfile(path):
        raise Failed(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location("exercise", path)
    if spec is None or spec.loader is None:
        raise Failed(f"{path}: not a Python file (it should end in .py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (anything in a student's file)
        raise Failed(f"importing the file raised {type(e).__name__}: {e}") from None
    if not hasattr(module, name):
        raise Failed(f"the file defines no {name!r}: the exercise asks for {EXERCISES[_exercise(name)]}")
    return getattr(module, name)


def _exercise(name: str) -> str:
    return next(k for k, v in NAMES.items() if v == name)


def _hypothesis(prop, fn, strategies: dict, examples: int) -> None:
    """Run `prop(fn, **drawn)` on `examples` inputs that hypothesis draws; raise the smallest failure's Mismatch."""
    from hypothesis import HealthCheck, Verbosity, given, settings

    def test(**drawn):
        prop(fn, **drawn)

    run = settings(database=None, derandomize=True, deadline=None, max_examples=examples, verbosity=Verbosity.quiet,
                   report_multiple_bugs=False, suppress_health_check=list(HealthCheck))(given(**strategies)(test))
    run()


def check_split_batch(path: str, examples: int) -> str:
    from .properties import STRATEGIES, split_property

    _hypothesis(split_property, load(path, "split_batch"), STRATEGIES["split_batch"], examples)
    return (f"{examples} batches drawn by hypothesis (1 to 8 devices, up to 48 rows): every shard holds its near-equal "
            "slice of X and y, on its device, in memory of its own")


def check_allreduce(path: str, examples: int) -> str:
    from .properties import STRATEGIES, allreduce_property

    _hypothesis(allreduce_property, load(path, "allreduce"), STRATEGIES["allreduce"], examples)
    return (f"{examples} lists of tensors drawn by hypothesis (1 to 8 devices, any shape up to 100,000 elements, float "
            "and int dtypes, transposed views): every device's own tensor holds the sum, bitwise identical")


def check_schedule(path: str, plot_path: str) -> str:
    from ..cost import traffic
    from .explain import plot_schedule
    from .properties import Mismatch, schedule_property

    fn = load(path, "schedule")
    for n in range(1, 17):
        try:
            schedule_property(fn, n)
        except Mismatch as e:
            drawn = _draw(fn, n, plot_path) if n <= 8 else None
            raise Failed(str(e) + (f" (drawn in {drawn})" if drawn else "")) from None
    lines = ["schedule(n) for n = 1 to 16: every transfer valid, and every device ends with every device's "
             "contribution to every chunk exactly once.",
             f"bytes per device for a buffer of S = {SIZE} bytes, against 2(n-1)/n * S, the least an allreduce "
             "can send (the ring's):",
             "  {:>7}{:>8}{:>12}{:>15}{:>15}".format("devices", "rounds", "most sent", "most received", "2(n-1)/n * S")]
    for n in (4, 8):
        sched = schedule_property(fn, n)
        t = traffic(sched, SIZE, 4)
        bound = 2 * (n - 1) * SIZE // n
        ratio = max(t["sent"]) / bound
        lines.append("  {:>7}{:>8}{:>12}{:>15}{:>15}".format(n, len(sched.rounds), max(t["sent"]), max(t["received"]),
                                                           bound)
                     + ("   at the formula" if ratio <= 1.0001 else f"   {ratio:.2f} times the formula"))
    plot_schedule(schedule_property(fn, 4), plot_path, "your schedule on 4 devices")
    lines.append(f"drawn on 4 devices: {plot_path}")
    return "\n".join(lines)


def _draw(fn, n: int, plot_path: str) -> str | None:
    """Draw a failing schedule when its transfers can be drawn; the path, or None."""
    from ..cost import check_schedule
    from .explain import plot_schedule
    from .properties import as_schedule

    try:
        sched = as_schedule(fn(n), n, "")
        check_schedule(sched)
        plot_schedule(sched, plot_path, f"your schedule on {n} devices")
    except Exception:  # noqa: BLE001 (what cannot be drawn was already told in words)
        return None
    return plot_path


def check_ddp(path: str) -> str:
    from ..spmd.launch import launch
    from .properties import ddp_job, ddp_mismatch

    load(path, "DDP")  # its errors are told here, in this process, before any rank starts
    try:
        results = launch(ddp_job, 2, (os.path.abspath(path),), timeout=DDP_TIMEOUT)
    except TimeoutError:
        raise Failed(f"the 2 ranks did not finish in {DDP_TIMEOUT:.0f} s: a rank waits for a message the other never "
                     "sends (do both ranks make the same collective calls, in the same order?)") from None
    except Exception as e:  # noqa: BLE001 (a rank that died: its last lines)
        raise Failed(f"a rank died: {str(e).strip().splitlines()[-1]}") from None
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise Failed(errors[0])
    ddp_mismatch(results, "DDP")
    return ("DDP equals torch's DDP on 2 ranks, fed the same data (a model with a layer used twice and a frozen layer, "
            "float64, to 1e-12): the parameters after construction, and after each of 3 steps the gradients when "
            "backward returned and the parameters after the optimizer step")


@contextlib.contextmanager
def _within(seconds: float):
    """Raise TimeoutError after `seconds` where a student's function never returns (main thread on Unix only)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_):
        raise TimeoutError(f"the check took more than {seconds:.0f} s: does your code loop forever?")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    """`manualdp check EXERCISE FILE.py`: 0 when every check passes, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="manualdp check", description="Grade your own code with the property tests that hold manualdp's.",
        epilog="The exercises: " + "; ".join(f"{k}: {v}" for k, v in EXERCISES.items()))
    parser.add_argument("exercise", choices=list(EXERCISES))
    parser.add_argument("file", help="your Python file")
    parser.add_argument("--examples", type=int, default=100, help="inputs hypothesis draws (default 100)")
    parser.add_argument("--plot", metavar="PATH", help="schedule: where to draw it (default: FILE with .png)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up (default 300)")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    plot_path = args.plot or os.path.splitext(args.file)[0] + ".png"
    if args.exercise != "schedule" and args.plot:
        parser.error("--plot is for the schedule exercise")
    if not plot_path.lower().endswith(".png"):
        parser.error(f"--plot: {plot_path!r} must end in .png")
    try:
        import hypothesis  # noqa: F401 (only to say what is missing)
    except ImportError:
        print("manualdp check runs manualdp's property tests, which need hypothesis: pip install hypothesis "
              "(or pip install -e \".[test]\" in a checkout)")
        return 1
    from .properties import Mismatch

    label = f"{args.exercise} ({args.file})"
    try:
        with _within(args.timeout):
            report = {"split_batch": lambda: check_split_batch(args.file, args.examples),
                      "allreduce": lambda: check_allreduce(args.file, args.examples),
                      "schedule": lambda: check_schedule(args.file, plot_path),
                      "ddp": lambda: check_ddp(args.file)}[args.exercise]()
    except (Failed, Mismatch, TimeoutError) as e:
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
