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
# arm64 cross toolchain and qemu-user, which runs the arm64 tests (the arm64 preset); python3 for the docs
# tests and scripts/qemu_x86_64.sh; git for the formatting check.
GRADCLIP_TEST_PACKAGES=(clang clang-format libopenmpi-dev openmpi-bin pkg-config libtorch-dev libclang-rt-14-dev
  g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user python3 git)

# Prints the path of a qemu-x86_64 that emulates AVX2 gathers correctly, for the emulated x86-64 stages
# (scripts/qemu_x86_64.sh). Debian 12's qemu 7.2 decodes a VSIB index of xmm4/ymm4 as "no index", so its
# AVX2 gathers with that index read base[0] (qemu's "target/i386: Fix VSIB decode", in 9.1, 8.2.7 and
# 9.0.3); gradclip's AVX2 p-norm kernels then fail under -cpu Haswell. Where the installed qemu-x86_64 is
# older than 9.1, the static binaries of bookworm-backports' qemu-user (10.0) are unpacked into
# build/qemu-user; nothing is installed into the system.
gradclip_qemu_x86_64() {
  local installed version
  installed=$(command -v qemu-x86_64 || true)
  if [[ -n $installed ]]; then
    version=$("$installed" --version | sed -n 's/^qemu-x86_64 version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
    read -r major minor <<<"$version"
    if ((major > 9 || (major == 9 && minor >= 1))); then
      echo "$installed"
      return
    fi
  fi
  local dir=$PWD/build/qemu-user
  if [[ ! -x $dir/usr/bin/qemu-x86_64 ]]; then
    mkdir -p "$dir/apt/lists/partial"
    echo "deb http://deb.debian.org/debian bookworm-backports main" >"$dir/apt/sources.list"
    local apt_options=(-o "Dir::Etc::sourcelist=$dir/apt/sources.list" -o Dir::Etc::sourceparts=/dev/null
      -o "Dir::State::Lists=$dir/apt/lists" -o APT::Sandbox::User=root)
    apt-get "${apt_options[@]}" update -qq >&2
    (cd "$dir/apt" && apt-get "${apt_options[@]}" download -qq qemu-user/bookworm-backports >&2)
    dpkg-deb --fsys-tarfile "$dir"/apt/qemu-user_*.deb | tar -x -C "$dir" ./usr/bin/qemu-x86_64
    rm -r "$dir/apt"
  fi
  echo "$dir/usr/bin/qemu-x86_64"
}
