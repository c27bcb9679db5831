// partial_norm: a mergeable piece of a sum of squares, kept as a power-of-two scale and a scaled sum,
// so that no merge overflows or underflows. Ranks of a distributed job each compute one and reduce them.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace gradclip {

/// The sum of squares of some elements, as `sum * 4^exponent` (that is, norm = 2^exponent * sqrt(sum)).
///
/// Merging keeps the larger exponent and rescales the other sum by an exact power of two, so a
/// partial norm represents every finite sum of squares, however large or small, to double precision.
/// `finite` is false once any merged part was not finite; `sum` then holds NaN (a NaN was seen) or +inf.
struct partial_norm {
  int exponent = 0;
  double sum = 0.0;
  bool finite = true;

  /// Adds another part. Order-independent up to the rounding of `sum`.
  void merge(const partial_norm& other) noexcept {
    if (!finite || !other.finite) {
      const bool saw_nan = std::isnan(sum) || std::isnan(other.sum);
      *this = {0, saw_nan ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(), false};
      return;
    }
    if (other.sum == 0.0) return;
    if (sum == 0.0 || other.exponent > exponent) {
      sum = other.sum + scaled_sum_at(other.exponent);
      exponent = other.exponent;
    } else {
      sum += other.scaled_sum_at(exponent);
    }
  }

  /// The L2 norm: +inf when it exceeds double's range although every element was finite,
  /// NaN or +inf when `!finite`.
  double norm() const noexcept {
    if (!finite) return sum;
    return std::ldexp(std::sqrt(sum), exponent);
  }

  /// `sum` expressed at a scale 2^target >= 2^exponent (exact unless it underflows, when it is negligible).
  double scaled_sum_at(int target) const noexcept {
    const long shift = 2L * (static_cast<long>(exponent) - target);  // <= 0
    return std::ldexp(sum, static_cast<int>(std::max(shift, -4000L)));
  }
};

}  // namespace gradclip
