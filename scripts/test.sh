#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: formatting, then every test built with g++ and
# with clang++.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}" clang-format

echo "== clang-format"
git ls-files '*.hpp' '*.cpp' | xargs clang-format --dry-run --Werror

for preset in default clang; do
  echo "== build and test: $preset"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$(nproc)"
  ctest --preset "$preset"
done
