// Element types: which scalars gradclip accepts, their runtime tag, and conversions that vectorize.
#pragma once

#include <gradclip/detail/config.hpp>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// Runtime tag of a gradient's element type, for groups that mix types.
enum class dtype { float16, bfloat16, float32, float64 };

namespace detail {

template <class T>
struct element_traits {
  static constexpr bool supported = false;
};
template <>
struct element_traits<Eigen::half> {
  static constexpr bool supported = true;
  static constexpr dtype tag = dtype::float16;
  static constexpr const char* name = "float16";
};
template <>
struct element_traits<Eigen::bfloat16> {
  static constexpr bool supported = true;
  static constexpr dtype tag = dtype::bfloat16;
  static constexpr const char* name = "bfloat16";
};
template <>
struct element_traits<float> {
  static constexpr bool supported = true;
  static constexpr dtype tag = dtype::float32;
  static constexpr const char* name = "float32";
};
template <>
struct element_traits<double> {
  static constexpr bool supported = true;
  static constexpr dtype tag = dtype::float64;
  static constexpr const char* name = "float64";
};

template <class T>
inline constexpr bool is_element_v = element_traits<std::remove_cv_t<T>>::supported;

static_assert(sizeof(Eigen::half) == 2 && std::is_standard_layout_v<Eigen::half>,
              "gradclip reads Eigen::half as its 16 raw bits, so it must be a 2-byte standard-layout type.");
static_assert(sizeof(Eigen::bfloat16) == 2 && std::is_standard_layout_v<Eigen::bfloat16>,
              "gradclip reads Eigen::bfloat16 as its 16 raw bits, so it must be a 2-byte standard-layout type.");

inline float float_from_bits(std::uint32_t bits) noexcept {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline std::uint32_t bits_of(float f) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

/// IEEE binary16 bits to float, exact for every pattern. Branch-free, so loops over it vectorize,
/// and free of subnormal float arithmetic, so it stays exact under flush-to-zero modes.
inline float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t magnitude = h & 0x7fffu;
  const std::uint32_t exponent = magnitude >> 10;
  const float normal = float_from_bits((magnitude << 13) + 0x38000000u);  // rebias 15 -> 127
  const float subnormal = static_cast<float>(static_cast<std::int32_t>(magnitude)) * 0x1p-24f;
  const float inf_or_nan = float_from_bits((magnitude << 13) | 0x7f800000u);
  const float value = exponent == 0 ? subnormal : (exponent == 31 ? inf_or_nan : normal);
  return float_from_bits(bits_of(value) | (static_cast<std::uint32_t>(h & 0x8000u) << 16));
}

/// bfloat16 is the upper half of a float.
inline float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return float_from_bits(static_cast<std::uint32_t>(b) << 16);
}

/// Any supported element as float (exact for FP16, BF16 and FP32).
inline float to_float(Eigen::half x) noexcept { return half_bits_to_float(Eigen::numext::bit_cast<std::uint16_t>(x)); }
inline float to_float(Eigen::bfloat16 x) noexcept {
  return bfloat16_bits_to_float(Eigen::numext::bit_cast<std::uint16_t>(x));
}
inline float to_float(float x) noexcept { return x; }

/// Any supported element in the wider of its own type and Compute, exactly.
template <class Compute, class T>
inline Compute widen(T x) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    static_assert(std::is_same_v<Compute, double>, "FP64 elements can only be computed in FP64.");
    return x;
  } else {
    return static_cast<Compute>(to_float(x));
  }
}

/// Rounds a computed value to the element type, once, to nearest even (Eigen's conversions).
template <class T, class Compute>
inline T narrow(Compute x) noexcept {
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    return T(static_cast<float>(x));
  } else {
    return static_cast<T>(x);
  }
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
