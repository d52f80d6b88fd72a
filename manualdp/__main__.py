import os
import sys

from .runners.cli import main

code = main()
if code and "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
    # A rank that stops on an error keeps its process group (a dead peer could hold up its
    # teardown). Left to the interpreter's exit, gloo's own threads, freeing the last
    # collective's tensors, need the GIL while Python finalizes and abort the process
    # ("terminate called without an active exception"). The error is written: end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
