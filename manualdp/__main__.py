import atexit
import os
import sys

from .runners.cli import main

code = main()
if "torch.distributed" in sys.modules:
    # A process that used gloo ends here, its output written and flushed. Left to the
    # interpreter's finalization, gloo's own threads (a group's connections outlive
    # destroy_process_group in torch 2.13, and a rank that stops on an error keeps its
    # group) can still run while Python finalizes and abort the process ("terminate called
    # without an active exception", exit -6): once in 4 refused runs under torchrun, and
    # once in CI's soak after a fault-tolerant replica had written its --json, rc 0.
    # The exit handlers still run first (multiprocessing removes its temporary folder there).
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
raise SystemExit(code)
