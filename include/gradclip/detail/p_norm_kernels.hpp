// Kernels for the L1, L-infinity and general p-norms on raw contiguous buffers, each returning a
// partial_norm whose power-of-two scale keeps every finite input from overflowing or underflowing.
#pragma once

#include <gradclip/detail/element.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/partial_norm.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace gradclip::detail {

namespace pnorm {

// The vector loops of `target` (which must be supported), else the scalar ones (simd.hpp,
// p_norm_loops.inc): the same sums bit for bit.
#if GRADCLIP_X86_DISPATCH
#define GRADCLIP_PNORM_DISPATCH(target, call)         \
  do {                                                \
    if ((target) == isa::avx512) return avx512::call; \
    if ((target) == isa::avx2) return avx2::call;     \
    return scalar::call;                              \
  } while (false)
#else
#define GRADCLIP_PNORM_DISPATCH(target, call) return scalar::call
#endif

template <class T>
inline double sum_abs(isa target, const T* p, std::size_t n) noexcept {
  GRADCLIP_PNORM_DISPATCH(target, sum_abs(p, n));
}

/// The largest magnitude, exact; NaN if an element is NaN.
template <class T>
inline double max_abs(isa target, const T* p, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    GRADCLIP_PNORM_DISPATCH(target, max_abs(p, n));
  } else {
    using bits_t = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
    const auto bits = [&]() -> bits_t { GRADCLIP_PNORM_DISPATCH(target, max_magnitude_bits<bits_t>(p, n)); }();
    return static_cast<double>(widen<float>(Eigen::numext::bit_cast<T>(bits)));
  }
}

template <power_kind Kind, class T>
inline double power_block(isa target, const T* b, std::size_t m, const power_scale& scale, double& top) noexcept {
  GRADCLIP_PNORM_DISPATCH(target, power_block<Kind>(b, m, scale, top));
}

#undef GRADCLIP_PNORM_DISPATCH

/// The part of a run that holds a NaN or Inf: NaN wins wherever it is.
template <class T>
inline partial_norm nonfinite_run(isa target, const T* p, std::size_t n, double order) noexcept {
  return partial_norm::nonfinite(max_abs(target, p, n), order);
}

/// L-infinity: {e, m} with max |x| = m * 2^e.
template <class T>
inline partial_norm max_kernel(const T* p, std::size_t n) noexcept {
  const double top = max_abs(best_isa(), p, n);
  const double inf = std::numeric_limits<double>::infinity();
  if (!std::isfinite(top)) return partial_norm::nonfinite(top, inf);
  const scaled s = scaled::of(top);
  return {s.exponent, s.mantissa, true, inf};
}

/// parts += part, without rescaling an empty `parts` (its zero sum at exponent 0 would meet a factor
/// 2^(p * shift) that overflows).
inline void add_part(partial_norm& parts, const partial_norm& part) noexcept {
  if (parts.sum == 0.0)
    parts = part;
  else
    parts.merge(part);
}

/// L1: sum |x| in FP64 lanes per block, block sums totalled compensated, in one read pass. Only FP64
/// blocks can overflow double (1024 values near 1.8e308); then the run is summed again block by block,
/// the overflowing blocks scaled by 2^-64 (exact except for values below 2^-1010, negligible beside a
/// sum above 2^1024).
template <class T>
inline partial_norm l1_kernel(const T* p, std::size_t n) noexcept {
  const isa target = best_isa();
  const double sum = sum_abs(target, p, n);
  if (std::isfinite(sum)) return {0, sum, true, 1.0};
  if (std::isnan(sum) || !std::is_same_v<T, double>) return partial_norm::nonfinite(sum, 1.0);
  partial_norm total{0, 0.0, true, 1.0};
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    const double top = max_abs(target, block, m);
    if (!std::isfinite(top)) return nonfinite_run(target, p, n, 1.0);
    if (top < 0x1p1000) {
      add_part(total, {0, sum_abs(target, block, m), true, 1.0});
    } else {
      double scaled_block[block_size];
      for (std::size_t i = 0; i < m; ++i) scaled_block[i] = widen<double>(block[i]) * 0x1p-64;
      add_part(total, {64, sum_abs(target, scaled_block, m), true, 1.0});
    }
  }
  return total;
}

/// The exponent E of the scale 2^E at which terms (|x| 2^-E)^p are summed, for a largest magnitude
/// `top` (finite, nonzero): its own binary exponent k, so the largest term lies in [1, 2^p), unless
/// that term would exceed 2^960 (p > 960), when k + 1 puts it in [2^-p, 1) instead. Above p = 1982 that
/// term can underflow: the representation 2^(p E) then has no exponent for the sum.
inline int scale_exponent(double top, double p) noexcept {
  const int k = std::ilogb(top);
  if (p <= 960) return k;
  return p * std::log2(std::ldexp(top, -k)) > 960 ? k + 1 : k;
}

/// Sums of |x|^p at one scale 2^E: terms stay below 2^960 (so 2^63 of them cannot overflow) while the
/// elements stay below `limit` = 2^(E + 960 / p).
struct power_run {
  double order;
  int exponent = 0;
  double limit = 0;
  power_scale scale{};
  power_kind kind = power_kind::general;

  void set_scale(double top) noexcept {
    exponent = scale_exponent(top, order);
    limit = std::exp2(std::min(exponent + 960.0 / order, 2000.0));
    scale = {order, std::ldexp(1.0, -exponent), 1023.0 + exponent};
    // Products need 2^-E to be a normal double; other scales (FP64 near its range's ends) take logs.
    const bool products = exponent > -1000 && exponent < 1000;
    kind = products && order == 3.0   ? power_kind::cube
           : products && order == 4.0 ? power_kind::fourth
                                      : power_kind::general;
  }

  template <class T>
  double block(isa target, const T* b, std::size_t m, double& top) const noexcept {
    switch (kind) {
      case power_kind::cube:
        return power_block<power_kind::cube>(target, b, m, scale, top);
      case power_kind::fourth:
        return power_block<power_kind::fourth>(target, b, m, scale, top);
      case power_kind::general:
        break;
    }
    return power_block<power_kind::general>(target, b, m, scale, top);
  }
};

/// General p in one read pass: the run's terms are summed at the scale of its first nonzero block's
/// maximum (compensated across blocks); a block whose maximum exceeds the scale's limit (or that holds
/// a NaN or Inf) is summed again from L1 cache, at its own scale once it is known to be finite, and
/// the sums so far become a part of their own. Blocks far below the scale lose only terms below
/// 2^-1022 of the run's largest term, which is at least 1.
template <class T>
inline partial_norm general_kernel(const T* p, std::size_t n, double order) noexcept {
  const isa target = best_isa();
  partial_norm parts{0, 0.0, true, order};
  portable::compensated_sum current;
  power_run run{order};
  bool scaled_yet = false;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    if (!scaled_yet) {
      const double top = max_abs(target, block, m);
      if (!std::isfinite(top)) return nonfinite_run(target, p, n, order);
      if (top == 0.0) continue;
      run.set_scale(top);
      scaled_yet = true;
    }
    double top = 0;
    double sum = run.block(target, block, m, top);
    if (!(std::isfinite(sum) && top <= run.limit)) {
      top = max_abs(target, block, m);
      if (!std::isfinite(top)) return nonfinite_run(target, p, n, order);
      add_part(parts, {run.exponent, current.value(), true, order});
      current = {};
      run.set_scale(top);
      sum = run.block(target, block, m, top);
    }
    current.add(sum);
  }
  add_part(parts, {run.exponent, current.value(), true, order});
  return parts;
}

}  // namespace pnorm

/// The partial norm of one contiguous run for p != 2 (the L2 norm keeps its own kernels): sum |x|^p,
/// or max |x| for p = inf, with `.p = order`.
template <class T>
inline partial_norm power_sum_kernel(const T* p, std::size_t n, double order) noexcept {
  if (order == 1.0) return pnorm::l1_kernel(p, n);
  if (std::isinf(order)) return pnorm::max_kernel(p, n);
  return pnorm::general_kernel(p, n, order);
}

}  // namespace gradclip::detail
