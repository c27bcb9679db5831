// The clipping variants beside the L2 path they extend: p-norms (L1, L-infinity, general p), adaptive
// clipping and per-group thresholds, with a plain read of the same bytes as the memory roofline.
#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/group_clip.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/p_norm.hpp>

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

template <class T>
std::vector<T> random_values(std::size_t n, double scale = 1.0) {
  std::mt19937_64 rng(20261202);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(normal(rng));
  return v;
}

template <class T>
void set_bytes(benchmark::State& state, std::size_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n * sizeof(T)));
}

// The roofline: every byte read once as 64-bit words and folded by XOR, which vectorizes fully.
template <class T>
void plain_read(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto g = random_values<T>(n);
  std::vector<std::uint64_t> words(n * sizeof(T) / sizeof(std::uint64_t));
  std::memcpy(words.data(), g.data(), words.size() * sizeof(std::uint64_t));
  for (auto _ : state) {
    std::uint64_t folded = 0;
    for (std::uint64_t w : words) folded ^= w;
    benchmark::DoNotOptimize(folded);
  }
  set_bytes<T>(state, n);
}

// The existing L2 norm: the baseline every variant is compared to.
template <class T>
void l2_norm(benchmark::State& state) {
  const auto g = random_values<T>(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::norm(g));
  set_bytes<T>(state, g.size());
}

// p as a template argument in tenths (std::numeric_limits<int>::max() for inf) so names show it.
template <class T, int TenthsOfP>
void p_norm(benchmark::State& state) {
  const auto g = random_values<T>(static_cast<std::size_t>(state.range(0)));
  const double p =
      TenthsOfP == std::numeric_limits<int>::max() ? std::numeric_limits<double>::infinity() : TenthsOfP / 10.0;
  const gradclip::norm_type type{p};
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::norm(g, type));
  set_bytes<T>(state, g.size());
}

constexpr int inf = std::numeric_limits<int>::max();

// Clipping by one global norm of two tensors versus two groups with their own thresholds (neither
// binds, so both cost the norm pass and the bookkeeping).
template <class T>
void one_global_norm(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto a = random_values<T>(n / 4), b = random_values<T>(n - n / 4);
  std::vector<gradclip::grad_view> grads{gradclip::grad_view(a), gradclip::grad_view(b)};
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::clip_by_global_norm(grads, 1e30));
  set_bytes<T>(state, n);
}

template <class T>
void two_group_norms(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  auto a = random_values<T>(n / 4), b = random_values<T>(n - n / 4);
  const std::vector<gradclip::param_group> groups{{"embeddings", {gradclip::grad_view(a)}, 1e30},
                                                  {"rest", {gradclip::grad_view(b)}, 1e30}};
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::clip_by_group_norms(groups));
  set_bytes<T>(state, n);
}

// AGC on a square weight matrix (units = rows): column-major rows are strided, row-major rows are
// contiguous. Gradient and weights are both read, so bytes count both; the gradient is rewritten
// whenever a row clips (every row here, every iteration: after one clip ||g_u|| == max_norm_u).
template <class T, int Options>
void adaptive(benchmark::State& state) {
  const auto side = static_cast<Eigen::Index>(state.range(0));
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Options>;
  const auto values = random_values<T>(static_cast<std::size_t>(side * side));
  matrix g = Eigen::Map<const matrix>(values.data(), side, side);
  const matrix w = g * T(10.0f);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::adaptive_clip(g, w, 0.01));
  set_bytes<T>(state, static_cast<std::size_t>(2 * side * side));
}

// The same bytes through the L2 clip (binding every iteration: max_norm below the norm), for AGC's ratio.
template <class T>
void l2_clip_two_reads(benchmark::State& state) {
  const auto side = static_cast<std::size_t>(state.range(0));
  auto g = random_values<T>(side * side), w = random_values<T>(side * side);
  for (auto _ : state) {
    benchmark::DoNotOptimize(gradclip::norm(w));
    benchmark::DoNotOptimize(gradclip::clip_by_norm(g, 0.0));
  }
  set_bytes<T>(state, 2 * side * side);
}

// 16 Ki elements sit in L2 cache, 1 Mi around the last level, 16 Mi well past it.
void sizes(benchmark::internal::Benchmark* b) { b->RangeMultiplier(64)->Range(1 << 14, 1 << 24); }
void sides(benchmark::internal::Benchmark* b) { b->Arg(128)->Arg(1024)->Arg(4096); }

BENCHMARK(plain_read<float>)->Apply(sizes);
BENCHMARK(l2_norm<float>)->Apply(sizes);
BENCHMARK(p_norm<float, 20>)->Apply(sizes);
BENCHMARK(p_norm<float, 10>)->Apply(sizes);
BENCHMARK(p_norm<float, inf>)->Apply(sizes);
BENCHMARK(p_norm<float, 30>)->Apply(sizes);
BENCHMARK(p_norm<float, 5>)->Apply(sizes);
BENCHMARK(plain_read<Eigen::half>)->Apply(sizes);
BENCHMARK(l2_norm<Eigen::half>)->Apply(sizes);
BENCHMARK(p_norm<Eigen::half, 10>)->Apply(sizes);
BENCHMARK(p_norm<Eigen::half, inf>)->Apply(sizes);
BENCHMARK(plain_read<double>)->Apply(sizes);
BENCHMARK(l2_norm<double>)->Apply(sizes);
BENCHMARK(p_norm<double, 10>)->Apply(sizes);
BENCHMARK(p_norm<double, inf>)->Apply(sizes);
BENCHMARK(one_global_norm<float>)->Apply(sizes);
BENCHMARK(two_group_norms<float>)->Apply(sizes);
BENCHMARK(l2_clip_two_reads<float>)->Apply(sides);
BENCHMARK(adaptive<float, Eigen::ColMajor>)->Apply(sides);
BENCHMARK(adaptive<float, Eigen::RowMajor>)->Apply(sides);

}  // namespace

BENCHMARK_MAIN();
