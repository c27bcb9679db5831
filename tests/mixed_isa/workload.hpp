// The work both translation units of the mixed-ISA program compile (tests/mixed_isa/CMakeLists.txt): FP16,
// FP32 and FP64 clips, a global norm over grad_views and a clip on two threads over 6 MiB. Everything
// here has internal linkage, so each unit keeps its own copy: only gradclip's code (and what it
// instantiates) is shared between them at link time, which is what the program tests.
#pragma once

#include <gradclip/gradclip.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr std::size_t small = 3001, large = std::size_t{1} << 19;  // three FP32 tensors of 2 MiB each

Eigen::half half_data[small];
float float_data[small];
double double_data[small];
float large_data[3][large];

// xorshift64: the same values in every unit and on every CPU, from integer arithmetic alone.
std::uint64_t next(std::uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// A value in (-8, 8), built from integers (an FP16 pattern for FP16) so no conversion code runs here.
double value(std::uint64_t& state) {
  const auto r = static_cast<std::int64_t>(next(state) >> 11) - (std::int64_t{1} << 52);
  return static_cast<double>(r) * 0x1p-49;
}

std::uint16_t half_bits(std::uint64_t& state) {
  // Sign, an exponent field from 1 to 18 (2^-14 to 2^3), a random significand.
  const std::uint64_t r = next(state);
  return static_cast<std::uint16_t>(((r & 1u) << 15) | ((1u + (r >> 1) % 18u) << 10) | ((r >> 8) & 0x3ffu));
}

// FNV-1a over the bytes of n elements.
template <class T>
std::uint64_t fingerprint(const T* p, std::size_t n) {
  unsigned char bytes[sizeof(T)];
  std::uint64_t h = 14695981039346656037u;
  for (std::size_t i = 0; i < n; ++i) {
    std::memcpy(bytes, p + i, sizeof(T));
    for (unsigned char b : bytes) h = (h ^ b) * 1099511628211u;
  }
  return h;
}

void print(std::FILE* out, const char* what, const gradclip::clip_result& r, std::uint64_t bits) {
  std::fprintf(out, "%s: norm %a coefficient %a clipped %d finite %d elements %016llx\n", what, r.norm, r.coefficient,
               r.clipped, r.finite, static_cast<unsigned long long>(bits));
}

void workload(std::FILE* out) {
  std::uint64_t state = 20261203;
  for (std::size_t i = 0; i < small; ++i) {
    const std::uint16_t h = half_bits(state);
    std::memcpy(static_cast<void*>(&half_data[i]), &h, sizeof h);
    float_data[i] = static_cast<float>(value(state));
    double_data[i] = value(state) * 0x1p-600;  // far below FP32's range: the FP64 kernels' scaling
  }
  for (auto& tensor : large_data)
    for (float& x : tensor) x = static_cast<float>(value(state));

  // Each clip before the fingerprint of what it wrote: the order of a call's arguments is unspecified (g++
  // evaluates them last to first).
  const gradclip::clip_result fp16 = gradclip::clip_by_norm(half_data, small, 1.0);
  print(out, "fp16 clip_by_norm", fp16, fingerprint(half_data, small));
  const gradclip::clip_result fp32 = gradclip::clip_by_norm(float_data, small, 1.0);
  print(out, "fp32 clip_by_norm", fp32, fingerprint(float_data, small));
  const gradclip::clip_result fp64 = gradclip::clip_by_norm(double_data, small, 0x1p-600);
  print(out, "fp64 clip_by_norm", fp64, fingerprint(double_data, small));

  const std::array<gradclip::const_grad_view, 3> group{gradclip::const_grad_view(half_data, small),
                                                       gradclip::const_grad_view(float_data, small),
                                                       gradclip::const_grad_view(double_data, small)};
  std::fprintf(out, "global_norm over grad_views: %a\n", gradclip::global_norm(group));

  gradclip::options two_threads;
  two_threads.threads = 2;
  const std::array<gradclip::grad_view, 3> tensors{gradclip::grad_view(large_data[0], large),
                                                   gradclip::grad_view(large_data[1], large),
                                                   gradclip::grad_view(large_data[2], large)};
  const gradclip::clip_result r = gradclip::clip_by_global_norm(tensors, 100.0, two_threads);
  print(out, "fp32 clip_by_global_norm, 2 threads, 6 MiB", r, fingerprint(&large_data[0][0], 3 * large));
}

}  // namespace
