"""Command line: `manualdp train | explain | check | coordinator`.

The benchmarks are scripts of the repository: `python bench/NAME.py`.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

from ..schedule import ALGORITHMS
from ..validate import MAX_LR, MAX_SEED, MAX_TIMEOUT

__all__ = ["main", "build_parser"]

DEFAULT_LR = {"lenet": 0.2, "mlp": 0.2, "resnet18": 0.05}
DEFAULT_EPOCHS = {"synthetic": 4, "fashion-mnist": 10}


def _load(args):
    """What `train` and a fault-tolerant replica both start from: (lr, train_iter, test_iter, epochs, model), torch
    seeded with --seed; None, after one line on stderr, where the data set cannot be loaded."""
    import torch

    from ..support import data, models

    lr = args.lr if args.lr is not None else DEFAULT_LR[args.model]
    torch.manual_seed(args.seed)
    try:
        train_iter, test_iter = data.load_data(args.dataset, args.batch_size, data_dir=args.data_dir,
                                               seed=args.seed, download=args.download,
                                               num_train=args.num_train, num_test=args.num_test)
    except (OSError, RuntimeError, ValueError) as e:
        hint = " (or pass --download)" if isinstance(e, FileNotFoundError) and not args.download else ""
        _error(f"{e}{hint}")
        return None
    epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS[args.dataset]
    return lr, train_iter, test_iter, epochs, models.get_model(args.model)


def _error(message: str) -> None:
    """One line on stderr, in one write: ranks under torchrun share the stream, and `print`'s
    separate newline let two ranks' lines run into one."""
    sys.stderr.write(f"manualdp train: error: {message}\n")
    sys.stderr.flush()


def positive(kind, at_most: float | None = None, why: str = ""):
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if at_most is not None and not value <= at_most:  # also refuses inf and nan
            raise argparse.ArgumentTypeError(f"must be <= {at_most:.3g}{why}, got {text}")
        return value
    return parse


def _non_negative_int(at_most: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be <= {at_most}, got {text}")
        return value
    return parse


def _address(text: str) -> tuple[str, int]:
    from .ft_train import parse_address
    try:
        host, port = parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return _host(host), port


def _host(text: str) -> str:
    """`text` if it is an address, or a name that resolves: checked before anything starts."""
    import socket

    from ..spmd.ft.coordinator import check_host
    try:
        check_host(text)
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except (OSError, UnicodeError) as e:
        raise argparse.ArgumentTypeError(f"host {text!r} does not resolve to an address: {e}") from None
    return text


def _replica_id(text: str) -> str:
    from .ft_train import check_replica_id
    try:
        return check_replica_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _min_replicas(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be from 1 to 4096, got {text}")
    return value


def _momentum(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a float, got {text!r}") from None
    if not 0 <= value < 1:  # also refuses nan; 1 never forgets, and the steps grow without bound
        raise argparse.ArgumentTypeError(f"must be from 0 to below 1, got {text}")
    return value


def _port(allow_zero: bool):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
        low = 0 if allow_zero else 1
        if not low <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be from {low} to 65535, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The `manualdp` argument parser; `explain` and `check` parse their own arguments."""
    parser = argparse.ArgumentParser(prog="manualdp", description="Data-parallel training by hand, on PyTorch.",
                                     epilog="The benchmarks are scripts in a checkout of the repository: "
                                            "python bench/NAME.py")
    sub = parser.add_subparsers(dest="command", metavar="{train,explain,check,coordinator}")
    sub.required = True
    _fault_tolerance_options(_train_parser(sub))
    _coordinator_parser(sub)
    e = sub.add_parser("explain", help="print an allreduce schedule step by step", add_help=False)
    e.add_argument("rest", nargs=argparse.REMAINDER)
    c = sub.add_parser("check", help="grade your own split_batch, allreduce, schedule or DDP (the book's exercises)",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _train_parser(sub) -> argparse.ArgumentParser:
    """`manualdp train`'s options, but for fault tolerance (`_fault_tolerance_options`)."""
    t = sub.add_parser("train", help="train a model on several (simulated) devices",
                       description="Train with single-controller data parallelism; "
                                   "under torchrun, one process per device.")
    t.add_argument("--devices", type=positive(int, 4096), default=None,
                   help="number of devices (default: 2; under torchrun, the ranks are the devices: leave it out)")
    t.add_argument("--cpu", action="store_true", help="simulate the devices on the CPU even when GPUs exist")
    t.add_argument("--model", choices=sorted(DEFAULT_LR), default="lenet", help="network (default: lenet)")
    t.add_argument("--dataset", choices=["synthetic", "fashion-mnist"], default="synthetic",
                   help="data set (default: synthetic, needs no download)")
    t.add_argument("--data-dir", default=None,
                   help="where Fashion-MNIST lives (default: ~/.cache/manualdp/fashion-mnist)")
    t.add_argument("--download", action="store_true", help="download Fashion-MNIST if it is missing")
    t.add_argument("--num-train", type=positive(int), default=None, metavar="N",
                   help="use the first N training examples (default: all; synthetic has 10000)")
    t.add_argument("--num-test", type=positive(int), default=None, metavar="N",
                   help="use the first N test examples (default: all; synthetic has 2000)")
    t.add_argument("--epochs", type=positive(int), default=None, help="epochs (default: data set's)")
    t.add_argument("--batch-size", type=positive(int), default=256, help="global batch size (default: 256)")
    t.add_argument("--lr", type=positive(float, MAX_LR, " (float32's largest)"), default=None,
                   help="learning rate (default: per model)")
    t.add_argument("--seed", type=_non_negative_int(MAX_SEED), default=0,
                   help=f"random seed, 0..{MAX_SEED} (default: 0)")
    t.add_argument("--algorithm", choices=[*ALGORITHMS, "auto"], default=None,
                   help="allreduce algorithm (default: naive in one process; under torchrun, auto: the cost "
                        "model's pick for each bucket, with constants measured on this transport)")
    t.add_argument("--bucket-mb", type=positive(float), default=None,
                   help="fuse gradients into buckets of this many MiB "
                        "(default: one allreduce per parameter; 25 under torchrun)")
    t.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="optimizer (default: sgd)")
    t.add_argument("--zero", type=int, choices=[1, 2, 3], default=None,
                   help="ZeRO stage: 1 shards the optimizer state over the devices, 2 also the gradients, "
                        "3 also the parameters (its all-gathers and reduce-scatters run by ring)")
    t.add_argument("--trace", metavar="PATH", help="write a timeline of every step as Chrome trace JSON (Perfetto)")
    t.add_argument("--plot-trace", metavar="PATH", help="draw the timeline as a PNG (needs --trace)")
    t.add_argument("--json", metavar="PATH", help="write the training history as JSON")
    t.add_argument("--plot", metavar="PATH", help="plot the training curves to a PNG")
    t.add_argument("--nonfinite", choices=["raise", "skip", "off"], default=None,
                   help="on a NaN/Inf gradient after the allreduce: stop (default), skip the step, or do not check "
                        "(default off with --zero 2 or 3 under torchrun, where each rank holds only its shard; with "
                        "--fault-tolerant, unless off, a non-finite or far out of line contribution discards the step "
                        "and three in a row remove its replica)")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save a checkpoint here after every epoch (with --fault-tolerant: each committed step, "
                        "in DIR/ID/, and resume from it)")
    t.add_argument("--checkpoint-every", type=positive(int), metavar="STEPS",
                   help="also save a checkpoint every STEPS steps (needs --checkpoint-dir)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    t.add_argument("--timeout", type=positive(float, MAX_TIMEOUT, " (a year)"), default=None, metavar="SECONDS",
                   help="under torchrun: give up on a silent peer after SECONDS (default: 300)")
    t.add_argument("--threads", type=positive(int), default=None, metavar="N",
                   help="torch threads per process on the CPU (default: 1 for simulated devices, which take "
                        "turns on small shards; under torchrun, the cores shared among this machine's ranks)")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return t


def _fault_tolerance_options(t: argparse.ArgumentParser) -> None:
    """`manualdp train`'s group of options for a fault-tolerant run."""
    f = t.add_argument_group("fault tolerance", "each replica one process and one device, started on its own; "
                                                "they meet at a `manualdp coordinator`")
    f.add_argument("--fault-tolerant", type=_address, metavar="HOST:PORT",
                   help="train as one replica of a run that survives replicas that die or hang, meeting the others "
                        "at the coordinator at HOST:PORT; a replica started again with the same command rejoins")
    f.add_argument("--replica-id", type=_replica_id, metavar="NAME",
                   help="this replica's name, unique among the live ones (with --fault-tolerant)")
    f.add_argument("--min-replicas", type=_min_replicas, default=None, metavar="N",
                   help="train only in a quorum of at least N replicas; fewer, and wait (default: more than half of "
                        "the last quorum's replicas that did not leave, so that a run cut in two never trains twice)")
    f.add_argument("--async-quorum", action="store_true", default=None,
                   help="ask for each step's quorum in a thread while forward and backward run, as torchft's "
                        "async quorum does (a replica of one process; default: ask before each step)")
    f.add_argument("--token-file", metavar="PATH",
                   help="a file holding the run's shared secret (one line, at least 16 characters; default: "
                        "$MANUALDP_FT_TOKEN), the coordinator's: every key and value in its store is signed with it")
    every = f.add_mutually_exclusive_group()
    every.add_argument("--local-sgd", type=positive(int, 10**6), default=None, metavar="H",
                       help="local SGD: H steps alone, then average the parameters (torchft's LocalSGD, sync_every=H; "
                            "default: average the gradients every step, as DDP)")
    every.add_argument("--diloco", type=positive(int, 10**6), default=None, metavar="H",
                       help="DiLoCo: H steps alone, then an outer Nesterov SGD step on the average change of the "
                            "parameters (torchft's DiLoCo, sync_every=H)")
    f.add_argument("--outer-lr", type=positive(float, MAX_LR, " (float32's largest)"), default=None,
                   help="DiLoCo's outer learning rate (default: 0.7, the paper's)")
    f.add_argument("--outer-momentum", type=_momentum, default=None,
                   help="DiLoCo's outer Nesterov momentum, from 0 to below 1 (default: 0.9, the paper's)")


def _coordinator_parser(sub) -> None:
    """`manualdp coordinator`: the store fault-tolerant replicas meet in."""
    co = sub.add_parser("coordinator", help="host the store fault-tolerant replicas meet in, until stopped",
                        description="Host the membership store of `manualdp train --fault-tolerant` until Ctrl-C "
                                    "or SIGTERM. Its server (torch's TCPStore) accepts any number of connections, "
                                    "from any address that reaches the port: it has no limit to set, so a process "
                                    "that holds thousands keeps replicas from joining; keep the port on a trusted "
                                    "network.")
    co.add_argument("--port", type=_port(allow_zero=True), required=True,
                    help="TCP port to listen on (0: a free one, printed)")
    co.add_argument("--host", type=_host, default="127.0.0.1",
                    help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                         "with a warning)")
    co.add_argument("--token-file", metavar="PATH",
                    help="a file holding the run's shared secret (one line, at least 16 characters; default: "
                         "$MANUALDP_FT_TOKEN): every key and value is signed with it, and a process without it cannot "
                         "forge a decision, vote, heartbeat or state. It encrypts nothing, and cannot stop a process "
                         "that reaches the port from deleting keys. Without it the store is open to anyone who "
                         "reaches the port")


def main(argv: list[str] | None = None) -> int:
    """Run `manualdp ARGV`; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # explain hands its arguments to the module that owns it.
    if argv and argv[0] == "explain":
        from .explain import main as explain_main
        return explain_main(argv[1:]) or 0
    if argv and argv[0] == "check":
        from .grader.check import main as check_main
        return check_main(argv[1:])
    if argv and argv[0] == "bench":  # the benchmarks are scripts of the repository, not part of the library
        build_parser().error(f"{' '.join(argv[:2])!r}: the benchmarks are not installed with the package; "
                             f"from a checkout of the repository, run python bench/NAME.py")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "coordinator":
        return run_coordinator(args.port, args.host, args.token_file)
    problem = check_train_args(args)
    if problem:
        parser.exit(2, f"manualdp train: error: {problem}\n")
    if args.fault_tolerant:
        return run_replica(args)
    try:
        return run_train(args)
    except KeyboardInterrupt as e:  # Ctrl-C: where it stopped and how to go on, not a traceback
        return _interrupted(getattr(e, "step", None), args.checkpoint_dir)


def run_coordinator(port: int, host: str = "127.0.0.1", token_file: str | None = None) -> int:
    """`manualdp coordinator`: host the store until SIGINT or SIGTERM; 0 when stopped so, 1 if it cannot listen."""
    import signal

    from ..spmd.ft import Coordinator
    from ..spmd.ft.coordinator import load_token
    from .ft_train import replica_command

    try:
        coordinator = Coordinator(port, host, load_token(token_file), log_warnings=False)
    except ValueError as e:  # the secret cannot be read, or is too short
        sys.stderr.write(f"manualdp coordinator: error: {_one_line(e)}\n")
        return 2
    except (RuntimeError, OSError) as e:  # the port is taken, or not ours to take
        sys.stderr.write(f"manualdp coordinator: error: cannot listen on {host}:{port}: {_one_line(e)}\n")
        return 1

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"coordinator listening on {host}:{coordinator.port}; replicas: "
          f"{replica_command(host, coordinator.port, token_file)}", flush=True)
    for warning in coordinator.warnings:  # after the first line, which scripts read for the port
        sys.stderr.write(f"manualdp coordinator: warning: {warning}\n")
    coordinator.serve()  # returns on KeyboardInterrupt, and closes the store
    print("coordinator stopped", flush=True)
    return 0


def check_train_args(args) -> str | None:
    """What is wrong with `manualdp train`'s arguments, found before any training; None if nothing."""
    from ..support.checkpoint import check_checkpoint_dir

    if (args.checkpoint_every or args.resume) and args.checkpoint_dir is None:
        return "--checkpoint-every and --resume need --checkpoint-dir"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    problem = _fault_tolerant_problem(args, world_size)
    if problem:
        return problem
    if world_size > 1 and args.devices is not None and args.devices != world_size:
        return (f"--devices {args.devices} under torchrun, which started {world_size} ranks: every rank is one device; "
                "leave --devices out, or start torchrun with that many processes")
    if args.devices is None:
        args.devices = 2
    if args.algorithm == "auto" and world_size == 1:
        return "--algorithm auto times the transport between processes: use it under torchrun"
    if args.zero == 2 and world_size > 1 and args.nonfinite in ("raise", "skip"):
        return (f"--nonfinite {args.nonfinite} needs the averaged gradients on every rank, and with --zero 2 each rank "
                "holds only its shard: pass --nonfinite off, or --zero 1")
    if args.zero == 3 and args.algorithm not in (None, "ring"):
        return (f"--algorithm {args.algorithm} with --zero 3: ZeRO-3 has no allreduce, and its all-gathers and "
                "reduce-scatters run by ring only: leave --algorithm out, or pass ring")
    if args.zero == 3 and world_size == 1 and args.trace:
        return "--zero 3 in one process has no timeline yet: leave out --trace (under torchrun it has one)"
    if args.plot and not args.plot.lower().endswith(".png"):
        return f"--plot: {args.plot!r} must end in .png"
    if args.plot_trace and (not args.trace or not args.plot_trace.lower().endswith(".png")):
        return f"--plot-trace: {args.plot_trace!r} must end in .png and needs --trace"
    problem = _shared_output(args) or _output_problems(args)
    if problem:
        return problem
    ranks = world_size if world_size > 1 else args.devices
    if args.batch_size < ranks:
        return f"--batch-size {args.batch_size} is smaller than the {ranks} devices: every device needs an example"
    problem = _memory_problem(args)
    if problem:
        return problem
    if args.checkpoint_dir:
        try:
            check_checkpoint_dir(args.checkpoint_dir, args.resume or bool(args.fault_tolerant))
        except ValueError as e:
            return f"--checkpoint-dir: {e}"
        if args.fault_tolerant and glob.glob(os.path.join(glob.escape(args.checkpoint_dir), "ckpt-*.pt")):
            return (f"--checkpoint-dir: {args.checkpoint_dir!r} holds checkpoints itself (a replica's folder, or a "
                    f"run without --fault-tolerant): give the run's folder, the same for every replica (each keeps "
                    f"its own ID/ below it, and a replica started again goes on from there by itself)")
    return None


def _fault_tolerant_problem(args, world_size: int) -> str | None:
    """What does not go with `--fault-tolerant` (or needs it), in one line; None if nothing."""
    if not args.fault_tolerant:
        given = [o for o, v in (("--replica-id", args.replica_id), ("--min-replicas", args.min_replicas),
                                ("--token-file", args.token_file), ("--async-quorum", args.async_quorum),
                                ("--local-sgd", args.local_sgd), ("--diloco", args.diloco),
                                ("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum))
                 if v is not None]
        return f"{' and '.join(given)} need --fault-tolerant HOST:PORT" if given else None
    for option, value in (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum)):
        if value is not None and args.diloco is None:
            return f"{option} {value:g} needs --diloco H: only DiLoCo has an outer optimizer"
    if args.replica_id is None:
        return "--fault-tolerant needs --replica-id NAME, unique among the replicas"
    if world_size > 1:  # a replica group: torchrun's ranks (ft_group_train.py)
        from .ft_group_train import group_problem
        problem = group_problem(args)
        if problem:
            return problem
    refused = [("--zero", args.zero is not None and world_size == 1,
                "a replica of one process holds the whole model; --zero 3 shards it inside a replica group "
                "of several ranks (torchrun --nproc-per-node 2 or more)"),
               ("--devices", args.devices not in (None, 1), "each replica is one process and one device"),
               ("--algorithm auto", args.algorithm == "auto", "each new quorum would measure the link again; "
                                                              "pass naive, ring, tree, ..."),
               ("--bucket-mb", args.bucket_mb is not None, "the gradients go in one flat buffer per dtype"),
               ("--checkpoint-every", args.checkpoint_every is not None, "every committed step is kept"),
               ("--resume", args.resume, "a replica resumes from --checkpoint-dir by itself"),
               ("--trace", args.trace is not None, "no timeline yet"),
               ("--async-quorum", args.async_quorum and world_size > 1, "a replica group asks before each step")]
    for option, bad, why in refused:
        if bad:
            return f"{option} with --fault-tolerant: {why}"
    return None


# Bytes a checkpoint of each model takes, about: parameters, momentum-free SGD state, RNG (x2 for the payload copy).
_CHECKPOINT_BYTES = {"lenet": 1 << 20, "mlp": 4 << 20, "resnet18": 100 << 20}


def _shared_output(args) -> str | None:
    """Two outputs naming one file (also through a symlink or a relative path): one would overwrite the other."""
    seen: dict[str, tuple[str, str]] = {}
    for option, path in (("--json", args.json), ("--plot", args.plot), ("--trace", args.trace),
                         ("--plot-trace", args.plot_trace), ("--checkpoint-dir", args.checkpoint_dir)):
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen and real != os.devnull:  # /dev/null takes any number of outputs
            first, first_path = seen[real]
            return f"{first} {first_path!r} and {option} {path!r} name the same file: give each output its own path"
        seen[real] = (option, path)
    return None


def _output_problems(args) -> str | None:
    """The first output (--json, --plot, --trace, --plot-trace, --checkpoint-dir) that cannot be written,
    as one line."""
    from ..support.files import output_problem

    outputs = [("--json", args.json, 1 << 20, False), ("--plot", args.plot, 4 << 20, False),
               ("--trace", args.trace, 64 << 20, False), ("--plot-trace", args.plot_trace, 4 << 20, False),
               ("--checkpoint-dir", args.checkpoint_dir, 3 * _CHECKPOINT_BYTES[args.model], True)]
    for option, path, need, folder in outputs:
        if path is None:
            continue
        problem = output_problem(path, need, folder=folder)
        if problem:
            return f"{option} {path!r}: {problem}"
    return None


def _memory_problem(args) -> str | None:
    """Refuse data sets that cannot fit in memory before making them (a synthetic example is 28x28 float32)."""
    n = (args.num_train or 0) + (args.num_test or 0)
    need = n * 28 * 28 * 4 * 3  # the images, the generator's temporaries and the float copy
    available = _available_memory()
    if available is not None and need > available:
        return (f"--num-train/--num-test {n} examples need about {need / 2**30:.1f} GiB, "
                f"only {available / 2**30:.1f} GiB of memory is available")
    return None


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _run_spmd(args, net, train_iter, test_iter, epochs, lr, nonfinite, progress):
    """This rank's part of `manualdp train` under torchrun: rank 0's History, or an exit status."""
    import torch.distributed as dist

    from ..guard import NonFiniteGradientError
    from ..spmd import PeerError, init_from_env, shard_loader
    from ..spmd.transport.postmortem import explain_peer_error
    from .loop import train_spmd

    try:
        init_from_env(timeout=args.timeout)  # default: 300 s, not gloo's 30 minutes
    except (RuntimeError, ValueError) as e:
        _error(f"could not join the other ranks: {e}")
        return 1
    # Each rank reads and collates only its shard of every global batch (same order on every rank).
    train_iter = shard_loader(train_iter, dist.get_rank(), dist.get_world_size())
    try:
        algorithm = args.algorithm or ("ring" if args.zero == 3 else "auto")  # ZeRO-3 runs ring: say so
        history = train_spmd(net, train_iter, test_iter, epochs, lr, algorithm=algorithm,
                             bucket_cap_mb=args.bucket_mb or 25.0, nonfinite=nonfinite,
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                             resume=args.resume, config=run_config(args), progress=progress,
                             **_optimizer_args(args))
    except OSError as e:
        _error(f"rank {dist.get_rank()}: {_one_line(e)}")
        _save_partial(args, getattr(e, "history", None))
        return 1
    except (PeerError, NonFiniteGradientError, ValueError) as e:
        # No destroy_process_group here: a dead peer could make it wait; exiting closes everything.
        # A lost peer: leave our line in the store, and add the one it left, if it stopped before us.
        _error(f"{explain_peer_error(e) if isinstance(e, PeerError) else e}")
        return 1
    except RuntimeError as e:  # anything else torch.distributed raised: one line, with the rank
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _error(f"rank {dist.get_rank()}: {first}")
        return 1
    dist.destroy_process_group()
    return history if history is not None else 0


def cpu_threads(requested: int | None, world_size: int) -> int:
    """Threads for torch on the CPU: what was asked, else 1 per simulated device run, else the cores per rank.

    Simulated devices run their small shards one after another; on such work extra threads
    mostly wait for each other (on 2 busy cores, 4x slower than one thread).
    """
    if requested is not None:
        return requested
    if world_size > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return max(1, (os.cpu_count() or 1) // max(local, 1))
    return 1


OPTIMIZERS = {"sgd": None, "adam": "Adam", "adamw": "AdamW"}  # None: train's default, SGD


def _optimizer_args(args) -> dict:
    import torch

    name = OPTIMIZERS[args.optimizer]
    return {"optimizer": getattr(torch.optim, name) if name else None, "zero": args.zero, "trace": args.trace}


def _report_trace(args, history) -> None:
    """Print the timeline's summary and draw it, when --trace was given."""
    if not args.trace:
        return
    s = history.config["timeline"]
    print(f"timeline: {args.trace}; communication {s['comm_ms_per_step']:.2f} ms/step, "
          f"{100 * s['overlap_fraction']:.0f}% hidden behind backward, "
          f"{s['exposed_comm_ms_per_step']:.2f} ms/step exposed")
    if args.plot_trace:
        from ..support.trace import plot_trace

        plot_trace(history.trace, args.plot_trace)  # the events in memory: --trace may be a FIFO or /dev/stdout
        print(f"wrote {args.plot_trace}")


def run_train(args) -> int:
    """`manualdp train`: one process driving simulated or real devices, or one rank under torchrun."""
    import torch

    from ..devices import cpu_devices, try_all_gpus
    from ..guard import NonFiniteGradientError
    from .loop import train

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(cpu_threads(args.threads, world_size))
    loaded = _load(args)
    if loaded is None:
        return 2
    lr, train_iter, test_iter, epochs, net = loaded
    progress = not args.no_progress
    default = "raise" if world_size == 1 else "auto"
    nonfinite = {"off": None, None: default}.get(args.nonfinite, args.nonfinite)

    if world_size > 1:
        history = _run_spmd(args, net, train_iter, test_iter, epochs, lr, nonfinite, progress)
        if isinstance(history, int):  # an exit status: it failed, or this is a rank other than 0 (they print nothing)
            return history
        where = f"{world_size} processes"
    else:
        gpus = [] if args.cpu else [d for d in try_all_gpus() if d.type == "cuda"]
        devices = gpus[:args.devices] if len(gpus) >= args.devices else cpu_devices(args.devices)
        if gpus and devices[0].type == "cpu":
            print(f"note: {len(gpus)} GPU(s) for {args.devices} devices; simulating them on the CPU instead")
        try:
            history = train(net, train_iter, test_iter, devices, epochs, lr, algorithm=args.algorithm,
                            bucket_cap_mb=args.bucket_mb, nonfinite=nonfinite, checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every, resume=args.resume, config=run_config(args),
                            progress=progress, **_optimizer_args(args))
        except NonFiniteGradientError as e:
            _error(f"{e} (--nonfinite skip skips such steps)")
            return 1
        except OSError as e:  # a write error during the run: one line, and the epochs done are kept
            _error(f"{_one_line(e)}")
            _save_partial(args, getattr(e, "history", None))
            return 1
        except ValueError as e:  # found only at resume: a changed configuration, a folder in use
            _error(f"{e}")
            return 1
        kind = "simulated CPU devices" if devices[0].type == "cpu" else "GPUs"
        where = f"{len(devices)} {kind}"
    _report_trace(args, history)
    seconds = sum(history.epoch_seconds) / len(history.epoch_seconds)
    print(f"loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
          f"test acc {history.test_acc[-1]:.3f}")
    print(f"test acc: {history.test_acc[-1]:.2f}, {seconds:.1f} sec/epoch on {where}")
    return _write_outputs(args, history)


def _interrupted(step: int | None, checkpoint_dir: str | None) -> int:
    """Say where Ctrl-C stopped training and, when a checkpoint was written, how to continue; 130, as shells do."""
    from ..support.checkpoint import load_latest

    line = "interrupted" + (f" at step {step}" if step is not None else " before the first step")
    latest = load_latest(checkpoint_dir) if checkpoint_dir and os.path.isdir(checkpoint_dir) else None
    if latest is not None:
        line += (f"; `--resume` (with --checkpoint-dir {checkpoint_dir}) continues from step {latest['global_step']}, "
                 f"{os.path.basename(latest['path'])}")
    sys.stderr.write(f"\nmanualdp train: {line}\n")
    return 130


def run_replica(args) -> int:
    """`manualdp train --fault-tolerant`: one replica, training through the failures of the others."""
    from .cpp_log import store_logs_dropped

    with store_logs_dropped():  # a lost coordinator is one line, not thirty of C++ logs around it
        return _run_replica(args)


def _run_replica(args) -> int:
    import torch

    from ..spmd.ft import Manager
    from ..spmd.ft.durable import RunFinished
    from ..spmd.ft.manager import CoordinatorLost
    from ..spmd.ft.admission import Misfit
    from ..spmd.ft.coordinator import load_token
    from .ft_train import train_replica

    try:
        token = load_token(args.token_file)
    except ValueError as e:  # before anything starts
        _error(_one_line(e))
        return 2
    group_size = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: a replica group of its ranks
    torch.set_num_threads(cpu_threads(args.threads, group_size))
    loaded = _load(args)
    if loaded is None:
        return 2
    lr, train_iter, test_iter, epochs, net = loaded
    host, port = args.fault_tolerant
    timeout = args.timeout if args.timeout is not None else 60.0
    if group_size > 1:
        return _run_group_rank(args, loaded, token, timeout)
    try:
        manager = Manager(args.replica_id, host, port, checkpoint_dir=args.checkpoint_dir,
                          min_replicas=args.min_replicas, timeout=timeout,
                          quorum_timeout=min(10.0, timeout), algorithm=args.algorithm or "ring", token=token,
                          async_quorum=bool(args.async_quorum))
    except ConnectionError as e:  # nobody answers there within the timeout: connect says so in one line
        _error(f"replica {args.replica_id!r}: {_one_line(e)}")
        return 1
    except (RuntimeError, OSError) as e:
        _error(f"replica {args.replica_id!r}: cannot reach the coordinator at {host}:{port}: {_one_line(e)}")
        return 1
    except ValueError as e:  # another live replica goes by this id (a Misfit), its folder is in use: refused
        _error(_one_line(e))
        return 2
    if args.nonfinite == "off":  # else every contribution is judged before the average (spmd/ft/guard.py)
        manager.guard = None
    try:
        sync = "local_sgd" if args.local_sgd else "diloco" if args.diloco else "ddp"
        outer = {k: v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum))
                 if v is not None}
        history = train_replica(net, train_iter, test_iter, epochs, lr, manager, progress=not args.no_progress,
                                sync=sync, sync_every=args.local_sgd or args.diloco or 1, **outer,
                                settings=run_config(args),
                                **{k: v for k, v in _optimizer_args(args).items() if k == "optimizer"})
    except RunFinished as e:  # started after its run ended: nothing to do, nothing wrong
        print(_one_line(e), flush=True)
        return 0
    except CoordinatorLost as e:  # its line names the replica, the coordinator and where the run goes on from
        _error(_one_line(e))
        return 1
    except Misfit as e:  # refused by the run (other settings, no room in the batch): the run goes on
        _error(_one_line(e))
        return 2
    except (TimeoutError, ValueError) as e:  # too few replicas for too long; replicas started with other settings
        _error(_one_line(e))
        return 1
    except RuntimeError as e:  # the coordinator is gone, or a state that does not fit this model
        _error(f"replica {args.replica_id!r}: {_one_line(e)}")
        return 1
    except OSError as e:  # a checkpoint that cannot be written or read (the disk filled, the folder went away)
        _error(f"replica {args.replica_id!r}: --checkpoint-dir {args.checkpoint_dir}: {_one_line(e)}")
        return 1
    finally:
        manager.close()
    ft = history.config["fault_tolerant"]
    print(f"loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
          f"test acc {history.test_acc[-1]:.3f}")
    unit = "steps" if ft["sync"] == "ddp" else f"blocks of up to {ft['sync_every']} steps"
    print(f"replica {args.replica_id}: {sum(r['committed'] for r in ft['steps'])} {unit} committed, "
          f"{sum(not r['committed'] for r in ft['steps'])} discarded, {len(ft['recoveries'])} state(s) received; "
          f"parameters sha256 {ft['parameters_sha256'][:16]}")
    return _write_outputs(args, history)


def _write_outputs(args, history) -> int:
    """Write `--json` and `--plot` where asked; 1 if one could not be written (told in one line), else 0."""
    failed = 0
    for option, path, write in (("--json", args.json, history.to_json), ("--plot", args.plot, history.plot)):
        if path is None:
            continue
        try:
            write(path)
            print(f"wrote {path}")
        except OSError as e:  # the disk filled or went read-only while training
            _error(f"{option}: cannot write {path}: {_one_line(e)}")
            failed = 1
    return failed


def run_config(args) -> dict:
    """The options outside the training loop's own arguments that decide the result: part of the run identity."""
    return {"model": args.model, "dataset": args.dataset, "num_train": args.num_train, "num_test": args.num_test,
            "batch_size": args.batch_size, "seed": args.seed}


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _save_partial(args, history) -> None:
    """After a failed run, write what `history` holds to --json, if it was asked for and can still be written."""
    if history is None or not args.json or not history.train_loss:
        return
    try:
        history.to_json(args.json)
        print(f"wrote the {len(history.train_loss)} finished epoch(s) to {args.json}", file=sys.stderr)
    except OSError as e:
        _error(f"--json: cannot write {args.json} either: {_one_line(e)}")


def _run_group_rank(args, loaded: tuple, token: str | None, timeout: float) -> int:
    """`manualdp train --fault-tolerant` under torchrun: this rank of replica group `--replica-id`; an exit status.

    `loaded` is `cli._load`'s (lr, train_iter, test_iter, epochs, model), the same on every rank of every group.
    """
    import torch.distributed as dist

    from ..spmd.ft.admission import Misfit
    from ..spmd.ft.durable import RunFinished
    from ..spmd.ft.group import GroupBroken, GroupManager
    from .agree import agree_on_settings
    from .ft_group_train import init_group, train_group_rank

    lr, train_iter, test_iter, epochs, net = loaded
    host, port = args.fault_tolerant
    world_size = int(os.environ["WORLD_SIZE"])
    who = f"replica group {args.replica_id!r}, rank {os.environ.get('RANK', '?')}"
    manager = None
    try:
        init_group(timeout)
        # the group's ranks train one model: each must be given the same command (a rank with another --lr
        # would step apart from its group, and the lanes would average replicas that differ)
        agree_on_settings({**run_config(args), "lr": lr, "epochs": epochs, "optimizer": args.optimizer,
                           "fault_tolerant": f"{host}:{port}", "replica_id": args.replica_id,
                           "min_replicas": args.min_replicas, "timeout": timeout, "token": token is not None},
                          timeout)
        manager = GroupManager(args.replica_id, host, port, min_groups=args.min_replicas, timeout=timeout,
                               quorum_timeout=min(10.0, timeout), token=token, guard=args.nonfinite != "off",
                               checkpoint_dir=args.checkpoint_dir)
        history = train_group_rank(net, train_iter, test_iter, epochs, lr, manager, progress=not args.no_progress,
                                   settings=run_config(args), guard=args.nonfinite != "off", zero=args.zero,
                                   **{k: v for k, v in _optimizer_args(args).items() if k == "optimizer"})
    except RunFinished as e:  # started after its run ended: nothing to do, nothing wrong
        if dist.get_rank() == 0:
            print(_one_line(e), flush=True)
        return 0
    except (GroupBroken, Misfit, ConnectionError, TimeoutError, ValueError, RuntimeError, OSError) as e:
        line = _one_line(e)
        if not isinstance(e, (GroupBroken, Misfit)):  # name the group and the rank once ("rank r: ..." from agree)
            line = f"replica group {args.replica_id!r}, {line}" if line.startswith("rank ") else f"{who}: {line}"
        _error(line)
        return 2 if isinstance(e, Misfit) else 1
    finally:
        if manager is not None:
            manager.close()
    if dist.get_rank() != 0:
        return 0  # rank 0 speaks for the group: its outputs are every rank's
    ft = history.config["fault_tolerant"]
    print(f"loss {history.train_loss[-1]:.3f}, train acc {history.train_acc[-1]:.3f}, "
          f"test acc {history.test_acc[-1]:.3f}")
    print(f"replica group {args.replica_id} ({world_size} ranks): {sum(r['committed'] for r in ft['steps'])} steps "
          f"committed, {sum(not r['committed'] for r in ft['steps'])} discarded, {len(ft['recoveries'])} state(s) "
          f"received; parameters sha256 {ft['parameters_sha256'][:16]}")
    return _write_outputs(args, history)
