# Sourced by the other scripts: installs, as root on Debian 12, the packages that are missing.
# Usage: gradclip_install_missing package...
gradclip_install_missing() {
  local missing=()
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
  done
  if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# What every build needs: compilers, CMake, Eigen, GoogleTest (the quick-start example needs no more).
GRADCLIP_BASE_PACKAGES=(g++ cmake make libeigen3-dev libgtest-dev)
# What the whole test suite needs besides: clang and clang-format; OpenMPI for the gradclip::mpi tests;
# pkg-config for the pkg-config consumer test; libtorch for the libtorch adapter's test, example and
# benchmark (built by the default preset only); clang's libFuzzer and sanitizer runtimes (tests/fuzz); the
# arm64 cross toolchain and qemu-user, which runs the arm64 tests (the arm64 preset).
GRADCLIP_TEST_PACKAGES=(clang clang-format libopenmpi-dev openmpi-bin pkg-config libtorch-dev libclang-rt-14-dev
  g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
