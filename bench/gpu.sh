#!/usr/bin/env bash
# The GPU checks and benchmarks, in one command, on a machine with CUDA.
#
#     bash bench/gpu.sh                     # results in bench/results/gpu/
#     OUT=/tmp/gpu bash bench/gpu.sh        # elsewhere
#
# 1. the tests that need CUDA (bench/test_gpu.py; tests/ holds none, and its modules import test-only packages
#    such as mktestdocs and expecttest that a GPU machine's image may lack);
# 2. bench/compare_ddp.py (lenet, resnet18) and bench/scaling.py: manualdp's DDP against torch's, on NCCL;
# 3. bench/allreduce.py --spmd: manualdp's allreduce against NCCL's all_reduce;
# 4. bench/zero.py: ZeRO-1/2/3 against torch's ZeRO-1 and FSDP2.
# NCCL takes one GPU per rank: the runs use up to 4 GPUs, and the ones that need two ranks are left
# out (and said so) on a machine with one. GPU work is timed by CUDA events (bench/common.py's
# Stopwatch). Every step runs even when one before it failed; the exit status says whether any did.
# Without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
gpus=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "${gpus:-0}" -eq 0 ]; then
    echo "bench/gpu.sh: no CUDA device here (torch.cuda.is_available() is False); nothing to run"
    exit 0
fi
mkdir -p "$OUT"
ranks=$(( gpus < 4 ? gpus : 4 ))
failed=()
run() {  # run NAME COMMAND...: its output to the screen and to $OUT/NAME.txt
    local name=$1; shift
    echo "== $name: $*"
    if ! "$@" 2>&1 | tee "$OUT/$name.txt"; then
        failed+=("$name")
    fi
}
echo "bench/gpu.sh: $gpus GPU(s), NCCL runs on up to $ranks rank(s); results in $OUT"
python -c 'import torch; print(torch.__version__, torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])' \
    | tee "$OUT/device.txt"

run tests python -m pytest -q -m gpu bench/test_gpu.py
for model in lenet resnet18; do
    run "compare_ddp_$model" python bench/compare_ddp.py --model "$model" --world-size "$ranks" --backend nccl \
        --json "$OUT/compare_ddp_$model.json"
done
run scaling python bench/scaling.py --world-sizes $(seq 1 "$ranks") --backend nccl --no-progress \
    --json "$OUT/scaling.json" --plot "$OUT/scaling.png"
if [ "$ranks" -ge 2 ]; then
    run allreduce_spmd python bench/allreduce.py --spmd --world-size "$ranks" --backend nccl --min-bytes 65536 \
        --json "$OUT/allreduce_spmd.json" --plot "$OUT/allreduce_spmd.png"
else
    echo "== allreduce_spmd: left out: an allreduce needs 2 ranks, and NCCL a GPU per rank ($gpus here)" \
        | tee "$OUT/allreduce_spmd.txt"
fi
run zero python bench/zero.py --world-size "$ranks" --backend nccl --json "$OUT/zero.json" --txt "$OUT/zero_table.txt"

if [ ${#failed[@]} -gt 0 ]; then
    echo "bench/gpu.sh: failed: ${failed[*]} (see $OUT/NAME.txt)"
    exit 1
fi
echo "bench/gpu.sh: all ran; results in $OUT"
