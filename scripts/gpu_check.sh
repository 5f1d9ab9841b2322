#!/usr/bin/env bash
# Run this first on any machine with a GPU (about 5 minutes on one GPU, 12 at most):
#   1. the CUDA tests (tests marked cuda; skipped on machines without a GPU),
#   2. the server on the GPU: two workers on one card in disagg over cuda-ipc, greedy and seeded
#      requests against the CPU's output, run-time switches,
#   3. the engine benchmark on the GPU in bfloat16 against transformers.
# One line per check, then a summary. Logs go to ${GPU_CHECK_LOGS:-/tmp/minipd-gpu-check}.
# The benchmark runs the default model, or GPU_CHECK_BENCH_MODEL (a folder) where it is not installed.
set -u
cd "$(dirname "$0")/.."
logs=${GPU_CHECK_LOGS:-/tmp/minipd-gpu-check}
mkdir -p "$logs"
passed=0
failed=0

check() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - start)) s)"
        passed=$((passed + 1))
    else
        echo "FAIL $name ($((SECONDS - start)) s), last lines of $logs/$name.log:"
        tail -n 15 "$logs/$name.log" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}

python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.cuda.get_device_name(0))" \
    || { echo "FAIL no GPU visible to torch"; exit 1; }
check cuda-tests 300 python3 -m pytest -q -m cuda tests/test_cuda.py
check serve-disagg-cuda-ipc 200 python3 scripts/gpu_serve_check.py --gpus 0,0
grep -E "^(PASS|FAIL)" "$logs/serve-disagg-cuda-ipc.log" | sed 's/^/    /'
check bench-engine-bf16 200 python3 scripts/bench_engine.py --device cuda --dtype bfloat16 --quick \
    ${GPU_CHECK_BENCH_MODEL:+--model "$GPU_CHECK_BENCH_MODEL"}
tail -n 8 "$logs/bench-engine-bf16.log" | sed 's/^/    /'
echo "summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
