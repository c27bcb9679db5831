#!/usr/bin/env bash
# Compile-time benchmark (issue 26): times the issue's table rows as the median of N `c++ -O2 -c` builds
# of tiny generated TUs, minus the same TU with only <Eigen/Core>, and prints each next to its goal.
# In compiled mode (GRADCLIP_LIB=path to the built library's archive, optional) the rows are also built
# with -DGRADCLIP_COMPILED. Usage: scripts/compile_time.sh [N=3]   (CXX, CXXFLAGS honoured)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
cxx=${CXX:-g++}
flags=(-std=c++17 -O2 -I include -isystem /usr/include/eigen3 ${CXXFLAGS:-})
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '#include <Eigen/Core>\nint main() { return 0; }\n' >"$work/base.cpp"
printf '#include <Eigen/Core>\n#include <gradclip/gradclip.hpp>\nint main() { return 0; }\n' >"$work/include.cpp"
cat >"$work/calls.cpp" <<'CPP'
#include <Eigen/Core>
#include <gradclip/gradclip.hpp>
int main() {
  Eigen::VectorXf f = Eigen::VectorXf::Ones(100);
  Eigen::Matrix<Eigen::half, Eigen::Dynamic, 1> h(100);
  h.setConstant(Eigen::half(1));
  return static_cast<int>(gradclip::clip_by_norm(f, 1.0).norm + gradclip::clip_by_norm(h, 1.0).norm);
}
CPP

# Median wall seconds of n builds of $1 with extra flags $2...
median_build() {
  local src=$1; shift
  local times=()
  for _ in $(seq "$n"); do
    local start end
    start=$(date +%s.%N)
    "$cxx" "${flags[@]}" "$@" -c "$src" -o "$work/out.o"
    end=$(date +%s.%N)
    times+=("$(echo "$end - $start" | bc)")
  done
  printf '%s\n' "${times[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}

base=$(median_build "$work/base.cpp")
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $cxx; median of $n builds"
echo "<Eigen/Core> alone: ${base} s"
row() {
  local label=$1 goal=$2 src=$3; shift 3
  local t
  t=$(median_build "$src" "$@")
  printf '%-55s +%.2f s   goal <= +%s s\n' "$label" "$(echo "$t - $base" | bc)" "$goal"
}
row "#include <gradclip/gradclip.hpp> alone" 1 "$work/include.cpp"
row "include + clip_by_norm FP32 and FP16 (header-only)" 5 "$work/calls.cpp"
if [[ -n "${GRADCLIP_LIB:-}" ]]; then
  row "include + clip_by_norm FP32 and FP16 (compiled mode)" 1.5 "$work/calls.cpp" -DGRADCLIP_COMPILED
fi
