// Update clipping (issue 25), each case paired so that the machine's drift reaches every part alike:
// - clip_update_by_rms at 64 Mi elements against a read and a rewrite of the same bytes (a clip that
//   binds), and against the read alone (an RMS below the threshold);
// - stable_adamw_factor and spam_clip (no element clipped) of g and an FP32 v against a read of both;
// - clip_per_tensor with adagc on GPT-2 small's 148 FP32 tensors against clip_by_global_norm on the same
//   list, every tensor clipping on every call in both.
#include <gradclip/adagc.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/update_clip.hpp>

#include "paired.hpp"

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using paired_timing::add_paired;
using paired_timing::part;
using paired_timing::total_of;

constexpr std::size_t large = std::size_t{64} << 20;

/// Uniform values in [-scale, scale) (a xorshift stream: 64 Mi of them in well under a second).
template <class T>
std::vector<T> make_values(std::size_t n, std::uint64_t seed, double scale = 1.0, double offset = 0.0) {
  std::vector<T> v(n);
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const double u = static_cast<double>(s >> 11) * 0x1p-53;  // [0, 1)
    x = static_cast<T>(offset + scale * (2 * u - 1));
  }
  return v;
}

/// A plain read of the bytes, summed as 64-bit words in eight lanes (the memory roofline of a read).
std::uint64_t read_words(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lanes[8] = {};
  std::size_t i = 0;
  for (; i + 64 <= bytes; i += 64)
    for (int k = 0; k < 8; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lanes[k] += w;
    }
  std::uint64_t sum = 0;
  for (; i < bytes; ++i) sum += p[i];
  for (auto l : lanes) sum += l;
  return sum;
}

volatile std::uint64_t rewrite_key = 0;

/// A read and a write of every byte (XOR with a key the compiler cannot see, zero): the roofline of a
/// clip's write pass.
void rewrite_words(void* data, std::size_t bytes) {
  auto* p = static_cast<unsigned char*>(data);
  const std::uint64_t key = rewrite_key;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    w ^= key;
    std::memcpy(p + i, &w, 8);
  }
  for (; i < bytes; ++i) p[i] = static_cast<unsigned char>(p[i] ^ key);
}

template <class T>
void rms_clip(benchmark::State& state) {
  std::vector<T> u = make_values<T>(large, 1);
  const std::vector<T> pristine = u;
  const double rms = gradclip::norm(u) / std::sqrt(static_cast<double>(large));
  double max_rms = rms;
  const std::size_t bytes = large * sizeof(T);
  std::vector<part> parts{
      {"read", [&] { benchmark::DoNotOptimize(read_words(u.data(), bytes)); }},
      {"rewrite",
       [&] {
         rewrite_words(u.data(), bytes);
         benchmark::ClobberMemory();
       }},
      {"clip",
       [&] {
         max_rms *= 0.999;
         benchmark::DoNotOptimize(gradclip::clip_update_by_rms(u, max_rms).coefficient);
       }},
      {"no_clip",
       [&] {
         benchmark::DoNotOptimize(gradclip::clip_update_by_rms(u, std::numeric_limits<double>::infinity()).coefficient);
       }},
  };
  paired_timing::run_parts(state, parts, [&] {
    if (max_rms < 0.5 * rms) {  // the clips shrank the update: restore it
      u = pristine;
      max_rms = rms;
    }
  });
  state.counters["clip_x_roofline"] = (total_of(parts, "read") + total_of(parts, "rewrite")) / total_of(parts, "clip");
  state.counters["no_clip_x_read"] = total_of(parts, "read") / total_of(parts, "no_clip");
}

template <class T>
void stable_adamw(benchmark::State& state) {
  const std::vector<T> g = make_values<T>(large, 2, 3.0);
  const std::vector<float> v = make_values<float>(large, 3, 0.5, 1.0);  // in [0.5, 1.5)
  std::vector<part> parts{
      {"read",
       [&] {
         benchmark::DoNotOptimize(read_words(g.data(), large * sizeof(T)));
         benchmark::DoNotOptimize(read_words(v.data(), large * sizeof(float)));
       }},
      {"factor", [&] { benchmark::DoNotOptimize(gradclip::stable_adamw_factor(g, v, 1e-8)); }},
  };
  paired_timing::run_parts(state, parts, [] {});
  state.counters["factor_x_read"] = total_of(parts, "read") / total_of(parts, "factor");
}

template <class T>
void spam(benchmark::State& state) {
  std::vector<T> g = make_values<T>(large, 4);
  const std::vector<float> v = make_values<float>(large, 5, 0.5, 1.0);  // g^2 < 5000 v everywhere
  std::vector<part> parts{
      {"read",
       [&] {
         benchmark::DoNotOptimize(read_words(g.data(), large * sizeof(T)));
         benchmark::DoNotOptimize(read_words(v.data(), large * sizeof(float)));
       }},
      {"spam", [&] { benchmark::DoNotOptimize(gradclip::spam_clip(g, v, 5000.0)); }},
  };
  paired_timing::run_parts(state, parts, [] {});
  state.counters["spam_x_read"] = total_of(parts, "read") / total_of(parts, "spam");
}

// GPT-2 small's parameters (as bench_sizes.cpp lists them): 148 tensors, 124 M elements.
std::vector<std::size_t> gpt2_small_sizes() {
  constexpr std::size_t d = 768, layers = 12, vocabulary = 50257, context = 1024;
  std::vector<std::size_t> sizes{vocabulary * d, context * d};
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) sizes.push_back(n);
  sizes.push_back(d);
  sizes.push_back(d);
  return sizes;
}

// Both parts clip every tensor on every call: clip_by_global_norm with a threshold 1 % below the last
// norm, adagc after a one-step warm-up with lambda_rel 0.5 (its thresholds fall 1 % a step).
void adagc_gpt2(benchmark::State& state) {
  std::vector<std::vector<float>> global_group, tensor_group;
  std::uint64_t seed = 10;
  for (std::size_t n : gpt2_small_sizes()) global_group.push_back(make_values<float>(n, ++seed));
  tensor_group = global_group;
  double max_norm = gradclip::global_norm(global_group);
  gradclip::adagc_config config;
  config.warmup_steps = 1;
  config.lambda_abs = std::numeric_limits<double>::infinity();
  config.lambda_rel = 0.5;
  gradclip::adagc controller(config);
  (void)gradclip::clip_per_tensor(tensor_group, controller);  // the warm-up: gamma_i = ||g_i||
  std::vector<part> parts{
      {"global",
       [&] {
         max_norm *= 0.99;
         benchmark::DoNotOptimize(gradclip::clip_by_global_norm(global_group, max_norm).coefficient);
       }},
      {"adagc", [&] { benchmark::DoNotOptimize(gradclip::clip_per_tensor(tensor_group, controller).data()); }},
  };
  paired_timing::run_parts(state, parts, [] {});
  state.counters["tensors"] = static_cast<double>(tensor_group.size());
  state.counters["adagc_per_global"] = total_of(parts, "adagc") / total_of(parts, "global");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string n = std::to_string(large);
  add_paired("update/rms_clip/float16/" + n, [](benchmark::State& s) { rms_clip<Eigen::half>(s); });
  add_paired("update/rms_clip/bfloat16/" + n, [](benchmark::State& s) { rms_clip<Eigen::bfloat16>(s); });
  add_paired("update/rms_clip/float32/" + n, [](benchmark::State& s) { rms_clip<float>(s); });
  add_paired("update/rms_clip/float64/" + n, [](benchmark::State& s) { rms_clip<double>(s); });
  add_paired("update/stable_adamw/float16/" + n, [](benchmark::State& s) { stable_adamw<Eigen::half>(s); });
  add_paired("update/stable_adamw/bfloat16/" + n, [](benchmark::State& s) { stable_adamw<Eigen::bfloat16>(s); });
  add_paired("update/stable_adamw/float32/" + n, [](benchmark::State& s) { stable_adamw<float>(s); });
  add_paired("update/stable_adamw/float64/" + n, [](benchmark::State& s) { stable_adamw<double>(s); });
  add_paired("update/spam/float16/" + n, [](benchmark::State& s) { spam<Eigen::half>(s); });
  add_paired("update/spam/float32/" + n, [](benchmark::State& s) { spam<float>(s); });
  add_paired("update/adagc/gpt2_small/float32", adagc_gpt2);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
