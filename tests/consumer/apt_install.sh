#!/bin/bash
# Installs the Debian package with apt, builds the consumer against the system with find_package and with
# pkg-config, then removes the package again if it was not installed before. This modifies the system, so
# it runs only where GRADCLIP_SYSTEM_TESTS=1 (CI, as root on a fresh machine); elsewhere it skips (77).
# Usage: apt_install.sh <package.deb> <consumer source dir> <work dir> <c++ compiler> [compiled: ON or OFF]
set -euo pipefail
deb=$1 consumer=$2 work=$3 cxx=$4 compiled=${5:-OFF}

if [[ ${GRADCLIP_SYSTEM_TESTS:-0} != 1 ]]; then
  echo "skipped: set GRADCLIP_SYSTEM_TESTS=1 to let this test install a package into the system"
  exit 77
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
  echo "skipped: needs root, apt-get and dpkg"
  exit 77
fi

if ! dpkg-query -W -f='${Status}' libgradclip-dev 2>/dev/null | grep -q "install ok installed"; then
  trap 'DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq libgradclip-dev >/dev/null' EXIT
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$deb"

rm -rf "$work"
cmake -S "$consumer" -B "$work/find_package" -DCMAKE_CXX_COMPILER="$cxx" -DGRADCLIP_CONSUMER_ROUTE=find_package \
  -DGRADCLIP_CONSUMER_EXPECT_COMPILED="$compiled"
cmake --build "$work/find_package"
"$work/find_package/consumer"
if command -v pkg-config >/dev/null; then
  GRADCLIP_CONSUMER_EXPECT_COMPILED=$compiled "$consumer/pkg_config_consumer.sh" "$cxx" "$consumer/main.cpp" \
    "$work/pkg-config-consumer"
fi
