// Reduction kernels on raw contiguous buffers: the L2 sum of squares by the policy's row of the traits
// table, and every other p-norm by the p-norm kernels, each returning a partial_norm.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/detail/p_norm_kernels.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

// Block maxima inside [2^-range, 2^range] are summed unscaled: a block of squares can then neither
// overflow nor lose more than a negligible 2^-40 relative to underflow. Others are rescaled.
template <class Acc>
inline constexpr int safe_exponent_range = std::is_same_v<Acc, float> ? 50 : 450;

// True when every finite T squares and sums (2^63 times) inside Acc's normal range: no scaling needed.
template <class T, class Acc>
inline constexpr bool fits_without_scaling = std::numeric_limits<Acc>::max_exponent >
                                                 2 * std::numeric_limits<T>::max_exponent + 64 &&
                                             std::numeric_limits<Acc>::min_exponent <
                                                 2 * (std::numeric_limits<T>::min_exponent -
                                                      std::numeric_limits<T>::digits);

/// The part of a block whose maximum is outside the safe range (or not finite): rescanned from L1,
/// divided by a power of two near its maximum.
template <class Acc, class T>
inline partial_norm rescaled_block(const T* block, std::size_t m) noexcept {
  Acc max = 0;
  const double sum = portable::sum_squares<Acc>(block, m, Acc(1), &max);
  if (std::isnan(sum) || std::isinf(max)) return partial_norm::nonfinite(sum);
  if (max == Acc(0)) return {};
  const int e = std::ilogb(max) + 1;  // max * 2^-e lies in [0.5, 1)
  const auto [first, second] = power_of_two_factors<Acc>(-e);
  if (first == Acc(1)) return {e, portable::sum_squares<Acc>(block, m, second), true};
  // Apply the first factor through a small buffer so the kernel still takes one scale.
  Acc buffer[block_size];
  for (std::size_t i = 0; i < m; ++i) buffer[i] = widen<Acc>(block[i]) * first;
  return {e, portable::sum_squares<Acc>(buffer, m, second), true};
}

/// A total of unscaled block sums as a partial_norm (not finite once a block sum overflowed or saw NaN).
inline partial_norm unscaled_part(double total) noexcept {
  return std::isfinite(total) ? partial_norm{0, total, true} : partial_norm::nonfinite(total);
}

/// The sum of squares in Acc, blocks totalled in FP64. With MaxScales, in one read pass: each block is
/// summed unscaled when its maximum is in the safe range (the vector kernel's common case), else
/// rescaled by rescaled_block, and the parts merge; without, squares overflow as Acc does.
template <class Acc, bool MaxScales, class T>
inline partial_norm sum_squares(const T* p, std::size_t n) noexcept {
  const isa target = best_isa();
  std::size_t done = 0;
  if constexpr (!MaxScales || fits_without_scaling<T, Acc>) {
    return unscaled_part(block_sums<Acc, false>(target, p, n, Acc(0), Acc(0), done));
  } else {
    // Blocks whose maximum has an exponent e (max in [2^(e-1), 2^e)) with |e| <= range.
    const Acc lo = std::ldexp(Acc(1), -safe_exponent_range<Acc> - 1);
    const Acc hi = std::ldexp(Acc(1), safe_exponent_range<Acc>);
    partial_norm rescaled;
    double unscaled = 0;
    for (std::size_t start = 0; start < n;) {
      unscaled += block_sums<Acc, true>(target, p + start, n - start, lo, hi, done);
      start += done;
      if (start == n) break;
      const std::size_t m = std::min(block_size, n - start);
      rescaled.merge(rescaled_block<Acc>(p + start, m));
      start += m;
    }
    rescaled.merge(unscaled_part(unscaled));
    return rescaled;
  }
}

/// Sequentially, in the element type itself: exactly what g.square().sum() does in FP16.
template <class T>
inline partial_norm sequential_sum_squares(const T* p, std::size_t n) noexcept {
  T sum(0);
  for (std::size_t i = 0; i < n; ++i) sum += p[i] * p[i];
  return unscaled_part(static_cast<double>(sum));
}

/// The partial norm of a contiguous run: the policy's sum of squares for p = 2, the p-norm kernels
/// (the same under every policy) for other p.
template <class Policy, class T>
inline partial_norm reduce_run(const T* p, std::size_t n, double order) noexcept {
  static_assert(is_policy_v<Policy>, "The policy must be a row of gradclip::detail::policy_traits.");
  using traits = policy_traits<Policy>;
  using element = std::remove_const_t<T>;
  if (order != 2.0) return power_sum_kernel(p, n, order);
  if constexpr (traits::sequential)
    return sequential_sum_squares(p, n);
  else
    return sum_squares<typename traits::template accumulator<element>, traits::max_scales>(p, n);
}

}  // namespace gradclip::detail
