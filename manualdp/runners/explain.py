"""Print a collective's schedule round by round, so it can be followed by hand.

    manualdp explain ring --devices 4 --size 1048576
    manualdp explain reduce_scatter --devices 4        (also all_gather, reduce, broadcast)
    manualdp explain auto --devices 2 --size 1048576   (what algorithm="auto" would pick, and why)
    manualdp explain zero3 --devices 4 [--plot zero3.png]  (one ZeRO-3 step's collectives:
                                                            manualdp.runners.explain_zero3)
    manualdp explain diloco --devices 4 --sync-every 100   (bytes per step of DDP, local SGD and DiLoCo)

Device 0 starts with the values `a`, device 1 with `b`, and so on; `a0+b0` is chunk 0 of
`a` plus chunk 0 of `b`, and `sum0` is chunk 0 summed over every device (the result).
"""
from __future__ import annotations

import argparse
import math
import string
from collections import Counter

from ..cost import SYNC_METHODS, bytes_per_step, cost, traffic
from ..loads import allreduce_loads
from ..schedule import ALGORITHMS, COLLECTIVES, Schedule, chunk_sizes, get_collective, get_schedule
from ..spmd.auto.tune import DEFAULT_SEGMENT_BYTES, Link, choose, known_link, predict
from ..validate import non_negative_int, one_of, positive_int

__all__ = ["NAMES", "plot", "plot_schedule", "pictures", "DEFAULT_ALPHA", "DEFAULT_BETA", "DEFAULT_GAMMA",
           "DEFAULT_SIZE", "trace", "explain", "explain_auto", "explain_sync", "main"]

# Typical numbers for GPUs in one machine linked by PCIe 4.0 x16 (NCCL measures ~20-25 GB/s):
DEFAULT_ALPHA = 5e-6         # seconds per message: a few microseconds of launch and link latency
DEFAULT_BETA = 1 / 20e9      # seconds per byte sent or received: a 20 GB/s link
DEFAULT_GAMMA = 1 / 200e9    # seconds per byte added: reading two chunks and writing one from ~600 GB/s memory
DEFAULT_SIZE = 1 << 20       # 1 MiB, i.e. 262144 float32 values
STATE_MAX_DEVICES = 8        # wider tables stop being readable
STATE_LIMIT = 32             # --state past this: the tables grow as devices^3 (1000 devices took 5.5 GB)
MAX_DEVICES = 256            # a ring of 256 prints ~130k transfer lines within a second; more helps no reader

# What `explain` takes: an allreduce algorithm, or another collective (run by its first algorithm).
NAMES = {**{a: ("allreduce", a) for a in ALGORITHMS},
         **{c: (c, next(iter(algs))) for c, algs in COLLECTIVES.items() if c != "allreduce"}}


def trace(schedule: Schedule) -> list[list[list[Counter]]]:
    """Run `schedule` on symbols: `states[r][dev][chunk]` counts, per device, the contributions after round r.

    `states[0]` is the start (device d holds only its own values); a correct allreduce ends
    with every device holding every device's contribution to every chunk exactly once.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    n, k = schedule.num_devices, schedule.num_chunks
    state = [[Counter({d: 1}) for _ in range(k)] for d in range(n)]
    states = [state]
    for rnd in schedule.rounds:
        # The transfers of a round are simultaneous: they all read the state before the round.
        new = [[Counter(c) for c in dev] for dev in state]
        for t in rnd:
            if t.reduce:
                new[t.dst][t.chunk] += state[t.src][t.chunk]
            else:
                new[t.dst][t.chunk] = Counter(state[t.src][t.chunk])
        state = new
        states.append(state)
    return states


def _symbol(contributions: Counter, chunk: int, n: int) -> str:
    if contributions == Counter(range(n)):
        return f"sum{chunk}"
    names = string.ascii_lowercase if n <= 26 else [f"d{d}_" for d in range(n)]
    return "+".join(f"{names[d]}{chunk}" for d in sorted(contributions.elements()))


def _state_table(state: list[list[Counter]], indent: str = "    ") -> list[str]:
    n, k = len(state), len(state[0])
    cells = [[_symbol(state[d][c], c, n) for c in range(k)] for d in range(n)]
    width = max(len(f"chunk {k - 1}"), *(len(cell) for row in cells for cell in row))
    lines = [indent + "      " + "  ".join(f"chunk {c}".ljust(width) for c in range(k))]
    for d, row in enumerate(cells):
        lines.append(indent + f"dev{d}".ljust(6) + "  ".join(cell.ljust(width) for cell in row))
    return [line.rstrip() for line in lines]


def _textbook(name: str, n: int, size: int, root: int) -> str:
    log = (n - 1).bit_length()  # ceil(log2 n)
    if name == "naive":
        return (f"textbook: dev0 sends and receives (n-1)*S = {(n - 1) * size} bytes, "
                f"the others S = {size if n > 1 else 0}")
    if name == "ring":
        return f"textbook: every device sends and receives 2(n-1)/n * S = {2 * (n - 1) * size / n:.0f} bytes"
    if name in ("reduce_scatter", "all_gather"):
        return (f"textbook: every device sends and receives (n-1)/n * S = {(n - 1) * size / n:.0f} bytes "
                f"(busbw factor (n-1)/n)")
    if name == "tree":
        return (f"textbook: 2*ceil(log2 n) = {2 * log} rounds; every device but dev0 sends S = {size} up "
                f"and receives S down, plus S per child each way")
    if name in ("reduce", "broadcast"):
        way = "sends S up" if name == "reduce" else "receives S"
        return (f"textbook: ceil(log2 n) = {log} rounds; every device but the root dev{root} {way} once, "
                f"{size} bytes (busbw factor 1)")
    p = 1 << (n.bit_length() - 1)
    if name == "recursive_doubling":
        if p == 1:
            return "textbook: nothing to send"
        line = f"textbook: p = {p}; {_devs(0, p - 1)} send and receive S * log2 p = {(p.bit_length() - 1) * size} bytes"
        if n > p:
            line += f", plus S = {size} for {_devs(0, n - p - 1)}; {_devs(p, n - 1)} send and receive S"
        return line
    line = f"textbook: p = {p}; {_devs(0, p - 1)} send and receive 2(p-1)/p * S = {2 * (p - 1) * size / p:.0f} bytes"
    if n > p:
        line += f", plus S = {size} for {_devs(0, n - p - 1)}; {_devs(p, n - 1)} send and receive S"
    return line


def _title(given: str, collective: str, name: str) -> str:
    return f"{given} allreduce" if collective == "allreduce" else f"{collective} ({name})"


def _devs(first: int, last: int) -> str:
    return f"dev{first}" if first == last else f"dev{first}..dev{last}"


def _rate(seconds_per_byte: float) -> str:
    return f" ({1 / seconds_per_byte / 1e9:.3g} GB/s)" if seconds_per_byte else ""


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def explain(
    algorithm: str,
    num_devices: int,
    size_bytes: int = DEFAULT_SIZE,
    alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
    gamma: float = DEFAULT_GAMMA,
    element_size: int = 4,
    show_state: bool | None = None,
    root: int = 0,
) -> str:
    """The schedule of `algorithm` on `num_devices`, round by round, then bytes per device and estimated time.

    Args:
        size_bytes: the buffer being allreduced (S); cut into chunks of whole elements of `element_size` bytes.
        alpha, beta, gamma: seconds per message, per byte sent or received, per byte added.
        show_state: print what every device holds after each round; default only up to 8 devices.
        root: the device that reduce ends on and broadcast starts from.
    """
    one_of("algorithm", algorithm, NAMES)
    positive_int("num_devices", num_devices)
    positive_int("element_size", element_size)
    non_negative_int("size_bytes", size_bytes)
    if size_bytes % element_size:
        raise ValueError(f"size_bytes must be a non-negative multiple of element_size={element_size}, "
                         f"got {size_bytes!r}")
    if num_devices > MAX_DEVICES:
        raise ValueError(f"num_devices must be at most {MAX_DEVICES} to be explained line by line, got {num_devices}; "
                         "the bytes and time of larger rings follow the formulas printed for smaller ones, "
                         f"and 'explain auto --devices {num_devices}' predicts every allreduce's time")
    if show_state and num_devices > STATE_LIMIT:
        raise ValueError(f"the chunk tables (--state) are drawn for at most {STATE_LIMIT} devices, got {num_devices}")
    collective, name = NAMES[algorithm]
    schedule = get_collective(collective, name, num_devices, root)
    if show_state is None:
        show_state = num_devices <= STATE_MAX_DEVICES
    cost(schedule, size_bytes, alpha, beta, gamma, element_size)  # checks alpha, beta, gamma before printing anything
    n, k = num_devices, schedule.num_chunks
    sizes = [s * element_size for s in chunk_sizes(size_bytes // element_size, k)]

    out = [
        f"{_title(algorithm, collective, name)} on {n} device{'s' * (n != 1)}: {len(schedule.rounds)} rounds, "
        f"{k} chunks of a buffer of S = {size_bytes} bytes",
        "chunk sizes (bytes): " + " ".join(str(s) for s in sizes),
        "dev0 starts with a, dev1 with b, ...; 'a0+b0' is chunk 0 of a plus chunk 0 of b; "
        "'sum0' is chunk 0 of the result.",
    ]
    states = trace(schedule) if show_state else None
    if show_state:
        out += ["", "start:"] + _state_table(states[0])
    for r, (rnd, phase) in enumerate(zip(schedule.rounds, schedule.phases), start=1):
        one = Schedule(algorithm, n, k, (rnd,), (phase,))
        out += ["", f"round {r} ({phase}): {len(rnd)} transfers, "
                    f"estimated {_us(cost(one, size_bytes, alpha, beta, gamma, element_size))}"]
        for t in rnd:
            op = "add" if t.reduce else "copy"
            out.append(f"  dev{t.src} -> dev{t.dst}  chunk {t.chunk}  {op}  ({sizes[t.chunk]} bytes)")
        if show_state:
            out += ["  afterwards:"] + _state_table(states[r])
    if not schedule.rounds:
        out += ["", "one device: nothing to send, it already holds the result."]

    t = traffic(schedule, size_bytes, element_size)
    row = "  {:<8}{:>12}{:>12}{:>12}{:>15}".format
    out += ["", "bytes per device:", row("device", "sent", "received", "reduced", "messages sent")]
    for d in range(n):
        out.append(row(f"dev{d}", t["sent"][d], t["received"][d], t["reduced"][d], t["messages"][d]))
    out.append(row("total", *(sum(t[key]) for key in ("sent", "received", "reduced", "messages"))))
    out.append("  " + _textbook(algorithm, n, size_bytes, root))
    total = cost(schedule, size_bytes, alpha, beta, gamma, element_size)
    out += [
        "",
        f"estimated time: {_us(total)}",
        f"  model: each round lasts as long as its busiest device; alpha = {alpha:.3g} s per message, "
        f"beta = {beta:.3g} s per byte sent or received{_rate(beta)}, "
        f"gamma = {gamma:.3g} s per byte added{_rate(gamma)}",
    ]
    return "\n".join(out)


def explain_auto(num_devices: int, size_bytes: int, link: Link, element_size: int = 4, source: str = "",
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> str:
    """What `algorithm="auto"` picks for an allreduce of `size_bytes` on `num_devices` ranks: every prediction."""
    positive_int("num_devices", num_devices)
    non_negative_int("size_bytes", size_bytes)
    positive_int("segment_bytes", segment_bytes)
    pick = choose(num_devices, size_bytes, link, element_size, segment_bytes)
    rounds = {a: sum(repeats for _, repeats in allreduce_loads(a, num_devices, 0)) for a in ALGORITHMS}
    # Two algorithms can be one schedule (naive and tree at two ranks); past MAX_DEVICES none are,
    # and building them is slow.
    schedules = {a: get_schedule(a, num_devices).rounds if num_devices <= MAX_DEVICES else a for a in ALGORITHMS}
    out = [f"algorithm='auto' for an allreduce of {size_bytes} bytes on {num_devices} ranks",
           f"  link{f' ({source})' if source else ''}: alpha {_us(link.alpha)} per message, beta {link.beta:.3g} s/B"
           f"{_rate(link.beta)}, gamma {link.gamma:.3g} s/B{_rate(link.gamma)}, duplex {link.duplex:.2f}"
           + (f" +- {link.duplex_spread:.2f} (the pick loses least to the fastest anywhere in that range)"
              if link.duplex_spread else "")
           + (f", {link.parallel} ranks at once" if 0 < link.parallel < num_devices else ""),
           "", "  {:<18}{:>8}{:>16}".format("algorithm", "rounds", "predicted")]
    for a in ALGORITHMS:
        same = [b for b in ALGORITHMS if b != a and schedules[b] == schedules[a]]
        note = ("  <- pick" if a == pick else "") + (f"  (same transfers as {', '.join(same)})" if same else "")
        out.append("  {:<18}{:>8}{:>16}".format(a, rounds[a], _us(predict(a, num_devices, size_bytes, link,
                                                                                element_size, segment_bytes))) + note)
    out += ["", f"pick: {pick}; the model is manualdp.cost.cost, each round as long as its busiest rank, "
                "sending and receiving at once charged (1 + duplex) times the larger, additions overlapping "
                f"transfers segment by segment ({segment_bytes} B)"
            + (f", and the busy ranks sharing {link.parallel} cores equally"
               if 0 < link.parallel < num_devices else "")]
    return "\n".join(out)


def explain_sync(num_devices: int, size_bytes: int, sync_every: int, algorithm: str = "ring",
                 alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA, gamma: float = DEFAULT_GAMMA,
                 element_size: int = 4) -> str:
    """Bytes per step and device of DDP, local SGD and DiLoCo (`manualdp.cost.bytes_per_step`), side by side."""
    one_of("algorithm", algorithm, ALGORITHMS)
    positive_int("num_devices", num_devices)
    positive_int("sync_every", sync_every)
    non_negative_int("size_bytes", size_bytes)
    try:  # Python's ints never overflow, but the floats of the table do
        ddp = max_sent(algorithm, num_devices, size_bytes, element_size)
        seconds = (cost(get_schedule(algorithm, num_devices), size_bytes, alpha, beta, gamma, element_size)
                   if num_devices <= MAX_DEVICES else  # the loads without the schedule (loads.py)
                   predict(algorithm, num_devices, size_bytes, Link(alpha, beta, gamma), element_size, None))
        textbook = _textbook(algorithm, num_devices, size_bytes, 0)
        if not all(math.isfinite(x) for x in (float(ddp), seconds)):
            raise OverflowError
    except OverflowError:
        raise ValueError(f"--devices {num_devices} and --size {size_bytes}: the bytes or the time per step overflow "
                         f"a float (about 1.8e308): give fewer devices or a smaller size") from None
    what = {"ddp": "the gradients", "local_sgd": "the parameters", "diloco": "their change (outer gradient)"}
    row = "  {:<11}{:<32}{:>8}{:>18} {:>14}{:>10}".format  # the space: a time of a trillion devices is wide
    out = [f"bytes per training step for a model of S = {size_bytes} bytes on {num_devices} replicas, "
           f"{algorithm} allreduce, H = {sync_every}",
           "", row("method", "allreduce of", "every", "max sent/device", "est. time", "of DDP")]
    for method in SYNC_METHODS:
        h = 1 if method == "ddp" else sync_every
        sent = ddp / h  # DDP's allreduce every step; local SGD's and DiLoCo's every H (cost.bytes_per_step)
        share = "1" if method == "ddp" else f"1/{h}"
        out.append(row(method, what[method], f"{h} step{'s' * (h != 1)}", f"{sent:.1f}", _us(seconds / h),
                       share if ddp else "-"))
    out += ["", f"  each allreduce moves S = {size_bytes} bytes: DDP's every step, local SGD's and DiLoCo's once "
                "every H steps, so 1/H of DDP's bytes per step",
            f"  {textbook}",
            "  the time per step is the model's (manualdp.cost.cost) for one allreduce, over H"]
    return "\n".join(out)


def max_sent(algorithm: str, n: int, nbytes: int, element_size: int = 4) -> int:
    """The most bytes any device sends in one allreduce: `max(cost.traffic(...)["sent"])`, in closed form.

    For any `n` with naive, ring, tree and recursive_doubling; halving_doubling's uneven halves
    are counted on its schedule, up to `MAX_DEVICES`.
    """
    if n == 1:
        return 0
    if algorithm == "naive":  # dev0 sends the sum back to every other device
        return (n - 1) * nbytes
    if algorithm == "ring":  # every chunk twice but the two after its own: the smallest two that neighbour
        base, extra = divmod(nbytes // element_size, n)
        small = base * element_size
        return 2 * nbytes - (2 * small if n - extra >= 2 else 2 * small + element_size)
    if algorithm == "tree":  # dev0 sends the whole buffer once per level of the broadcast
        return (n - 1).bit_length() * nbytes
    if algorithm == "recursive_doubling":  # log2 p swaps, and one more for the partner of an extra device
        p = 1 << (n.bit_length() - 1)
        return (p.bit_length() - 1 + (n > p)) * nbytes
    if n > MAX_DEVICES:
        raise ValueError(f"explain diloco --schedule {algorithm} counts its bytes on its schedule, on at most "
                         f"{MAX_DEVICES} devices, got {n}: naive, ring, tree and recursive_doubling take any number")
    return int(max(bytes_per_step("ddp", nbytes, n, 1, algorithm, element_size)))


def plot(algorithm: str, num_devices: int, path: str, root: int = 0):
    """Draw `algorithm`'s rounds on `num_devices` as a PNG at `path`: one panel per round, one arrow per transfer."""
    one_of("algorithm", algorithm, NAMES)
    positive_int("num_devices", num_devices)
    if num_devices > STATE_LIMIT:
        raise ValueError(f"the rounds are drawn with their chunk tables, for at most {STATE_LIMIT} devices, "
                         f"got {num_devices}")
    collective, name = NAMES[algorithm]
    schedule = get_collective(collective, name, num_devices, root)
    return plot_schedule(schedule, path, f"{_title(algorithm, collective, name)} on {num_devices} devices")


def plot_schedule(schedule: Schedule, path: str, title: str):
    """Draw any `schedule` (one a student wrote, too) as a PNG at `path`: one panel per round."""
    from ..support.plot_rounds import plot_rounds

    cells, shares = pictures(schedule)
    return plot_rounds(path, title, [list(r) for r in schedule.rounds], list(schedule.phases), cells, shares)


def pictures(schedule: Schedule) -> tuple[list, list]:
    """What a drawing shows after each round: `cells[r][dev][chunk]` ('a0+b0', 'sum0'), and `shares`, the
    fraction of the devices whose values a cell holds (its colour)."""
    n, k = schedule.num_devices, schedule.num_chunks
    states = trace(schedule)
    cells = [[[_symbol(s[d][c], c, n) for c in range(k)] for d in range(n)] for s in states]
    shares = [[[len(set(s[d][c].elements())) / n for c in range(k)] for d in range(n)] for s in states]
    return cells, shares


def main(argv: list[str] | None = None) -> int:
    """`manualdp explain ALGORITHM --devices N [--size BYTES]`: print the schedule step by step."""
    parser = argparse.ArgumentParser(
        prog="manualdp explain",
        description="Print a collective's schedule round by round, the bytes each device moves, and an estimated time.",
    )
    parser.add_argument("algorithm", choices=[*sorted(NAMES), "auto", "zero3", "local_sgd", "diloco"],
                        help="an allreduce algorithm, another collective, auto: what the engine's cost model picks, "
                        "zero3: the collectives of one ZeRO-3 step, or local_sgd and diloco: their bytes per step "
                        "against DDP's")
    parser.add_argument("--sync-every", type=_positive_int, default=None, metavar="H",
                        help="local_sgd and diloco: steps between two allreduces (default 100)")
    parser.add_argument("--schedule", choices=ALGORITHMS, default="ring",
                        help="local_sgd and diloco: the allreduce's algorithm (default ring, the replicas')")
    parser.add_argument("--root", type=int, default=0, help="root device of reduce and broadcast (default 0)")
    parser.add_argument("--devices", type=int, default=4, help="number of devices (default 4)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help=f"buffer size in bytes (default {DEFAULT_SIZE})")
    parser.add_argument("--element-size", type=int, default=4,
                        help="bytes per element; chunks hold whole elements (default 4)")
    parser.add_argument("--alpha", type=float, help=f"seconds per message (default {DEFAULT_ALPHA:g}; for auto: "
                        "this host's measured constants if a run has cached them)")
    parser.add_argument("--beta", type=float, help=f"seconds per byte moved (default {DEFAULT_BETA:g}, 20 GB/s)")
    parser.add_argument("--gamma", type=float, help=f"seconds per byte added (default {DEFAULT_GAMMA:g})")
    parser.add_argument("--duplex", type=float, help="auto only: extra cost of sending and receiving at once, "
                        "0 (full duplex, default), 1 (the directions take turns), "
                        "up to 2 (they also get in each other's way)")
    parser.add_argument("--segment-bytes", type=int, help=f"auto only: the executor's message segments "
                        f"(default {DEFAULT_SEGMENT_BYTES})")
    parser.add_argument("--parallel", type=int, help="auto only: ranks that can work at once, 0 for all (default: "
                        "this host's cores for cached constants, else 0)")
    parser.add_argument("--plot", metavar="PATH", help="also draw the rounds as a PNG")
    state = parser.add_mutually_exclusive_group()
    state.add_argument("--state", dest="show_state", action="store_true", default=None,
                       help="always print the chunk tables")
    state.add_argument("--no-state", dest="show_state", action="store_false", help="never print the chunk tables")
    args = parser.parse_args(argv)
    if args.plot is not None:  # before any work, as `manualdp train --plot`: one line, nothing half-written
        problem = _plot_problem(args.plot, args.algorithm)
        if problem:
            parser.error(problem)
    if args.algorithm == "auto":
        return _main_auto(parser, args)
    if args.algorithm == "zero3":
        return _main_zero3(parser, args)
    if args.algorithm in ("local_sgd", "diloco"):
        return _main_sync(parser, args)
    if args.sync_every is not None or args.schedule != "ring":
        parser.error("--sync-every and --schedule are for explain local_sgd and explain diloco")
    if args.segment_bytes is not None:
        parser.error("--segment-bytes is for explain auto "
                     "(the schedules print per round, segments only matter to auto's pick)")
    if args.parallel is not None:
        parser.error("--parallel is for explain auto (it only matters to auto's pick)")
    if args.duplex is not None:
        parser.error("--duplex is for explain auto (the schedules print per round, duplex only matters to auto's pick)")
    args.alpha = DEFAULT_ALPHA if args.alpha is None else args.alpha
    args.beta = DEFAULT_BETA if args.beta is None else args.beta
    args.gamma = DEFAULT_GAMMA if args.gamma is None else args.gamma
    try:
        text = explain(
            args.algorithm, args.devices, args.size, args.alpha, args.beta, args.gamma,
            element_size=args.element_size, show_state=args.show_state, root=args.root,
        )
        if args.plot is not None:
            plot(args.algorithm, args.devices, args.plot, args.root)
    except ValueError as e:
        parser.error(str(e))
    print(text)
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def _plot_problem(path: str, algorithm: str) -> str | None:
    """Why `--plot PATH` cannot be written, in one line (`manualdp.support.files.output_problem`); None if it can."""
    from ..support.files import output_problem

    if algorithm == "auto":
        return "--plot is for the schedules and zero3: explain auto prints its pick, it draws nothing"
    problem = output_problem(path, 4 << 20) or (None if path.lower().endswith(".png") else "it must end in .png")
    return f"--plot {path!r}: {problem}" if problem else None


def _main_zero3(parser, args) -> int:
    from .explain_zero3 import explain_zero3, plot_zero3

    given = [f"--{k.replace('_', '-')}" for k in ("alpha", "beta", "gamma", "duplex", "segment_bytes", "parallel")
             if getattr(args, k) is not None]
    try:
        if given:
            raise ValueError(f"{', '.join(given)}: explain zero3 runs one step of a small MLP, "
                             f"it takes --devices and --plot")
        text = explain_zero3(args.devices)
        if args.plot is not None:
            plot_zero3(args.devices, args.plot)
    except ValueError as e:
        parser.error(str(e))
    print(text)
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return int(text)


def _main_sync(parser, args) -> int:
    given = [f"--{k.replace('_', '-')}" for k in ("duplex", "segment_bytes", "parallel", "plot")
             if getattr(args, k) is not None]
    try:
        if given:
            raise ValueError(f"{', '.join(given)}: explain {args.algorithm} prints the bytes per step of DDP, "
                             "local SGD and DiLoCo; it takes --devices, --size, --sync-every, --schedule, "
                             "--alpha, --beta and --gamma")
        text = explain_sync(args.devices, args.size, 100 if args.sync_every is None else args.sync_every,
                            args.schedule, DEFAULT_ALPHA if args.alpha is None else args.alpha,
                            DEFAULT_BETA if args.beta is None else args.beta,
                            DEFAULT_GAMMA if args.gamma is None else args.gamma, args.element_size)
    except ValueError as e:
        parser.error(str(e))
    print(text)
    return 0


def _main_auto(parser, args) -> int:
    given = [v is not None for v in (args.alpha, args.beta, args.gamma)]
    try:
        if any(given):
            if not all(given):
                raise ValueError("give --alpha, --beta and --gamma together, or none (this host's measured constants)")
            link, source = Link(args.alpha, args.beta, args.gamma, args.duplex or 0.0, args.parallel or 0), "given"
        else:
            link, source = known_link("gloo", args.devices)
            if link is None:
                link = Link(DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_GAMMA, args.duplex or 0.0, args.parallel or 0)
                source = f"defaults: nothing measured yet at {source}"
            else:
                link = Link(link.alpha, link.beta, link.gamma, link.duplex if args.duplex is None else args.duplex,
                            link.parallel if args.parallel is None else args.parallel,
                            link.duplex_spread if args.duplex is None else 0.0)
        text = explain_auto(args.devices, args.size, link, args.element_size, source,
                            DEFAULT_SEGMENT_BYTES if args.segment_bytes is None else args.segment_bytes)
    except ValueError as e:
        parser.error(str(e))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
