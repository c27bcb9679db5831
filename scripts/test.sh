#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: formatting, then every test built with g++
# (Release) and built with clang++ under AddressSanitizer and UndefinedBehaviorSanitizer (with the fuzz
# target); the thread pool's tests under ThreadSanitizer; the core tests at -O0 with Eigen's assertions; the
# kernels' tests cross-built for arm64 and run under qemu-aarch64; and the default build's kernels tests
# under qemu-x86_64 on CPUs without AVX-512 (Haswell) and without AVX (Nehalem), with the docs programs
# under Nehalem. Every stage fails if it ran fewer tests than it should (scripts/ctest_checked.sh), so a
# stage whose tests vanish cannot pass. Prints each stage's time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
stage_start=$SECONDS
# stage NAME: prints the time the previous stage took, then NAME.
stage() {
  if [[ -n ${stage_name:-} ]]; then
    echo "== $stage_name: $((SECONDS - stage_start)) s"
  fi
  stage_name=$1 stage_start=$SECONDS
  [[ -z $stage_name ]] || echo "== $stage_name"
}

stage "packages"
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}" "${GRADCLIP_TEST_PACKAGES[@]}"
# A qemu-x86_64 whose AVX2 gathers are right (scripts/deps.sh), for tests/mixed_isa and the x86-64 stages.
GRADCLIP_QEMU_X86_64=$(gradclip_qemu_x86_64)
export GRADCLIP_QEMU_X86_64
# On CI's fresh machine the Debian package test may install into the system (tests/consumer); elsewhere
# that test is left out rather than skipped, since a skipped test fails its stage. (A -LE given here
# replaces the preset's exclusion, so the sanitize stage names its `long` again.)
not_system=(-LE system) sanitize_excluded=(-LE "long|system")
if [[ -n "${CI:-}" ]]; then
  export GRADCLIP_SYSTEM_TESTS=1
  not_system=() sanitize_excluded=()
fi

stage "clang-format"
git ls-files '*.hpp' '*.cpp' | xargs clang-format --dry-run --Werror

# build PRESET MIN_TESTS [ctest arguments]: configure, build and test one preset.
build_and_test() {
  local preset=$1 min=$2
  shift 2
  stage "build and test: $preset"
  cmake --preset "$preset" -DGRADCLIP_QEMU_X86_64="$GRADCLIP_QEMU_X86_64" >/dev/null
  cmake --build --preset "$preset" -j "$(nproc)"
  scripts/ctest_checked.sh "$min" --preset "$preset" "$@"
}

# The minimum counts are the tests each stage selects today, rounded down: losing an executable's tests
# (a discovery or label gone wrong) fails the stage; adding tests needs no change here.
build_and_test default 600 "${not_system[@]}"
# The whole suite again with clang++ -ffp-contract=fast (which ignores the pragma against FMA contraction:
# docs/reliability.md) under AddressSanitizer and UndefinedBehaviorSanitizer, with the examples, the
# package tests and the libFuzzer target's short run; not the 4 GiB test, which the default build ran. Most
# unit tests build at -O0 (three times faster to compile under ASan than -O1), test_kernels, the examples
# and docs programs at -O1 -g1 (at -O0 they would run ten times slower, and clang would not fuse products
# that test_kernels must find rounded): tests/CMakeLists.txt. One build
# gives both the second compiler and the sanitizers, and the compiled mode (GRADCLIP_COMPILED_LIBRARY: every
# test but the kernels' own uses the library, test_compiled checks its bits against the headers', and the
# package tests consume it by every route), whose units also build faster.
build_and_test sanitize 580 "${sanitize_excluded[@]}"
# ThreadSanitizer (g++) over the tests labelled pool: the thread pool itself, and calls that are concurrent,
# nested in a pool's threads, in a forked child or given an executor that throws (the other threaded tests
# run the same pool in the builds above).
build_and_test tsan 35
# g++ -O0 -g with Eigen's and libstdc++'s assertions on, over the tests labelled core.
build_and_test debug 200

# arm64: the tests labelled kernels cross-built with Debian's aarch64 g++ and run under qemu-aarch64 (the
# portable kernels; no MPI, no libtorch). GoogleTest is built for arm64 first, from the sources libgtest-dev ships.
stage "build and test: arm64 (qemu-aarch64)"
cmake -S /usr/src/googletest -B build/arm64-googletest-build --toolchain "$PWD/cmake/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DCMAKE_INSTALL_PREFIX="$PWD/build/arm64-googletest" >/dev/null
cmake --build build/arm64-googletest-build -j "$(nproc)" >/dev/null
cmake --install build/arm64-googletest-build >/dev/null
cmake --preset arm64 >/dev/null
cmake --build --preset arm64 -j "$(nproc)"
scripts/ctest_checked.sh 420 --preset arm64

# The default build again, unchanged, on other x86-64 CPU models: its kernels tests must pass where gradclip
# dispatches to AVX2 (Haswell) or portable code (Nehalem), and the docs' programs and outputs print the
# documented digits on the portable code. (The docs outputs under Haswell too cost about 5 minutes of CI's
# budget; the kernels tests there check that AVX2 gives the portable code's bits.)
stage "qemu-x86_64 -cpu Haswell: the default build's kernels tests"
scripts/qemu_x86_64.sh build/default Haswell 340 0
stage "qemu-x86_64 -cpu Nehalem: the default build's kernels tests and docs outputs"
scripts/qemu_x86_64.sh build/default Nehalem 330 11 VectorKernels
stage ""
echo "== all stages passed in $((SECONDS - start)) s"
