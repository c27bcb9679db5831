// The element census behind options::report: zeros, subnormals, NaN, Inf and max |x| of a run, counted on
// the elements' bits. Integer arithmetic only, so every CPU counts the same. The vector targets' L2 sums of
// squares count inside their own loop (census_lanes.inc, chosen by reduce.hpp's sum_squares for a
// census_observer); other reductions are followed by census_of (kernels.inc, via count_elements). Short
// runs are counted inline (add_short_census), where the vector loop costs more than it saves.
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

/// The observer of options::report (reduce.hpp), which the L2 kernels recognise and count in their loop.
struct census_observer;

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

/// NaN and Inf counts and the largest non-NaN magnitude of a block that holds one of them (the rare path).
template <class I, class Bits, class T>
void count_nonfinite(const T* q, std::size_t m, census& c, I& top) noexcept {
  for (std::size_t i = 0; i < m; ++i) {
    I x;
    std::memcpy(&x, q + i, sizeof x);
    const I a = static_cast<I>(x & Bits::mask);
    c.inf += a == Bits::inf;
    c.nan += a > Bits::inf;
    if (a <= Bits::inf) top = std::max(top, a);
  }
}

/// Adds the census of a short run (the reductions' short_run elements or fewer) to c, inline: the same
/// counts as census_of, without the dispatch and the vector loop's setup, which cost more than counting a
/// few elements of many small tensors. The loop keeps only the largest and the least magnitude; the zeros
/// and subnormals, and NaN and Inf, are counted in a second look at the run (in L1) only when those
/// say there are some.
template <class T>
void add_short_census(census& c, const T* p, std::size_t n) noexcept {
  using element = std::remove_const_t<T>;
  using bits = float_bits<element>;
  using I = typename bits::type;
  const auto magnitude = [&](std::size_t i) {
    I x;
    std::memcpy(&x, p + i, sizeof x);
    return static_cast<I>(x & bits::mask);
  };
  I top = 0, low = bits::mask;
  for (std::size_t i = 0; i < n; ++i) {
    const I a = magnitude(i);
    top = std::max(top, a);
    low = std::min(low, a);
  }
  c.size += n;
  if (low < bits::min_normal) {
    std::size_t zeros = 0, below = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const I a = magnitude(i);
      zeros += a == 0;
      below += a < bits::min_normal;
    }
    c.zeros += zeros;
    c.subnormals += below - zeros;
  }
  if (top >= bits::inf) {
    top = 0;
    count_nonfinite<I, bits>(p, n, c, top);
  }
  element largest;
  std::memcpy(static_cast<void*>(&largest), &top, sizeof top);  // bits of a trivially copyable T
  c.max_abs = std::max(c.max_abs, static_cast<double>(widen<double>(largest)));
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
