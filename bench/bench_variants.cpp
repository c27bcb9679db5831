// The clipping variants beside the L2 path they extend: p-norms (L1, L-infinity, general p) timed
// paired with the L2 norm of the same buffer, adaptive clipping and per-group thresholds, with a plain
// read of the same bytes as the memory roofline.
#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/group_clip.hpp>
#include <gradclip/norm.hpp>

#include "paired.hpp"

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <random>
#include <string>
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

// Every p-norm kernel and the robust L2 norm of one buffer, timed paired (bench/paired.hpp). Counters:
// <norm>_per_l2, the norm's throughput as a fraction of the L2 norm's (the targets: L1 and inf >= 0.9,
// p = 3 >= 0.5, p = 1.5 >= 0.2), and l2_GBps.
template <class T>
void p_norm_ratios(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto g = random_values<T>(n);
  const T* p = g.data();
  const auto reduce = [p, n](double order) {
    return [p, n, order] { benchmark::DoNotOptimize(gradclip::detail::reduce_run<gradclip::robust>(p, n, order).sum); };
  };
  std::vector<paired_timing::part> parts{{"l2", reduce(2.0)},
                                         {"l1", reduce(1.0)},
                                         {"inf", reduce(std::numeric_limits<double>::infinity())},
                                         {"p3", reduce(3.0)},
                                         {"p1.5", reduce(1.5)}};
  paired_timing::run_parts(state, parts, [] {});
  const double l2 = paired_timing::total_of(parts, "l2");
  for (const auto& part : parts)
    if (part.name != "l2") state.counters[part.name + "_per_l2"] = l2 / part.total;
  state.counters["l2_GBps"] = static_cast<double>(state.iterations()) * static_cast<double>(n * sizeof(T)) / l2 / 1e9;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// What binds the FP16 L1 norm (issue 28): bare loops that add |x| of FP16 elements into the kernel's 16
// FP64 lanes, without its blocks, by each widening, paired with sum_abs itself. Built with the bench
// preset's -march=native; vcvtph2pd only where the CPU has AVX512-FP16. Counters: <widening>_per_kernel
// (above 1: faster than the kernel). On the Intel Xeon of issue 28 (load 3.7): at 128 Ki f16c 1.03,
// wide 0.99, fp16 0.84 (vcvtph2pd is the slowest there); at 64 Mi all three 0.97-0.99.
namespace bare {

// The masked (maskz) intrinsics: see detail/simd.hpp (GCC bug 105593).
// The kernel's widening: 8 elements by vcvtph2ps, then vcvtps2pd; the sign cleared in FP64.
inline void f16c(const std::uint16_t* p, __m512d& lo, __m512d& hi) {
  const auto eight = [](const std::uint16_t* q) {
    return _mm512_andnot_pd(
        _mm512_set1_pd(-0.0),
        _mm512_maskz_cvtps_pd(0xff, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
  };
  lo = eight(p);
  hi = eight(p + 8);
}

// 16 elements by one vcvtph2ps, the sign cleared on the 16-bit integers.
inline void wide(const std::uint16_t* p, __m512d& lo, __m512d& hi) {
  const __m256i bits =
      _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi16(0x7fff));
  const __m512 f = _mm512_maskz_cvtph_ps(0xffff, bits);
  lo = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, f, 0));
  hi = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, f, 1));
}

#if defined(__AVX512FP16__)
// AVX512-FP16: 8 elements straight to FP64 by vcvtph2pd.
inline void fp16(const std::uint16_t* p, __m512d& lo, __m512d& hi) {
  const __m128i sign_off = _mm_set1_epi16(0x7fff);
  lo = _mm512_maskz_cvtph_pd(
      0xff, _mm_castsi128_ph(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), sign_off)));
  hi = _mm512_maskz_cvtph_pd(
      0xff, _mm_castsi128_ph(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)), sign_off)));
}
#endif

template <class Widen>
double sum_abs(const std::uint16_t* p, std::size_t n, Widen widen) {
  __m512d a = _mm512_setzero_pd(), b = a;
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    if (i % 32 == 0) __builtin_prefetch(p + i + 1024);  // the kernels' 2 KiB ahead, once per line
    __m512d lo, hi;
    widen(p + i, lo, hi);
    a = _mm512_add_pd(a, lo);
    b = _mm512_add_pd(b, hi);
  }
  double lanes[8];
  _mm512_storeu_pd(lanes, _mm512_add_pd(a, b));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

}  // namespace bare

void l1_fp16_widening(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto g = random_values<Eigen::half>(n);
  std::vector<std::uint16_t> bits(n);
  std::memcpy(bits.data(), g.data(), n * sizeof(std::uint16_t));
  const std::uint16_t* p = bits.data();
  std::vector<paired_timing::part> parts{
      {"kernel",
       [&] {
         benchmark::DoNotOptimize(gradclip::detail::with_isa(
             gradclip::detail::best_isa(), [&](auto k) { return decltype(k)::sum_abs(g.data(), n); }));
       }},
      {"f16c", [&] { benchmark::DoNotOptimize(bare::sum_abs(p, n, bare::f16c)); }},
      {"wide", [&] { benchmark::DoNotOptimize(bare::sum_abs(p, n, bare::wide)); }}};
#if defined(__AVX512FP16__)
  parts.push_back({"fp16", [&] { benchmark::DoNotOptimize(bare::sum_abs(p, n, bare::fp16)); }});
#endif
  paired_timing::run_parts(state, parts, [] {});
  const double kernel = paired_timing::total_of(parts, "kernel");
  for (const auto& part : parts)
    if (part.name != "kernel") state.counters[part.name + "_per_kernel"] = kernel / part.total;
}
#endif

// General p (1.5) by both paths of pnorm::general_kernel, paired, on short runs: where the tables'
// cost is repaid (pnorm::tables_from). Counter: tables_speedup (tables against the series; > 1 pays).
template <class T>
void p_norm_tables(benchmark::State& state) {
  namespace pnorm = gradclip::detail::pnorm;
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto g = random_values<T>(n);
  const T* p = g.data();
  const auto general = [p, n](pnorm::general_path path) {
    return [p, n, path] {
      benchmark::DoNotOptimize(gradclip::detail::with_isa(gradclip::detail::best_isa(), [&](auto k) {
                                 return pnorm::general_kernel<decltype(k)>(p, n, 1.5, path);
                               }).sum);
    };
  };
  std::vector<paired_timing::part> parts{{"series", general(pnorm::general_path::series)},
                                         {"tables", general(pnorm::general_path::tables)}};
  paired_timing::run_parts(state, parts, [] {});
  state.counters["tables_speedup"] =
      paired_timing::total_of(parts, "series") / paired_timing::total_of(parts, "tables");
}

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

// 128 Ki elements stay in cache, 64 Mi are far past it.
void ratio_sizes(benchmark::internal::Benchmark* b) { b->Arg(1 << 17)->Arg(1 << 26)->Unit(benchmark::kMillisecond); }

BENCHMARK(p_norm_ratios<Eigen::half>)->Apply(ratio_sizes);
BENCHMARK(p_norm_ratios<Eigen::bfloat16>)->Apply(ratio_sizes);
BENCHMARK(p_norm_ratios<float>)->Apply(ratio_sizes);
BENCHMARK(p_norm_ratios<double>)->Apply(ratio_sizes);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
BENCHMARK(l1_fp16_widening)->Apply(ratio_sizes);
#endif
BENCHMARK(p_norm_tables<Eigen::half>)->RangeMultiplier(2)->Range(1 << 9, 1 << 14);
BENCHMARK(p_norm_tables<Eigen::bfloat16>)->RangeMultiplier(2)->Range(1 << 9, 1 << 14);
BENCHMARK(p_norm_tables<float>)->RangeMultiplier(2)->Range(1 << 9, 1 << 14);
BENCHMARK(p_norm_tables<double>)->RangeMultiplier(2)->Range(1 << 9, 1 << 14);
BENCHMARK(plain_read<float>)->Apply(sizes);
BENCHMARK(plain_read<Eigen::half>)->Apply(sizes);
BENCHMARK(plain_read<double>)->Apply(sizes);
BENCHMARK(one_global_norm<float>)->Apply(sizes);
BENCHMARK(two_group_norms<float>)->Apply(sizes);
BENCHMARK(l2_clip_two_reads<float>)->Apply(sides);
BENCHMARK(adaptive<float, Eigen::ColMajor>)->Apply(sides);
BENCHMARK(adaptive<float, Eigen::RowMajor>)->Apply(sides);

}  // namespace

BENCHMARK_MAIN();
