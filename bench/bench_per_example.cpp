// Per-example clipping: the per-example norms against a plain read of the same bytes (the memory roofline),
// both storage orders; clip_per_example whole; and ghost clipping of a dense layer against materializing
// each example's weight gradient, across T, d_in and d_out. Parts of one measurement are timed inside one
// loop in rotating order (paired.hpp); the counters are ratios of their total times.
#include <gradclip/ghost_norm.hpp>
#include <gradclip/per_example.hpp>

#include "paired.hpp"
#include "workloads.hpp"

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

using paired_timing::part;
using paired_timing::total_of;
using workloads::plain_read;

template <class T, int Layout>
Eigen::Tensor<T, 2, Layout> random_batch(Eigen::Index examples, Eigen::Index size) {
  std::mt19937_64 rng(20261202);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Eigen::Tensor<T, 2, Layout> t(examples, size);
  for (Eigen::Index k = 0; k < t.size(); ++k) t.data()[k] = T(normal(rng));
  return t;
}

// norms_x_read: read time / per-example norms time (1 = memory speed); clip_x_read the same for
// clip_per_example (norms, then the weighted sum: two reads of the batch).
template <class T, int Layout>
void per_example_norms(benchmark::State& state) {
  const Eigen::Index examples = state.range(0), size = state.range(1);
  const auto batch = random_batch<T, Layout>(examples, size);
  Eigen::Tensor<float, 1> sum(size);
  const std::size_t bytes = static_cast<std::size_t>(batch.size()) * sizeof(T);
  std::vector<part> parts{
      {"read", [&] { benchmark::DoNotOptimize(plain_read(batch.data(), bytes)); }},
      {"norms", [&] { benchmark::DoNotOptimize(gradclip::per_example_partial_norms(std::tie(batch))); }},
      {"clip", [&] { benchmark::DoNotOptimize(gradclip::clip_per_example(std::tie(batch), std::tie(sum), 1.0)); }}};
  paired_timing::run_parts(state, parts, [] {});
  const double read = total_of(parts, "read");
  state.counters["norms_x_read"] = read / total_of(parts, "norms");
  state.counters["clip_x_read"] = read / total_of(parts, "clip");
  state.counters["read_GBps"] = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / read / 1e9;
}

// A dense layer y_t = W x_t + b over B = 32 examples of T steps: ghost clipping (ghost norms, the plan,
// one GEMM for the clipped sum) against materializing each example's B_i^T A_i, taking its norm, and
// summing the clipped matrices. materialize_per_ghost: materialize time / ghost time (> 1: ghost wins);
// gram_per_direct: the norms alone in the two forms.
void ghost_against_materialized(benchmark::State& state) {
  const Eigen::Index examples = 32, steps = state.range(0), d_in = state.range(1), d_out = state.range(2);
  const Eigen::MatrixXf x = Eigen::MatrixXf::Random(examples * steps, d_in);
  const Eigen::MatrixXf dy = Eigen::MatrixXf::Random(examples * steps, d_out);
  Eigen::MatrixXf sum_w(d_out, d_in);
  Eigen::VectorXf sum_b(d_out);
  const std::size_t t = static_cast<std::size_t>(steps);
  const auto ghost = [&](gradclip::ghost_form form) {
    std::vector<gradclip::partial_norm> parts;
    (void)gradclip::add_ghost_norms(parts, x, dy, t, true, form);
    return parts;
  };
  std::vector<part> parts{
      {"ghost",
       [&] {
         const auto plan = gradclip::plan_per_example(ghost(gradclip::ghost_form::automatic), 1.0);
         gradclip::ghost_weighted_sum(plan, x, dy, t, sum_w, sum_b);
         benchmark::ClobberMemory();
       }},
      {"materialize",
       [&] {
         std::vector<Eigen::MatrixXf> grads(static_cast<std::size_t>(examples));
         std::vector<gradclip::partial_norm> norms(grads.size());
         for (Eigen::Index i = 0; i < examples; ++i) {
           auto& g = grads[static_cast<std::size_t>(i)];
           g.noalias() = dy.middleRows(i * steps, steps).transpose() * x.middleRows(i * steps, steps);
           Eigen::VectorXf bias = dy.middleRows(i * steps, steps).colwise().sum().transpose();
           norms[static_cast<std::size_t>(i)] = gradclip::per_example_partial_norms(std::tie(g))[0];
           norms[static_cast<std::size_t>(i)].merge(gradclip::partial_norm{0, bias.cast<double>().squaredNorm(), true});
         }
         const auto plan = gradclip::plan_per_example(norms, 1.0);
         sum_w.setZero();
         for (std::size_t i = 0; i < grads.size(); ++i) sum_w += static_cast<float>(plan.coefficient(i)) * grads[i];
         benchmark::ClobberMemory();
       }},
      {"gram", [&] { benchmark::DoNotOptimize(ghost(gradclip::ghost_form::gram)); }},
      {"direct", [&] { benchmark::DoNotOptimize(ghost(gradclip::ghost_form::direct)); }}};
  paired_timing::run_parts(state, parts, [] {});
  state.counters["materialize_per_ghost"] = total_of(parts, "materialize") / total_of(parts, "ghost");
  state.counters["gram_per_direct"] = total_of(parts, "gram") / total_of(parts, "direct");
}

void batch_sizes(benchmark::internal::Benchmark* b) {
  b->Args({64, 4096})->Args({64, 1 << 18})->UseRealTime()->Unit(benchmark::kMicrosecond);
}

void layer_shapes(benchmark::internal::Benchmark* b) {
  for (long steps : {1, 4, 16, 64, 256})
    for (long d : {64, 256, 1024}) b->Args({steps, d, d});
  b->Args({16, 1024, 16})->Args({16, 16, 1024})->UseRealTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(per_example_norms<Eigen::half, Eigen::ColMajor>)->Apply(batch_sizes);
BENCHMARK(per_example_norms<Eigen::half, Eigen::RowMajor>)->Apply(batch_sizes);
BENCHMARK(per_example_norms<float, Eigen::ColMajor>)->Apply(batch_sizes);
BENCHMARK(per_example_norms<float, Eigen::RowMajor>)->Apply(batch_sizes);
BENCHMARK(ghost_against_materialized)->Apply(layer_shapes);

}  // namespace

BENCHMARK_MAIN();
