#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: formatting, then every test built with g++ and
# with clang++.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}" "${GRADCLIP_TEST_PACKAGES[@]}"
# On CI's fresh machine the Debian package test may install into the system (tests/consumer).
if [[ -n "${CI:-}" ]]; then export GRADCLIP_SYSTEM_TESTS=1; fi

echo "== clang-format"
git ls-files '*.hpp' '*.cpp' | xargs clang-format --dry-run --Werror

for preset in default clang; do
  echo "== build and test: $preset"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$(nproc)"
  ctest --preset "$preset"
done

# The whole suite again under AddressSanitizer and UndefinedBehaviorSanitizer (g++; the clang build
# above already ran the fuzz target with them).
echo "== build and test: sanitize"
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j "$(nproc)"
ctest --preset sanitize
