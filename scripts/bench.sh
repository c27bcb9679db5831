#!/usr/bin/env bash
# Installs what is missing, builds the benchmarks twice (the `bench` preset with -march=native, and the
# compiler's default flags, which reach the vector kernels through runtime dispatch), runs bench_clip
# (and bench_torch when it was built) with JSON output, and writes docs/bench/results.md and
# docs/bench/throughput.png. Extra arguments go to every benchmark binary (e.g. --benchmark_filter=f16).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}" libbenchmark-dev python3-matplotlib

jobs=$(nproc)
cmake --preset bench >/dev/null
cmake --build --preset bench -j "$jobs" --target bench_clip
cmake -S . -B build/bench-default -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ -DGRADCLIP_BUILD_TESTS=OFF \
  -DGRADCLIP_BUILD_EXAMPLES=OFF -DGRADCLIP_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/bench-default -j "$jobs" --target bench_clip
# bench_torch is optional: built only when libtorch was found.
cmake --build --preset bench -j "$jobs" --target bench_torch 2>/dev/null || true

out=docs/bench
mkdir -p "$out"
run=(--benchmark_repetitions=9 --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
  --benchmark_out_format=json "$@")
echo "== bench_clip, -march=native"
build/bench/bench/bench_clip "${run[@]}" --benchmark_out="$out/native.json" >/dev/null
echo "== bench_clip, default flags"
# Only gradclip's own cases: the naive and Eigen baselines do not depend on gradclip's dispatch.
build/bench-default/bench/bench_clip "${run[@]}" --benchmark_out="$out/default.json" \
  --benchmark_filter='^(norm|clip_binds|clip_nobind)/(robust|max_scale|promote)/' >/dev/null
torch_args=()
if [[ -x build/bench/bench/bench_torch ]]; then
  echo "== bench_torch"
  build/bench/bench/bench_torch "${run[@]}" --benchmark_out="$out/torch.json" >/dev/null
  torch_args=(--torch "$out/torch.json")
fi
# Debian's python3-matplotlib is for the system interpreter, not a pyenv one that may shadow it.
/usr/bin/python3 scripts/plot.py bench "$out/native.json" "$out/results.md" "$out/throughput.png" \
  --default "$out/default.json" "${torch_args[@]}"
