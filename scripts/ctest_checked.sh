#!/usr/bin/env bash
# Runs ctest and fails unless every test it selects ran and passed, none skipped, and there were at least
# MIN of them: a stage whose tests were never discovered, were filtered away or skipped themselves fails
# instead of passing with nothing checked.
# Usage: scripts/ctest_checked.sh MIN ctest-arguments...   (e.g. 250 --preset arm64)
set -euo pipefail
min=$1
shift
listed=$(ctest "$@" -N | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p')
if ((${listed:-0} < min)); then
  echo "ctest $* selects ${listed:-0} tests, fewer than the $min expected" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
ctest "$@" | tee "$log" || status=$?
ran=$(sed -n 's/.*tests passed, 0 tests failed out of \([0-9]*\)$/\1/p' "$log")
if ((status != 0)) || [[ $ran != "$listed" ]] || grep -q "did not run" "$log"; then
  echo "ctest $*: ${ran:-not all} of $listed tests passed (exit status $status; skipped or failed tests above)" >&2
  exit 1
fi
echo "ctest $*: all $listed tests ran and passed"
