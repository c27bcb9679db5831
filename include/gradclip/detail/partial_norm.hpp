// partial_norm: a mergeable piece of a norm, kept as a power-of-two scale and a scaled sum (or maximum),
// so that no merge overflows or underflows. Threads and ranks each compute one and merge them; ranks of a
// distributed job can also reduce them with two standard all-reduces (MAX of an exponent, then SUM of
// rescaled sums).
// Defined here, below the kernels that produce it; include it as <gradclip/partial_norm.hpp>.
// IWYU pragma: private, include <gradclip/partial_norm.hpp>
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/detail/scaled.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace gradclip {
inline namespace GRADCLIP_ABI {

struct partial_norm;

namespace detail {
/// A part's norm as mantissa * 2^exponent: exists even where the norm exceeds double's range. Not finite
/// when the part is not.
inline scaled norm_scaled(const partial_norm& part) noexcept;
}  // namespace detail

/// A piece of the p-norm of some elements: for finite p, sum |x|^p = `sum * 2^(p * exponent)`, so that
/// norm = 2^exponent * sum^(1/p) (for the L2 norm, the sum of squares is `sum * 4^exponent`); for p = inf,
/// max |x| = `sum * 2^exponent`. Every kind of norm is one of these: sum of squares (p = 2), sum of
/// magnitudes (p = 1), largest magnitude (p = inf) and sum of |x|^p.
///
/// Merging keeps the larger exponent and rescales the other sum by 2^(p * difference) (an exact power of
/// two for integer p), so a partial norm represents every finite sum, however large or small, to double
/// precision. `finite` is false once any merged part was not finite; `sum` then holds NaN (a NaN was seen)
/// or +inf. Parts merge only with parts of the same p; merging different ones gives a NaN part.
///
/// Distributed jobs can reduce one L1 or L2 part per rank with two all-reduces that any collective
/// library offers (MPI, NCCL, Gloo, torch.distributed), because no rank can merge before it knows the
/// common scale:
///
///     gradclip::partial_norm local = gradclip::partial_global_norm(my_shards);
///     int e = local.reduction_exponent();    // all-reduce MAX over ranks (int32)
///     double s = local.reduction_sum(e);      // all-reduce SUM over ranks (float64)
///     gradclip::partial_norm total = gradclip::partial_norm::from_reduction(e, s);
///
/// Kinds whose norm reads the element count (the RMS norm) also need `elements` summed over the ranks
/// (an integer SUM), passed to from_reduction. Every rescaled sum lies in [0, 2^p), so the SUM can neither
/// overflow nor lose a significant part, and a non-finite rank contributes NaN or +inf, which the SUM
/// carries to every rank. A floating-point SUM
/// rounds in whatever order the library adds, which MPI does not promise is the same on every rank;
/// `reduction_exact_sum` is the same contribution as integers, whose SUM (int64) is exact and so
/// bit-identical on every rank whatever the order. The maximum norm reduces with one MAX instead (see
/// gradclip::mpi), other p by gathering the parts and merging them in a fixed order.
struct partial_norm {
  int exponent = 0;
  double sum = 0.0;
  bool finite = true;
  double p = 2.0;  ///< which norm this is a part of: > 0, or +inf for the maximum
  /// The sum's tail: sum + low is the sum to about 2^-100 where the parts carried one (robust FP64 sums of
  /// squares), merges adding their rounding errors to it; clipping and the L2 norm use it, the all-reduce
  /// helpers do not.
  double low = 0.0;
  /// How many elements the part covers: set by the reductions, added by merge whatever the parts hold
  /// (zero, non-finite), kept by normalized. Kinds whose norm depends on n (the RMS norm) read it.
  std::uint64_t elements = 0;

  /// The exponent a zero or non-finite part contributes to the all-reduce MAX: it constrains nothing.
  static constexpr int no_exponent = std::numeric_limits<int>::min();

  /// A part that saw a NaN (when `witness` is NaN) or an infinity.
  static partial_norm nonfinite(double witness, double order = 2.0) noexcept {
    return {0, std::isnan(witness) ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(),
            false, order};
  }

  /// Adds another part of the same norm. Commutative bit for bit; for three parts or more, each merge
  /// rounds `sum` once. The element counts add.
  [[gnu::always_inline]] void merge(const partial_norm& other) noexcept {
    const std::uint64_t count = elements + other.elements;
    if (!merged_at_one_scale(other)) *this = merged_values(*this, other);
    elements = count;
  }

  /// The norm: +inf when it exceeds double's range although every element was finite, NaN or +inf when
  /// `!finite`. Computed as detail::norm_scaled(*this).value(), with a shortcut for unscaled L2 parts
  /// (norm_kind::root_value).
  double norm() const noexcept;

  /// `sum` expressed at a scale 2^target >= 2^exponent: exact for integer p unless it underflows, when it
  /// is negligible; one rounding of the factor 2^(p * shift) otherwise.
  double scaled_sum_at(int target) const noexcept { return rescaled(sum, target); }

  /// The same value with `sum` in [1, 2^p) ([1, 2) for the maximum; only the exponent moves, exactly for
  /// integer p). Zero parts become empty parts and non-finite parts are returned unchanged.
  partial_norm normalized() const noexcept {
    if (!finite) return *this;
    if (sum == 0.0) return {0, 0.0, true, p, 0.0, elements};
    const int k = std::ilogb(sum);  // sum in [2^k, 2^(k+1))
    const int shift = static_cast<int>(std::floor(k / detail::norm_kind{p}.weight()));
    partial_norm n{exponent + shift, 0.0, true, p, 0.0, elements};
    n.sum = rescaled(sum, exponent + shift);
    if (n.sum < 1.0) {  // k / p rounded up to a whole number (non-integer p): one step down
      n.exponent -= 1;
      n.sum = rescaled(sum, n.exponent);
    }
    n.low = rescaled(low, n.exponent);
    return n;
  }

  /// This part's contribution to the all-reduce MAX: the exponent of normalized(), or no_exponent.
  int reduction_exponent() const noexcept { return finite && sum != 0.0 ? normalized().exponent : no_exponent; }

  /// This part's contribution to the all-reduce SUM, given `max_exponent`, the result of the MAX: the
  /// normalized sum rescaled to that exponent, in [0, 2^p); NaN or +inf for a non-finite part.
  double reduction_sum(int max_exponent) const noexcept {
    if (!finite) return sum;
    if (sum == 0.0) return 0.0;
    return normalized().scaled_sum_at(max_exponent);
  }

  /// The reduced part from the results of the two all-reduces (on every rank the same), covering
  /// `elements`: the SUM of the ranks' element counts, for the kinds that read it (the RMS norm).
  static partial_norm from_reduction(int max_exponent, double summed, double order = 2.0,
                                     std::uint64_t elements = 0) noexcept {
    if (!std::isfinite(summed)) return {0, summed, false, order, 0.0, elements};
    if (max_exponent == no_exponent || summed == 0.0) return {0, 0.0, true, order, 0.0, elements};
    return {max_exponent, summed, true, order, 0.0, elements};
  }

  /// reduction_sum as integers for an all-reduce SUM over int64 (for p <= 2): counts of NaN and of +inf
  /// parts, then the rescaled sum in fixed point, 32 bits per limb from 2^1 down to 2^-94. Integer sums are exact, so
  /// the result does not depend on the order of the reduction; only bits below 2^-94 of the largest
  /// part's scale are lost (rounded, per part), far below one rounding of the total. Up to 2^30 parts.
  using exact_sum = std::array<std::int64_t, 5>;

  exact_sum reduction_exact_sum(int max_exponent) const noexcept {
    if (!finite) return {std::isnan(sum) ? 1 : 0, std::isnan(sum) ? 0 : 1, 0, 0, 0};
    double v = std::ldexp(reduction_sum(max_exponent), 30);  // [0, 2^32)
    exact_sum limbs{};
    for (std::size_t j = 2; j < 4; ++j) {  // exact: a fraction of a double and its products by 2^32 are doubles
      const double whole = std::floor(v);
      limbs[j] = static_cast<std::int64_t>(whole);
      v = std::ldexp(v - whole, 32);
    }
    limbs[4] = std::llround(v);
    return limbs;
  }

  /// The reduced part from the MAX of reduction_exponent and the SUM of reduction_exact_sum, correctly
  /// rounded to double from the exact integer total.
  static partial_norm from_reduction(int max_exponent, const exact_sum& summed, double order = 2.0,
                                     std::uint64_t elements = 0) noexcept {
    partial_norm part = from_exact_sum(max_exponent, summed, order);
    part.elements = elements;
    return part;
  }

 private:
  static partial_norm from_exact_sum(int max_exponent, const exact_sum& summed, double order) noexcept {
    if (summed[0] > 0) return nonfinite(std::numeric_limits<double>::quiet_NaN(), order);
    if (summed[1] > 0) return nonfinite(std::numeric_limits<double>::infinity(), order);
    if (max_exponent == no_exponent) return {0, 0.0, true, order};
    // Carry the limbs into one 128-bit integer hi:lo, worth (hi * 2^64 + lo) * 2^-94.
    constexpr std::uint64_t low32 = 0xffffffffu;
    std::uint64_t l2 = static_cast<std::uint64_t>(summed[4]);
    std::uint64_t l1 = static_cast<std::uint64_t>(summed[3]) + (l2 >> 32);
    std::uint64_t hi = static_cast<std::uint64_t>(summed[2]) + (l1 >> 32);
    std::uint64_t lo = ((l1 & low32) << 32) | (l2 & low32);
    if (hi == 0) return from_reduction(max_exponent, std::ldexp(static_cast<double>(lo), -94), order);
    int shift = 0;
    for (; (hi >> 63) == 0; ++shift) {
      hi = (hi << 1) | (lo >> 63);
      lo <<= 1;
    }
    // The 64 leading bits with the rest folded into a sticky bit: converting them rounds correctly.
    const double top = static_cast<double>(hi | (lo != 0 ? 1u : 0u));
    return from_reduction(max_exponent, std::ldexp(top, 64 - 94 - shift), order);
  }

  /// merge's common case, inline: finite parts of one sum at one scale (or an empty other part), whose
  /// total is finite. False, and nothing changed, otherwise.
  [[gnu::always_inline]] bool merged_at_one_scale(const partial_norm& other) noexcept {
    if (!(finite && other.finite && other.p == p && other.exponent == exponent)) return false;
    if (other.sum == 0.0) return true;
    if (detail::norm_kind{p}.merges_by_maximum()) return false;
    const double total = sum + other.sum;
    if (std::isinf(total)) return false;
    low = rounding_error(sum, other.sum, total) + (low + other.low);
    sum = total;
    return true;
  }

  /// merge without the element counts, on copies, and not inlined: merge stays small enough to inline, and
  /// a part merged in a loop is never addressed, so the compiler can keep it in registers.
  [[gnu::noinline]] static partial_norm merged_values(partial_norm mine, const partial_norm& other) noexcept {
    mine.merge_values(other);
    return mine;
  }

  /// merge without the element counts, the parts at any scale.
  void merge_values(const partial_norm& other) noexcept {
    if (finite && other.finite && other.p == p) {
      if (other.sum == 0.0) return;
      const partial_norm before = *this;
      add(other);
      // Parts built without scaling (near double's maximum) can overflow together; normalized parts
      // cannot.
      if (std::isinf(sum)) {
        *this = before.normalized();
        add(other.normalized());
      }
      return;
    }
    const bool saw_nan = std::isnan(sum) || std::isnan(other.sum) || !(other.p == p);
    *this = nonfinite(saw_nan ? std::numeric_limits<double>::quiet_NaN() : sum + other.sum, p);
  }

  /// v (this part's sum or tail) expressed at 2^target >= 2^exponent: see scaled_sum_at.
  double rescaled(double v, int target) const noexcept {
    if (v == 0.0) return 0.0;  // an empty part at any scale (0 * 2^huge would be NaN)
    const double shift = static_cast<double>(exponent) - static_cast<double>(target);  // <= 0
    const double power = detail::norm_kind{p}.weight() * shift;
    if (power < -4000.0) return 0.0;
    if (power == std::floor(power)) return std::ldexp(v, static_cast<int>(power));
    return v * std::exp2(power);
  }

  /// (a + b) - s exactly, for s = a + b rounded (Knuth's TwoSum; symmetric in a and b).
  static double rounding_error(double a, double b, double s) noexcept {
    const double moved = s - a;
    return (a - (s - moved)) + (b - moved);
  }

  void add(const partial_norm& other) noexcept {
    const bool rescale_mine = sum == 0.0 || other.exponent > exponent;
    const double mine = rescale_mine ? scaled_sum_at(other.exponent) : sum;
    const double theirs = rescale_mine ? other.sum : other.scaled_sum_at(exponent);
    const double tails =
        rescale_mine ? rescaled(low, other.exponent) + other.low : low + other.rescaled(other.low, exponent);
    if (rescale_mine) exponent = other.exponent;
    if (detail::norm_kind{p}.merges_by_maximum()) {
      sum = std::max(mine, theirs);
      return;
    }
    sum = mine + theirs;
    low = rounding_error(mine, theirs, sum) + tails;
  }
};

inline detail::scaled detail::norm_scaled(const partial_norm& part) noexcept {
  if (!part.finite) return {part.sum, 0};
  if (part.sum == 0.0) return {};
  return norm_kind{part.p}.root(part.sum, part.low, part.exponent, part.elements);
}

inline double partial_norm::norm() const noexcept {
  if (finite && sum > 0.0) return detail::norm_kind{p}.root_value(sum, low, exponent, elements);
  return detail::norm_scaled(*this).value();
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
