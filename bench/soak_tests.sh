#!/usr/bin/env bash
# The long test suites, too slow for the README's CPU suite; CI runs this after it (.ci/run). First the tests of
# tests/ marked soak (fault tolerance's replica processes, a torchrun resume, a killed node), then every test file
# of bench/ but test_gpu.py (bench/README.md says what each tries): the adversaries' tries of fully_shard, the
# ladder, ZeRO-2, the fault-tolerant room and the graders; every hostile answer of tests/answers/ against `manualdp
# check`; the sandbox's answers that signal their parent; every chapter of the book run twice as a script; the
# FSDP2 example both ways; scripts that end without tearing their group down.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m soak tests/  # the slow runs taken out of the CPU suite
exec python -m pytest -q -m "" bench/test_adversary_fsdp.py bench/test_adversary_35.py bench/test_adversary_35b.py \
    bench/test_check_answers.py bench/test_book_twice.py \
    bench/test_fsdp2_example.py bench/test_exit.py bench/test_adversary_round32.py bench/test_adversary_ft.py \
    bench/test_sandbox_soak.py bench/test_adversary_graders.py "$@"
