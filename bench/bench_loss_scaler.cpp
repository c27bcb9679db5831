// Loss scaling fused with clipping: loss_scaler::unscale_and_clip (one read pass, one write pass) against
// clip_by_global_norm alone (the same two passes), PyTorch's three-pass sequence (unscale_, the norm, the
// scaling) and gradclip's own unscale followed by clip_by_global_norm (four passes),
// with a plain read and a plain read-modify-write of the same bytes as rooflines.
//
// Every case multiplies the gradients by a factor whose product rounds back to the same values (clipping by a
// factor of 1 - 1e-9 after unscaling by S = 1/2 and scaling by 1/2, ...), so each iteration does the full work
// on unchanged data. Each group is four gradients of n/4 elements; bytes_per_second counts the gradient once.
#include <gradclip/gradclip.hpp>

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

template <class T>
std::vector<std::vector<T>> make_group(std::size_t n) {
  std::mt19937_64 rng(20261202);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<T>> group(4, std::vector<T>(n / 4));
  for (auto& g : group)
    for (auto& x : g) x = T(normal(rng));
  return group;
}

template <class T>
void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0) *
                          static_cast<std::int64_t>(sizeof(T)));
}

// Roofline: a plain read of the same bytes (integer sums, so nothing but memory limits it).
template <class T>
void plain_read(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) {
    std::uint64_t sum = 0;
    for (const auto& g : group) {
      const auto* words = reinterpret_cast<const unsigned char*>(g.data());
      std::uint64_t lanes[8] = {};
      const std::size_t bytes = g.size() * sizeof(T);
      for (std::size_t i = 0; i + 64 <= bytes; i += 64)
        for (int j = 0; j < 8; ++j) {
          std::uint64_t w;
          std::memcpy(&w, words + i + 8 * j, 8);
          lanes[j] += w;
        }
      for (auto l : lanes) sum += l;
    }
    benchmark::DoNotOptimize(sum);
  }
  set_bytes<T>(state);
}

// Roofline: a plain read-modify-write of the same bytes (xor with a mask the compiler cannot see is zero).
template <class T>
void plain_read_write(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  volatile std::uint64_t mask_source = 0;
  for (auto _ : state) {
    const std::uint64_t mask = mask_source;
    for (auto& g : group) {
      auto* words = reinterpret_cast<unsigned char*>(g.data());
      const std::size_t bytes = g.size() * sizeof(T);
      for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
        std::uint64_t w;
        std::memcpy(&w, words + i, 8);
        w ^= mask;
        std::memcpy(words + i, &w, 8);
      }
    }
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// A clip that binds but rounds back to the same values: max_norm just below the norm.
template <class T>
void clip_by_global_norm(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  const double max_norm = gradclip::global_norm(group) * (1 - 1e-9);
  for (auto _ : state) {
    const auto r = gradclip::clip_by_global_norm(group, max_norm);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// S = 1/2 and max_norm just below ||g||: the fused factor c / S is 1 - 1e-9, so the values come back unchanged.
gradclip::loss_scaler half_scaler() {
  gradclip::loss_scaler_config config;
  config.init_scale = 0.5;
  return gradclip::loss_scaler(config);
}

template <class T>
void unscale_and_clip(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  const double max_norm = gradclip::global_norm(group) * (1 - 1e-9);
  gradclip::loss_scaler scaler = half_scaler();
  for (auto _ : state) {
    const auto r = scaler.unscale_and_clip(group, max_norm);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// PyTorch's sequence: unscale_ (a read-write pass multiplying by 1/S), then clip_grad_norm_ (a norm pass and a
// scaling pass), every pass with gradclip's own vector kernels. unscale_ also checks for Inf/NaN in its pass;
// that check is left out here, so this is a lower bound on the cost of three passes.
template <class T>
void three_passes(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  const double max_norm = gradclip::global_norm(group) * (1 - 1e-9);
  const gradclip::detail::scaled inverse_scale{1.0, 1};  // 1 / S with S = 1/2
  for (auto _ : state) {
    for (auto& g : group) gradclip::detail::scale_run<gradclip::robust>(g.data(), g.size(), inverse_scale);
    const auto r = gradclip::clip_by_global_norm(group, max_norm);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// gradclip's unscale (a read pass and a write pass) followed by clip_by_global_norm: four passes.
template <class T>
void unscale_then_clip(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  const double max_norm = gradclip::global_norm(group) * (1 - 1e-9);
  gradclip::loss_scaler scaler = half_scaler();
  for (auto _ : state) {
    const auto u = scaler.unscale(group);
    const auto r = gradclip::clip_by_global_norm(group, max_norm);
    benchmark::DoNotOptimize(u);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// gradclip's unscale alone (its read pass and its write pass) by a scale that is not a power of two,
// S = 1 + 2^-20: every quotient is a division and a round to odd FP32 before the 16-bit rounding, and rounds
// back to the same value. Against plain_read plus plain_read_write.
template <class T>
void unscale_by_any_scale(benchmark::State& state) {
  auto group = make_group<T>(static_cast<std::size_t>(state.range(0)));
  gradclip::loss_scaler_config config;
  config.init_scale = 1 + 0x1p-20;
  const gradclip::loss_scaler scaler(config);
  for (auto _ : state) {
    const auto u = scaler.unscale(group);
    benchmark::DoNotOptimize(u);
    benchmark::ClobberMemory();
  }
  set_bytes<T>(state);
}

// From in-cache (8 KiB of FP16) to well past the last-level cache (32 MiB of FP16, 64 MiB of FP32).
#define GRADCLIP_LOSS_SCALER_BENCH(function, T) \
  BENCHMARK_TEMPLATE(function, T)->RangeMultiplier(16)->Range(1 << 12, 1 << 24)->Unit(benchmark::kMicrosecond)

GRADCLIP_LOSS_SCALER_BENCH(plain_read, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(plain_read_write, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(clip_by_global_norm, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(unscale_and_clip, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(three_passes, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(unscale_then_clip, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(unscale_by_any_scale, Eigen::half);
GRADCLIP_LOSS_SCALER_BENCH(plain_read, float);
GRADCLIP_LOSS_SCALER_BENCH(plain_read_write, float);
GRADCLIP_LOSS_SCALER_BENCH(clip_by_global_norm, float);
GRADCLIP_LOSS_SCALER_BENCH(unscale_and_clip, float);
GRADCLIP_LOSS_SCALER_BENCH(three_passes, float);
GRADCLIP_LOSS_SCALER_BENCH(unscale_then_clip, float);

}  // namespace

BENCHMARK_MAIN();
