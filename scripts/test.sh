#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: formatting, then every test built with g++ and
# with clang++, and under AddressSanitizer and UndefinedBehaviorSanitizer; the threaded tests under
# ThreadSanitizer; and the kernels' tests cross-built for arm64 and run under qemu-user.
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
# above already ran the fuzz target with them), without the examples and package tests the two builds
# above ran.
echo "== build and test: sanitize"
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j "$(nproc)"
ctest --preset sanitize

# ThreadSanitizer (g++) over the tests labelled threads: every test that sets options::threads or pool.
echo "== build and test: tsan"
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j "$(nproc)"
ctest --preset tsan

# arm64: the tests labelled kernels cross-built with Debian's aarch64 g++ and run under qemu-aarch64 (the
# portable kernels; no MPI, no libtorch). GoogleTest is built for arm64 first, from the sources libgtest-dev ships.
echo "== build and test: arm64 (qemu-aarch64)"
cmake -S /usr/src/googletest -B build/arm64-googletest-build --toolchain "$PWD/cmake/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DCMAKE_INSTALL_PREFIX="$PWD/build/arm64-googletest" >/dev/null
cmake --build build/arm64-googletest-build -j "$(nproc)" >/dev/null
cmake --install build/arm64-googletest-build >/dev/null
cmake --preset arm64 >/dev/null
cmake --build --preset arm64 -j "$(nproc)"
ctest --preset arm64
