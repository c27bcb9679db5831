// What the benchmarks measure on, shared so that every binary reads the same data and the same
// roofline: gradient groups of normal values, GPT-2 small's parameter sizes, a plain read of the bytes
// and the element types' short names.
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

namespace workloads {

/// One vector per size, normal(0, 1) values from `seed`.
template <class T>
std::vector<std::vector<T>> make_group(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<T>> group;
  for (const std::size_t n : sizes) {
    group.emplace_back(n);
    for (auto& x : group.back()) x = T(normal(rng));
  }
  return group;
}

/// GPT-2 small's parameters: 148 tensors, 124 M elements.
inline std::vector<std::size_t> gpt2_small_sizes() {
  constexpr std::size_t d = 768, layers = 12, vocabulary = 50257, context = 1024;
  std::vector<std::size_t> sizes{vocabulary * d, context * d};  // token and position embeddings
  for (std::size_t l = 0; l < layers; ++l)
    for (std::size_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) sizes.push_back(n);
  sizes.push_back(d);  // final layer norm
  sizes.push_back(d);
  return sizes;
}

/// The roofline of a norm: the bytes read as 64-bit words into eight XOR chains (the compiler makes them
/// vectors, so nothing but memory limits it); a tail of fewer than 64 bytes is not read.
inline std::uint64_t plain_read(const void* data, std::size_t bytes) {
  std::uint64_t chains[8] = {};
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i + 64 <= bytes; i += 64)
    for (std::size_t c = 0; c < 8; ++c) {
      std::uint64_t word;
      std::memcpy(&word, p + i + 8 * c, sizeof word);
      chains[c] ^= word;
    }
  return chains[0] ^ chains[1] ^ chains[2] ^ chains[3] ^ chains[4] ^ chains[5] ^ chains[6] ^ chains[7];
}

/// The element type's name in benchmark names.
template <class T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, Eigen::half>) return "f16";
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return "bf16";
  if constexpr (std::is_same_v<T, float>) return "f32";
  if constexpr (std::is_same_v<T, double>) return "f64";
}

}  // namespace workloads
