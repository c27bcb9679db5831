// Kernels for the L1, L-infinity and general p-norms on raw contiguous buffers, each returning a
// partial_norm whose power-of-two scale keeps every finite input from overflowing or underflowing.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/partial_norm.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/simd.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

namespace pnorm {

/// The largest magnitude, exact; NaN if an element is NaN.
template <class K, class T>
inline double max_abs(const T* p, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    return K::max_abs(p, n);
  } else {
    using bits_t = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
    const bits_t bits = K::template max_magnitude_bits<bits_t>(p, n);
    return static_cast<double>(widen<float>(Eigen::numext::bit_cast<T>(bits)));
  }
}

/// The part of a run that holds a NaN or Inf: NaN wins wherever it is.
template <class K, class T>
inline partial_norm nonfinite_run(const T* p, std::size_t n, double order) noexcept {
  return partial_norm::nonfinite(max_abs<K>(p, n), order);
}

/// L-infinity: {e, m} with max |x| = m * 2^e.
template <class K, class T>
inline partial_norm max_kernel(const T* p, std::size_t n) noexcept {
  const double top = max_abs<K>(p, n);
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
template <class K, class T>
inline partial_norm l1_kernel(const T* p, std::size_t n) noexcept {
  const double sum = K::sum_abs(p, n);
  if (std::isfinite(sum)) return {0, sum, true, 1.0};
  if (std::isnan(sum) || !std::is_same_v<T, double>) return partial_norm::nonfinite(sum, 1.0);
  partial_norm total{0, 0.0, true, 1.0};
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    const double top = max_abs<K>(block, m);
    if (!std::isfinite(top)) return nonfinite_run<K>(p, n, 1.0);
    if (top < 0x1p1000) {
      add_part(total, {0, K::sum_abs(block, m), true, 1.0});
    } else {
      double scaled_block[block_size];
      for (std::size_t i = 0; i < m; ++i) scaled_block[i] = widen<double>(block[i]) * 0x1p-64;
      add_part(total, {64, K::sum_abs(scaled_block, m), true, 1.0});
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

/// A target's power_map (kernels.inc).
using power_map_fn = void (*)(const double*, double*, std::size_t, const power_scale&) noexcept;

/// The tables of the general term for elements of type T (table_term in p_norm_loops.inc): c^p for
/// every leading significand c of `bits` bits (all of an FP16 or BF16 significand, so their terms are
/// a product of two entries; FP32 and FP64 add a series, accurate for p <= max_order), and 2^(p (e -
/// E)) for every exponent e of T at the run's scale 2^E. Entries come from power_map, so every
/// instruction set builds the same tables. Plain arrays (about 19 KiB): they live on the stack.
template <class T>
struct power_tables {
  static constexpr int bits = std::is_same_v<T, Eigen::half> ? 10 : std::is_same_v<T, Eigen::bfloat16> ? 7 : 8;
  static constexpr bool series = sizeof(T) > 2;
  // The series' first omitted term, binom(p, 7) r^7 with r < 2^-8, stays below 2^-53 up to p = 8.
  static constexpr double max_order = 8;
  // Biased exponent fields of T's values widened to FP64 (for FP64, subnormals as table_term reads
  // them, 54 below their field once scaled by 2^54); 2047 holds Inf and NaN.
  static constexpr int first_field = std::numeric_limits<T>::min_exponent - std::numeric_limits<T>::digits + 1023;
  static constexpr int last_field = std::numeric_limits<T>::max_exponent - 1 + 1023;
  static constexpr int below = 54;  // fields from -54 (FP64 zero) up

  double exponent_entries[below + 2048];
  // 16-bit elements: exponents by T's own sign and exponent field (bits >> bits), for raw_sum.
  double exponents16[sizeof(T) == 2 ? 1 << (16 - bits) : 1];
  double powers[1 << bits];
  double coefficients[6];  // binom(p, k), k = 1..6

  const double* exponents() const noexcept { return exponent_entries + below; }

  /// The parts that depend on p alone, by one target's power_map.
  void set_order(double order, power_map_fn map) noexcept {
    constexpr int count = 1 << bits;
    for (int j = 0; j < count; ++j) powers[j] = 1.0 + j * (1.0 / count);
    map(powers, powers, count, {order, 1.0, 1023.0});
    double binomial = 1;
    for (int k = 1; k <= 6; ++k) coefficients[k - 1] = binomial *= (order - (k - 1)) / k;
  }

  /// The exponent entries at scale 2^E: only those whose terms can lie in [2^-1022, 2^960] are
  /// evaluated, lower ones are 0 and higher ones +Inf (the caller redoes such a block at its own scale).
  void set_scale(const power_scale& scale, int exponent, power_map_fn map) noexcept {
    double* e = exponent_entries + below;
    const double order = scale.order;
    const double lowest = std::max<double>(first_field, 1023.0 + exponent - 1022.0 / order - 1);
    const double highest = std::min<double>(last_field, 1023.0 + exponent + 960.0 / order);
    const int lo = static_cast<int>(lowest), hi = static_cast<int>(highest);
    std::fill(exponent_entries, e + lo, 0.0);
    for (int f = lo; f <= hi; ++f)  // 2^(f - 1023), subnormal for f <= 0
      e[f] = f64_from_bits(f > 0 ? std::uint64_t(f) << 52 : std::uint64_t{1} << (51 + f));
    if (hi >= lo) map(e + lo, e + lo, static_cast<std::size_t>(hi - lo + 1), scale);
    std::fill(e + std::max(lo, hi + 1), e + 2047, std::numeric_limits<double>::infinity());
    if constexpr (!std::is_same_v<T, double>) e[0] = 0;  // zero, the only value with field 0
    e[2047] = std::numeric_limits<double>::quiet_NaN();
    if constexpr (sizeof(T) == 2) {
      constexpr int fields = 1 << (15 - bits), bias = std::numeric_limits<T>::max_exponent - 1;
      for (int f = 0; f < fields; ++f)  // field 0: zero (raw_sum leaves subnormals to table_block)
        exponents16[f] = exponents16[f + fields] = f == 0 ? 0.0 : f == fields - 1 ? e[2047] : e[f - bias + 1023];
    }
  }

 private:
  static double f64_from_bits(std::uint64_t b) noexcept { return Eigen::numext::bit_cast<double>(b); }
};

// Rounded products as in table_term, whatever the user's -ffp-contract, and loads kept scalar: gathers
// (what the vectorizer would make of them) run several times slower on AMD Zen 4.
GRADCLIP_FP_CONTRACT_OFF_BEGIN
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")
#endif
template <class T>
inline double raw_term(T x, const power_tables<T>& tables) noexcept {
  constexpr int bits = power_tables<T>::bits;
  const unsigned b = Eigen::numext::bit_cast<std::uint16_t>(x);
  return rounded(tables.exponents16[b >> bits] * tables.powers[b & ((1u << bits) - 1)]);
}

/// sum (|x| 2^-E)^p over a block of 16-bit elements without subnormals, from T's own bit fields:
/// exponents16[sign and exponent] * powers[significand], table_term's product (so table_block's sum
/// bit for bit, in its 16 lanes and order) from two tables that stay in L1 cache (FP16: 8 KiB).
template <class T>
inline double raw_sum(const T* b, std::size_t m, const power_tables<T>& tables) noexcept {
  constexpr std::size_t L = lanes<double>;
  double acc[L] = {};
  std::size_t i = 0;
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
  for (; i + L <= m; i += L)
    for (std::size_t j = 0; j < L; ++j) acc[j] += raw_term(b[i + j], tables);
  for (std::size_t j = 0; i + j < m; ++j) acc[j] += raw_term(b[i + j], tables);
  return sum_lanes(acc);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
GRADCLIP_FP_CONTRACT_OFF_END

/// One target's kernels that general_kernel calls, as pointers, so that its loop, its tables and its
/// scaling are compiled once per element type rather than once per target and type. The series terms
/// (log2 and exp2 per element, far slower than a read) of every element type run on FP64 blocks,
/// widened exactly, so the terms and sums are those of the elements themselves: each target compiles
/// them once. The products (p = 3, 4: near memory speed) and the tables' gathers read the elements as
/// they are.
template <class T>
struct general_kernels {
  double (*largest)(const T*, std::size_t) noexcept;  // max_abs
  double (*products)(power_kind, const T*, std::size_t, const power_scale&, double&) noexcept;
  void (*widen)(const T*, std::size_t, double*) noexcept;  // not for FP64
  double (*series)(const double*, std::size_t, const power_scale&, double&) noexcept;
  double (*tables)(const T*, std::size_t, const power_tables<T>&, double&) noexcept;
  std::uint16_t (*magnitudes)(const T*, std::size_t, std::uint16_t&) noexcept;  // 16-bit
  power_map_fn map;

  template <class K>
  static general_kernels of() noexcept {
    general_kernels k{};
    k.largest = &max_abs<K, T>;
    k.products = &K::template product_block<T>;
    k.series = &K::power_block;
    k.map = &K::power_map;
    if constexpr (!std::is_same_v<T, double>) k.widen = &K::template widen_block<T>;
    if constexpr (sizeof(T) == 2) k.magnitudes = &K::template magnitude_range<T>;
    k.tables = &K::template table_block<power_tables<T>::series, std::is_same_v<T, double>, T, power_tables<T>>;
    return k;
  }
};

/// Sums of |x|^p at one scale 2^E: terms stay below 2^960 (so 2^63 of them cannot overflow) while the
/// elements stay below `limit` = 2^(E + 960 / p). General terms come from `tables` when given.
template <class T>
struct power_run {
  double order;
  power_tables<T>* tables = nullptr;
  int exponent = 0;
  double limit = 0;
  power_scale scale{};
  power_kind kind = power_kind::general;

  void set_scale(double top, const general_kernels<T>& k) noexcept {
    exponent = scale_exponent(top, order);
    limit = std::exp2(std::min(exponent + 960.0 / order, 2000.0));
    scale = {order, std::ldexp(1.0, -exponent), 1023.0 + exponent};
    // Products need 2^-E to be a normal double; other scales (FP64 near its range's ends) take logs.
    const bool products = exponent > -1000 && exponent < 1000;
    kind = products && order == 3.0   ? power_kind::cube
           : products && order == 4.0 ? power_kind::fourth
                                      : power_kind::general;
    if (tables && kind == power_kind::general) tables->set_scale(scale, exponent, k.map);
  }

  double block(const T* b, std::size_t m, double& top, const general_kernels<T>& k) const noexcept {
    if (kind != power_kind::general) return k.products(kind, b, m, scale, top);
    if constexpr (sizeof(T) == 2) {
      if (tables) {  // raw_sum unless a subnormal is there (the smallest normal is 1 << bits)
        std::uint16_t low = 0;
        const std::uint16_t high = k.magnitudes(b, m, low);
        if (low >= (1u << power_tables<T>::bits) - 1) {
          top = widen<double>(Eigen::numext::bit_cast<T>(high));  // NaN if one is: the sum is NaN then too
          return raw_sum(b, m, *tables);
        }
      }
    }
    if (tables) return k.tables(b, m, *tables, top);
    if constexpr (std::is_same_v<T, double>) {
      return k.series(b, m, scale, top);
    } else {
      double widened[block_size];
      k.widen(b, m, widened);
      return k.series(widened, m, scale, top);
    }
  }
};

/// How general terms are computed: by the series of power_term, or from power_tables.
enum class general_path { series, tables };

/// The run length from which power_tables pay for their building (about 2^bits general terms plus
/// one per exponent in range): twice the break-even measured by bench_variants' p_norm_tables (AMD
/// Zen 4, AVX-512).
template <class T>
inline constexpr std::size_t tables_from = std::is_same_v<T, Eigen::bfloat16> ? 2048
                                           : std::is_same_v<T, double>        ? 8192
                                                                              : 4096;

/// The path for a run of n elements: tables for p up to max_order except 3 and 4 (products), in long
/// enough runs.
template <class T>
inline general_path choose_path(std::size_t n, double order) noexcept {
  const bool tables = order <= power_tables<T>::max_order && order != 3.0 && order != 4.0 && n >= tables_from<T>;
  return tables ? general_path::tables : general_path::series;
}

/// General p in one read pass: the run's terms are summed at the scale of its first nonzero block's
/// maximum (compensated across blocks); a block whose maximum exceeds the scale's limit (or that holds
/// a NaN or Inf) is summed again from L1 cache, at its own scale once it is known to be finite, and
/// the sums so far become a part of their own. Blocks far below the scale lose only terms below
/// 2^-1022 of the run's largest term, which is at least 1.
template <class T>
inline partial_norm general_kernel(const T* p, std::size_t n, double order, general_path path,
                                   const general_kernels<T>& k) noexcept {
  partial_norm parts{0, 0.0, true, order};
  compensated_sum current;
  power_tables<T> tables;
  power_run<T> run{order};
  if (path == general_path::tables) {
    tables.set_order(order, k.map);
    run.tables = &tables;
  }
  bool scaled_yet = false;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    if (!scaled_yet) {
      const double top = k.largest(block, m);
      if (!std::isfinite(top)) return partial_norm::nonfinite(k.largest(p, n), order);
      if (top == 0.0) continue;
      run.set_scale(top, k);
      scaled_yet = true;
    }
    double top = 0;
    double sum = run.block(block, m, top, k);
    if (!(std::isfinite(sum) && top <= run.limit)) {
      top = k.largest(block, m);
      if (!std::isfinite(top)) return partial_norm::nonfinite(k.largest(p, n), order);
      add_part(parts, {run.exponent, current.value(), true, order});
      current = {};
      run.set_scale(top, k);
      sum = run.block(block, m, top, k);
    }
    current.add(sum);
  }
  add_part(parts, {run.exponent, current.value(), true, order});
  return parts;
}

/// general_kernel on target K's kernels.
template <class K, class T>
inline partial_norm general_kernel(const T* p, std::size_t n, double order, general_path path) noexcept {
  return general_kernel(p, n, order, path, general_kernels<T>::template of<K>());
}

}  // namespace pnorm

/// The partial norm of one contiguous run for p != 2 (the L2 norm keeps its own kernels): sum |x|^p,
/// or max |x| for p = inf, with `.p = order`.
template <class T>
inline partial_norm power_sum_kernel(const T* p, std::size_t n, double order) noexcept {
  return with_isa(best_isa(), [&](auto k) {
    using K = decltype(k);
    if (order == 1.0) return pnorm::l1_kernel<K>(p, n);
    if (std::isinf(order)) return pnorm::max_kernel<K>(p, n);
    return pnorm::general_kernel<K>(p, n, order, pnorm::choose_path<T>(n, order));
  });
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
