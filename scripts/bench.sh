#!/usr/bin/env bash
# Installs what is missing, builds the benchmarks twice (the `bench` preset with -march=native, and the
# compiler's default flags, which reach the vector kernels through runtime dispatch), runs bench_clip
# (and bench_torch when it was built) with JSON output, and writes docs/bench/results.md and
# docs/bench/throughput.png. Extra arguments go to every benchmark binary (e.g. --benchmark_filter=f16).
# That full run takes about 45 minutes on two cores.
#
# scripts/bench.sh --sizes: only the speed-at-every-size figures (small tensors, in cache, GPT-2 small,
# threads) beside their targets, in docs/bench/sizes.md and sizes.png; the full run appends them to
# results.md.
#
# scripts/bench.sh --quick: the headline figures in under three minutes on two cores, build included. It
# builds the `bench` preset only and runs the paired cases at 64 Mi elements (every policy against the read
# roofline; libtorch against gradclip when libtorch is installed) and one run of each case the throughput
# plot needs; it prints the headline table and writes docs/bench/quick/results.md and throughput.png.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}" libbenchmark-dev python3-matplotlib

jobs=$(nproc)

# Whether build/bench builds bench_torch. Its cache keeps what the first configure found, so a build
# directory configured before libtorch was installed leaves the libtorch rows out: say so.
torch_built() {
  if grep -q '^GRADCLIP_WITH_TORCH:BOOL=ON' build/bench/CMakeCache.txt; then return 0; fi
  echo "note: GRADCLIP_WITH_TORCH is OFF in build/bench, so the libtorch rows are left out" \
    "(cmake -B build/bench -DGRADCLIP_WITH_TORCH=ON adds them where libtorch is installed)" >&2
  return 1
}

# The speed-at-every-size figures (issue 16), each beside its target: bench_clip's paired cases at 128 Ki
# (in cache) and 64 Mi, bench_sizes (small tensors, GPT-2 small, threads) and bench_torch on GPT-2 small.
# Writes docs/bench/sizes.md and docs/bench/sizes.png; about 5 minutes on two cores, build included.
sizes_figures() {
  local targets=(bench_clip bench_sizes) torch=false
  if torch_built; then targets+=(bench_torch) torch=true; fi
  cmake --build --preset bench -j "$jobs" --target "${targets[@]}"
  local out=docs/bench scratch
  scratch=$(mktemp -d)
  local paired=(--benchmark_report_aggregates_only=true --benchmark_out_format=json)
  echo "== bench_clip: paired cases at 128 Ki (5 repetitions) and norms at 64 Mi (3)"
  build/bench/bench/bench_clip "${paired[@]}" --benchmark_repetitions=5 --benchmark_filter='^paired/.*/131072/' \
    --benchmark_out="$scratch/in_cache.json" >/dev/null
  build/bench/bench/bench_clip "${paired[@]}" --benchmark_repetitions=3 --benchmark_filter='^paired/norm/[a-z0-9]+/67108864/' \
    --benchmark_out="$scratch/out_of_cache.json" >/dev/null
  echo "== bench_sizes (3 repetitions)"
  build/bench/bench/bench_sizes "${paired[@]}" --benchmark_repetitions=3 --benchmark_out="$scratch/sizes.json" >/dev/null
  local torch_args=()
  if $torch; then
    echo "== bench_torch: GPT-2 small (3 repetitions)"
    build/bench/bench/bench_torch "${paired[@]}" --benchmark_repetitions=3 --benchmark_min_time=0.2 \
      --benchmark_filter='^paired<.*gpt2' --benchmark_out="$scratch/torch.json" >/dev/null
    torch_args=(--torch "$scratch/torch.json")
  fi
  /usr/bin/python3 scripts/plot.py sizes "$scratch/in_cache.json" "$scratch/out_of_cache.json" "$scratch/sizes.json" \
    "$out/sizes.md" "$out/sizes.png" "${torch_args[@]}"
  rm -rf "$scratch"
}

if [[ "${1:-}" == "--sizes" ]]; then
  if (($# > 1)); then echo "scripts/bench.sh --sizes takes no other arguments" >&2; exit 2; fi
  cmake --preset bench >/dev/null
  sizes_figures
  exit 0
fi

if [[ "${1:-}" == "--quick" ]]; then
  if (($# > 1)); then echo "scripts/bench.sh --quick takes no other arguments" >&2; exit 2; fi
  cmake --preset bench >/dev/null
  targets=(bench_clip) torch=false
  if torch_built; then targets+=(bench_torch) torch=true; fi
  cmake --build --preset bench -j "$jobs" --target "${targets[@]}"
  out=docs/bench/quick
  mkdir -p "$out"
  # The plot's series at every size, and naive Eigen's clip at 64 Mi for the table.
  plotted='^((read|rewrite)/(256|512)|norm/(robust|max_scale|promote)|clip_binds/robust|eigen_(naive_norm|norm|stable_norm))/'
  echo "== bench_clip: the plotted cases, one run each"
  build/bench/bench/bench_clip --benchmark_filter="$plotted|^eigen_naive_clip/-/[a-z0-9]+/67108864/" \
    --benchmark_out_format=json --benchmark_out="$out/sizes.json" >/dev/null
  paired=(--benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_out_format=json)
  echo "== bench_clip: paired cases at 64 Mi elements, 3 repetitions"
  build/bench/bench/bench_clip "${paired[@]}" --benchmark_filter='^paired/(norm|clip_binds)/[a-z0-9]+/67108864/' \
    --benchmark_out="$out/paired.json" >/dev/null
  torch_args=()
  if $torch; then
    echo "== bench_torch: paired cases, 3 repetitions"
    build/bench/bench/bench_torch "${paired[@]}" --benchmark_min_time=0.2 --benchmark_filter='^paired<' \
      --benchmark_out="$out/torch.json" >/dev/null
    torch_args=(--torch "$out/torch.json")
  fi
  /usr/bin/python3 scripts/plot.py quick "$out/sizes.json" "$out/paired.json" "$out/results.md" "$out/throughput.png" \
    "${torch_args[@]}"
  printf '\nRun time: %d s, build included.\n' "$SECONDS" | tee -a "$out/results.md"
  exit 0
fi

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
sizes_figures
{ echo; cat "$out/sizes.md"; } >>"$out/results.md"
