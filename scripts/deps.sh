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

# What every build needs: compilers, CMake, Eigen, GoogleTest.
GRADCLIP_BASE_PACKAGES=(g++ clang cmake make libeigen3-dev libgtest-dev)
