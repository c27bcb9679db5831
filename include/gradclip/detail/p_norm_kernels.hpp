// Kernels for the L1, L-infinity and general p-norms on raw contiguous buffers, each returning a
// power_sum: sum |x|^p kept as scale^p * sum so that no finite input overflows or underflows.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/partial_norm.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

/// sum |x_i|^p = scale^p * sum. `scale` is the largest |x_i| merged (L-infinity, p > 64), that magnitude
/// rounded down to a power of two (other p) or, for L1, the block sum so rounded; `sum` then stays in
/// [1, 2^11 n] (L1) or [1, 2^p n] and neither field overflows for any finite input. `finite` is false once a NaN or Inf
/// element was merged; `sum` then holds NaN (a NaN was seen) or +inf, as in partial_norm.
struct power_sum {
  double scale = 0.0;
  double sum = 0.0;
  bool finite = true;

  void merge(const power_sum& other, double p) noexcept {
    if (!finite || !other.finite) {
      const bool saw_nan = std::isnan(sum) || std::isnan(other.sum);
      *this = {0.0, saw_nan ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(),
               false};
      return;
    }
    if (other.sum == 0.0) return;
    if (sum == 0.0) {
      *this = other;
    } else if (other.scale > scale) {
      sum = other.sum + sum * ratio_power(scale / other.scale, p);
      scale = other.scale;
    } else {
      sum += other.sum * ratio_power(other.scale / scale, p);
    }
  }

  /// r^p for a ratio r in [0, 1] of two scales: exact for L1 (a power of two), 0 or 1 for L-infinity.
  static double ratio_power(double r, double p) noexcept {
    if (p == 1.0) return r;
    if (std::isinf(p)) return r == 1.0 ? 1.0 : 0.0;
    return std::pow(r, p);
  }
};

inline power_sum nonfinite_power_sum(double witness) noexcept {
  return {0.0, std::isnan(witness) ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity(),
          false};
}

/// The p-norm scale^p-root as a partial_norm {e, r * r} with r in [1, 2), that is norm = 2^e * r. That
/// form exists even where the norm overflows double (FP64 input), and plan_clip takes it unchanged
/// (sqrt(fl(r * r)) == r exactly in binary floating point, so no accuracy is lost).
inline partial_norm as_partial_norm(const power_sum& s, double p) noexcept {
  if (!s.finite) return {0, s.sum, false};
  if (s.sum == 0.0) return {};
  int e = std::ilogb(s.scale);
  double r = std::ldexp(s.scale, -e);
  if (!std::isinf(p) && s.sum != 1.0) {
    const double root = std::pow(s.sum, 1.0 / p);
    if (std::isfinite(root)) {
      r *= root;
    } else {
      // sum^(1/p) beyond double (p below ~0.02 and many elements): take its exponent apart in log2. The
      // clamp keeps the exponent an int; a norm of 2^1e6 is +inf and clips to zero either way.
      const double t = std::log2(s.sum) / p;
      const double whole = std::min(std::floor(t), 1e6);
      r *= std::exp2(t - whole);
      e += static_cast<int>(whole);
    }
    const int k = std::ilogb(r);
    r = std::ldexp(r, -k);
    e += k;
  }
  return {e, r * r, true};
}

namespace pnorm {

// The L2 kernels' block and lane structure: a block is re-read from L1 cache when it needs a second
// pass, and independent accumulators let the compiler vectorize without -ffast-math.
using detail::block_size;
using portable::lanes;
using portable::sum_lanes;

// The type in which magnitudes are compared: exact for every element type.
template <class T>
using max_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// max |x| over n elements in Acc (exact), NaN if any element is NaN.
template <class Acc, class T>
inline Acc max_abs(const T* p, std::size_t n) noexcept {
  constexpr std::size_t L = lanes<Acc>;
  // The plain `a > top` select vectorizes to a max instruction but skips NaN, so a second set of lanes
  // adds a * 0, which turns NaN when an element is NaN or infinite.
  Acc top[L] = {}, probe[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    for (std::size_t j = 0; j < L; ++j) {
      const Acc a = std::abs(widen<Acc>(p[i + j]));
      top[j] = a > top[j] ? a : top[j];
      probe[j] += a * Acc(0);
    }
  for (std::size_t j = 0; i + j < n; ++j) {
    const Acc a = std::abs(widen<Acc>(p[i + j]));
    top[j] = a > top[j] ? a : top[j];
    probe[j] += a * Acc(0);
  }
  Acc result = 0, nonfinite = 0;
  for (std::size_t j = 0; j < L; ++j) {
    result = top[j] > result ? top[j] : result;
    nonfinite += probe[j];
  }
  if (nonfinite == Acc(0)) return result;
  for (i = 0; i < n; ++i)  // rare: an Inf or NaN is here; find out whether a NaN is
    if (std::isnan(widen<Acc>(p[i]))) return std::numeric_limits<Acc>::quiet_NaN();
  return result;
}

/// sum |x| * scale over n elements in double lanes (scale a power of two). The magnitude is taken in
/// the element's own width (exact) before widening, which keeps the loop vectorizable.
template <class T>
inline double sum_abs(const T* p, std::size_t n, double scale = 1.0) noexcept {
  constexpr std::size_t L = lanes<double>;
  double acc[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    for (std::size_t j = 0; j < L; ++j) acc[j] += static_cast<double>(std::abs(widen<max_t<T>>(p[i + j]))) * scale;
  for (std::size_t j = 0; i + j < n; ++j) acc[j] += static_cast<double>(std::abs(widen<max_t<T>>(p[i + j]))) * scale;
  return sum_lanes(acc);
}

/// The largest magnitude of FP16 or BF16 elements from their bits: with the sign cleared, larger bits
/// are larger magnitudes, then infinity, then NaN, so an integer max (which vectorizes, unlike the
/// conversion to float) decides everything. `infinity` is the bit pattern of +inf.
template <class T>
inline power_sum max_kernel_16(const T* p, std::size_t n, std::uint16_t infinity) noexcept {
  constexpr std::size_t L = 64;
  std::int16_t top[L] = {};  // magnitudes fit in 15 bits, so a signed max works without SSE4.1
  std::size_t i = 0;
  const auto magnitude = [&](std::size_t k) {
    return static_cast<std::int16_t>(Eigen::numext::bit_cast<std::uint16_t>(p[k]) & 0x7fffu);
  };
  for (; i + L <= n; i += L)
    for (std::size_t j = 0; j < L; ++j) top[j] = std::max(top[j], magnitude(i + j));
  for (std::size_t j = 0; i + j < n; ++j) top[j] = std::max(top[j], magnitude(i + j));
  const auto bits = static_cast<std::uint16_t>(*std::max_element(top, top + L));
  if (bits > infinity) return nonfinite_power_sum(std::numeric_limits<double>::quiet_NaN());
  if (bits == infinity) return nonfinite_power_sum(std::numeric_limits<double>::infinity());
  const double m = static_cast<double>(to_float(Eigen::numext::bit_cast<T>(bits)));
  return m == 0.0 ? power_sum{} : power_sum{m, 1.0, true};
}

/// L-infinity: the largest magnitude, in float for 32-bit input (exact, twice the lanes of double).
template <class T>
inline power_sum max_kernel(const T* p, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return max_kernel_16(p, n, 0x7c00u);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return max_kernel_16(p, n, 0x7f80u);
  } else {
    const double m = static_cast<double>(max_abs<max_t<T>>(p, n));
    if (!std::isfinite(m)) return nonfinite_power_sum(m);
    return m == 0.0 ? power_sum{} : power_sum{m, 1.0, true};
  }
}

/// L1: one read pass summing |x| in double per block. Only FP64 blocks can overflow double (a block of
/// 1024 values near 1.8e308); those are summed again (from L1 cache) scaled by 2^-64, which is exact
/// except for values below 2^-1010, negligible beside a sum above 2^1024.
template <class T>
inline power_sum l1_kernel(const T* p, std::size_t n) noexcept {
  power_sum total;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    double sum = sum_abs(block, m);
    int shift = 0;  // the block's L1 norm is sum * 2^shift
    if (std::isnan(sum)) return nonfinite_power_sum(sum);
    if (std::isinf(sum)) {
      const double top = max_abs<max_t<T>>(block, m);
      if (!std::isfinite(top)) return nonfinite_power_sum(top);
      sum = sum_abs(block, m, 0x1p-64);
      shift = 64;
    }
    if (sum == 0.0) continue;
    // scale = 2^k <= sum * 2^shift; k <= 1023 + 11 only in the overflow case, so cap it at the largest
    // power of two (the stored sum then exceeds 2 by at most 2^11, still far from overflow).
    const int k = std::min(std::ilogb(sum) + shift, std::numeric_limits<double>::max_exponent - 1);
    total.merge({std::ldexp(1.0, k), std::ldexp(sum, shift - k), true}, 1.0);
  }
  return total;
}

/// General p: per block, the maximum magnitude first, then sum (|x| / scale)^p from L1 cache, with
/// scale = 2^k <= max (or the maximum itself for p > 64, so the largest term is exactly 1):
/// - p < 1: |x|^p * 2^(-k p); |x|^p neither overflows nor underflows for p < 1, so even subnormals
///   beside values near 2^1023 count (their terms are not negligible when p is small);
/// - 1 < p <= 64: (|x| * 2^-k)^p, exact scaling; what underflows weighs below 2^-1022 relative;
/// - p > 64: (|x| / max)^p.
template <class T>
inline power_sum general_kernel(const T* p, std::size_t n, double order) noexcept {
  constexpr std::size_t L = 8;  // independent chains: they hide pow's latency and let sqrt and products vectorize
  power_sum total;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    const double top = static_cast<double>(max_abs<max_t<T>>(block, m));
    if (!std::isfinite(top)) return nonfinite_power_sum(top);
    if (top == 0.0) continue;
    const int k = std::ilogb(top);
    double scale = std::ldexp(1.0, k);
    // 2^-k in two factors: 2^-k alone is not a double for subnormal maxima (k down to -1074).
    const double first = std::ldexp(1.0, -k / 2);
    const double second = std::ldexp(1.0, -k - (-k / 2));
    double acc[L] = {};
    // The orders users pick most (0.5, 3, 4) as sqrt and products, which vectorize; others through pow.
    const auto sum_terms = [&](auto power, double pre, double post) {
      for (std::size_t i = 0; i < m; i += L)
        for (std::size_t j = 0; j < L && i + j < m; ++j)
          acc[j] += power(std::abs(widen<double>(block[i + j])) * pre) * post;
    };
    const auto by_pow = [order](double u) { return std::pow(u, order); };
    if (order < 1) {
      // 2^(-k p) through pow of exact powers of two: exp2(-k * p) would round its argument first, an
      // error of up to 2^-44 relative for |k| near 1000.
      const double factor = std::pow(first, order) * std::pow(second, order);
      if (order == 0.5)
        sum_terms([](double u) { return std::sqrt(u); }, 1.0, factor);
      else
        sum_terms(by_pow, 1.0, factor);
    } else if (order <= 64) {
      const double to_unit = first * second;  // 2^-k, a double unless the maximum is subnormal
      if (std::isinf(to_unit)) {
        for (std::size_t i = 0; i < m; ++i)
          acc[i % L] += std::pow(std::abs(widen<double>(block[i])) * first * second, order);
      } else if (order == 3.0) {
        sum_terms([](double u) { return u * u * u; }, to_unit, 1.0);
      } else if (order == 4.0) {
        sum_terms([](double u) { return (u * u) * (u * u); }, to_unit, 1.0);
      } else {
        sum_terms(by_pow, to_unit, 1.0);
      }
    } else {
      scale = top;
      for (std::size_t i = 0; i < m; ++i) acc[i % L] += std::pow(std::abs(widen<double>(block[i])) / top, order);
    }
    total.merge({scale, sum_lanes(acc), true}, order);
  }
  return total;
}

}  // namespace pnorm

/// sum |x|^p over one contiguous run for p != 2 (the L2 norm keeps its own kernels).
template <class T>
inline power_sum power_sum_kernel(const T* p, std::size_t n, double order) noexcept {
  if (order == 1.0) return pnorm::l1_kernel(p, n);
  if (std::isinf(order)) return pnorm::max_kernel(p, n);
  return pnorm::general_kernel(p, n, order);
}

}  // namespace gradclip::detail
