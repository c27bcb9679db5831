// The rules of every norm kind, one row each: how its parts merge, how a merged part becomes the norm, how
// a loss scale divides it, how the ranks of gradclip::mpi all-reduce it, which kernels reduce a run of its
// elements, and which kinds a call accepts. The rest of the library asks norm_kind instead of testing p, so
// a kind is a row in row_of plus its norm_type constant (options.hpp); docs/development.md, "A norm kind".
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/scaled.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// The largest finite p a norm may have: a part keeps sum |x|^p as sum * 2^(p * exponent) with a whole
/// exponent, which leaves a block's largest term inside double's range only up to about p = 1900. Above
/// it the p-norm differs from the max norm by less than a factor n^(1/p) anyway: use inf_norm.
inline constexpr double largest_finite_p = 1000.0;

/// How a merged part becomes the norm.
enum class norm_root {
  square_root,       ///< sqrt(sum + low): the tail counts, and the quotient of clipping keeps it
  identity,          ///< the sum (L1) or the maximum is the norm
  weight_root,       ///< sum^(1/w), split so that it cannot overflow for any w
  mean_square_root,  ///< sqrt((sum + low) / elements): the RMS norm, the tail kept as for square_root
};

/// What divides a part's sum by the mantissa m of a loss scale S = m * 2^k (its exponent takes 2^k).
enum class unscale_rule {
  mantissa_twice,      ///< sum / m / m: two roundings, the bits loss_scaler has always given the L2 norm
  mantissa,            ///< sum / m
  mantissa_to_weight,  ///< sum / m^w
};

/// How the ranks of gradclip::mpi all-reduce their parts, every rank getting the same bits.
enum class rank_reduction {
  maximum_bits,  ///< one MAX of each rank's norm as bits, sent with the arguments' agreement
  exact_sum,     ///< MAX of the exponents, then an exact int64 SUM of sums rescaled into [0, 2^w), w <= 2
  gather,        ///< every rank's part gathered and merged in rank order
};

/// Which kernels reduce a run of elements.
enum class run_kernel {
  sum_of_squares,  ///< the policy's own (detail/reduce.hpp), with one sweep over interleaved units
  p_norm,          ///< the p-norm kernels (detail/p_norm_kernels.hpp), the same under every policy
};

/// Everything one kind decides.
struct norm_row {
  /// w: a part's `sum` at `exponent` stands for sum * 2^(w * exponent), so a shift of the exponent
  /// multiplies the sum by a power of two for whole w. p for sums of |x|^p, 1 for the maximum.
  double weight;
  bool merges_by_maximum;  ///< parts merge by their maximum, not by adding rescaled sums
  norm_root root;
  unscale_rule unscale;
  rank_reduction ranks;
  run_kernel kernel;
  bool accepted;  ///< whether a call takes this kind (check_options)
  bool p_norm;    ///< the kind is the p-norm of its p: what libtorch's norm_type means (torch.hpp)
};

/// The row of the kind named p (norm_type, partial_norm::p): L2, L1, the maximum, any other p, or the RMS
/// norm (key -2, options.hpp). The exact integer SUM holds rescaled sums below 4 only, so p above 2 gathers
/// instead. Always inlined: a merge or a run asks one column, which then costs a comparison or two.
[[gnu::always_inline]] inline norm_row row_of(double p) noexcept {
  using root = norm_root;
  using unscale = unscale_rule;
  using ranks = rank_reduction;
  using kernel = run_kernel;
  // {weight, merges_by_maximum, root, unscale, ranks, kernel, accepted, p_norm}
  if (p == 2.0)
    return {2.0,  false, root::square_root, unscale::mantissa_twice, ranks::exact_sum, kernel::sum_of_squares,
            true, true};
  if (p == 1.0)
    return {1.0, false, root::identity, unscale::mantissa_to_weight, ranks::exact_sum, kernel::p_norm, true, true};
  if (p == -2.0)  // rms_norm: L2's parts, merges, loss scale and all-reduce, its root divides by the count
    return {2.0,  false, root::mean_square_root, unscale::mantissa_twice, ranks::exact_sum, kernel::sum_of_squares,
            true, false};
  if (std::isinf(p))
    return {1.0, true, root::identity, unscale::mantissa, ranks::maximum_bits, kernel::p_norm, p > 0, true};
  if (p <= 2.0)
    return {p, false, root::weight_root, unscale::mantissa_to_weight, ranks::exact_sum, kernel::p_norm, p > 0, true};
  const bool in_range = p <= largest_finite_p;  // false for NaN
  return {p, false, root::weight_root, unscale::mantissa_to_weight, ranks::gather, kernel::p_norm, in_range, true};
}

/// A norm kind, named by the p of norm_type and of partial_norm, with the rules of its row.
class norm_kind {
 public:
  [[gnu::always_inline]] explicit norm_kind(double p) noexcept : row_(row_of(p)) {}

  bool accepted() const noexcept { return row_.accepted; }
  bool p_norm() const noexcept { return row_.p_norm; }
  bool merges_by_maximum() const noexcept { return row_.merges_by_maximum; }
  /// See norm_row::weight.
  double weight() const noexcept { return row_.weight; }
  rank_reduction ranks() const noexcept { return row_.ranks; }
  run_kernel kernel() const noexcept { return row_.kernel; }

  /// The norm of a finite part with sum > 0 (and tail low) covering `elements` elements, as
  /// mantissa * 2^exponent.
  scaled root(double sum, double low, int exponent, std::uint64_t elements) const noexcept {
    switch (row_.root) {
      case norm_root::square_root:
        return scaled{std::sqrt(sum + low), exponent}.normalized();
      case norm_root::identity:
        return scaled{sum, exponent}.normalized();
      case norm_root::weight_root:
        break;
      case norm_root::mean_square_root: {
        const scaled r = mean_root_with_tail(sum, low, exponent, elements);
        return scaled{r.mantissa + r.low, r.exponent}.normalized();
      }
    }
    // sum^(1/w) = 2^(k/w) * (sum * 2^-k)^(1/w) with k the binary exponent of sum: no overflow for any w.
    const double w = row_.weight;
    const int k = std::ilogb(sum);
    const double whole = std::floor(k / w);
    const double value = std::pow(std::ldexp(sum, -k), 1.0 / w) * std::exp2(k / w - whole);
    return scaled{value, exponent + static_cast<int>(std::max(std::min(whole, 1e6), -1e6))}.normalized();
  }

  /// root(...).value(); an unscaled square root (the common case) skips the normalization round trip:
  /// the root of a positive double is a normal double, which splitting and joining gives back exactly.
  [[gnu::always_inline]] double root_value(double sum, double low, int exponent,
                                           std::uint64_t elements) const noexcept {
    if (row_.root == norm_root::square_root && exponent == 0) return std::sqrt(sum + low);
    return root(sum, low, exponent, elements).value();
  }

  /// root(...) for the quotient of clipping: a square root in double-double (the tail kept), so that the
  /// coefficient is correctly rounded; the other roots as root() gives them.
  scaled root_for_quotient(double sum, double low, int exponent, std::uint64_t elements) const noexcept {
    if (row_.root == norm_root::square_root) return root_with_tail(sum, low, exponent);
    if (row_.root == norm_root::mean_square_root) return mean_root_with_tail(sum, low, exponent, elements);
    return root(sum, low, exponent, elements);
  }

  /// A part's sum divided by the mantissa m (in [1, 2)) of a loss scale.
  double unscaled_sum(double sum, double m) const noexcept {
    switch (row_.unscale) {
      case unscale_rule::mantissa_twice:
        return sum / m / m;
      case unscale_rule::mantissa:
        return sum / m;
      case unscale_rule::mantissa_to_weight:
        break;
    }
    return sum / std::pow(m, row_.weight);
  }

 private:
  /// sqrt((sum + low) / elements * 4^exponent) with its tail: the quotient in double-double, at a scale
  /// where it is a normal double for any count (sum in [0.5, 4) there). No elements: +inf.
  static scaled mean_root_with_tail(double sum, double low, int exponent, std::uint64_t elements) noexcept {
    if (elements == 0) return {std::numeric_limits<double>::infinity(), 0};
    const int k = std::ilogb(sum) / 2 * 2;  // even, so the exponent halves exactly
    const double s = std::ldexp(sum, -k);
    const double n = static_cast<double>(elements);
    const double q = s / n;
    return root_with_tail(q, (std::fma(-q, n, s) + std::ldexp(low, -k)) / n, exponent + k / 2);
  }

  norm_row row_;
};

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
