// The kernels of update clipping (update_clip.hpp): the RMS of a norm's part, StableAdamW's fused sum of
// g^2 / max(v, eps^2) and SPAM's elementwise clip on raw pointers, their vector loops dispatched
// (update_kernels.inc); and two views paired by element.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/partial_norm.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/strided_view.hpp>
#if defined(GRADCLIP_COMPILED)
#include <gradclip/detail/compiled.hpp>  // quotient_lanes and spam_unclear, from the library
#else
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

/// The part of the RMS ||u||_2 / sqrt(n) from the L2 part of n elements: the sum of squares divided by n
/// in double-double (the quotient's remainder is exact by FMA), so plan_clip's coefficient keeps the
/// precision it has for a norm. Zero and non-finite parts are returned unchanged.
inline partial_norm rms_part(const partial_norm& part, std::size_t n) noexcept {
  if (!part.finite || part.sum == 0.0 || n == 0) return part;
  partial_norm p = part.normalized();  // sum in [1, 4): the quotient stays a normal double
  const double count = static_cast<double>(n);
  const double q = p.sum / count;
  p.low = (std::fma(-q, count, p.sum) + p.low) / count;
  p.sum = q;
  return p;
}

/// The element at linear index k of a view (segment by segment), stepped forward one element at a time.
template <class T>
class view_cursor {
 public:
  view_cursor(const strided_view<T>& v, std::size_t k) noexcept
      : v_(v), segment_(v.inner_size == 0 ? 0 : k / v.inner_size), index_(v.inner_size == 0 ? 0 : k % v.inner_size) {}
  T& operator*() const noexcept {
    return v_.data[static_cast<std::ptrdiff_t>(segment_) * v_.outer_stride +
                   static_cast<std::ptrdiff_t>(index_) * v_.inner_stride];
  }
  void next() noexcept {
    if (++index_ == v_.inner_size) {
      index_ = 0;
      ++segment_;
    }
  }

 private:
  strided_view<T> v_;
  std::size_t segment_, index_;
};

template <class T>
bool is_contiguous(const strided_view<T>& v) noexcept {
  return v.outer_size == 1 && v.inner_stride == 1;
}

/// Calls f(a, b, m) on elements [first, last) of two views of one size, paired by linear index, in
/// blocks of at most block_size: pointers into the views when both are contiguous, else gathered copies
/// (a's copy written back after f unless A is const). Blocks start at multiples of block_size from
/// `first`, whatever the layout, so a strided view gives the bits its contiguous copy gives.
template <class A, class B, class F>
void for_each_paired_block(const strided_view<A>& a, const strided_view<B>& b, std::size_t first, std::size_t last,
                           F&& f) {
  if (is_contiguous(a) && is_contiguous(b)) {
    for (std::size_t start = first; start < last; start += block_size)
      f(a.data + start, b.data + start, std::min(block_size, last - start));
    return;
  }
  std::remove_const_t<A> buffer_a[block_size];
  std::remove_const_t<B> buffer_b[block_size];
  view_cursor<A> ca(a, first);
  view_cursor<B> cb(b, first);
  for (std::size_t start = first; start < last; start += block_size) {
    const std::size_t m = std::min(block_size, last - start);
    const view_cursor<A> block_start = ca;
    for (std::size_t i = 0; i < m; ++i, ca.next(), cb.next()) {
      buffer_a[i] = *ca;
      buffer_b[i] = *cb;
    }
    f(static_cast<A*>(buffer_a), static_cast<const B*>(buffer_b), m);
    if constexpr (!std::is_const_v<A>) {
      view_cursor<A> back = block_start;
      for (std::size_t i = 0; i < m; ++i, back.next()) *back = buffer_a[i];
    }
  }
}

// The loops round every product before adding (no contraction into FMA), so their bits do not depend on
// the instruction set the compiler targets.
GRADCLIP_FP_CONTRACT_OFF_BEGIN

/// StableAdamW's sum, sum_j g_j^2 / max(v_j, eps^2), as a part of p = 1 (sum * 2^exponent), and whether
/// an input was NaN or infinite (`witness`: the first such value, in element order).
struct quotient_sum {
  partial_norm sum{0, 0.0, true, 1.0};
  bool nonfinite_input = false;
  double witness = 0.0;

  void merge(const quotient_sum& other) noexcept {
    sum.merge(other.sum);
    if (other.nonfinite_input && !nonfinite_input) witness = other.witness;
    nonfinite_input = nonfinite_input || other.nonfinite_input;
  }
};

/// One term, from a block the fast loop could not sum: every finite term as mantissa * 2^exponent (no
/// overflow or underflow for any eps > 0), a non-finite input in IEEE arithmetic.
inline void add_quotient_term(double x, double w, double eps_squared, const scaled& eps_squared_scaled,
                              quotient_sum& total) noexcept {
  if (!std::isfinite(x) || !std::isfinite(w)) {
    if (!total.nonfinite_input) total.witness = std::isnan(x) || std::isinf(x) ? x : w;
    total.nonfinite_input = true;
    const double t = x * x / std::max(w, eps_squared);  // std::max keeps a NaN w
    total.sum.merge(std::isfinite(t) ? partial_norm{0, t, true, 1.0} : partial_norm::nonfinite(t, 1.0));
    return;
  }
  if (x == 0.0) return;
  const scaled xs = scaled::of(x);
  const scaled m = w > 0.0 && eps_squared_scaled < scaled::of(w) ? scaled::of(w) : eps_squared_scaled;
  const scaled t = xs * xs / m;
  total.sum.merge(partial_norm{t.exponent, t.mantissa, true, 1.0});
}

/// The sum over one block (at most block_size elements). The fast loop (quotient_lanes, dispatched) sums
/// in FP64 vectors; a block whose sum is not finite (a term that overflows, an input that is NaN or
/// infinite, or a v too large for its grouped quotients) is summed again term by term. Terms that
/// underflow are negligible: the factor is 1 unless the sum exceeds the element count.
template <class T, class V>
quotient_sum quotient_block(const T* g, const V* v, std::size_t m, double eps_squared,
                            const scaled& eps_squared_scaled) noexcept {
  const double sum = with_isa(best_isa(), [&](auto k) { return decltype(k)::quotient_lanes(g, v, m, eps_squared); });
  quotient_sum block;
  // eps^2 below double's normal range would make the fast loop's max(v, eps^2) inexact or zero.
  if (std::isfinite(sum) && eps_squared >= std::numeric_limits<double>::min()) {
    if (sum != 0.0) block.sum = {0, sum, true, 1.0};
    return block;
  }
  for (std::size_t k = 0; k < m; ++k)
    add_quotient_term(widen<double>(g[k]), widen<double>(v[k]), eps_squared, eps_squared_scaled, block);
  return block;
}

/// x^2 > theta * w for finite x != 0, finite w > 0 and finite theta > 0, decided on the mantissas: exact
/// when x^2 is exact in FP64 (x from FP32 or narrower), within one rounding of x^2 for FP64 x.
inline bool square_exceeds(double x, double w, double theta) noexcept {
  int ex = 0, ew = 0, et = 0;
  const double mx = std::frexp(std::abs(x), &ex), mw = std::frexp(w, &ew), mt = std::frexp(theta, &et);
  const int shift = 2 * ex - ew - et;  // x^2 / (theta w) = mx^2 2^shift / (mt mw), mantissas in [1/2, 1)
  if (shift >= 2) return true;
  if (shift <= -2) return false;
  return std::fma(mt, mw, -std::ldexp(mx * mx, shift)) < 0;  // the sign of an FMA is exact
}

/// sqrt(theta * w) for finite theta > 0 and w > 0, without overflow or underflow.
inline double root_of_product(double theta, double w) noexcept {
  const double t = theta * w;
  if (t >= 0x1p-1000 && t <= std::numeric_limits<double>::max()) return std::sqrt(t);
  int et = 0, ew = 0;
  double m = std::frexp(theta, &et) * std::frexp(w, &ew);
  int e = et + ew;
  if (e % 2 != 0) {
    m *= 2;
    e -= 1;
  }
  return std::ldexp(std::sqrt(m), e / 2);
}

/// One element spam_unclear_one did not rule out: g <- sign(g) sqrt(theta v) when g^2 > theta v, v > 0
/// and both are finite (with `clip_infinite`, on_nonfinite::propagate's rule, also for an infinite g and
/// a finite v > 0, as the reference's mask has it), the root rounded to T and never above |g|. Returns
/// whether it clipped.
template <class T>
bool spam_element(T& g, double w, double theta, bool clip_infinite) noexcept {
  const double x = widen<double>(g);
  const bool finite = std::isfinite(x) && std::isfinite(w);
  if (finite) {
    if (!(w > 0) || x == 0 || !square_exceeds(x, w, theta)) return false;
  } else if (!clip_infinite || !std::isinf(x) || !(w > 0) || !std::isfinite(w)) {
    return false;
  }
  T y = narrow<T>(root_of_product(theta, w));
  if (finite && widen<double>(y) > std::abs(x)) y = narrow<T>(std::abs(x));
  g = x < 0 ? T(-y) : y;
  return true;
}

/// The one-element SPAM test of the portable kernels (the library's copy in compiled mode).
#if defined(GRADCLIP_COMPILED)
using scalar_kernels = compiled::kernels;
#else
using scalar_kernels = portable;
#endif

/// spam_clip on one block: one vectorized pass (spam_unclear, dispatched) counts the elements it cannot
/// rule out; only a block with such elements is visited again, element by element. Returns how many it
/// clipped.
template <class T, class V>
std::size_t spam_block(T* g, const V* v, std::size_t m, double theta, bool clip_infinite) noexcept {
  const T* read = g;
  if (with_isa(best_isa(), [&](auto k) { return decltype(k)::spam_unclear(read, v, m, theta); }) == 0) return 0;
  std::size_t clipped = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const double w = widen<double>(v[i]);
    if (scalar_kernels::spam_unclear_one(widen<double>(g[i]), w, theta))
      clipped += spam_element(g[i], w, theta, clip_infinite);
  }
  return clipped;
}

/// The first NaN or infinite value of a block of g and v (g's first), or 0 when there is none.
template <class T, class V>
double first_nonfinite(const T* g, const V* v, std::size_t m) noexcept {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const double x = widen<double>(g[i]), w = widen<double>(v[i]);
    bad += static_cast<std::size_t>(!(x - x == 0)) | static_cast<std::size_t>(!(w - w == 0));
  }
  if (bad == 0) return 0.0;
  for (std::size_t i = 0; i < m; ++i) {
    const double x = widen<double>(g[i]), w = widen<double>(v[i]);
    if (!std::isfinite(x)) return x;
    if (!std::isfinite(w)) return w;
  }
  return 0.0;
}

GRADCLIP_FP_CONTRACT_OFF_END

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
