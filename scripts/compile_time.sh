#!/usr/bin/env bash
# Compile-time benchmark (issue 26): builds the issue's table rows, tiny generated units, N times each with
# `c++ -O2 -c`, header-only and in compiled mode (-DGRADCLIP_COMPILED, which needs no library to compile),
# and prints each row's median cost beside its goal: CPU seconds (user + sys, what the compiler did, steady
# on a shared machine) and wall seconds (what a developer waits, inflated when other jobs run), both minus
# the same unit with only <Eigen/Core>; then, without a goal, the header-only calls on four more FP32
# gradient types (minus a unit with <Eigen/Core> and the Tensor module), which should cost nearly nothing
# more. Usage: scripts/compile_time.sh [N=3]   (CXX, CXXFLAGS honoured)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
cxx=${CXX:-g++}
# shellcheck disable=SC2206  # CXXFLAGS is meant to split into words
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

# The calls above on four more FP32 gradient types: what each further type of one element type costs.
cat >"$work/types.cpp" <<'CPP'
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>
#include <gradclip/gradclip.hpp>
#include <vector>
int main() {
  Eigen::VectorXf f = Eigen::VectorXf::Ones(100);
  Eigen::Matrix<Eigen::half, Eigen::Dynamic, 1> h(100);
  h.setConstant(Eigen::half(1));
  Eigen::MatrixXf m = Eigen::MatrixXf::Ones(10, 10);
  Eigen::ArrayXf a = Eigen::ArrayXf::Ones(100);
  Eigen::Tensor<float, 2> t(10, 10);
  t.setConstant(1.0f);
  std::vector<float> v(100, 1.0f);
  return static_cast<int>(gradclip::clip_by_norm(f, 1.0).norm + gradclip::clip_by_norm(h, 1.0).norm +
                          gradclip::clip_by_norm(m, 1.0).norm + gradclip::clip_by_norm(a, 1.0).norm +
                          gradclip::clip_by_norm(t, 1.0).norm + gradclip::clip_by_norm(v, 1.0).norm);
}
CPP
printf '#include <Eigen/Core>\n#include <unsupported/Eigen/CXX11/Tensor>\nint main() { return 0; }\n' >"$work/tensor_base.cpp"

median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

# "CPU wall": the median CPU and median wall seconds of n builds of $1 with extra flags $2...
median_build() {
  local src=$1
  shift
  local cpu=() wall=()
  for _ in $(seq "$n"); do
    /usr/bin/time -f '%U %S %e' -o "$work/time" "$cxx" "${flags[@]}" "$@" -c "$src" -o "$work/out.o"
    read -r user sys elapsed <"$work/time"
    cpu+=("$(echo "$user + $sys" | bc)")
    wall+=("$elapsed")
  done
  echo "$(printf '%s\n' "${cpu[@]}" | median) $(printf '%s\n' "${wall[@]}" | median)"
}

read -r base_cpu base_wall < <(median_build "$work/base.cpp")
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "compiler: $($cxx --version | head -1); ${flags[*]}; median of $n builds"
printf '%-56s %9s %9s   %s\n' "unit" "CPU s" "wall s" "goal"
printf '%-56s %9.2f %9.2f\n' "<Eigen/Core> alone (the base)" "$base_cpu" "$base_wall"
row() {
  local label=$1 goal=$2 src=$3
  shift 3
  local cpu wall
  read -r cpu wall < <(median_build "$src" "$@")
  [[ $goal == - ]] && goal="(no goal)" || goal="<= +$goal s"
  printf '%-56s %+9.2f %+9.2f   %s\n' "$label" "$(echo "$cpu - $base_cpu" | bc)" "$(echo "$wall - $base_wall" | bc)" \
    "$goal"
}
row "#include <gradclip/gradclip.hpp> alone" 1 "$work/include.cpp"
row "#include <gradclip/gradclip.hpp> alone (compiled mode)" 1 "$work/include.cpp" -DGRADCLIP_COMPILED
row "include + clip_by_norm FP32 and FP16 (header-only)" 5 "$work/calls.cpp"
row "include + clip_by_norm FP32 and FP16 (compiled mode)" 1.5 "$work/calls.cpp" -DGRADCLIP_COMPILED
# No goal: a further gradient type of an element type the unit already clips shares its pipeline, so this
# row, over a base with the Tensor module, comes out close to the header-only call row.
read -r base_cpu base_wall < <(median_build "$work/tensor_base.cpp")
printf '%-56s %9.2f %9.2f\n' "<Eigen/Core> and the Tensor module (the next row's base)" "$base_cpu" "$base_wall"
row "the calls + 4 more FP32 types: matrix, array, tensor..." "-" "$work/types.cpp"
