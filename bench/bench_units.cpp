// The pipeline over units (issue 23): per-example clipping (DP-SGD, flat and per layer), adaptive
// clipping (AGC) and group clipping, each paired in one loop (paired.hpp) against plain reads and
// rewrites of the same bytes, on one thread and on options::threads = 2, and against the K = 1 case on
// the same bytes (per-layer against flat DP, clip_by_group_norms against clip_by_global_norm). Counters
// are ratios of the parts' total times; same_bits checks, outside the timed loop, that 1, 2 and 3
// threads give the same bits.
#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/group_clip.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/per_example.hpp>

#include "paired.hpp"
#include "workloads.hpp"

#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using paired_timing::part;
using paired_timing::total_of;
using workloads::dtype_name;
using workloads::plain_read;

// ---- The roofline: workloads::plain_read, and an in-place XOR with a key the compiler cannot see
// (zero): a read and a write of every byte.

volatile std::uint64_t rewrite_key = 0;

void plain_rewrite(void* data, std::size_t bytes) {
  const std::uint64_t key = rewrite_key;
  auto* p = static_cast<unsigned char*>(data);
  for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, sizeof word);
    word ^= key;
    std::memcpy(p + i, &word, sizeof word);
  }
  benchmark::ClobberMemory();
}

/// f(first_half) on a helper thread started per call (as a library without a pool would) and
/// f(second_half) on the caller: what a second core gives a plain pass.
template <class F>
void on_two_threads(F&& f) {
  std::thread helper([&] { f(0); });
  f(1);
  helper.join();
}

template <class T>
void fill_normal(T* p, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t k = 0; k < n; ++k) p[k] = T(normal(rng));
}

gradclip::options on_threads(unsigned threads) {
  gradclip::options opt;
  opt.threads = threads;
  return opt;
}

template <class T>
bool same_bytes(const T& a, const T& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(a.data()[0]) * a.size()) == 0;
}

// ---- clip_per_example on one [B, D] batch into an FP32 sum. clip_x_2reads: two plain reads of the batch
// (the norms pass, the accumulation pass) / clip_per_example on one thread; norms_x_read and
// accumulate_x_read: each pass alone against one read; speedup_2t: one thread's time / two threads';
// read_gain_2t: the same for the plain read; same_bits: 1 when 1, 2 and 3 threads wrote the same sum
// and norms (checked before the loop).
template <class T, int Layout>
void per_example(benchmark::State& state) {
  const Eigen::Index examples = state.range(0), size = state.range(1);
  Eigen::Tensor<T, 2, Layout> batch(examples, size);
  fill_normal(batch.data(), static_cast<std::size_t>(batch.size()), 20261203);
  const std::size_t bytes = static_cast<std::size_t>(batch.size()) * sizeof(T);
  Eigen::Tensor<float, 1> sum(size);
  const auto input = std::tie(batch);
  auto output = std::tie(sum);

  std::vector<Eigen::Tensor<float, 1>> sums;
  std::vector<std::vector<double>> norms;
  for (unsigned threads : {1u, 2u, 3u}) {
    sums.emplace_back(size);
    norms.emplace_back();
    (void)gradclip::clip_per_example(input, std::tie(sums.back()), 1.0, on_threads(threads), norms.back());
  }
  bool same = true;
  for (std::size_t k = 1; k < sums.size(); ++k) same = same && same_bytes(sums[k], sums[0]) && norms[k] == norms[0];
  if (!same) state.SkipWithError("clip_per_example: the bits depend on the thread count");

  const auto plan = gradclip::plan_per_example(gradclip::per_example_partial_norms(input), 1.0);
  const gradclip::options two = on_threads(2);
  const auto* data = reinterpret_cast<const unsigned char*>(batch.data());
  const std::size_t half = bytes / 2;
  std::vector<part> parts{
      {"read", [&] { benchmark::DoNotOptimize(plain_read(data, bytes)); }},
      {"read_2t",
       [&] {
         std::uint64_t r[2];
         on_two_threads([&](int k) { r[k] = plain_read(data + k * half, k ? bytes - half : half); });
         benchmark::DoNotOptimize(r[0] ^ r[1]);
       }},
      {"norms", [&] { benchmark::DoNotOptimize(gradclip::per_example_partial_norms(input)); }},
      {"accumulate",
       [&] {
         gradclip::accumulate_per_example(input, output, plan);
         benchmark::ClobberMemory();
       }},
      {"clip", [&] { benchmark::DoNotOptimize(gradclip::clip_per_example(input, output, 1.0)); }},
      {"clip_2t", [&] { benchmark::DoNotOptimize(gradclip::clip_per_example(input, output, 1.0, two)); }}};
  paired_timing::run_parts(state, parts, [] {});
  const double read = total_of(parts, "read"), clip = total_of(parts, "clip");
  state.counters["clip_x_2reads"] = 2 * read / clip;
  state.counters["norms_x_read"] = read / total_of(parts, "norms");
  state.counters["accumulate_x_read"] = read / total_of(parts, "accumulate");
  state.counters["speedup_2t"] = clip / total_of(parts, "clip_2t");
  state.counters["read_gain_2t"] = read / total_of(parts, "read_2t");
  state.counters["read_GBps"] = static_cast<double>(bytes) * static_cast<double>(state.iterations()) / read / 1e9;
  state.counters["same_bits"] = same ? 1 : 0;
}

// ---- Per-layer against flat DP on the same bytes: eight per-example tensors (four weights and their
// biases, 527 872 elements an example) of a [B, ...] batch. per_layer_per_flat: per-layer time / flat
// time on options::threads = range(1); flat_x_2reads: two plain reads / flat.
constexpr long layer_sizes[] = {262144, 1024, 131072, 512, 65536, 512, 65536, 1024};

template <class T, int Layout>
void per_layer_against_flat(benchmark::State& state) {
  const Eigen::Index examples = state.range(0);
  const gradclip::options opt = on_threads(static_cast<unsigned>(state.range(1)));
  std::vector<Eigen::Tensor<T, 2, Layout>> batch;
  std::vector<Eigen::Tensor<float, 1>> sums;
  std::size_t bytes = 0;
  for (long size : layer_sizes) {
    batch.emplace_back(examples, size);
    fill_normal(batch.back().data(), static_cast<std::size_t>(batch.back().size()), 20261203 + batch.size());
    sums.emplace_back(size);
    bytes += static_cast<std::size_t>(batch.back().size()) * sizeof(T);
  }
  // Each layer's bound is its share of C = 1 by size, so that per-layer clipping binds as often as flat.
  std::vector<double> max_norms;
  for (long size : layer_sizes) max_norms.push_back(std::sqrt(static_cast<double>(size) / 527872.0));
  std::vector<part> parts{
      {"read",
       [&] {
         for (const auto& t : batch) benchmark::DoNotOptimize(plain_read(t.data(), t.size() * sizeof(T)));
       }},
      {"flat", [&] { benchmark::DoNotOptimize(gradclip::clip_per_example(batch, sums, 1.0, opt)); }},
      {"per_layer",
       [&] { benchmark::DoNotOptimize(gradclip::clip_per_example_per_layer(batch, sums, max_norms, opt)); }}};
  paired_timing::run_parts(state, parts, [] {});
  const double flat = total_of(parts, "flat");
  state.counters["per_layer_per_flat"] = total_of(parts, "per_layer") / flat;
  state.counters["flat_x_2reads"] = 2 * total_of(parts, "read") / flat;
  state.counters["MiB"] = static_cast<double>(bytes) / (1 << 20);
}

// ---- adaptive_clip on a rows x cols gradient with FP16 weights of the same shape, every unit (row)
// clipping on every call: the clipping factor shrinks 0.1 % a call after a first call that brought
// every row to the same ratio to its weights, and the buffer is restored (untimed) when it has halved.
// agc_x_roofline: (read(g, w) + rewrite(g)) / adaptive_clip on one thread; speedup_2t: one thread's time
// / two threads'; roofline_gain_2t: the same for the roofline's passes; all_clipped: the fraction of
// calls in which every unit clipped; same_bits: 1, 2 and 3 threads clip to the same bits.
// A range(0) x range(1) gradient and its weights, normally distributed, after a first call at a factor below
// every row's ||g_u|| / ||w_u||, which leaves every row at that ratio; returns the factor.
template <class Matrix>
double agc_setup(benchmark::State& state, Matrix& grad, Matrix& weights) {
  const Eigen::Index rows = state.range(0), cols = state.range(1);
  grad.resize(rows, cols);
  weights.resize(rows, cols);
  fill_normal(grad.data(), static_cast<std::size_t>(grad.size()), 20261203);
  fill_normal(weights.data(), static_cast<std::size_t>(weights.size()), 20261204);
  double ratio = std::numeric_limits<double>::infinity();
  for (Eigen::Index r = 0; r < rows; ++r)
    ratio = std::min(ratio, grad.row(r).template cast<double>().norm() / weights.row(r).template cast<double>().norm());
  const double start = 0.5 * ratio;
  (void)gradclip::adaptive_clip(grad, weights, start);
  return start;
}

template <class T, int Order>
void adaptive(benchmark::State& state) {
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>;
  matrix grad, weights;
  const double start = agc_setup(state, grad, weights);

  std::vector<matrix> clipped;
  for (unsigned threads : {1u, 2u, 3u}) {
    clipped.push_back(grad);
    (void)gradclip::adaptive_clip(clipped.back(), weights, 0.9 * start, 1e-3, on_threads(threads));
  }
  bool same = true;
  for (std::size_t k = 1; k < clipped.size(); ++k) same = same && same_bytes(clipped[k], clipped[0]);
  if (!same) state.SkipWithError("adaptive_clip: the bits depend on the thread count");
  clipped.clear();

  const matrix pristine = grad;
  const std::size_t bytes = static_cast<std::size_t>(grad.size()) * sizeof(T);
  const gradclip::options one = on_threads(1), two = on_threads(2);
  double clipping = start;
  std::size_t calls = 0, all = 0;
  const auto agc = [&](const gradclip::options& opt) {
    clipping *= 0.999;
    const auto r = gradclip::adaptive_clip(grad, weights, clipping, 1e-3, opt);
    ++calls;
    all += r.clipped == r.units;
  };
  auto* g = reinterpret_cast<unsigned char*>(grad.data());
  const auto* w = reinterpret_cast<const unsigned char*>(weights.data());
  const std::size_t half = bytes / 2;
  std::vector<part> parts{{"roofline",
                           [&] {
                             benchmark::DoNotOptimize(plain_read(g, bytes) ^ plain_read(w, bytes));
                             plain_rewrite(g, bytes);
                           }},
                          {"roofline_2t",
                           [&] {
                             std::uint64_t x[2];
                             on_two_threads([&](int k) {
                               const std::size_t at = k * half, n = k ? bytes - half : half;
                               x[k] = plain_read(g + at, n) ^ plain_read(w + at, n);
                               plain_rewrite(g + at, n);
                             });
                             benchmark::DoNotOptimize(x[0] ^ x[1]);
                           }},
                          {"agc", [&] { agc(one); }},
                          {"agc_2t", [&] { agc(two); }}};
  paired_timing::run_parts(state, parts, [&] {
    if (clipping < 0.5 * start) {
      grad = pristine;
      clipping = start;
    }
  });
  const double one_thread = total_of(parts, "agc");
  state.counters["agc_x_roofline"] = total_of(parts, "roofline") / one_thread;
  state.counters["speedup_2t"] = one_thread / total_of(parts, "agc_2t");
  state.counters["roofline_gain_2t"] = total_of(parts, "roofline") / total_of(parts, "roofline_2t");
  state.counters["all_clipped"] = calls ? static_cast<double>(all) / static_cast<double>(calls) : 0;
  state.counters["same_bits"] = same ? 1 : 0;
}

// ---- adaptive_clip alone in a loop on one thread, as a training step calls it, every unit clipping.
// faults_per_call: the process's minor page faults (getrusage) over the loop, per call. A call's per-unit
// arrays come from blocks its thread keeps (detail/scratch.hpp); allocated afresh, glibc gave them back to
// the system and each call faulted them in again (17 us a fault on the AMD guest of docs/bench).
template <class T, int Order>
void adaptive_alone(benchmark::State& state) {
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>;
  matrix grad, weights;
  const double start = agc_setup(state, grad, weights);
  const matrix pristine = grad;
  double clipping = start;
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  for (auto _ : state) {
    clipping *= 0.999;
    if (clipping < 0.5 * start) {
      grad = pristine;  // same size: no allocation, no fault
      clipping = start;
    }
    benchmark::DoNotOptimize(gradclip::adaptive_clip(grad, weights, clipping, 1e-3, on_threads(1)).clipped);
  }
  getrusage(RUSAGE_SELF, &after);
  state.counters["faults_per_call"] =
      static_cast<double>(after.ru_minflt - before.ru_minflt) / static_cast<double>(state.iterations());
}

// ---- clip_by_group_norms against clip_by_global_norm on the same tensors (range(0) tensors of range(1)
// elements, in range(2) groups of consecutive tensors), both binding on every call: each threshold is
// 0.999 of the norm its group (or the whole) has after the previous calls, tracked from the results.
// groups_per_global: group time / global time; global_x_roofline and groups_x_roofline: (a read of every
// tensor, then a rewrite of every tensor) / each; all_bound: the fraction of calls in which every
// threshold bound.
template <class T>
void groups_against_global(benchmark::State& state) {
  const std::size_t count = static_cast<std::size_t>(state.range(0)), size = static_cast<std::size_t>(state.range(1));
  const std::size_t group_count = static_cast<std::size_t>(state.range(2)), per_group = count / group_count;
  std::vector<Eigen::Tensor<T, 1>> tensors;
  for (std::size_t k = 0; k < count; ++k) {
    tensors.emplace_back(static_cast<Eigen::Index>(size));
    fill_normal(tensors.back().data(), size, 20261203 + k);
  }
  const auto pristine = tensors;
  std::vector<gradclip::param_group> groups(group_count);
  for (std::size_t j = 0; j < group_count; ++j) {
    groups[j].name = "group " + std::to_string(j);
    for (std::size_t k = j * per_group; k < (j + 1) * per_group; ++k) groups[j].grads.emplace_back(tensors[k]);
  }
  std::vector<double> initial(group_count);
  for (std::size_t j = 0; j < group_count; ++j) {
    const std::vector<Eigen::Tensor<T, 1>> members(tensors.begin() + static_cast<std::ptrdiff_t>(j * per_group),
                                                   tensors.begin() + static_cast<std::ptrdiff_t>((j + 1) * per_group));
    initial[j] = gradclip::global_norm(members);
  }
  std::vector<double> norms = initial;  // each group's norm now
  const auto whole = [&] {
    double s = 0;
    for (double n : norms) s += n * n;
    return std::sqrt(s);
  };
  std::size_t calls = 0, bound = 0;
  std::vector<part> parts{{"roofline",
                           [&] {
                             for (const auto& t : tensors)
                               benchmark::DoNotOptimize(plain_read(t.data(), size * sizeof(T)));
                             for (auto& t : tensors) plain_rewrite(t.data(), size * sizeof(T));
                           }},
                          {"global",
                           [&] {
                             const auto r = gradclip::clip_by_global_norm(tensors, 0.999 * whole());
                             for (double& n : norms) n *= r.coefficient;
                             ++calls;
                             bound += r.clipped;
                           }},
                          {"groups", [&] {
                             for (std::size_t j = 0; j < group_count; ++j) groups[j].max_norm = 0.999 * norms[j];
                             const auto results = gradclip::clip_by_group_norms(groups);
                             bool every = true;
                             for (std::size_t j = 0; j < group_count; ++j) {
                               norms[j] = results[j].result.norm * results[j].result.coefficient;
                               every = every && results[j].result.clipped;
                             }
                             ++calls;
                             bound += every;
                           }}};
  paired_timing::run_parts(state, parts, [&] {
    if (whole() < 0.5 * std::sqrt(static_cast<double>(count * size))) {
      for (std::size_t k = 0; k < count; ++k) std::memcpy(tensors[k].data(), pristine[k].data(), size * sizeof(T));
      norms = initial;
    }
  });
  const double global = total_of(parts, "global"), roofline = total_of(parts, "roofline");
  state.counters["groups_per_global"] = total_of(parts, "groups") / global;
  state.counters["global_x_roofline"] = roofline / global;
  state.counters["groups_x_roofline"] = roofline / total_of(parts, "groups");
  state.counters["all_bound"] = calls ? static_cast<double>(bound) / static_cast<double>(calls) : 0;
}

void paired_timing_of(benchmark::internal::Benchmark* b) {
  b->MinTime(0.5)->UseRealTime()->Unit(benchmark::kMillisecond);
}

void batch(benchmark::internal::Benchmark* b) { paired_timing_of(b->Args({64, 512 * 1024})); }
void layers(benchmark::internal::Benchmark* b) { paired_timing_of(b->Args({64, 1})->Args({64, 2})); }
// The 4096 x 4096, and 4000 rows: a column-major leading dimension of 8000 bytes instead of 8 KiB,
// to tell the cache's set conflicts (power-of-two strides) from the kernels' own cost.
void square(benchmark::internal::Benchmark* b) { paired_timing_of(b->Args({4096, 4096})->Args({4000, 4096})); }
void group_shapes(benchmark::internal::Benchmark* b) {
  // bench_clip's group (256 x 16 Ki) and 64 tensors of 1 Mi, out of cache; 4 groups and one per tensor.
  paired_timing_of(
      b->Args({256, 16 * 1024, 4})->Args({256, 16 * 1024, 256})->Args({64, 1 << 20, 4})->Args({64, 1 << 20, 64}));
}

BENCHMARK(per_example<Eigen::half, Eigen::ColMajor>)->Apply(batch);
BENCHMARK(per_example<Eigen::half, Eigen::RowMajor>)->Apply(batch);
BENCHMARK(per_example<Eigen::bfloat16, Eigen::ColMajor>)->Apply(batch);
BENCHMARK(per_example<Eigen::bfloat16, Eigen::RowMajor>)->Apply(batch);
BENCHMARK(per_layer_against_flat<Eigen::half, Eigen::ColMajor>)->Apply(layers);
BENCHMARK(per_layer_against_flat<Eigen::half, Eigen::RowMajor>)->Apply(layers);
BENCHMARK(adaptive<Eigen::half, Eigen::ColMajor>)->Apply(square);
BENCHMARK(adaptive<Eigen::half, Eigen::RowMajor>)->Apply(square);
BENCHMARK(adaptive_alone<Eigen::half, Eigen::ColMajor>)->Args({4096, 4096})->Unit(benchmark::kMillisecond);
BENCHMARK(adaptive_alone<Eigen::half, Eigen::RowMajor>)->Args({4096, 4096})->Unit(benchmark::kMillisecond);
BENCHMARK(groups_against_global<Eigen::half>)->Apply(group_shapes);
BENCHMARK(groups_against_global<float>)->Apply(group_shapes);

}  // namespace

BENCHMARK_MAIN();
