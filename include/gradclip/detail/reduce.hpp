// Sum-of-squares kernels on raw contiguous buffers, one per policy, each returning a partial_norm.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

// FP64 accumulation for FP64 input, FP32 otherwise: the "promote" rule.
template <class T>
using promoted_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class Acc>
inline partial_norm nonfinite_part(Acc sum) noexcept {
  return {0, std::isnan(sum) ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(),
          false};
}

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
  if (std::isnan(sum) || std::isinf(max)) return nonfinite_part(sum);
  if (max == Acc(0)) return {};
  const int e = std::ilogb(max) + 1;  // max * 2^-e lies in [0.5, 1)
  // 2^-e in two factors, each a normal number of Acc (2^-e alone may not be representable).
  const Acc first = std::ldexp(Acc(1), -e / 2);
  const Acc second = std::ldexp(Acc(1), -e - (-e / 2));
  if (first == Acc(1)) return {e, portable::sum_squares<Acc>(block, m, second), true};
  // Apply the first factor through a small buffer so the kernel still takes one scale.
  Acc buffer[block_size];
  for (std::size_t i = 0; i < m; ++i) buffer[i] = widen<Acc>(block[i]) * first;
  return {e, portable::sum_squares<Acc>(buffer, m, second), true};
}

/// A total of unscaled block sums as a partial_norm (not finite once a block sum overflowed or saw NaN).
inline partial_norm unscaled_part(double total) noexcept {
  return std::isfinite(total) ? partial_norm{0, total, true} : nonfinite_part(total);
}

/// Max scaling in one read pass: each block is summed unscaled when its maximum is in the safe range
/// (the vector kernel's common case), else rescaled by rescaled_block; the parts merge as partial_norms.
template <class Acc, class T>
inline partial_norm scaled_sum_squares(const T* p, std::size_t n) noexcept {
  const isa target = best_isa();
  std::size_t done = 0;
  if constexpr (fits_without_scaling<T, Acc>) {
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

/// The squares of each block summed in Acc (overflowing as Acc does), block sums totalled in FP64.
template <class Acc, class T>
inline partial_norm unscaled_sum_squares(const T* p, std::size_t n) noexcept {
  std::size_t done = 0;
  const double total = block_sums<Acc, false>(best_isa(), p, n, Acc(0), Acc(0), done);
  return {0, total, static_cast<bool>(std::isfinite(total))};
}

template <class Policy>
struct reduce_kernel;

template <>
struct reduce_kernel<naive> {
  // Sequential, in the element type itself: exactly what g.square().sum() does in FP16.
  template <class T>
  static partial_norm run(const T* p, std::size_t n) noexcept {
    T sum(0);
    for (std::size_t i = 0; i < n; ++i) sum += p[i] * p[i];
    const double s = static_cast<double>(sum);
    return {0, s, static_cast<bool>(std::isfinite(s))};
  }
};

template <>
struct reduce_kernel<promote> {
  template <class T>
  static partial_norm run(const T* p, std::size_t n) noexcept {
    return unscaled_sum_squares<promoted_t<T>>(p, n);
  }
};

template <>
struct reduce_kernel<max_scale> {
  template <class T>
  static partial_norm run(const T* p, std::size_t n) noexcept {
    return scaled_sum_squares<promoted_t<T>>(p, n);
  }
};

// FP32 squares of FP16 and BF16 elements are exact, so robust keeps them in FP32 chains (carried into
// FP64, see portable::chain) at promote's speed; FP32 and FP64 elements square and sum in FP64.
template <class T>
using robust_t = std::conditional_t<sizeof(T) == 2, float, double>;

template <>
struct reduce_kernel<robust> {
  template <class T>
  static partial_norm run(const T* p, std::size_t n) noexcept {
    return scaled_sum_squares<robust_t<T>>(p, n);
  }
};

template <class Policy>
inline constexpr bool is_policy_v = std::is_same_v<Policy, naive> || std::is_same_v<Policy, promote> ||
                                    std::is_same_v<Policy, max_scale> || std::is_same_v<Policy, robust>;

}  // namespace gradclip::detail
