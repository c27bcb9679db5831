// The element census behind options::report: zeros, subnormals, NaN, Inf and max |x| of a run, counted on
// the elements' bits. Integer arithmetic only, so every CPU counts the same, and the loops vectorize in
// any target (compare and add on lanes as wide as the element).
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// The counts of a run of elements, mergeable in any order (sums and a maximum).
struct census {
  std::size_t size = 0, nan = 0, inf = 0, zeros = 0, subnormals = 0;
  double max_abs = 0.0;  // of the non-NaN elements

  void merge(const census& other) noexcept {
    size += other.size, nan += other.nan, inf += other.inf, zeros += other.zeros, subnormals += other.subnormals;
    max_abs = std::max(max_abs, other.max_abs);
  }
};

/// The layout of T's bits: signed integers of T's width, the magnitude mask, the bits of +inf and of the
/// smallest normal. A magnitude (bits & mask) orders as the value does, so max |x| is an integer max.
template <class T>
struct float_bits;
template <>
struct float_bits<Eigen::half> {
  using type = std::int16_t;
  static constexpr type mask = 0x7fff, inf = 0x7c00, min_normal = 0x0400;
};
template <>
struct float_bits<Eigen::bfloat16> {
  using type = std::int16_t;
  static constexpr type mask = 0x7fff, inf = 0x7f80, min_normal = 0x0080;
};
template <>
struct float_bits<float> {
  using type = std::int32_t;
  static constexpr type mask = 0x7fffffff, inf = 0x7f800000, min_normal = 0x00800000;
};
template <>
struct float_bits<double> {
  using type = std::int64_t;
  static constexpr type mask = 0x7fffffffffffffff, inf = 0x7ff0000000000000, min_normal = 0x0010000000000000;
};

/// Elements counted per inner block: counts of one block fit T-wide lanes (int16 for 16-bit types), so
/// the loop needs no widening, and a fixed trip count lets even -O2's cheap vectorizer take it.
inline constexpr std::size_t census_block = 1024;

template <class T>
census count_elements(const T* p, std::size_t n) noexcept {
  using bits = float_bits<std::remove_const_t<T>>;
  using I = typename bits::type;
  static_assert(sizeof(I) == sizeof(T), "an element is read as one integer of its width");
  census c;
  c.size = n;
  I top = 0;  // the largest magnitude below NaN, as bits
  const auto block = [&](const T* q, std::size_t m) {
    I zeros = 0, subnormals = 0, infs = 0, nans = 0, block_top = 0;
    for (std::size_t i = 0; i < m; ++i) {
      I x;
      std::memcpy(&x, q + i, sizeof x);
      const I a = static_cast<I>(x & bits::mask);
      zeros = static_cast<I>(zeros + (a == 0));
      subnormals = static_cast<I>(subnormals + (a != 0 && a < bits::min_normal));
      infs = static_cast<I>(infs + (a == bits::inf));
      nans = static_cast<I>(nans + (a > bits::inf));
      block_top = std::max(block_top, a > bits::inf ? I(0) : a);
    }
    c.zeros += static_cast<std::size_t>(zeros), c.subnormals += static_cast<std::size_t>(subnormals);
    c.inf += static_cast<std::size_t>(infs), c.nan += static_cast<std::size_t>(nans);
    top = std::max(top, block_top);
  };
  std::size_t i = 0;
  for (; i + census_block <= n; i += census_block) block(p + i, census_block);
  if (i < n) block(p + i, n - i);
  std::remove_const_t<T> largest;
  std::memcpy(static_cast<void*>(&largest), &top, sizeof top);  // bits of a trivially copyable T
  c.max_abs = static_cast<double>(widen<double>(largest));
  return c;
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
