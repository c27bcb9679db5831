// Reduction kernels on raw contiguous buffers: the L2 sum of squares by the policy's row of the traits
// table, and every other p-norm by the p-norm kernels, each returning a partial_norm.
#pragma once

#include <gradclip/detail/census.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/partial_norm.hpp>
#include <gradclip/detail/policy_traits.hpp>
#include <gradclip/detail/scaled.hpp>
#if defined(GRADCLIP_COMPILED)
#include <gradclip/detail/compiled.hpp>  // the kernels' entry points below, from the library
#else
#include <gradclip/detail/p_norm_kernels.hpp>
#include <gradclip/detail/simd.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

// FP64 block maxima inside [2^-range, 2^range] are summed unscaled by the compensated kernel: its squares
// can then neither overflow nor lose more than a negligible 2^-40 relative to underflow. Sums in Acc are
// kept unscaled when finite and at least 2^(-2 range): a square that underflowed (by at most Acc's
// smallest normal) is then negligible beside them. Other blocks are rescaled.
template <class Acc>
inline constexpr int safe_exponent_range = std::is_same_v<Acc, float> ? 50 : 450;

// True when every finite T squares and sums (2^63 times) inside Acc's normal range: no scaling needed.
template <class T, class Acc>
inline constexpr bool fits_without_scaling = std::numeric_limits<Acc>::max_exponent >
                                                 2 * std::numeric_limits<T>::max_exponent + 64 &&
                                             std::numeric_limits<Acc>::min_exponent <
                                                 2 * (std::numeric_limits<T>::min_exponent -
                                                      std::numeric_limits<T>::digits);

/// A total of unscaled block sums as a partial_norm (not finite once a block sum overflowed or saw NaN).
inline partial_norm unscaled_part(double total) noexcept {
  return std::isfinite(total) ? partial_norm{0, total, true} : partial_norm::nonfinite(total);
}

/// Elements between two calls of a reduction's observer (options::report's census): a chunk it reads
/// again while the chunk is still in L1 or L2. A multiple of every block, so chunks change no bit.
inline constexpr std::size_t observed_chunk = 8192;

/// The observer of a reduction that nothing observes.
struct no_observer {
  template <class T>
  void operator()(const T*, std::size_t) const noexcept {}
};

#if !defined(GRADCLIP_COMPILED)
/// The census of a run on the best kernels (census_of, kernels.inc).
template <class T>
census count_elements(const T* p, std::size_t n) noexcept {
  return with_isa(best_isa(), [&](auto k) { return decltype(k)::census_of(p, n); });
}
#endif

/// The observer of options::report: adds the census of what it is shown to *counts. The L2 sum of
/// squares (sum_squares) counts inside its own loop instead, while the elements are in registers, on
/// the targets where counts_in_loop.
struct census_observer {
  census* counts;
  template <class T>
  void operator()(const T* p, std::size_t n) const noexcept {
    if (n <= short_run)
      add_short_census(*counts, p, n);
    else
      counts->merge(count_elements(p, n));
  }
};

#if !defined(GRADCLIP_COMPILED)

/// A block whose sum of squares was not accurate unscaled (or not finite): rescanned from L1, divided by
/// a power of two near its maximum.
template <class K, class Acc, class T>
inline partial_norm rescaled_block(const T* block, std::size_t m) noexcept {
  const double max = pnorm::max_abs<K>(block, m);
  if (!std::isfinite(max)) return partial_norm::nonfinite(max);
  if (max == 0.0) return {};
  const int e = std::ilogb(max) + 1;  // max * 2^-e lies in [0.5, 1)
  const auto [first, second] = power_of_two_factors<Acc>(-e);
  if (first == Acc(1)) return {e, K::template block_squares<Acc, true>(block, m, second), true};
  // Apply the first factor through a small buffer so the kernel still takes one scale.
  Acc buffer[block_for<T>];
  for (std::size_t i = 0; i < m; ++i) buffer[i] = widen<Acc>(block[i]) * first;
  return {e, K::template block_squares<Acc, true>(buffer, m, second), true};
}

/// sum_squares below, the kernels counting into `counts` (census_lanes; nothing for a std::nullptr_t*),
/// with observe(chunk, m) after each chunk.
template <class K, class Acc, bool MaxScales, class T, class Counts, class Observe>
inline partial_norm chunked_sum_squares(const T* p, std::size_t n, Counts* counts, Observe&& observe) noexcept {
  static_assert(observed_chunk % block_for<T> == 0, "chunks hold whole blocks");
  compensated_sum segment;
  if constexpr (!MaxScales || fits_without_scaling<T, Acc>) {
    for (std::size_t chunk = 0; chunk < n; chunk += observed_chunk) {
      const std::size_t m = std::min(observed_chunk, n - chunk);
      K::template add_block_sums<Acc, false>(p + chunk, m, 0.0, segment, counts);
      observe(p + chunk, m);
    }
    return unscaled_part(segment.value());
  } else {
    const double min_sum = std::ldexp(1.0, -2 * safe_exponent_range<Acc>);
    partial_norm rescaled;
    double unscaled = 0;
    for (std::size_t chunk = 0; chunk < n; chunk += observed_chunk) {
      const std::size_t end = std::min(n, chunk + observed_chunk);
      for (std::size_t start = chunk; start < end;) {
        start += K::template add_block_sums<Acc, true>(p + start, end - start, min_sum, segment, counts);
        if (start == end) break;
        unscaled += segment.value();  // the unscaled blocks so far, then the block to rescale
        segment = {};
        const std::size_t m = std::min(block_for<T>, end - start);
        rescaled.merge(rescaled_block<K, Acc>(p + start, m));
        start += m;
      }
      observe(p + chunk, end - chunk);
    }
    unscaled += segment.value();
    rescaled.merge(unscaled_part(unscaled));
    return rescaled;
  }
}

/// Whether target K's sums of squares count options::report's census in their own loop (census_lanes):
/// the vector targets do. The portable target counts each observed chunk again from cache (census_of,
/// which the compiler vectorizes on integers), the same counts: on the Intel Xeon of docs/bench that ran
/// its counted sums 1.4 (FP16) and 2.4 to 2.5 (FP32) times as fast as counting in its scalar loop, and
/// it spares every unit that clips about 0.3 s of compile time (issue 26).
template <class K>
inline constexpr bool counts_in_loop = K::target != isa::portable;

/// The sum of squares in Acc, blocks totalled in FP64. With MaxScales, in one read pass: each block is
/// summed unscaled and kept when that sum is accurate (accurate_unscaled: the vector kernel's
/// common case, with no maximum to track), else rescanned by rescaled_block, and the parts merge;
/// without, squares overflow as Acc does. observe(chunk, m) follows each observed_chunk elements; the
/// bits are those of one pass, whatever the chunks. Where counts_in_loop, a census_observer is not
/// called: the kernel counts each element as it sums it (census_lanes.inc), added to its census
/// at the end.
template <class K, class Acc, bool MaxScales, class T, class Observe>
inline partial_norm sum_squares(const T* p, std::size_t n, Observe&& observe) noexcept {
  if constexpr (std::is_same_v<std::decay_t<Observe>, census_observer> && counts_in_loop<K>) {
    typename K::template census_lanes<std::remove_const_t<T>, Acc> lanes;
    const partial_norm part = chunked_sum_squares<K, Acc, MaxScales>(p, n, &lanes, no_observer{});
    lanes.finish(n, *observe.counts);
    return part;
  } else {
    return chunked_sum_squares<K, Acc, MaxScales>(p, n, static_cast<std::nullptr_t*>(nullptr), observe);
  }
}

/// A sum of squares as (hi + lo) * 4^exponent, merged in double-double: the compensated FP64 sum's
/// segments and rescaled blocks, handed on as a partial_norm's sum and tail.
struct compensated_total {
  int exponent = 0;
  double_double value;
  partial_norm nonfinite;  // the non-finite blocks' parts, merged (NaN wins over inf)

  void add(int e, const double_double& s) noexcept {
    if (s.hi == 0.0) return;
    double_double mine = value, theirs = s;
    if (value.hi == 0.0 || e > exponent) {  // rescale mine: exact for 4^-k unless it underflows (negligible)
      mine = {std::ldexp(value.hi, 2 * (exponent - e)), std::ldexp(value.lo, 2 * (exponent - e))};
      exponent = e;
    } else {
      theirs = {std::ldexp(s.hi, 2 * (e - exponent)), std::ldexp(s.lo, 2 * (e - exponent))};
    }
    const double_double t = two_sum(mine.hi, theirs.hi);
    const double lo = t.lo + (mine.lo + theirs.lo);
    const double hi = t.hi + lo;
    value = {hi, lo - (hi - t.hi)};
  }

  partial_norm rounded() const noexcept {
    partial_norm part = nonfinite;
    if (std::isnan(value.hi)) part.merge(partial_norm::nonfinite(value.hi));
    if (!part.finite) return part;
    return {value.hi == 0.0 ? 0 : exponent, value.hi, true, 2.0, value.lo};
  }
};

/// A block whose maximum is outside the safe range (or not finite), rescanned from L1 and divided by a
/// power of two near its maximum, its squares summed by the compensated kernel.
template <class K>
inline void add_rescaled_block(const double* block, std::size_t m, compensated_total& total) noexcept {
  const double max = K::max_abs(block, m);
  if (!std::isfinite(max)) return total.nonfinite.merge(partial_norm::nonfinite(max));
  if (max == 0.0) return;
  const int e = std::ilogb(max) + 1;  // max * 2^-e lies in [0.5, 1)
  const auto [first, second] = power_of_two_factors(-e);
  double buffer[block_size];
  for (std::size_t i = 0; i < m; ++i) buffer[i] = block[i] * first * second;  // exact where it matters
  std::size_t done = 0;
  total.add(e, K::template compensated_squares<false>(buffer, m, 0.0, 0.0, done));
}

/// The FP64 sum of squares compensated (compensated_squares, kernels.inc), max-scaled blocks as in
/// sum_squares, everything merged in double-double and rounded once: within about 2^-53 relative of the
/// exact sum ((4400 n + 2^21) 2^-106 more).
template <class K>
inline partial_norm compensated_sum_squares(const double* p, std::size_t n) noexcept {
  const double lo = std::ldexp(1.0, -safe_exponent_range<double> - 1);
  const double hi = std::ldexp(1.0, safe_exponent_range<double>);
  compensated_total total;
  for (std::size_t start = 0; start < n;) {
    std::size_t done = 0;
    total.add(0, K::template compensated_squares<true>(p + start, n - start, lo, hi, done));
    start += done;
    if (start == n) break;
    const std::size_t m = std::min(block_size, n - start);
    add_rescaled_block<K>(p + start, m, total);
    start += m;
  }
  return total.rounded();
}

#endif

/// Whether short_squares unrolls its loop: FP32 only, where the compiler is GCC (GRADCLIP_UNROLLS_SHORT_RUNS).
/// 16-bit elements are widened in software on baseline x86-64, and unrolled they cost every unit that clips
/// them 0.3 to 0.6 s more to compile.
template <class T>
inline constexpr bool unrolls_short_runs = GRADCLIP_UNROLLS_SHORT_RUNS &&
                                           (std::is_same_v<std::remove_const_t<T>, float>);

/// The squares of a short run (at most short_run elements) summed in FP64 directly: exact squares for FP32
/// and narrower elements, so at least as accurate as the kernels, and overflow-free. visit(x) sees each
/// element widened, in registers. Always inlined (here and below), as reduce_run is. Unrolled completely
/// where unrolls_short_runs: straight-line pairs with an exit after each.
template <class T, class Visit>
[[gnu::always_inline]] inline double short_squares(const T* p, std::size_t n, Visit&& visit) noexcept {
  static_assert(sizeof(std::remove_const_t<T>) <= 4, "squares exact in FP64, whether or not contracted into FMA");
  static_assert(short_run == 32, "the pragma below unrolls short_run / 2 pairs");
  double even = 0, odd = 0;
  const auto add_pair = [&](std::size_t i) GRADCLIP_INLINE_LAMBDA {
    const double x = widen<double>(p[i]), y = widen<double>(p[i + 1]);
    even += x * x;
    odd += y * y;
    visit(x), visit(y);
  };
  std::size_t i = 0;
  if constexpr (unrolls_short_runs<T>) {  // the same loop: g++ 12 crashes on a pragma count that depends on T
#pragma GCC unroll 16
    for (; i + 2 <= n; i += 2) add_pair(i);
  } else {
    for (; i + 2 <= n; i += 2) add_pair(i);
  }
  if (i < n) {
    const double x = widen<double>(p[i]);
    even += x * x;
    visit(x);
  }
  return even + odd;
}

template <class T>
[[gnu::always_inline]] inline partial_norm short_sum_squares(const T* p, std::size_t n) noexcept {
  return unscaled_part(short_squares(p, n, [](double) {}));
}

/// Whether a short run's sum of squares (short_squares) is all its census says: sets `sum`, and `top` to its
/// largest magnitude, and returns whether every element is a finite normal number (a zero, a subnormal, Inf
/// or NaN makes the least magnitude small or the sum not finite; NaN passes both comparisons by, but makes
/// the sum NaN). Tracking the magnitudes in the sum's loop costs a third of the instructions of a second
/// look at the run's bits. n >= 1: where the loop is unrolled, both start at the first magnitude (widened
/// once with the first pair), which 0 and infinity would have to be compared with first, for NaN's sake.
template <class T>
[[gnu::always_inline]] inline bool normal_short_squares(const T* p, std::size_t n, double& sum, double& top) noexcept {
  using element = std::remove_const_t<T>;
  double largest = 0, least = std::numeric_limits<double>::infinity();
  if constexpr (unrolls_short_runs<T>) largest = least = std::abs(widen<double>(p[0]));
  sum = short_squares(p, n, [&](double x) {
    const double magnitude = std::abs(x);
    largest = std::max(largest, magnitude);
    least = std::min(least, magnitude);
  });
  top = largest;
  return least >= static_cast<double>(std::numeric_limits<element>::min()) && std::isfinite(sum);
}

/// short_sum_squares, adding the run's census to `counts`: counted again (add_short_census) only where
/// normal_short_squares says the run holds zeros, subnormals, Inf or NaN.
template <class T>
[[gnu::always_inline]] inline partial_norm counted_short_sum_squares(const T* p, std::size_t n,
                                                                     census& counts) noexcept {
  if (n == 0) return unscaled_part(0.0);
  double sum, top;
  if (normal_short_squares(p, n, sum, top)) {
    counts.size += n;
    counts.max_abs = std::max(counts.max_abs, top);
  } else {
    add_short_census(counts, p, n);
  }
  return unscaled_part(sum);
}

/// Sequentially, in the element type itself: exactly what g.square().sum() does in FP16.
template <class T>
inline partial_norm sequential_sum_squares(const T* p, std::size_t n) noexcept {
  T sum(0);
  for (std::size_t i = 0; i < n; ++i) sum += p[i] * p[i];
  return unscaled_part(static_cast<double>(sum));
}

/// Whether reduce_run sums a run of short_run elements or fewer in its caller's loop (short_squares), for
/// the kinds that sum squares.
template <class Policy, class T>
inline constexpr bool sums_short_runs = !policy_traits<Policy>::sequential && policy_traits<Policy>::max_scales &&
                                        !std::is_same_v<std::remove_const_t<T>, double>;

/// The partial norm of a contiguous run: the policy's sum of squares for p = 2, the p-norm kernels
/// (the same under every policy) for other p.
/// observe(chunk, m) sees every element once, after the reduction read it: in chunks while they are in
/// cache on the L2 sum-of-squares path, all at once after the other paths.
/// Always inlined, so that a short run (many small gradients) is summed in its caller's loop; the kernels
/// of longer runs are calls.
template <class Policy, class T, class Observe = no_observer>
[[gnu::always_inline]] inline partial_norm reduce_run_kernels(const T* p, std::size_t n, double order,
                                                              Observe&& observe = {}) noexcept {
  static_assert(is_policy_v<Policy>, "The policy must be a row of gradclip::detail::policy_traits.");
  using traits = policy_traits<Policy>;
  using element = std::remove_const_t<T>;
  const auto observed = [&](const partial_norm& part) {
    observe(p, n);
    return part;
  };
  if (norm_kind{order}.kernel() != run_kernel::sum_of_squares) return observed(power_sum_kernel(p, n, order));
  if constexpr (sums_short_runs<Policy, T>)
    if (n <= short_run) {
      if constexpr (std::is_same_v<std::decay_t<Observe>, census_observer>)
        return counted_short_sum_squares(p, n, *observe.counts);
      else
        return observed(short_sum_squares(p, n));
    }
  if constexpr (traits::sequential) {
    return observed(sequential_sum_squares(p, n));
  } else {
    return with_isa(best_isa(), [&](auto k) {
      using K = decltype(k);
      if constexpr (traits::compensated && std::is_same_v<element, double>)
        return observed(compensated_sum_squares<K>(p, n));
      else
        return sum_squares<K, typename traits::template accumulator<element>, traits::max_scales>(p, n, observe);
    });
  }
}

/// reduce_run_kernels' part, of the kind `order` (the sums of squares serve more than L2), covering n
/// elements.
template <class Policy, class T, class Observe = no_observer>
[[gnu::always_inline]] inline partial_norm reduce_run(const T* p, std::size_t n, double order,
                                                      Observe&& observe = {}) noexcept {
  partial_norm part = reduce_run_kernels<Policy>(p, n, order, observe);
  part.p = order;
  part.elements = n;
  return part;
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
