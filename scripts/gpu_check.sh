#!/usr/bin/env bash
# Issue 27's GPU check: builds test_torch and test_torch_ops against a CUDA build of libtorch, runs them on
# CUDA tensors (GRADCLIP_TEST_DEVICE=cuda) and prints "N passed, M failed"; then bench_torch's GPT-2 small
# case against torch's clip_grad_norm_ when it is built (bench_torch still allocates its tensors on the CPU:
# a CUDA case there is future work, so these timings are CPU ones).
# Usage: scripts/gpu_check.sh [CMAKE_PREFIX_PATH of the CUDA libtorch]   (build in build/gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no GPU (nvidia-smi fails): not run" >&2
  exit 2
fi
prefix=${1:-${TORCH_PREFIX:-}}
build=build/gpu-check
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADCLIP_WITH_TORCH=ON ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"} >/dev/null
cmake --build "$build" --target test_torch test_torch_ops -j"$(nproc)"
passed=0
failed=0
for test in test_torch test_torch_ops; do
  log="$build/$test.cuda.log"
  GRADCLIP_TEST_DEVICE=cuda ATEN_CPU_CAPABILITY=default "$build/tests/$test" >"$log" 2>&1 || true
  p=$(grep -c '^\[       OK \]' "$log" || true)
  f=$(grep -c '^\[  FAILED  \].*(' "$log" || true)
  echo "$test on cuda: $p passed, $f failed (log: $log)"
  passed=$((passed + p))
  failed=$((failed + f))
done
echo "$passed passed, $failed failed"
if cmake --build "$build" --target bench_torch -j"$(nproc)" >/dev/null 2>&1; then
  GRADCLIP_TEST_DEVICE=cuda "$build/bench/bench_torch" --benchmark_filter='gpt2_small' --benchmark_repetitions=5 \
    --benchmark_report_aggregates_only=true || true
fi
[ "$failed" -eq 0 ]
