"""Local SGD and DiLoCo against DDP, by the commands: test accuracy, and the bytes each replica sent per step.

    python bench/local_sgd.py                                  # the default task, 3 replicas, H = 3, 3 seeds
    python bench/local_sgd.py --replicas 2 --sync-every 13 --runs 3 --json bench/results/local_sgd.json
    python bench/local_sgd.py --tiny                           # the size of tests/spmd/ft/test_ft_sync_accuracy.py

Each run starts a coordinator and `--replicas` replicas by `manualdp train --fault-tolerant`, with
`--local-sgd H`, `--diloco H` or neither (DDP), all else the default task (LeNet on the synthetic
set, 4 epochs, global batch 256: 39 batches an epoch, so H = 3 or 13 gives blocks of exactly H),
and the same seed for the three methods. A run's test accuracy is the last epoch's, the same on
every replica (each replica's `--json`, checked). Bytes: every replica counts what the executor
sent on the quorum's group, float32 only (the model; the loss and correct count that each step
or block also averages are float64), divided by the steps taken, against
`cost.bytes_per_step(method, model bytes, replicas, H)` for its rank; the two must be equal
(where an epoch's last block is shorter than H, against the formula times H * blocks / steps).
The table: each method's mean test accuracy over the runs, each run's, and the gap to DDP's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = ("ddp", "local_sgd", "diloco")
# the default task is `manualdp train`'s defaults; --tiny is a few seconds a run
TINY = ["--model", "mlp", "--num-train", "512", "--num-test", "256", "--batch-size", "32", "--lr", "0.1",
        "--epochs", "2"]


def _child(out: str, argv: list[str]) -> int:
    """One replica: `manualdp train ARGV`, and at its end the bytes it sent on the quorum's group, to OUT."""
    import torch.distributed as dist

    from manualdp.runners.cli import main
    from manualdp.spmd.ft.manager import Manager
    from manualdp.spmd.transport.p2p import traffic

    close = Manager.close

    def counted_close(self):
        if os.path.exists(out):  # finish() closes, then the loop's own close: the first one, still in the group, counts
            return close(self)
        sent = traffic().sent() if dist.is_initialized() else {}
        with open(out, "w") as f:
            json.dump({"sent": sent, "rank": self.quorum.rank(self.id), "members": self.quorum.ids,
                       "recoveries": len(self.recoveries)}, f)
        close(self)

    Manager.close = counted_close
    return main(argv)


def run_one(method: str, sync_every: int, replicas: int, seed: int, task: list[str], tmp: str,
            timeout: float = 1800) -> dict:
    """One run of `method` by the commands; its test accuracy and each replica's measured bytes per step."""

    from manualdp.cost import bytes_per_step
    from manualdp.spmd.ft import Coordinator
    from manualdp.support import models

    every = {"ddp": [], "local_sgd": ["--local-sgd", str(sync_every)], "diloco": ["--diloco", str(sync_every)]}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coordinator = Coordinator(0)
    procs, ids = [], [chr(ord("a") + i) for i in range(replicas)]
    started = time.perf_counter()
    try:
        for rid in ids:
            argv = ["train", "--fault-tolerant", f"127.0.0.1:{coordinator.port}", "--replica-id", rid,
                    "--min-replicas", str(replicas), "--seed", str(seed), "--no-progress", "--threads", "1",
                    *task, *every[method], "--json", os.path.join(tmp, f"{rid}.json")]
            log = open(os.path.join(tmp, f"{rid}.log"), "w")
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                           os.path.join(tmp, f"{rid}.sent.json"), *argv], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        seconds = time.perf_counter() - started
        logs = {rid: open(os.path.join(tmp, f"{rid}.log")).read() for rid in ids}
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"{method} seed {seed}: a replica failed: {logs}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        coordinator.close()
    histories = [json.load(open(os.path.join(tmp, f"{rid}.json"))) for rid in ids]
    sent = [json.load(open(os.path.join(tmp, f"{rid}.sent.json"))) for rid in ids]
    accs = {h["test_acc"][-1] for h in histories}
    if len(accs) != 1:
        raise AssertionError(f"{method} seed {seed}: the replicas end on different test accuracies {accs}")
    steps = [h["config"]["fault_tolerant"]["steps"] for h in histories]
    if any(not r["committed"] or len(r["members"]) != replicas for s in steps for r in s):
        raise AssertionError(f"{method} seed {seed}: a step was discarded or taken without every replica")
    batches = sum(r.get("local_steps", 1) for r in steps[0])
    nbytes = sum(p.numel() * p.element_size() for p in models.get_model("lenet" if "--model" not in task else
                                                                       task[task.index("--model") + 1]).parameters())
    formula = bytes_per_step(method, nbytes, replicas, sync_every if method != "ddp" else 1, "ring")
    rows, H, syncs = [], sync_every if method != "ddp" else 1, len(steps[0])
    for s in sent:
        measured = s["sent"].get("float32", 0) / batches
        # the formula's H steps a sync; an epoch's last block may be shorter: then H * syncs / steps of it
        rows.append({"rank": s["rank"], "measured": measured, "formula": formula[s["rank"]],
                     "formula_blocks_taken": formula[s["rank"]] * H * syncs / batches})
    return {"method": method, "sync_every": sync_every if method != "ddp" else 1, "seed": seed,
            "test_acc": accs.pop(), "train_loss": histories[0]["train_loss"][-1], "steps": batches,
            "syncs": len(steps[0]), "seconds": round(seconds, 1), "bytes_per_step": rows}


def summarize(results: list[dict]) -> list[dict]:
    """Per method: the mean test accuracy, each run's, the gap to DDP's mean, and bytes per step against the formula."""
    table = []
    ddp = [r["test_acc"] for r in results if r["method"] == "ddp"]
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        accs = [r["test_acc"] for r in runs]
        measured = [b["measured"] for r in runs for b in r["bytes_per_step"]]
        formula = [b["formula"] for r in runs for b in r["bytes_per_step"]]
        taken = [b["formula_blocks_taken"] for r in runs for b in r["bytes_per_step"]]
        table.append({"method": method, "sync_every": runs[0]["sync_every"], "runs": len(runs),
                      "test_acc_mean": statistics.mean(accs), "test_acc": accs,
                      "gap_to_ddp": statistics.mean(accs) - statistics.mean(ddp) if ddp else None,
                      "bytes_per_step_measured": statistics.mean(measured),
                      "bytes_per_step_formula": statistics.mean(formula),
                      "bytes_equal_formula": all(abs(m - f) <= 1e-9 * f for m, f in zip(measured, taken)),
                      "blocks_of_exactly_h": formula == taken,
                      "seconds_mean": statistics.mean(r["seconds"] for r in runs)})
    return table


def measure(replicas: int, sync_every: int, runs: int, task: list[str], methods=METHODS, show=print) -> dict:
    results = []
    for seed in range(runs):
        for method in methods:  # interleaved: the machine's load falls on every method alike
            with tempfile.TemporaryDirectory(prefix="manualdp-local-sgd-") as tmp:
                r = run_one(method, sync_every, replicas, seed, task, tmp)
            show(f"  seed {seed} {method:<9} H={r['sync_every']:<3} test acc {r['test_acc']:.4f}  "
                 f"bytes/step {r['bytes_per_step'][0]['measured']:.0f} "
                 f"(formula {r['bytes_per_step'][0]['formula']:.0f})"
                 f"  {r['seconds']:.0f} s")
            results.append(r)
    return {"replicas": replicas, "sync_every": sync_every, "task": task, "results": results,
            "table": summarize(results)}


def print_table(report: dict, show=print) -> None:
    show(f"{report['replicas']} replicas, task {' '.join(report['task']) or 'default (lenet, synthetic, 4 epochs)'}")
    show(f"{'method':<10}{'H':>4}{'runs':>6}{'test acc':>10}{'gap to DDP':>12}  {'each run':<26}"
         f"{'bytes/step':>12}{'formula':>12}{'equal':>7}")
    for row in report["table"]:
        gap = f"{row['gap_to_ddp']:+.4f}" if row["gap_to_ddp"] is not None else "-"
        each = " ".join(f"{a:.4f}" for a in row["test_acc"])
        show(f"{row['method']:<10}{row['sync_every']:>4}{row['runs']:>6}{row['test_acc_mean']:>10.4f}{gap:>12}  "
             f"{each:<26}{row['bytes_per_step_measured']:>12.0f}{row['bytes_per_step_formula']:>12.0f}"
             f"{'yes' if row['bytes_equal_formula'] else 'NO':>7}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, choices=[2, 3, 4], default=3)
    p.add_argument("--sync-every", type=int, default=3, metavar="H", help="H of local SGD and DiLoCo (default 3)")
    p.add_argument("--runs", type=int, default=3, help="seeds 0..RUNS-1, each method once a seed (default 3)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)}")
    p.add_argument("--tiny", action="store_true", help="an MLP on 512 examples, 2 epochs: seconds a run")
    p.add_argument("--json", default=None, help="write the runs and the table here")
    args = p.parse_args(argv)
    if args.sync_every < 1 or args.runs < 1:
        p.error(f"--sync-every and --runs must be >= 1, got {args.sync_every} and {args.runs}")
    methods = args.methods.split(",")
    if any(m not in METHODS for m in methods):
        p.error(f"--methods must name some of {METHODS}, got {args.methods!r}")
    report = measure(args.replicas, args.sync_every, args.runs, TINY if args.tiny else [], methods)
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(row["bytes_equal_formula"] for row in report["table"]) else 1


if __name__ == "__main__":
    sys.exit(main())
