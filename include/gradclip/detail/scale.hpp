// In-place scaling kernels on raw contiguous buffers: g <- g * c (a scaled coefficient) with the
// policy's row of the traits table, and g <- g / s, each rounded once to the element type.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/policy_traits.hpp>
#include <gradclip/detail/scaled.hpp>
#if defined(GRADCLIP_COMPILED)
#include <gradclip/detail/compiled.hpp>  // multiply_with_tail and multiply_run, from the library
#else
#include <gradclip/detail/simd.hpp>
#endif

#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

#if !defined(GRADCLIP_COMPILED)
// The smallest exponent of a coefficient whose parts, mantissa and tail, both scale to normal doubles
// (the tail is about 2^-53 of the mantissa), so that multiply_compensated applies it.
inline constexpr int compensated_exponent_min = std::numeric_limits<double>::min_exponent + 53;

/// p[i] <- p[i] * c for FP64 elements, c's tail included, each product rounded once: the vector kernel
/// where c's parts are normal doubles, multiply_exactly element by element far below (a coefficient under
/// 2^-968 clips a gradient whose norm is 2^968 times the threshold).
inline void multiply_with_tail(double* p, std::size_t n, const scaled& c) noexcept {
  const scaled k = c.normalized();
  if (k.mantissa == 0 || !std::isfinite(k.mantissa) || k.exponent > std::numeric_limits<double>::max_exponent)
    return with_isa(best_isa(), [&](auto t) { decltype(t)::template multiply<double>(p, n, c.value()); });
  if (k.exponent >= compensated_exponent_min)
    return with_isa(best_isa(), [&](auto t) { decltype(t)::multiply_compensated(p, n, k); });
  for (std::size_t i = 0; i < n; ++i) p[i] = multiply_exactly(p[i], k);
}

/// p[i] <- p[i] * c computed in Compute. Short runs multiply element by element, as the vector kernels'
/// tails do: the same bits, without the call into a kernel. 16-bit elements scaled in FP64 (coefficients
/// outside FP32's normal range, rare) have no vector form.
template <class Compute, class T>
void multiply_run(T* p, std::size_t n, Compute c) noexcept {
  if constexpr (sizeof(T) == 2 && std::is_same_v<Compute, double>)
    portable::multiply<Compute>(p, n, c);
  else if (n <= short_run)
    portable::multiply<Compute>(p, n, c);
  else
    with_isa(best_isa(), [&](auto k) { decltype(k)::template multiply<Compute>(p, n, c); });
}
#endif

/// p[i] <- p[i] * c with the policy's scaling, the coefficient prepared once for every run of a call
/// (many small tensors make many runs).
template <class Policy>
class scaler {
 public:
  explicit scaler(const scaled& c) noexcept
      : c_(c),
        value_(c.value()),
        normal_float_(value_ == 0 || (std::abs(value_) >= std::numeric_limits<float>::min() &&
                                      std::abs(value_) <= std::numeric_limits<float>::max())) {
    static_assert(is_policy_v<Policy>, "The policy must be a row of gradclip::detail::policy_traits.");
  }

  template <class T>
  void operator()(T* p, std::size_t n) const noexcept {
    constexpr scaling rule = policy_traits<Policy>::scale;
    if constexpr (rule == scaling::element) {
      // Rounded to T and applied in T's arithmetic: Eigen multiplies two halves (or bfloat16s) exactly in
      // FP32 and rounds the product once, which is what multiply<float> does.
      const T coefficient(static_cast<T>(value_));
      if constexpr (std::is_same_v<T, double>)
        multiply_run<double>(p, n, coefficient);
      else
        multiply_run<float>(p, n, to_float(coefficient));
    } else if constexpr (rule == scaling::promoted) {
      using compute = promoted_t<T>;
      multiply_run<compute>(p, n, static_cast<compute>(value_));
    } else if constexpr (std::is_same_v<T, double>) {
      multiply_with_tail(p, n, c_);
    } else if constexpr (std::is_same_v<T, float>) {
      multiply_run<double>(p, n, value_);
    } else if (normal_float_) {
      // 16-bit elements: a coefficient that is a normal float is applied in FP32 (its rounding, 2^-24, is
      // far below the element's), any other in FP64.
      multiply_run<float>(p, n, static_cast<float>(value_));
    } else {
      multiply_run<double>(p, n, value_);
    }
  }

 private:
  scaled c_;
  double value_;
  bool normal_float_;
};

/// p[i] <- p[i] * c with the policy's scaling.
template <class Policy, class T>
void scale_run(T* p, std::size_t n, const scaled& c) noexcept {
  scaler<Policy>{c}(p, n);
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
