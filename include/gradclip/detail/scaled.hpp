// The one scaled-number type, mantissa * 2^exponent, and its helpers: it holds norms and coefficients
// whose value lies outside double's range (FP64 gradients near 1.8e308 or in the subnormals).
#pragma once

#include <gradclip/detail/fp_checks.hpp>

#include <cmath>
#include <limits>
#include <utility>

namespace gradclip::detail {

/// 2^e as two factors, each a normal number of Real, for |e| up to twice Real's exponent range: 2^e
/// itself may not be representable, but x * first * second then rounds only where the result does.
template <class Real = double>
inline std::pair<Real, Real> power_of_two_factors(int e) noexcept {
  const int half = e / 2;
  return {std::ldexp(Real(1), half), std::ldexp(Real(1), e - half)};
}

/// mantissa * 2^exponent. Normalized values have a mantissa in [1, 2), or zero, or are not finite
/// (exponent 0); products, quotients and sums of normalized values never overflow or underflow.
struct scaled {
  double mantissa = 0.0;
  int exponent = 0;

  static scaled of(double x) noexcept { return scaled{x, 0}.normalized(); }

  /// The value as a double: over- or underflows where the value lies outside double's range.
  double value() const noexcept {
    if (exponent > 2 * std::numeric_limits<double>::max_exponent ||
        exponent < 2 * std::numeric_limits<double>::min_exponent)  // beyond two factors' reach: 0 or inf
      return std::ldexp(mantissa, exponent > 0 ? 4096 : -4096);
    const auto [first, second] = power_of_two_factors(exponent);
    return mantissa * first * second;
  }

  scaled normalized() const noexcept {
    if (mantissa == 0.0 || !std::isfinite(mantissa)) return {mantissa, 0};
    const int k = std::ilogb(mantissa);
    return {std::ldexp(mantissa, -k), exponent + k};
  }

  friend scaled operator*(const scaled& a, const scaled& b) noexcept {
    return scaled{a.mantissa * b.mantissa, a.exponent + b.exponent}.normalized();
  }
  friend scaled operator/(const scaled& a, const scaled& b) noexcept {
    return scaled{a.mantissa / b.mantissa, a.exponent - b.exponent}.normalized();
  }
  /// The sum of two normalized non-negative values, rounded once (the smaller one is negligible where
  /// its shift underflows).
  friend scaled operator+(const scaled& a, const scaled& b) noexcept {
    if (b.mantissa == 0.0) return a;
    if (a.mantissa == 0.0) return b;
    const scaled& big = a.exponent >= b.exponent ? a : b;
    const scaled& small = a.exponent >= b.exponent ? b : a;
    const int shift = small.exponent - big.exponent;
    return scaled{big.mantissa + std::ldexp(small.mantissa, shift < -2000 ? -2000 : shift), big.exponent}
        .normalized();
  }
  /// Ordering of normalized non-negative values.
  friend bool operator<(const scaled& a, const scaled& b) noexcept {
    if (a.mantissa == 0.0 || b.mantissa == 0.0) return a.mantissa < b.mantissa;
    return a.exponent != b.exponent ? a.exponent < b.exponent : a.mantissa < b.mantissa;
  }
};

}  // namespace gradclip::detail
