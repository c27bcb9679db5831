// In-place scaling kernels on raw contiguous buffers: g <- g * c, rounded once to the element type.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/policies.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

/// A clipping coefficient as mantissa * 2^exponent, so that it stays exact where the coefficient
/// itself would be subnormal (FP64 gradients whose norm is near or beyond double's range).
struct factor {
  double mantissa = 1.0;
  int exponent = 0;
  double value() const noexcept { return std::ldexp(mantissa, exponent); }
};

/// p[i] <- p[i] * c, computed in Compute, with the widest supported vector kernels.
template <class Compute, class T>
inline void multiply(T* p, std::size_t n, Compute c) noexcept {
  multiply<Compute>(best_isa(), p, n, c);
}

/// p[i] <- (p[i] * 2^k1 * f) * 2^k2 in FP64: every factor a normal double, one rounding that matters.
inline void multiply_split(double* p, std::size_t n, const factor& c) noexcept {
  const int k1 = c.exponent / 2;
  const double first = std::ldexp(1.0, k1);
  const double second = std::ldexp(1.0, c.exponent - k1);
  for (std::size_t i = 0; i < n; ++i) p[i] = p[i] * first * c.mantissa * second;
}

template <class Policy>
struct scale_kernel {
  // max_scale and robust: the coefficient in FP64 (FP32 for 16-bit types when it is a normal float),
  // so the only rounding that matters is the final one to T.
  template <class T>
  static void run(T* p, std::size_t n, const factor& c) noexcept {
    const double value = c.value();
    if constexpr (std::is_same_v<T, double>) {
      if (c.mantissa != 0 && std::abs(value) < std::numeric_limits<double>::min())
        multiply_split(p, n, c);
      else
        multiply<double>(p, n, value);
    } else if constexpr (std::is_same_v<T, float>) {
      multiply<double>(p, n, value);
    } else {
      const bool normal_float = value == 0 || (std::abs(value) >= std::numeric_limits<float>::min() &&
                                               std::abs(value) <= std::numeric_limits<float>::max());
      if (normal_float)
        multiply<float>(p, n, static_cast<float>(value));
      else
        multiply<double>(p, n, value);
    }
  }
};

template <>
struct scale_kernel<promote> {
  // The coefficient rounded to FP32 (FP64 for FP64 input) and applied in that type.
  template <class T>
  static void run(T* p, std::size_t n, const factor& c) noexcept {
    using compute = promoted_t<T>;
    multiply<compute>(p, n, static_cast<compute>(c.value()));
  }
};

template <>
struct scale_kernel<naive> {
  // The coefficient rounded to T and applied in T's own arithmetic. Eigen multiplies two halves (or two
  // bfloat16s) exactly in FP32 and rounds the product once, which is what multiply<float> does.
  template <class T>
  static void run(T* p, std::size_t n, const factor& c) noexcept {
    const T coefficient(static_cast<T>(c.value()));
    if constexpr (std::is_same_v<T, double>)
      multiply<double>(p, n, coefficient);
    else
      multiply<float>(p, n, to_float(coefficient));
  }
};

}  // namespace gradclip::detail
