// Sum-of-squares kernels on raw contiguous buffers, one per policy, each returning a partial_norm.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

// Elements per block: small enough that a block is rescanned from L1 when it needs rescaling,
// large enough that the per-block bookkeeping is negligible.
inline constexpr std::size_t block_size = 1024;

// FP64 accumulation for FP64 input, FP32 otherwise: the "promote" rule.
template <class T>
using promoted_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Many independent accumulators: they let the compiler vectorize without -ffast-math, hide the add
// latency and, as a side effect, sum pairwise-like (error ~ n/lanes instead of n).
template <class Acc>
inline constexpr std::size_t lanes = 128 / sizeof(Acc);

template <class Acc, std::size_t L>
inline Acc sum_lanes(const Acc (&acc)[L]) noexcept {
  Acc partial[L];
  std::copy(acc, acc + L, partial);
  for (std::size_t width = L / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) partial[j] += partial[j + width];
  return partial[0];
}

/// sum(x^2) over n elements, each widened to Acc (and multiplied by `scale`, a power of two).
template <class Acc, class T>
inline Acc sum_squares(const T* p, std::size_t n, Acc scale = Acc(1)) noexcept {
  constexpr std::size_t L = lanes<Acc>;
  Acc acc[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    for (std::size_t j = 0; j < L; ++j) {
      const Acc v = widen<Acc>(p[i + j]) * scale;
      acc[j] += v * v;
    }
  const std::size_t rest = std::min(n - i, L);
  for (std::size_t j = 0; j < rest; ++j) {
    const Acc v = widen<Acc>(p[i + j]) * scale;
    acc[j] += v * v;
  }
  return sum_lanes(acc);
}

/// sum(x^2) and max|x| in one sweep. A NaN element makes the sum NaN; the max ignores NaN.
template <class Acc, class T>
inline void sum_squares_and_max(const T* p, std::size_t n, Acc& sum, Acc& max) noexcept {
  constexpr std::size_t L = lanes<Acc>;
  Acc acc[L] = {};
  Acc top[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    for (std::size_t j = 0; j < L; ++j) {
      const Acc v = widen<Acc>(p[i + j]);
      acc[j] += v * v;
      const Acc a = std::abs(v);
      top[j] = top[j] < a ? a : top[j];
    }
  const std::size_t rest = std::min(n - i, L);
  for (std::size_t j = 0; j < rest; ++j) {
    const Acc v = widen<Acc>(p[i + j]);
    acc[j] += v * v;
    const Acc a = std::abs(v);
    top[j] = top[j] < a ? a : top[j];
  }
  sum = sum_lanes(acc);
  max = *std::max_element(top, top + L);
}

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

/// Max scaling in one read pass: each block is summed unscaled when its maximum is in the safe range,
/// else rescanned (from L1) divided by a power of two near its maximum; blocks merge as partial_norms.
template <class Acc, class T>
inline partial_norm scaled_sum_squares(const T* p, std::size_t n) noexcept {
  partial_norm total;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    if constexpr (fits_without_scaling<T, Acc>) {
      const Acc sum = sum_squares<Acc>(block, m);
      total.merge(std::isfinite(sum) ? partial_norm{0, static_cast<double>(sum), true} : nonfinite_part(sum));
      continue;
    } else {
      Acc sum, max;
      sum_squares_and_max<Acc>(block, m, sum, max);
      if (std::isnan(sum) || std::isinf(max)) {
        total.merge(nonfinite_part(sum));
        continue;
      }
      if (max == Acc(0)) continue;
      const int e = std::ilogb(max) + 1;  // max * 2^-e lies in [0.5, 1)
      if (std::abs(e) <= safe_exponent_range<Acc>) {
        total.merge({0, static_cast<double>(sum), true});
        continue;
      }
      // 2^-e in two factors, each a normal number of Acc (2^-e alone may not be representable).
      const Acc first = std::ldexp(Acc(1), -e / 2);
      const Acc second = std::ldexp(Acc(1), -e - (-e / 2));
      Acc scaled = 0;
      if (first == Acc(1)) {
        scaled = sum_squares<Acc>(block, m, second);
      } else {
        // Apply the first factor through a small buffer so the kernel still takes one scale.
        Acc buffer[block_size];
        for (std::size_t i = 0; i < m; ++i) buffer[i] = widen<Acc>(block[i]) * first;
        scaled = sum_squares<Acc>(buffer, m, second);
      }
      total.merge({e, static_cast<double>(scaled), true});
    }
  }
  return total;
}

/// The squares of each block summed in Acc (overflowing as Acc does), block sums totalled in FP64.
template <class Acc, class T>
inline partial_norm unscaled_sum_squares(const T* p, std::size_t n) noexcept {
  double total = 0;
  for (std::size_t start = 0; start < n; start += block_size)
    total += static_cast<double>(sum_squares<Acc>(p + start, std::min(block_size, n - start)));
  return {0, total, std::isfinite(total)};
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

template <>
struct reduce_kernel<robust> {
  template <class T>
  static partial_norm run(const T* p, std::size_t n) noexcept {
    return scaled_sum_squares<double>(p, n);
  }
};

template <class Policy>
inline constexpr bool is_policy_v = std::is_same_v<Policy, naive> || std::is_same_v<Policy, promote> ||
                                    std::is_same_v<Policy, max_scale> || std::is_same_v<Policy, robust>;

}  // namespace gradclip::detail
