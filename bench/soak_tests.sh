#!/usr/bin/env bash
# The long adversarial and fault suites, too slow for the 10-minute CPU suite in tests/ (about 11 minutes here):
# the adversary's tries of fully_shard and of issue 35's surfaces at 2 and 3 ranks, the fault-tolerant replicas
# (quorum, local SGD, DiLoCo, killed and stopped, killed in a recovery, two at once, partitioned, by the command
# line, and local SGD's and DiLoCo's accuracy against DDP's at a tiny size), the FSDP2 example both ways, and
# every hostile answer of tests/answers/ against `manualdp check`, the sandbox's answers that signal their parent and
# how its child ended, every chapter of the book run twice as a script, and scripts that end without tearing their
# group down.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m soak tests/  # the slow runs taken out of the CPU suite
exec python -m pytest -q -m "" bench/test_adversary_fsdp.py bench/test_adversary_35.py bench/test_adversary_35b.py \
    bench/test_check_answers.py bench/test_book_twice.py \
    bench/test_fsdp2_example.py bench/test_exit.py bench/test_adversary_round32.py bench/test_adversary_ft.py \
    bench/test_sandbox_soak.py "$@"
