#!/usr/bin/env bash
# Runs an x86-64 build's CPU-dependent checks under qemu-x86_64 on another CPU model, with no rebuild:
# every test labelled `kernels` (the arithmetic that differs between instruction sets) and every program
# and output shown in the docs (which must print the digits they show). Haswell has AVX2 and FMA but no
# AVX-512, Nehalem only SSE4.2, so the kernels dispatch to AVX2 and to the portable code. Fails unless
# every test ctest lists for the label ran and passed, none skipped, and there were at least MIN_KERNELS
# kernels tests and MIN_DOCS docs tests (default 1 each; MIN_DOCS 0 runs the kernels tests only).
# EXCLUDE leaves out the kernels tests whose names contain it: VectorKernels on a CPU without AVX2, whose
# suites of that name compare the vector kernels with the portable ones and so have nothing to compare.
# Usage: scripts/qemu_x86_64.sh BUILD_DIR CPU [MIN_KERNELS [MIN_DOCS [EXCLUDE]]]
#   (e.g. build/default Nehalem 340 11 VectorKernels; qemu-x86_64 -cpu help lists the models)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1 cpu=$2 min_kernels=${3:-1} min_docs=${4:-1} exclude=${5:-}
source scripts/deps.sh
qemu=${GRADCLIP_QEMU_X86_64:-$(gradclip_qemu_x86_64)}
log=$build/qemu-$cpu
rm -rf "$log"
mkdir -p "$log"

# The kernels tests: each executable once, all its tests in one emulated process (a process per test
# case, as ctest runs them, would start qemu 300 times), as many at once as there are cores.
ctest --test-dir "$build" -L kernels -LE long ${exclude:+-E "$exclude"} --show-only=json-v1 >"$log/tests.json"
python3 - "$log/tests.json" "$log/executables" <<'PY'
import json, sys
tests = json.load(open(sys.argv[1]))["tests"]
executables = sorted({t["command"][0] for t in tests})
open(sys.argv[2], "w").write("".join(e + "\n" for e in executables))
print(len(tests), file=open(sys.argv[2] + ".count", "w"))
PY
listed=$(cat "$log/executables.count")
filter="*${exclude:+-*$exclude*}"
export qemu cpu log filter
xargs -P "$(nproc)" -I{} bash -c \
  'name=$(basename {}); "$qemu" -cpu "$cpu" {} --gtest_brief=1 --gtest_filter="$filter" >"$log/$name.log" 2>&1
   echo $? >"$log/$name.status"' \
  <"$log/executables"
passed=0 failed=()
while read -r executable; do
  name=$(basename "$executable")
  count=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\.$/\1/p' "$log/$name.log")
  passed=$((passed + ${count:-0}))
  if [[ $(cat "$log/$name.status") != 0 ]] || grep -q '^\[  \(FAILED\|SKIPPED\) ' "$log/$name.log"; then
    failed+=("$name")
    grep -v "warning: TCG doesn't support" "$log/$name.log" | tail -n 40 >&2
  fi
done <"$log/executables"
echo "kernels tests under qemu-x86_64 -cpu $cpu: $passed of $listed passed in $(wc -l <"$log/executables") executables"
if ((${#failed[@]})) || ((passed != listed)) || ((listed < min_kernels)); then
  echo "under -cpu $cpu: failed ${failed[*]:-none}, $passed of $listed passed, at least $min_kernels expected" \
    "(logs in $log)" >&2
  exit 1
fi

# The docs' programs and outputs, each run under the emulator by scripts/doc_snippets.py check (MIN_DOCS 0:
# not run).
if ((min_docs > 0)); then
  GRADCLIP_EMULATOR="$qemu -cpu $cpu" scripts/ctest_checked.sh "$min_docs" --test-dir "$build" \
    -R '^docs_(program|output)_' -j "$(nproc)" --output-on-failure
fi
