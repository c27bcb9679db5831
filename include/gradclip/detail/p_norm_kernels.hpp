// Kernels for the L1, L-infinity and general p-norms on raw contiguous buffers, each returning a
// partial_norm whose power-of-two scale keeps every finite input from overflowing or underflowing.
#pragma once

#include <gradclip/detail/config.hpp>
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
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

// 64-bit integer lanes beside each instruction set's `f64`, for the table terms (p_norm_loops.inc):
// bit fields of FP64 values as table indices, and gathers. Compiled for the same targets as simd.hpp's
// regions, so that the loops there inline them.
namespace scalar {
struct i64 {
  using vec = std::int64_t;
  static vec set1(std::int64_t x) noexcept { return x; }
  static vec of(double v) noexcept { return static_cast<vec>(f64::bits(v)); }
  static double to_f64(vec v) noexcept { return f64::from_bits(static_cast<std::uint64_t>(v)); }
  template <int N>
  static vec shift_right(vec v) noexcept {  // of nonnegative values only
    return v >> N;
  }
  template <int N>
  static vec shift_left(vec v) noexcept {  // of small nonnegative values only
    return v << N;
  }
  static vec add(vec a, vec b) noexcept { return a + b; }
  static vec bit_and(vec a, vec b) noexcept { return a & b; }
  static vec bit_or(vec a, vec b) noexcept { return a | b; }
  static vec keep(bool m, vec v) noexcept { return m ? v : 0; }
  static double gather(const double* base, vec i) noexcept { return base[i]; }
};
struct i16 {  // 16-bit magnitudes one at a time
  using vec = std::uint16_t;
  static constexpr std::size_t width = 1;
  static vec zero() noexcept { return 0; }
  static vec set1(std::uint16_t x) noexcept { return x; }
  template <class T>
  static vec load(const T* p) noexcept {
    return Eigen::numext::bit_cast<std::uint16_t>(*p);
  }
  static vec magnitude(vec v) noexcept { return static_cast<vec>(v & 0x7fffu); }
  static vec minus_one(vec v) noexcept { return static_cast<vec>(v - 1u); }  // 0 wraps to 0xffff
  static vec max(vec a, vec b) noexcept { return std::max(a, b); }
  static vec min(vec a, vec b) noexcept { return std::min(a, b); }
  static std::uint16_t max_lane(vec v) noexcept { return v; }
  static std::uint16_t min_lane(vec v) noexcept { return v; }
};
}  // namespace scalar

#if GRADCLIP_X86_DISPATCH
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
namespace avx2 {
struct i64 {
  using vec = __m256i;
  static vec set1(std::int64_t x) noexcept { return _mm256_set1_epi64x(x); }
  static vec of(__m256d v) noexcept { return _mm256_castpd_si256(v); }
  static __m256d to_f64(vec v) noexcept { return _mm256_castsi256_pd(v); }
  template <int N>
  static vec shift_right(vec v) noexcept {
    return _mm256_srli_epi64(v, N);
  }
  template <int N>
  static vec shift_left(vec v) noexcept {
    return _mm256_slli_epi64(v, N);
  }
  static vec add(vec a, vec b) noexcept { return _mm256_add_epi64(a, b); }
  static vec bit_and(vec a, vec b) noexcept { return _mm256_and_si256(a, b); }
  static vec bit_or(vec a, vec b) noexcept { return _mm256_or_si256(a, b); }
  static vec keep(__m256d m, vec v) noexcept { return _mm256_and_si256(_mm256_castpd_si256(m), v); }
  static __m256d gather(const double* base, vec i) noexcept { return _mm256_i64gather_pd(base, i, 8); }
};
struct i16 {  // unsigned 16-bit lanes
  using vec = __m256i;
  static constexpr std::size_t width = 16;
  static vec zero() noexcept { return _mm256_setzero_si256(); }
  static vec set1(std::uint16_t x) noexcept { return _mm256_set1_epi16(static_cast<short>(x)); }
  static vec load(const void* p) noexcept { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static vec magnitude(vec v) noexcept { return _mm256_and_si256(v, _mm256_set1_epi16(0x7fff)); }
  static vec minus_one(vec v) noexcept { return _mm256_sub_epi16(v, _mm256_set1_epi16(1)); }
  static vec max(vec a, vec b) noexcept { return _mm256_max_epu16(a, b); }
  static vec min(vec a, vec b) noexcept { return _mm256_min_epu16(a, b); }
  static std::uint16_t max_lane(vec v) noexcept {
    return reduce(v, [](auto a, auto b) { return std::max(a, b); });
  }
  static std::uint16_t min_lane(vec v) noexcept {
    return reduce(v, [](auto a, auto b) { return std::min(a, b); });
  }
  template <class Op>
  static std::uint16_t reduce(vec v, Op op) noexcept {
    std::uint16_t lanes[width];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), v);
    std::uint16_t r = lanes[0];
    for (std::uint16_t x : lanes) r = op(r, x);
    return r;
  }
};
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
#endif
namespace avx512 {
struct i64 {
  using vec = __m512i;
  static vec set1(std::int64_t x) noexcept { return _mm512_set1_epi64(x); }
  static vec of(__m512d v) noexcept { return _mm512_castpd_si512(v); }
  static __m512d to_f64(vec v) noexcept { return _mm512_castsi512_pd(v); }
  template <int N>  // the masked forms: see simd.hpp (GCC bug 105593)
  static vec shift_right(vec v) noexcept {
    return _mm512_maskz_srli_epi64(0xff, v, N);
  }
  template <int N>
  static vec shift_left(vec v) noexcept {
    return _mm512_maskz_slli_epi64(0xff, v, N);
  }
  static vec add(vec a, vec b) noexcept { return _mm512_add_epi64(a, b); }
  static vec bit_and(vec a, vec b) noexcept { return _mm512_and_si512(a, b); }
  static vec bit_or(vec a, vec b) noexcept { return _mm512_or_si512(a, b); }
  static vec keep(__mmask8 m, vec v) noexcept { return _mm512_maskz_mov_epi64(m, v); }
// Without optimization GCC's gather is a macro that passes the mask on as a plain char, which
// -Wsign-conversion reports at the user's call site.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif
  static __m512d gather(const double* base, vec i) noexcept {
    return _mm512_mask_i64gather_pd(_mm512_setzero_pd(), 0xff, i, base, 8);
  }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
};
struct i16 {  // see avx2::i16
  using vec = __m512i;
  static constexpr std::size_t width = 32;
  static vec zero() noexcept { return _mm512_setzero_si512(); }
  static vec set1(std::uint16_t x) noexcept { return _mm512_set1_epi16(static_cast<short>(x)); }
  static vec load(const void* p) noexcept { return _mm512_loadu_si512(p); }
  static vec magnitude(vec v) noexcept { return _mm512_and_si512(v, _mm512_set1_epi16(0x7fff)); }
  static vec minus_one(vec v) noexcept { return _mm512_sub_epi16(v, _mm512_set1_epi16(1)); }
  static vec max(vec a, vec b) noexcept { return _mm512_max_epu16(a, b); }
  static vec min(vec a, vec b) noexcept { return _mm512_min_epu16(a, b); }
  static std::uint16_t max_lane(vec v) noexcept {
    return avx2::i16::max_lane(_mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
  }
  static std::uint16_t min_lane(vec v) noexcept {
    return avx2::i16::min_lane(_mm256_min_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
  }
};
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // GRADCLIP_X86_DISPATCH

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
inline double sum_abs([[maybe_unused]] isa target, const T* p, std::size_t n) noexcept {
  GRADCLIP_PNORM_DISPATCH(target, sum_abs(p, n));
}

/// The largest magnitude, exact; NaN if an element is NaN.
template <class T>
inline double max_abs([[maybe_unused]] isa target, const T* p, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    GRADCLIP_PNORM_DISPATCH(target, max_abs(p, n));
  } else {
    using bits_t = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
    const auto bits = [&]() -> bits_t { GRADCLIP_PNORM_DISPATCH(target, max_magnitude_bits<bits_t>(p, n)); }();
    return static_cast<double>(widen<float>(Eigen::numext::bit_cast<T>(bits)));
  }
}

template <power_kind Kind, class T>
inline double power_block([[maybe_unused]] isa target, const T* b, std::size_t m, const power_scale& scale,
                          double& top) noexcept {
  GRADCLIP_PNORM_DISPATCH(target, power_block<Kind>(b, m, scale, top));
}

inline void power_map([[maybe_unused]] isa target, const double* in, double* out, std::size_t n,
                      const power_scale& scale) noexcept {
  GRADCLIP_PNORM_DISPATCH(target, power_map(in, out, n, scale));
}

#undef GRADCLIP_PNORM_DISPATCH

template <class T>
inline std::uint16_t magnitude_range([[maybe_unused]] isa target, const T* b, std::size_t m,
                                     std::uint16_t& low) noexcept {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::magnitude_range<avx512::i16>(b, m, low);
  if (target == isa::avx2) return avx2::magnitude_range<avx2::i16>(b, m, low);
#endif
  static_cast<void>(target);
  return scalar::magnitude_range<scalar::i16>(b, m, low);
}

template <class Tables, class T>
inline double table_block([[maybe_unused]] isa target, const T* b, std::size_t m, const Tables& tables,
                          double& top) noexcept {
  constexpr bool series = Tables::series, subnormals = std::is_same_v<T, double>;
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::table_block<avx512::i64, series, subnormals>(b, m, tables, top);
  if (target == isa::avx2) return avx2::table_block<avx2::i64, series, subnormals>(b, m, tables, top);
#endif
  static_cast<void>(target);
  return scalar::table_block<scalar::i64, series, subnormals>(b, m, tables, top);
}

/// The part of a run that holds a NaN or Inf: NaN wins wherever it is.
template <class T>
inline partial_norm nonfinite_run([[maybe_unused]] isa target, const T* p, std::size_t n, double order) noexcept {
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

  /// The parts that depend on p alone.
  void set_order([[maybe_unused]] isa target, double order) noexcept {
    constexpr int count = 1 << bits;
    for (int j = 0; j < count; ++j) powers[j] = 1.0 + j * (1.0 / count);
    power_map(target, powers, powers, count, {order, 1.0, 1023.0});
    double binomial = 1;
    for (int k = 1; k <= 6; ++k) coefficients[k - 1] = binomial *= (order - (k - 1)) / k;
  }

  /// The exponent entries at scale 2^E: only those whose terms can lie in [2^-1022, 2^960] are
  /// evaluated, lower ones are 0 and higher ones +Inf (the caller redoes such a block at its own scale).
  void set_scale([[maybe_unused]] isa target, const power_scale& scale, int exponent) noexcept {
    double* e = exponent_entries + below;
    const double order = scale.order;
    const double lowest = std::max<double>(first_field, 1023.0 + exponent - 1022.0 / order - 1);
    const double highest = std::min<double>(last_field, 1023.0 + exponent + 960.0 / order);
    const int lo = static_cast<int>(lowest), hi = static_cast<int>(highest);
    std::fill(exponent_entries, e + lo, 0.0);
    for (int f = lo; f <= hi; ++f)  // 2^(f - 1023), subnormal for f <= 0
      e[f] = f64_from_bits(f > 0 ? std::uint64_t(f) << 52 : std::uint64_t{1} << (51 + f));
    if (hi >= lo) power_map(target, e + lo, e + lo, static_cast<std::size_t>(hi - lo + 1), scale);
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
#if defined(__clang__)
#pragma float_control(push)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-tree-vectorize")
#endif
template <class T>
inline double raw_term(T x, const power_tables<T>& tables) noexcept {
  constexpr int bits = power_tables<T>::bits;
  const unsigned b = Eigen::numext::bit_cast<std::uint16_t>(x);
  return tables.exponents16[b >> bits] * tables.powers[b & ((1u << bits) - 1)];
}

/// sum (|x| 2^-E)^p over a block of 16-bit elements without subnormals, from T's own bit fields:
/// exponents16[sign and exponent] * powers[significand], table_term's product (so table_block's sum
/// bit for bit, in its 16 lanes and order) from two tables that stay in L1 cache (FP16: 8 KiB).
template <class T>
inline double raw_sum(const T* b, std::size_t m, const power_tables<T>& tables) noexcept {
  constexpr std::size_t lanes = portable::lanes<double>;
  double acc[lanes] = {};
  std::size_t i = 0;
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
  for (; i + lanes <= m; i += lanes)
    for (std::size_t j = 0; j < lanes; ++j) acc[j] += raw_term(b[i + j], tables);
  for (std::size_t j = 0; i + j < m; ++j) acc[j] += raw_term(b[i + j], tables);
  return portable::sum_lanes(acc);
}
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

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

  void set_scale([[maybe_unused]] isa target, double top) noexcept {
    exponent = scale_exponent(top, order);
    limit = std::exp2(std::min(exponent + 960.0 / order, 2000.0));
    scale = {order, std::ldexp(1.0, -exponent), 1023.0 + exponent};
    // Products need 2^-E to be a normal double; other scales (FP64 near its range's ends) take logs.
    const bool products = exponent > -1000 && exponent < 1000;
    kind = products && order == 3.0   ? power_kind::cube
           : products && order == 4.0 ? power_kind::fourth
                                      : power_kind::general;
    if (tables && kind == power_kind::general) tables->set_scale(target, scale, exponent);
  }

  double block([[maybe_unused]] isa target, const T* b, std::size_t m, double& top) const noexcept {
    switch (kind) {
      case power_kind::cube:
        return power_block<power_kind::cube>(target, b, m, scale, top);
      case power_kind::fourth:
        return power_block<power_kind::fourth>(target, b, m, scale, top);
      case power_kind::general:
        break;
    }
    if (!tables) return power_block<power_kind::general>(target, b, m, scale, top);
    if constexpr (sizeof(T) == 2) {  // raw_sum unless a subnormal is there (the smallest normal is 1 << bits)
      std::uint16_t low = 0;
      const std::uint16_t high = magnitude_range(target, b, m, low);
      if (low >= (1u << power_tables<T>::bits) - 1) {
        top = widen<double>(Eigen::numext::bit_cast<T>(high));  // NaN if one is: the sum is NaN then too
        return raw_sum(b, m, *tables);
      }
    }
    return table_block(target, b, m, *tables, top);
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
inline partial_norm general_kernel(const T* p, std::size_t n, double order, general_path path) noexcept {
  const isa target = best_isa();
  partial_norm parts{0, 0.0, true, order};
  portable::compensated_sum current;
  power_tables<T> tables;
  power_run<T> run{order};
  if (path == general_path::tables) {
    tables.set_order(target, order);
    run.tables = &tables;
  }
  bool scaled_yet = false;
  for (std::size_t start = 0; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    const T* block = p + start;
    if (!scaled_yet) {
      const double top = max_abs(target, block, m);
      if (!std::isfinite(top)) return nonfinite_run(target, p, n, order);
      if (top == 0.0) continue;
      run.set_scale(target, top);
      scaled_yet = true;
    }
    double top = 0;
    double sum = run.block(target, block, m, top);
    if (!(std::isfinite(sum) && top <= run.limit)) {
      top = max_abs(target, block, m);
      if (!std::isfinite(top)) return nonfinite_run(target, p, n, order);
      add_part(parts, {run.exponent, current.value(), true, order});
      current = {};
      run.set_scale(target, top);
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
  return pnorm::general_kernel(p, n, order, pnorm::choose_path<T>(n, order));
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
