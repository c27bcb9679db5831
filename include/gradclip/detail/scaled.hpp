// The one scaled-number type, mantissa * 2^exponent, and its helpers: it holds norms and coefficients
// whose value lies outside double's range (FP64 gradients near 1.8e308 or in the subnormals).
#pragma once

#include <gradclip/detail/config.hpp>

#include <cmath>
#include <limits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// 2^e as two factors, each a normal number of Real, for |e| up to twice Real's exponent range: 2^e
/// itself may not be representable, but x * first * second then rounds only where the result does.
template <class Real = double>
inline std::pair<Real, Real> power_of_two_factors(int e) noexcept {
  const int half = e / 2;
  return {std::ldexp(Real(1), half), std::ldexp(Real(1), e - half)};
}

/// mantissa * 2^exponent. Normalized values have a mantissa in [1, 2), or zero, or are not finite
/// (exponent 0); products, quotients and sums of normalized values never overflow or underflow.
///
/// `low` is an optional tail, (mantissa + low) * 2^exponent being the value to about 2^-100: plan_clip
/// sets it on the coefficient for the FP64 scale kernel. normalized() keeps it; value() and the
/// operators use the mantissa alone and return no tail.
struct scaled {
  double mantissa = 0.0;
  int exponent = 0;
  double low = 0.0;

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
    return {std::ldexp(mantissa, -k), exponent + k, std::ldexp(low, -k)};
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
    return scaled{big.mantissa + std::ldexp(small.mantissa, shift < -2000 ? -2000 : shift), big.exponent}.normalized();
  }
  /// Ordering of normalized non-negative values.
  friend bool operator<(const scaled& a, const scaled& b) noexcept {
    if (a.mantissa == 0.0 || b.mantissa == 0.0) return a.mantissa < b.mantissa;
    return a.exponent != b.exponent ? a.exponent < b.exponent : a.mantissa < b.mantissa;
  }
};

/// sqrt((sum + low) * 4^exponent) for sum > 0 finite and |low| a few ulps of sum at most, as a normalized
/// value with its tail, to about 2^-100 (the FMA residual of a correctly rounded root is exact).
inline scaled root_with_tail(double sum, double low, int exponent) noexcept {
  const int k = std::ilogb(sum) / 2 * 2;  // even, so the exponent halves exactly
  const double s = std::ldexp(sum, -k);   // in [0.5, 4): a normal double whatever sum is
  const double r = std::sqrt(s);
  return scaled{r, exponent + k / 2, (std::fma(-r, r, s) + std::ldexp(low, -k)) / (2 * r)}.normalized();
}

/// numerator / (denominator + epsilon) in double-double, normalized: the mantissa is the quotient
/// rounded to nearest, the tail the rest (to about 2^-100). numerator and epsilon are finite and >= 0, the
/// denominator normalized and >= 0 (its tail included); a zero sum gives inf or NaN, as a division does.
inline scaled quotient_with_tail(double numerator, const scaled& denominator, double epsilon) noexcept {
  // The denominator as hi + lo at 2^base, hi in [1, 4] (or zero).
  double hi = denominator.mantissa, lo = denominator.low;
  int base = denominator.exponent;
  if (epsilon > 0) {
    const scaled e = scaled::of(epsilon);
    if (hi == 0.0 || e.exponent > base) {
      hi = std::ldexp(hi, base - e.exponent);
      lo = std::ldexp(lo, base - e.exponent);
      base = e.exponent;
    }
    const double add = std::ldexp(e.mantissa, e.exponent - base);
    const double s = hi + add, moved = s - hi;
    lo += (hi - (s - moved)) + (add - moved);  // TwoSum's error
    hi = s;
  }
  const scaled n = scaled::of(numerator);
  const double q = n.mantissa / hi;
  if (q == 0.0 || !std::isfinite(q)) return scaled{q, 0}.normalized();
  const double rest = (std::fma(-q, hi, n.mantissa) - rounded(q * lo)) / hi;  // the FMA residual is exact
  const double sum = q + rest;
  return scaled{sum, n.exponent - base, rest - (sum - q)}.normalized();
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
