// Every policy x element type x size for norm, clip that binds and clip that does not, groups of 256
// tensors, and in the same binary the baselines that judge them: a plain read and a plain in-place
// rewrite of the same bytes (the roofline), Eigen's norm(), stableNorm() and blueNorm(), and the naive
// Eigen expressions a user would write. Names are op/policy/dtype/elements, for scripts/plot.py.
#include <gradclip/gradclip.hpp>

#include <benchmark/benchmark.h>
#include <unsupported/Eigen/CXX11/Tensor>

#include <Eigen/Core>

#include "paired.hpp"
#include "workloads.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GRADCLIP_BENCH_X86 1
#else
#define GRADCLIP_BENCH_X86 0
#endif

namespace {

using workloads::dtype_name;

// ---- The roofline: the fastest this machine reads (and rewrites) the bytes. Eight independent
// accumulators of 256-bit and of 512-bit vectors, each measured: which load width streams faster
// depends on the CPU (on the Zen 5 of docs/bench, 256-bit loads by 1.3x), and the roofline is the
// faster of the two. The portable loop stands in where neither instruction set runs.

enum class width { w256, w512 };

#if GRADCLIP_BENCH_X86
__attribute__((target("avx512f"))) std::uint64_t read_512(const unsigned char* p, std::size_t bytes) {
  __m512i a[8];
  for (auto& x : a) x = _mm512_setzero_si512();
  std::size_t i = 0;
  for (; i + 512 <= bytes; i += 512)
    for (int k = 0; k < 8; ++k) a[k] = _mm512_add_epi64(a[k], _mm512_loadu_si512(p + i + 64 * k));
  for (int k = 1; k < 8; ++k) a[0] = _mm512_add_epi64(a[0], a[k]);
  std::uint64_t lanes[8];
  _mm512_storeu_si512(lanes, a[0]);
  std::uint64_t sum = 0;
  for (auto x : lanes) sum += x;
  for (; i < bytes; ++i) sum += p[i];
  return sum;
}

__attribute__((target("avx512f"))) void rewrite_512(unsigned char* p, std::size_t bytes, std::uint64_t key) {
  const __m512i k = _mm512_set1_epi64(static_cast<long long>(key));
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m512i x0 = _mm512_loadu_si512(p + i), x1 = _mm512_loadu_si512(p + i + 64);
    _mm512_storeu_si512(p + i, _mm512_xor_si512(x0, k));
    _mm512_storeu_si512(p + i + 64, _mm512_xor_si512(x1, k));
  }
  for (; i < bytes; ++i) p[i] = static_cast<unsigned char>(p[i] ^ key);
}

__attribute__((target("avx2"))) std::uint64_t read_256(const unsigned char* p, std::size_t bytes) {
  __m256i a[8];
  for (auto& x : a) x = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 256 <= bytes; i += 256)
    for (int k = 0; k < 8; ++k)
      a[k] = _mm256_add_epi64(a[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32 * k)));
  for (int k = 1; k < 8; ++k) a[0] = _mm256_add_epi64(a[0], a[k]);
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a[0]);
  std::uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < bytes; ++i) sum += p[i];
  return sum;
}

__attribute__((target("avx2"))) void rewrite_256(unsigned char* p, std::size_t bytes, std::uint64_t key) {
  const __m256i k = _mm256_set1_epi64x(static_cast<long long>(key));
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    auto* q = reinterpret_cast<__m256i*>(p + i);
    const __m256i x0 = _mm256_loadu_si256(q), x1 = _mm256_loadu_si256(q + 1);
    const __m256i x2 = _mm256_loadu_si256(q + 2), x3 = _mm256_loadu_si256(q + 3);
    _mm256_storeu_si256(q, _mm256_xor_si256(x0, k));
    _mm256_storeu_si256(q + 1, _mm256_xor_si256(x1, k));
    _mm256_storeu_si256(q + 2, _mm256_xor_si256(x2, k));
    _mm256_storeu_si256(q + 3, _mm256_xor_si256(x3, k));
  }
  for (; i < bytes; ++i) p[i] = static_cast<unsigned char>(p[i] ^ key);
}
#endif

bool width_supported(width w) {
#if GRADCLIP_BENCH_X86
  return w == width::w512 ? __builtin_cpu_supports("avx512f") : __builtin_cpu_supports("avx2");
#else
  return w == width::w256;  // the portable loop, registered once
#endif
}

const char* width_name(width w) { return w == width::w512 ? "512" : "256"; }

std::uint64_t read_bytes(const void* data, std::size_t bytes, width w = width::w256) {
  const auto* p = static_cast<const unsigned char*>(data);
#if GRADCLIP_BENCH_X86
  if (w == width::w512) return read_512(p, bytes);
  return read_256(p, bytes);
#else
  static_cast<void>(w);
  std::uint64_t a[8] = {};
  std::size_t i = 0;
  for (; i + 64 <= bytes; i += 64)
    for (int k = 0; k < 8; ++k) {
      std::uint64_t x;
      std::memcpy(&x, p + i + 8 * k, 8);
      a[k] += x;
    }
  std::uint64_t sum = 0;
  for (auto x : a) sum += x;
  for (; i < bytes; ++i) sum += p[i];
  return sum;
#endif
}

// XOR with a key the compiler cannot see (zero): a read and a write of every byte.
void rewrite_bytes(void* data, std::size_t bytes, std::uint64_t key, width w) {
  auto* p = static_cast<unsigned char*>(data);
#if GRADCLIP_BENCH_X86
  if (w == width::w512) return rewrite_512(p, bytes, key);
  return rewrite_256(p, bytes, key);
#else
  static_cast<void>(w);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(p[i] ^ key);
#endif
}

// ---- Data: uniform in [-1, 1), the same for every case of an element type and size.

template <class Policy>
const char* policy_name() {
  if constexpr (std::is_same_v<Policy, gradclip::naive>) return "naive";
  if constexpr (std::is_same_v<Policy, gradclip::promote>) return "promote";
  if constexpr (std::is_same_v<Policy, gradclip::max_scale>) return "max_scale";
  if constexpr (std::is_same_v<Policy, gradclip::robust>) return "robust";
}

template <class T>
void fill(T* p, std::size_t n, std::uint64_t state) {
  for (std::size_t i = 0; i < n; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    p[i] = static_cast<T>(static_cast<float>(static_cast<double>(state >> 11) * 0x1p-52 - 1.0));
  }
}

// The buffer of the current element type and size, and a pristine copy to restore it from. Cases are
// registered type by type and size by size, so each buffer is filled once per size.
template <class T>
struct buffers {
  std::vector<T> pristine, work;
  static buffers& get(std::size_t n) {
    static buffers b;
    if (b.pristine.size() != n) {
      b.pristine.assign(n, T(0));
      b.pristine.shrink_to_fit();
      fill(b.pristine.data(), n, 0x9e3779b97f4a7c15ull);
    }
    b.work = b.pristine;
    return b;
  }
};

void set_counters(benchmark::State& state, std::size_t bytes, double reads, double writes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["reads"] = reads;
  state.counters["writes"] = writes;
}

// A clip that binds on every iteration: max_norm follows the shrinking norm down by 0.1% a step, and the
// buffer is restored every 1024 steps (amortized, inside the timing: under 0.1% of a pass).
template <class Clip, class Restore>
void binding_loop(benchmark::State& state, double norm, Clip&& clip, Restore&& restore) {
  double max_norm = 0.999 * norm;
  std::size_t step = 0;
  for (auto _ : state) {
    if (++step % 1024 == 0) {
      restore();
      max_norm = 0.999 * norm;
    }
    benchmark::DoNotOptimize(clip(max_norm));
    max_norm *= 0.999;
  }
}

// ---- gradclip cases.

template <class Policy, class T>
void gradclip_norm(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::norm<Policy>(b.work.data(), n));
  set_counters(state, n * sizeof(T), 1, 0);
}

template <class Policy, class T>
void gradclip_clip_binds(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  binding_loop(
      state, gradclip::norm<gradclip::robust>(b.work.data(), n),
      [&](double max_norm) { return gradclip::clip_by_norm<Policy>(b.work.data(), n, max_norm).coefficient; },
      [&] { std::memcpy(b.work.data(), b.pristine.data(), n * sizeof(T)); });
  set_counters(state, n * sizeof(T), 2, 1);
}

template <class Policy, class T>
void gradclip_clip_nobind(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::clip_by_norm<Policy>(b.work.data(), n, 1e30).norm);
  set_counters(state, n * sizeof(T), 1, 0);
}

// options::threads = 2 (the persistent pool's worker and the caller), against read_2threads.
const gradclip::options two_threads{gradclip::on_nonfinite::skip, 0.0, gradclip::l2_norm, 2};
template <class T>
void gradclip_norm_2threads(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::norm(b.work.data(), n, two_threads));
  set_counters(state, n * sizeof(T), 1, 0);
}

template <class T>
void gradclip_clip_binds_2threads(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  binding_loop(
      state, gradclip::norm(b.work.data(), n),
      [&](double max_norm) { return gradclip::clip_by_norm(b.work.data(), n, max_norm, two_threads).coefficient; },
      [&] { std::memcpy(b.work.data(), b.pristine.data(), n * sizeof(T)); });
  set_counters(state, n * sizeof(T), 2, 1);
}

// ---- Baselines.

template <class T>
void baseline_read(benchmark::State& state, std::size_t n, width w) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) benchmark::DoNotOptimize(read_bytes(b.work.data(), n * sizeof(T), w));
  set_counters(state, n * sizeof(T), 1, 0);
}

// The same read split over two threads (started per call, as a library would): does a second core help?
template <class T>
void baseline_read_2threads(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  const std::size_t half = n / 2 * sizeof(T);
  const auto* bytes = reinterpret_cast<const unsigned char*>(b.work.data());
  for (auto _ : state) {
    std::uint64_t other = 0;
    std::thread helper([&] { other = read_bytes(bytes + half, n * sizeof(T) - half); });
    const std::uint64_t mine = read_bytes(bytes, half);
    helper.join();
    benchmark::DoNotOptimize(mine + other);
  }
  set_counters(state, n * sizeof(T), 1, 0);
}

volatile std::uint64_t rewrite_key = 0;

template <class T>
void baseline_rewrite(benchmark::State& state, std::size_t n, width w) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) {
    rewrite_bytes(b.work.data(), n * sizeof(T), rewrite_key, w);
    benchmark::ClobberMemory();
  }
  set_counters(state, n * sizeof(T), 1, 1);
}

template <class T>
using vector_map = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>;

template <class T, int Which>
void eigen_norm(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  const vector_map<T> v(b.work.data(), static_cast<Eigen::Index>(n));
  for (auto _ : state) {
    if constexpr (Which == 0) benchmark::DoNotOptimize(v.norm());
    if constexpr (Which == 1) benchmark::DoNotOptimize(v.stableNorm());
    if constexpr (Which == 2) benchmark::DoNotOptimize(v.blueNorm());
  }
  set_counters(state, n * sizeof(T), 1, 0);
}

// The naive Eigen expression: t.cast<float>().square().sum().sqrt() (in T itself for FP32 and FP64).
template <class T>
float eigen_naive_norm_of(const T* p, std::size_t n) {
  const Eigen::TensorMap<const Eigen::Tensor<const T, 1>> t(p, static_cast<Eigen::Index>(n));
  using C = std::conditional_t<sizeof(T) == 2, float, T>;
  const Eigen::Tensor<C, 0> r = t.template cast<C>().square().sum().sqrt();
  return static_cast<float>(r());
}

template <class T>
void eigen_naive_norm(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  for (auto _ : state) benchmark::DoNotOptimize(eigen_naive_norm_of(b.work.data(), n));
  set_counters(state, n * sizeof(T), 1, 0);
}

// ... and the clip a user writes around it: norm, then t = (t.cast<float>() * c).cast<T>().
template <class T>
void eigen_naive_clip(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  Eigen::TensorMap<Eigen::Tensor<T, 1>> t(b.work.data(), static_cast<Eigen::Index>(n));
  using C = std::conditional_t<sizeof(T) == 2, float, T>;
  binding_loop(
      state, gradclip::norm(b.work.data(), n),
      [&](double max_norm) {
        const C norm = static_cast<C>(eigen_naive_norm_of(b.work.data(), n));
        if (norm > static_cast<C>(max_norm))
          t = (t.template cast<C>() * static_cast<C>(max_norm / norm)).template cast<T>();
        return norm;
      },
      [&] { std::memcpy(b.work.data(), b.pristine.data(), n * sizeof(T)); });
  set_counters(state, n * sizeof(T), 2, 1);
}

// Eigen's own half/bfloat16 arithmetic: squaredNorm() summed in the 16-bit type.
template <class T>
void eigen_half_norm(benchmark::State& state, std::size_t n) {
  auto& b = buffers<T>::get(n);
  const vector_map<T> v(b.work.data(), static_cast<Eigen::Index>(n));
  for (auto _ : state) benchmark::DoNotOptimize(static_cast<float>(v.norm()));
  set_counters(state, n * sizeof(T), 1, 0);
}

// ---- Groups: 256 tensors of 16 Ki elements.

constexpr std::size_t group_count = 256, group_tensor = 16 * 1024;

template <class T>
struct group_buffers {
  std::vector<Eigen::Tensor<T, 1>> pristine, work;
  static group_buffers& get() {
    static group_buffers g;
    if (g.pristine.empty()) {
      for (std::size_t k = 0; k < group_count; ++k) {
        g.pristine.emplace_back(static_cast<Eigen::Index>(group_tensor));
        fill(g.pristine.back().data(), group_tensor, 0x9e3779b97f4a7c15ull + k);
      }
    }
    g.work = g.pristine;
    return g;
  }
};

template <class T>
void group_read(benchmark::State& state, width w) {
  auto& g = group_buffers<T>::get();
  for (auto _ : state)
    for (const auto& t : g.work) benchmark::DoNotOptimize(read_bytes(t.data(), group_tensor * sizeof(T), w));
  set_counters(state, group_count * group_tensor * sizeof(T), 1, 0);
}

template <class T>
void group_rewrite(benchmark::State& state, width w) {
  auto& g = group_buffers<T>::get();
  for (auto _ : state) {
    for (auto& t : g.work) rewrite_bytes(t.data(), group_tensor * sizeof(T), rewrite_key, w);
    benchmark::ClobberMemory();
  }
  set_counters(state, group_count * group_tensor * sizeof(T), 1, 1);
}

template <class Policy, class T>
void group_norm(benchmark::State& state) {
  auto& g = group_buffers<T>::get();
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::global_norm<Policy>(g.work));
  set_counters(state, group_count * group_tensor * sizeof(T), 1, 0);
}

template <class Policy, class T>
void group_clip_binds(benchmark::State& state) {
  auto& g = group_buffers<T>::get();
  binding_loop(
      state, gradclip::global_norm(g.work),
      [&](double max_norm) { return gradclip::clip_by_global_norm<Policy>(g.work, max_norm).coefficient; },
      [&] { g.work = g.pristine; });
  set_counters(state, group_count * group_tensor * sizeof(T), 2, 1);
}

// ---- Paired: the ratios measured inside one loop. Each iteration times the roofline (reads and,
// for a clip, rewrites of both widths) and the three policies on the same buffer, in an order that
// rotates, so drift of this shared machine (other tenants, clock speed) reaches every part alike. The
// counters are ratios of the parts' total times: <policy>_x_roofline (roofline time / policy time) and
// <policy>_per_promote (policy time / promote time).

using paired_timing::add_paired;
using paired_timing::part;
using paired_timing::total_of;

// The faster width's total of a baseline ("read" or "rewrite").
double fastest_total(const std::vector<part>& parts, const std::string& baseline) {
  double best = 0;
  for (width w : {width::w256, width::w512}) {
    const double t = total_of(parts, baseline + "/" + width_name(w));
    if (t > 0 && (best == 0 || t < best)) best = t;
  }
  return best;
}

void report_parts(benchmark::State& state, const std::vector<part>& parts, bool binds) {
  const double roofline = fastest_total(parts, "read") + (binds ? fastest_total(parts, "rewrite") : 0.0);
  const double promote = total_of(parts, "promote");
  for (const std::string policy : {"robust", "max_scale", "promote"}) {
    const double t = total_of(parts, policy);
    state.counters[policy + "_x_roofline"] = roofline / t;
    if (policy != "promote") state.counters[policy + "_per_promote"] = t / promote;
  }
}

// The roofline parts: reads (and rewrites) of both widths of the buffers [first, last) of `bytes` each.
template <class It>
void add_roofline_parts(std::vector<part>& parts, It first, It last, std::size_t bytes, bool binds) {
  for (width w : {width::w256, width::w512}) {
    if (!width_supported(w)) continue;
    parts.push_back({std::string("read/") + width_name(w), [=] {
                       for (It b = first; b != last; ++b) benchmark::DoNotOptimize(read_bytes(*b, bytes, w));
                     }});
    if (binds)
      parts.push_back({std::string("rewrite/") + width_name(w), [=] {
                         for (It b = first; b != last; ++b) rewrite_bytes(*b, bytes, rewrite_key, w);
                         benchmark::ClobberMemory();
                       }});
  }
}

// The policies' parts: norm(g) or, when binds, clip(g, max_norm) with max_norm shrinking 0.1% a call.
template <class Norm, class Clip>
void add_policy_parts(std::vector<part>& parts, bool binds, double& max_norm, Norm&& norm, Clip&& clip) {
  const auto add_one = [&](auto policy) {
    using Policy = decltype(policy);
    if (binds)
      parts.push_back({policy_name<Policy>(), [=, &max_norm] {
                         max_norm *= 0.999;
                         benchmark::DoNotOptimize(clip(Policy{}, max_norm));
                       }});
    else
      parts.push_back({policy_name<Policy>(), [=] { benchmark::DoNotOptimize(norm(Policy{})); }});
  };
  add_one(gradclip::robust{});
  add_one(gradclip::max_scale{});
  add_one(gradclip::promote{});
}

template <class T>
void paired(benchmark::State& state, std::size_t n, bool binds) {
  auto& b = buffers<T>::get(n);
  T* data = b.work.data();
  const double norm = gradclip::norm(data, n);
  double max_norm = norm;
  std::vector<part> parts;
  void* buffer[] = {data};
  add_roofline_parts(parts, std::begin(buffer), std::end(buffer), n * sizeof(T), binds);
  add_policy_parts(
      parts, binds, max_norm, [=](auto policy) { return gradclip::norm<decltype(policy)>(data, n); },
      [=](auto policy, double m) { return gradclip::clip_by_norm<decltype(policy)>(data, n, m).coefficient; });
  paired_timing::run_parts(state, parts, [&] {
    if (binds && max_norm < 0.5 * norm) {  // the clips shrank the buffer: restore it
      std::memcpy(data, b.pristine.data(), n * sizeof(T));
      max_norm = norm;
    }
  });
  report_parts(state, parts, binds);
}

template <class T>
void paired_group(benchmark::State& state, bool binds) {
  auto& g = group_buffers<T>::get();
  const double norm = gradclip::global_norm(g.work);
  double max_norm = norm;
  std::vector<void*> tensors;
  for (auto& t : g.work) tensors.push_back(t.data());
  std::vector<part> parts;
  add_roofline_parts(parts, tensors.begin(), tensors.end(), group_tensor * sizeof(T), binds);
  add_policy_parts(
      parts, binds, max_norm, [&](auto policy) { return gradclip::global_norm<decltype(policy)>(g.work); },
      [&](auto policy, double m) { return gradclip::clip_by_global_norm<decltype(policy)>(g.work, m).coefficient; });
  paired_timing::run_parts(state, parts, [&] {
    if (binds && max_norm < 0.5 * norm) {
      g.work = g.pristine;
      max_norm = norm;
    }
  });
  report_parts(state, parts, binds);
}

// ---- Registration.

constexpr std::size_t sizes[] = {4 * 1024, 256 * 1024, 16 * 1024 * 1024, 64 * 1024 * 1024};

std::string case_name(const char* op, const char* policy, const char* dtype, std::size_t n) {
  return std::string(op) + "/" + policy + "/" + dtype + "/" + std::to_string(n);
}

void tune(benchmark::internal::Benchmark* b, std::size_t bytes) {
  // Out-of-cache sizes run a few iterations per repetition; in-cache sizes enough to be stable.
  b->MinTime(bytes >= (8u << 20) ? 0.05 : 0.1)->UseRealTime()->Unit(benchmark::kMicrosecond);
}

template <class F>
void add(const std::string& name, std::size_t bytes, F&& f) {
  tune(benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(f)), bytes);
}

template <class Policy, class T>
void register_policy(std::size_t n) {
  const char* p = policy_name<Policy>();
  const std::size_t bytes = n * sizeof(T);
  add(case_name("norm", p, dtype_name<T>(), n), bytes, [n](benchmark::State& s) { gradclip_norm<Policy, T>(s, n); });
  add(case_name("clip_binds", p, dtype_name<T>(), n), bytes,
      [n](benchmark::State& s) { gradclip_clip_binds<Policy, T>(s, n); });
  add(case_name("clip_nobind", p, dtype_name<T>(), n), bytes,
      [n](benchmark::State& s) { gradclip_clip_nobind<Policy, T>(s, n); });
}

template <class T>
void register_type() {
  const char* d = dtype_name<T>();
  for (std::size_t n : sizes) {
    const std::size_t bytes = n * sizeof(T);
    for (width w : {width::w256, width::w512}) {
      if (!width_supported(w)) continue;
      add(case_name("read", width_name(w), d, n), bytes, [n, w](benchmark::State& s) { baseline_read<T>(s, n, w); });
      add(case_name("rewrite", width_name(w), d, n), bytes,
          [n, w](benchmark::State& s) { baseline_rewrite<T>(s, n, w); });
    }
    if (n >= sizes[2]) {
      add(case_name("read_2threads", "-", d, n), bytes, [n](benchmark::State& s) { baseline_read_2threads<T>(s, n); });
      add(case_name("norm_2threads", "robust", d, n), bytes,
          [n](benchmark::State& s) { gradclip_norm_2threads<T>(s, n); });
      add(case_name("clip_binds_2threads", "robust", d, n), bytes,
          [n](benchmark::State& s) { gradclip_clip_binds_2threads<T>(s, n); });
    }
    if (n >= sizes[2])
      for (bool binds : {false, true})
        add_paired(case_name("paired", binds ? "clip_binds" : "norm", d, n),
                   [n, binds](benchmark::State& s) { paired<T>(s, n, binds); });

    register_policy<gradclip::robust, T>(n);
    register_policy<gradclip::max_scale, T>(n);
    register_policy<gradclip::promote, T>(n);
    register_policy<gradclip::naive, T>(n);
    if constexpr (sizeof(T) == 2) {
      add(case_name("eigen_half_norm", "-", d, n), bytes, [n](benchmark::State& s) { eigen_half_norm<T>(s, n); });
    } else {
      add(case_name("eigen_norm", "-", d, n), bytes, [n](benchmark::State& s) { eigen_norm<T, 0>(s, n); });
      add(case_name("eigen_stable_norm", "-", d, n), bytes, [n](benchmark::State& s) { eigen_norm<T, 1>(s, n); });
      add(case_name("eigen_blue_norm", "-", d, n), bytes, [n](benchmark::State& s) { eigen_norm<T, 2>(s, n); });
    }
    add(case_name("eigen_naive_norm", "-", d, n), bytes, [n](benchmark::State& s) { eigen_naive_norm<T>(s, n); });
    add(case_name("eigen_naive_clip", "-", d, n), bytes, [n](benchmark::State& s) { eigen_naive_clip<T>(s, n); });
  }
  const std::size_t n = group_count * group_tensor, bytes = n * sizeof(T);
  for (width w : {width::w256, width::w512})
    if (width_supported(w)) {
      add(case_name("group_read", width_name(w), d, n), bytes, [w](benchmark::State& s) { group_read<T>(s, w); });
      add(case_name("group_rewrite", width_name(w), d, n), bytes, [w](benchmark::State& s) { group_rewrite<T>(s, w); });
    }
  add(case_name("group_norm", "robust", d, n), bytes, [](benchmark::State& s) { group_norm<gradclip::robust, T>(s); });
  add(case_name("group_norm", "max_scale", d, n), bytes,
      [](benchmark::State& s) { group_norm<gradclip::max_scale, T>(s); });
  add(case_name("group_norm", "promote", d, n), bytes,
      [](benchmark::State& s) { group_norm<gradclip::promote, T>(s); });
  add(case_name("group_clip_binds", "robust", d, n), bytes,
      [](benchmark::State& s) { group_clip_binds<gradclip::robust, T>(s); });
  add(case_name("group_clip_binds", "promote", d, n), bytes,
      [](benchmark::State& s) { group_clip_binds<gradclip::promote, T>(s); });
  for (bool binds : {false, true})
    add_paired(case_name("paired", binds ? "group_clip_binds" : "group_norm", d, n),
               [binds](benchmark::State& s) { paired_group<T>(s, binds); });
  // In cache (issue 16): 128 Ki elements, 256 KiB to 1 MiB, inside L2.
  constexpr std::size_t in_cache = 128 * 1024;
  for (bool binds : {false, true})
    add_paired(case_name("paired", binds ? "clip_binds" : "norm", d, in_cache),
               [binds](benchmark::State& s) { paired<T>(s, in_cache, binds); });
}

}  // namespace

int main(int argc, char** argv) {
  register_type<Eigen::half>();
  register_type<Eigen::bfloat16>();
  register_type<float>();
  register_type<double>();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("gradclip_isa", gradclip::detail::best_isa() == gradclip::detail::isa::avx512 ? "avx512"
                                              : gradclip::detail::best_isa() == gradclip::detail::isa::avx2
                                                  ? "avx2"
                                                  : "portable");
#if defined(__AVX512F__)
  benchmark::AddCustomContext("gradclip_build", "-march with AVX-512");
#elif defined(__AVX2__)
  benchmark::AddCustomContext("gradclip_build", "-march with AVX2");
#else
  benchmark::AddCustomContext("gradclip_build", "default flags");
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
