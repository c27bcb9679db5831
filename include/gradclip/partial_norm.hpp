// partial_norm: a mergeable piece of a sum of squares, kept as a power-of-two scale and a scaled sum,
// so that no merge overflows or underflows. Ranks of a distributed job each compute one and reduce them,
// either by merging or with two standard all-reduces (MAX of an exponent, then SUM of rescaled sums).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace gradclip {

/// The sum of squares of some elements, as `sum * 4^exponent` (that is, norm = 2^exponent * sqrt(sum)).
///
/// Merging keeps the larger exponent and rescales the other sum by an exact power of two, so a
/// partial norm represents every finite sum of squares, however large or small, to double precision.
/// `finite` is false once any merged part was not finite; `sum` then holds NaN (a NaN was seen) or +inf.
///
/// Distributed jobs reduce one part per rank with two all-reduces that any collective library offers
/// (MPI, NCCL, Gloo, torch.distributed), because no rank can merge before it knows the common scale:
///
///     gradclip::partial_norm local = gradclip::partial_global_norm(my_shards);
///     int e = local.reduction_exponent();    // all-reduce MAX over ranks (int32)
///     double s = local.reduction_sum(e);      // all-reduce SUM over ranks (float64)
///     gradclip::partial_norm total = gradclip::partial_norm::from_reduction(e, s);
///
/// Every rescaled sum lies in [0, 4), so the SUM can neither overflow nor lose a significant part, and a
/// non-finite rank contributes NaN or +inf, which the SUM carries to every rank. A floating-point SUM
/// rounds in whatever order the library adds, which MPI does not promise is the same on every rank;
/// `reduction_exact_sum` is the same contribution as integers, whose SUM (int64) is exact and so
/// bit-identical on every rank whatever the order.
struct partial_norm {
  int exponent = 0;
  double sum = 0.0;
  bool finite = true;

  /// The exponent a zero or non-finite part contributes to the all-reduce MAX: it constrains nothing.
  static constexpr int no_exponent = std::numeric_limits<int>::min();

  /// Adds another part. Commutative bit for bit; for three parts or more, each merge rounds `sum` once.
  void merge(const partial_norm& other) noexcept {
    if (!finite || !other.finite) {
      const bool saw_nan = std::isnan(sum) || std::isnan(other.sum);
      *this = {0, saw_nan ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(), false};
      return;
    }
    if (other.sum == 0.0) return;
    const partial_norm before = *this;
    add(other);
    // Parts built without scaling (sum * 4^0 near double's maximum) can overflow together; normalized
    // parts cannot. Checked after the fact so that the common path costs one comparison.
    if (std::isinf(sum)) {
      *this = before.normalized();
      add(other.normalized());
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
    return std::ldexp(sum, static_cast<int>(shift < -4000L ? -4000L : shift));
  }

  /// The same value with `sum` in [1, 4) (exactly: only the exponent moves). Zero parts become {} and
  /// non-finite parts are returned unchanged.
  partial_norm normalized() const noexcept {
    if (!finite) return *this;
    if (sum == 0.0) return {};
    const int k = std::ilogb(sum);                     // sum in [2^k, 2^(k+1))
    const int half = k >= 0 ? k / 2 : -((1 - k) / 2);  // floor(k / 2)
    return {exponent + half, std::ldexp(sum, -2 * half), true};
  }

  /// This part's contribution to the all-reduce MAX: the exponent of normalized(), or no_exponent.
  int reduction_exponent() const noexcept { return finite && sum != 0.0 ? normalized().exponent : no_exponent; }

  /// This part's contribution to the all-reduce SUM, given `max_exponent`, the result of the MAX: the
  /// normalized sum rescaled to that exponent, in [0, 4); NaN or +inf for a non-finite part.
  double reduction_sum(int max_exponent) const noexcept {
    if (!finite) return sum;
    if (sum == 0.0) return 0.0;
    return normalized().scaled_sum_at(max_exponent);
  }

  /// The reduced part from the results of the two all-reduces (on every rank the same).
  static partial_norm from_reduction(int max_exponent, double summed) noexcept {
    if (!std::isfinite(summed)) return {0, summed, false};
    if (max_exponent == no_exponent || summed == 0.0) return {};
    return {max_exponent, summed, true};
  }

  /// reduction_sum as integers for an all-reduce SUM over int64: counts of NaN and of +inf parts, then
  /// the rescaled sum in fixed point, 32 bits per limb from 2^1 down to 2^-94. Integer sums are exact, so
  /// the result does not depend on the order of the reduction; only bits below 2^-94 of the largest
  /// part's scale are lost (rounded, per part), far below one rounding of the total. Up to 2^30 parts.
  using exact_sum = std::array<std::int64_t, 5>;

  exact_sum reduction_exact_sum(int max_exponent) const noexcept {
    if (!finite) return {std::isnan(sum) ? 1 : 0, std::isnan(sum) ? 0 : 1, 0, 0, 0};
    double v = std::ldexp(reduction_sum(max_exponent), 30);  // [0, 2^32)
    exact_sum limbs{};
    for (int j = 2; j < 4; ++j) {  // exact: a fraction of a double and its products by 2^32 are doubles
      const double whole = std::floor(v);
      limbs[j] = static_cast<std::int64_t>(whole);
      v = std::ldexp(v - whole, 32);
    }
    limbs[4] = std::llround(v);
    return limbs;
  }

  /// The reduced part from the MAX of reduction_exponent and the SUM of reduction_exact_sum, correctly
  /// rounded to double from the exact integer total.
  static partial_norm from_reduction(int max_exponent, const exact_sum& summed) noexcept {
    if (summed[0] > 0) return {0, std::numeric_limits<double>::quiet_NaN(), false};
    if (summed[1] > 0) return {0, std::numeric_limits<double>::infinity(), false};
    if (max_exponent == no_exponent) return {};
    // Carry the limbs into one 128-bit integer hi:lo, worth (hi * 2^64 + lo) * 2^-94.
    constexpr std::uint64_t low32 = 0xffffffffu;
    std::uint64_t l2 = static_cast<std::uint64_t>(summed[4]);
    std::uint64_t l1 = static_cast<std::uint64_t>(summed[3]) + (l2 >> 32);
    std::uint64_t hi = static_cast<std::uint64_t>(summed[2]) + (l1 >> 32);
    std::uint64_t lo = ((l1 & low32) << 32) | (l2 & low32);
    if (hi == 0) return from_reduction(max_exponent, std::ldexp(static_cast<double>(lo), -94));
    int shift = 0;
    for (; (hi >> 63) == 0; ++shift) {
      hi = (hi << 1) | (lo >> 63);
      lo <<= 1;
    }
    // The 64 leading bits with the rest folded into a sticky bit: converting them rounds correctly.
    const double top = static_cast<double>(hi | (lo != 0 ? 1u : 0u));
    return from_reduction(max_exponent, std::ldexp(top, 64 - 94 - shift));
  }

 private:
  void add(const partial_norm& other) noexcept {
    if (sum == 0.0 || other.exponent > exponent) {
      sum = other.sum + scaled_sum_at(other.exponent);
      exponent = other.exponent;
    } else {
      sum += other.scaled_sum_at(exponent);
    }
  }
};

}  // namespace gradclip
