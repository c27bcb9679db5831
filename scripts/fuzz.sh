#!/usr/bin/env bash
# Fuzzes gradclip for a while (default 600 s) with libFuzzer, AddressSanitizer and UBSan, in one process.
# Usage: scripts/fuzz.sh [seconds]
# Inputs that find new coverage go to build/fuzz/corpus; a failing input is written to build/fuzz/artifacts/
# and printed with the check it broke. Keep it as tests/fuzz/regressions/<name> with a named test in
# tests/fuzz/test_fuzz_corpus.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}"

seconds=${1:-600}
cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/fuzz --target fuzz_clip -j "$(nproc)"
mkdir -p build/fuzz/corpus build/fuzz/artifacts
# The first directory receives new inputs; the checked-in ones are only read.
build/fuzz/tests/fuzz/fuzz_clip build/fuzz/corpus tests/fuzz/corpus tests/fuzz/regressions \
  -max_total_time="$seconds" -max_len=4096 -artifact_prefix=build/fuzz/artifacts/ -print_final_stats=1
