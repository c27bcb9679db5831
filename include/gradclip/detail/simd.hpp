// The memory-bound kernels every norm and clip is built from (blocked sums of squares, the p-norm
// loops, in-place scaling and division), in a portable version and, on x86-64 with GCC or Clang,
// AVX2/F16C/FMA and AVX-512 versions chosen once at run time, so a build without -march still runs at
// memory speed. FMA appears only where it is asked for by name (the FP64 compensated kernels), never by
// contraction.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/scaled.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if !defined(GRADCLIP_NO_SIMD) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GRADCLIP_X86_DISPATCH 1
#include <immintrin.h>
#else
#define GRADCLIP_X86_DISPATCH 0
#endif

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

// Elements per block: small enough that a block is rescanned from L1 when it needs rescaling,
// large enough that the per-block bookkeeping is negligible.
inline constexpr std::size_t block_size = 1024;

// The blocks in which squares of T are summed, checked and rescaled: 16-bit elements take four times
// as many (8 KiB), so that the per-block lane sum and compensated total, about a fifth of the time of a
// 1024-element FP16 block in cache, are spread over more of them.
template <class T>
inline constexpr std::size_t block_for = sizeof(T) == 2 ? 4 * block_size : block_size;

// T's squares are exact in Acc over T's whole range (no rounding, overflow or underflow): FP16 and
// BF16 in FP64, FP16 in FP32, FP32 in FP64. A fused multiply-add then adds a square with the one
// rounding of the portable kernels' square-then-add, so the vector kernels use it and stay bit-identical.
template <class T, class Acc>
inline constexpr bool exact_squares = (2 * std::numeric_limits<T>::digits <= std::numeric_limits<Acc>::digits) &&
                                      (2 * std::numeric_limits<T>::max_exponent <
                                       std::numeric_limits<Acc>::max_exponent) &&
                                      (2 * (std::numeric_limits<T>::min_exponent - std::numeric_limits<T>::digits) >
                                       std::numeric_limits<Acc>::min_exponent);

// Runs this short cost more in a vector kernel's setup than in its loop (many small tensors): the
// reductions and the scaling handle them element by element.
inline constexpr std::size_t short_run = 32;

// The portable kernels round every square and product before adding, as the vector kernels do.
#if defined(__clang__)
#pragma float_control(push)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
namespace portable {

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

// FP32 sums of squares are carried into FP64 lanes every `chain` squares per lane, so a lane's FP32
// partial is rounded at most chain - 1 times. 16-bit elements, whose squares are exact in FP32, carry
// once per block (31 roundings, 2^-19 relative): the carry's FP32-to-FP64 conversions share a port with
// the FP16 ones, which bound the speed in cache. FP32 elements, whose FP32 squares round, carry every 8.
// FP64 lanes sum a whole block before the carry.
template <class T, class Acc>
inline constexpr std::size_t chain = !std::is_same_v<Acc, float> ? block_size / lanes<Acc>
                                     : sizeof(T) == 2            ? 32
                                                                 : 8;
template <class T, class Acc>
inline constexpr std::size_t chunk = chain<T, Acc>* lanes<Acc>;

/// sum(x^2) over n elements, each widened to Acc (and multiplied by `scale`, a power of two), in
/// chunks whose lanes are carried into FP64 lanes. NaN and Inf propagate; max|x| (NaN ignored) goes
/// to `top` when it is given.
template <class Acc, class T>
inline double sum_squares(const T* p, std::size_t n, Acc scale = Acc(1), Acc* top = nullptr) noexcept {
  constexpr std::size_t L = lanes<Acc>;
  double wide[L] = {};
  Acc high[L] = {};
  for (std::size_t start = 0; start < n; start += chunk<T, Acc>) {
    const std::size_t m = std::min(chunk<T, Acc>, n - start);
    const T* c = p + start;
    Acc acc[L] = {};
    std::size_t i = 0;
    for (; i + L <= m; i += L)
      for (std::size_t j = 0; j < L; ++j) {
        const Acc v = widen<Acc>(c[i + j]) * scale;
        acc[j] += v * v;
        const Acc a = std::abs(v);
        high[j] = high[j] < a ? a : high[j];
      }
    for (std::size_t j = 0; i + j < m; ++j) {
      const Acc v = widen<Acc>(c[i + j]) * scale;
      acc[j] += v * v;
      const Acc a = std::abs(v);
      high[j] = high[j] < a ? a : high[j];
    }
    for (std::size_t j = 0; j < L; ++j) wide[j] += static_cast<double>(acc[j]);
  }
  if (top) *top = *std::max_element(high, high + L);
  return sum_lanes(wide);
}

/// A running FP64 total with its rounding errors kept (Neumaier): 10^5 block sums (10^8 elements) add
/// about 2 rounding errors instead of 10^5, so the norm's error bound does not grow with n.
class compensated_sum {
 public:
  void add(double x) noexcept {
    const double t = sum_ + x;
    error_ += std::abs(sum_) >= std::abs(x) ? (sum_ - t) + x : (x - t) + sum_;
    sum_ = t;
  }
  // Once an Inf was added the error term is NaN (inf - inf): the total is then the plain sum.
  double value() const noexcept { return std::isfinite(sum_) ? sum_ + error_ : sum_; }

 private:
  double sum_ = 0, error_ = 0;
};

/// hi + lo, unevaluated: a compensated sum before its final rounding.
struct double_double {
  double hi = 0, lo = 0;
};

/// a + b = hi + lo exactly, whatever the magnitudes (Knuth's TwoSum).
inline double_double two_sum(double a, double b) noexcept {
  const double s = a + b;
  const double moved = s - a;
  return {s, (a - (s - moved)) + (b - moved)};
}

/// One step of Dot2 (Ogita, Rump and Oishi) on a lane: the rounded square added to the lane's sum by
/// TwoSum, whose error is (sum - (total - moved)) + (square - moved) exactly; the second term and the
/// square's own error (x^2 - square) are one FMA, x^2 - moved. The error goes to the lane's compensation.
/// The vector kernels take the same steps.
inline void add_square_compensated(double& sum, double& compensation, double x) noexcept {
  const double square = x * x;
  const double total = sum + square;
  const double moved = total - sum;
  const double lost = sum - (total - moved);
  compensation += lost + std::fma(x, x, -moved);
  sum = total;
}

/// The lanes' sums and compensations as one double-double, merged pairwise by TwoSum.
template <std::size_t L>
double_double merge_lanes(const double (&sum)[L], const double (&compensation)[L]) noexcept {
  double s[L], c[L];
  std::copy(sum, sum + L, s);
  std::copy(compensation, compensation + L, c);
  for (std::size_t width = L / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) {
      const double_double t = two_sum(s[j], s[j + width]);
      s[j] = t.hi;
      c[j] = (c[j] + c[j + width]) + t.lo;
    }
  const double hi = s[0] + c[0];
  return {hi, c[0] - (hi - s[0])};
}

/// sum(x^2) of FP64 elements by Dot2 in lanes<double> lanes carried across blocks: the double-double
/// result is within about n/lanes * 2^-106 relative of the exact sum, so one rounding to double leaves
/// it accurate to 2^-53. When Ranged, stops before the first block whose max|x| (NaN ignored) is nonzero
/// and outside [lo, hi), for the caller to rescale; `done` is the number of elements summed.
template <bool Ranged>
double_double compensated_squares(const double* p, std::size_t n, double lo, double hi, std::size_t& done) noexcept {
  constexpr std::size_t L = lanes<double>;
  double sum[L] = {}, compensation[L] = {};
  std::size_t start = 0;
  for (; start < n; start += block_size) {
    const std::size_t m = std::min(block_size, n - start);
    double saved_sum[L], saved_compensation[L];
    if (Ranged) {
      std::copy(sum, sum + L, saved_sum);
      std::copy(compensation, compensation + L, saved_compensation);
    }
    double top = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const double x = p[start + i];
      add_square_compensated(sum[i % L], compensation[i % L], x);
      const double a = std::abs(x);
      top = top < a ? a : top;
    }
    if (Ranged && top != 0 && !(top >= lo && top < hi)) {
      std::copy(saved_sum, saved_sum + L, sum);
      std::copy(saved_compensation, saved_compensation + L, compensation);
      break;
    }
  }
  done = std::min(start, n);
  return merge_lanes(sum, compensation);
}

/// Whether all n elements are zeros (of either sign): their bits, sign aside, are.
template <class T>
bool all_zeros(const T* p, std::size_t n) noexcept {
  using bits = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                  std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  bits any = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bits b;
    std::memcpy(&b, p + i, sizeof b);
    any |= b;
  }
  return static_cast<bits>(any << 1) == 0;
}

/// Whether a block's sum of squares, summed without scaling, is accurate: finite (no square or chain
/// overflowed, no NaN) and at least min_sum, so that squares which underflowed (at most one smallest
/// normal each) are negligible beside it; or zero from a block of zeros.
template <class T>
bool accurate_unscaled(const T* block, std::size_t m, double sum, double min_sum) noexcept {
  if (sum >= min_sum && sum <= std::numeric_limits<double>::max()) return true;
  return sum == 0.0 && all_zeros(block, m);
}

/// Sums the squares of each block of block_for<T> elements (see sum_squares) and totals the block sums
/// in FP64, compensated. When Ranged, stops before the first block whose sum is not accurate unscaled
/// (accurate_unscaled), for the caller to rescale. `done` is the number of elements summed.
template <class Acc, bool Ranged, class T>
double block_sums(const T* p, std::size_t n, double min_sum, std::size_t& done) noexcept {
  compensated_sum total;
  std::size_t start = 0;
  for (; start < n; start += block_for<T>) {
    const std::size_t m = std::min(block_for<T>, n - start);
    const double sum = sum_squares<Acc>(p + start, m);
    if (Ranged && !accurate_unscaled(p + start, m, sum, min_sum)) break;
    total.add(sum);
  }
  done = std::min(start, n);
  return total.value();
}

/// p[i] <- p[i] * c computed in Compute and rounded once to T, to nearest even.
template <class Compute, class T>
void multiply(T* p, std::size_t n, Compute c) noexcept {
  for (std::size_t i = 0; i < n; ++i) p[i] = narrow<T>(widen<Compute>(p[i]) * c);
}

/// x * (c.mantissa + c.low) * 2^c.exponent (c normalized, finite, nonzero) rounded once to double, for
/// every finite x and exponent: the product of the significands is formed as a double-double in [0.25,
/// 2) and scaled only at the end, rounded to the subnormal grid by hand where the result is subnormal.
inline double multiply_exactly(double x, const scaled& c) noexcept {
  if (x == 0 || !std::isfinite(x)) return x * c.mantissa;
  int shift;
  const double m = std::frexp(x, &shift);  // x = m 2^shift, 0.5 <= |m| < 1
  const double z = std::fma(m, c.mantissa, m * c.low);
  const int e = shift + c.exponent;  // x c = (z + rest) 2^e, |z| < 2
  if (std::ilogb(z) + e >= std::numeric_limits<double>::min_exponent - 1) return std::ldexp(z, e);  // exact
  if (e < std::numeric_limits<double>::min_exponent - std::numeric_limits<double>::digits - 2)
    return std::copysign(0.0, x);  // |x c| < 2^-1075: rounds to zero
  // Subnormal: |z| < 2^52 g with g = 2^(-1074 - e) the grid here, so adding 2^52 g rounds |z| to it.
  const double rest = std::fma(m, c.low, std::fma(m, c.mantissa, -z));
  const double g = std::ldexp(1.0, -1074 - e), big = std::ldexp(1.0, -1022 - e);
  const double a = std::abs(z), w = z < 0 ? -rest : rest;  // |x c| = (a + w) 2^e
  double q = (a + big) - big;
  const double over = (a - q) + w;  // a - q is exact
  const bool odd = std::fmod(q / g, 2.0) != 0;
  if (over > g / 2 || (over == g / 2 && odd))
    q += g;
  else if (over < -g / 2 || (over == -g / 2 && odd))
    q -= g;
  return std::copysign(std::ldexp(q, e), x);
}

// Products whose magnitude lies in [2^-1023, 2^-1000) go through multiply_exactly: there x * c.low, the
// addend of the one-rounding FMA, is itself rounded to the subnormal grid, an error of up to half an ulp
// of the product. Below the band that error is under 2^-53 of the product, above it negligible.
inline constexpr double exact_band_low = 0x1p-1023;
inline constexpr double exact_band_high = 0x1p-1000;

/// p[i] <- p[i] * c for FP64 elements and a coefficient with a tail (c normalized, finite, nonzero,
/// c.exponent >= -968 so that both parts scale to normal doubles): fma(x, high, x * low), one rounding
/// within 2^-100 of the exact product, and multiply_exactly for results in the band above.
inline void multiply_compensated(double* p, std::size_t n, const scaled& c) noexcept {
  const double high = std::ldexp(c.mantissa, c.exponent), low = std::ldexp(c.low, c.exponent);
  for (std::size_t i = 0; i < n; ++i) {
    const double y = std::fma(p[i], high, p[i] * low);
    const double a = std::abs(y);
    p[i] = a >= exact_band_low && a < exact_band_high ? multiply_exactly(p[i], c) : y;
  }
}

/// p[i] <- p[i] / s, the quotient computed in FP64 and rounded once to T (narrow<T>: FP16 and BF16
/// through FP32). That is the correctly rounded quotient whenever s is representable in T (FP64 holds
/// more than 2 * 24 + 2 bits, FP32 2 * 11 + 2, so neither rounding can cross a midpoint).
/// x rounded to FP32 "to odd" (when inexact, the neighbour whose last bit is 1): rounding that once more
/// to 16 bits (11 or 8 digits, at least two fewer) gives the correct rounding of x.
inline float round_to_odd_float(double x) noexcept {
  const float f = static_cast<float>(x);
  if (std::isnan(x) || static_cast<double>(f) == x || (bits_of(f) & 1u) != 0) return f;
  const bool away_from_zero = std::abs(x) > std::abs(static_cast<double>(f));
  return float_from_bits(away_from_zero ? bits_of(f) + 1u : bits_of(f) - 1u);
}

template <class T>
void divide(T* p, std::size_t n, double s) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const double q = widen<double>(p[i]) / s;
    if constexpr (sizeof(T) == 2)
      p[i] = T(round_to_odd_float(q));
    else
      p[i] = narrow<T>(q);
  }
}

}  // namespace portable
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/// How a block's terms are computed: (|x| 2^-E)^3 or ^4 by products, or 2^(p (log2 |x| - E)) by the
/// polynomials below for any p.
enum class power_kind { cube, fourth, general };

/// What the terms of a run at scale 2^E need, computed once per scale.
struct power_scale {
  double order;   // p
  double unit;    // 2^-E (products only: a normal double)
  double offset;  // 1023 + E: a biased exponent field minus offset is log2 |x|'s integer part minus E
};

// The p-norm loops on one FP64 value at a time: the portable version, and the reference the vector
// versions match bit for bit (so never contracted into FMA either).
#if defined(__clang__)
#pragma float_control(push)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
namespace scalar {

struct f64 {
  using vec = double;
  using mask = bool;
  static constexpr std::size_t width = 1;
  static vec zero() noexcept { return 0.0; }
  static vec set1(double x) noexcept { return x; }
  static vec broadcast(double x) noexcept { return x; }
  static double lane(vec v) noexcept { return v; }
  template <class T>
  static vec load(const T* p) noexcept {
    return widen<double>(*p);
  }
  static void store(double* p, vec v) noexcept { *p = v; }
  static vec add(vec a, vec b) noexcept { return a + b; }
  static vec sub(vec a, vec b) noexcept { return a - b; }
  static vec mul(vec a, vec b) noexcept { return a * b; }
  static vec div(vec a, vec b) noexcept { return a / b; }
  static vec abs(vec v) noexcept { return std::abs(v); }
  static vec max(vec a, vec b) noexcept { return a > b ? a : b; }  // b where a is NaN, like maxpd
  static double max_lane(vec v) noexcept { return v; }
  static mask less(vec a, vec b) noexcept { return a < b; }
  static vec select(mask m, vec a, vec b) noexcept { return m ? b : a; }
  static vec keep(mask m, vec v) noexcept { return m ? v : 0.0; }
  static std::uint64_t bits(vec v) noexcept {
    std::uint64_t b;
    std::memcpy(&b, &v, sizeof b);
    return b;
  }
  static vec from_bits(std::uint64_t b) noexcept {
    vec v;
    std::memcpy(&v, &b, sizeof v);
    return v;
  }
  /// The biased exponent field of v >= 0, as a double.
  static vec exponent_field(vec v) noexcept { return static_cast<double>(bits(v) >> 52); }
  /// The significand of a positive normal v, in [1, 2).
  static vec significand(vec v) noexcept { return from_bits((bits(v) & 0x000fffffffffffffu) | 0x3ff0000000000000u); }
  /// 2^n for t = n + 1.5 * 2^52 (n an integer in [-1022, 1023], kept in t's low bits).
  static vec power_of_two(vec t) noexcept { return from_bits((bits(t) + 1023) << 52); }
};

struct ints {
  template <class Bits>
  static constexpr std::size_t width = 1;
  using vec = std::uint32_t;
  static vec zero() noexcept { return 0; }
  template <class T>
  static vec load(const T* p) noexcept {
    std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t> b;
    std::memcpy(&b, p, sizeof b);
    return b;
  }
  template <class Bits>
  static vec max_magnitude(vec top, vec b) noexcept {
    return std::max<vec>(top, b & (std::numeric_limits<Bits>::max() >> 1));
  }
  template <class Bits>
  static Bits max_lane(vec v) noexcept {
    return static_cast<Bits>(v);
  }
};

#include <gradclip/detail/p_norm_loops.inc>

}  // namespace scalar
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/// The instruction sets gradclip has kernels for, each a superset of the one before.
enum class isa { portable, avx2, avx512 };

/// Whether this CPU (and OS) runs the kernels of `target`.
inline bool isa_supported(isa target) noexcept {
#if GRADCLIP_X86_DISPATCH
  __builtin_cpu_init();
  // Every CPU with AVX2 also has F16C and FMA (Haswell, Excavator and later).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (target) {
    case isa::avx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case isa::avx2:
      return avx2;
    case isa::portable:
      break;
  }
#endif
  return target == isa::portable;
}

/// The widest supported instruction set, detected once at start-up. A namespace-scope variable, so
/// reading it costs no guard; code that runs before it is initialized reads isa::portable, which is
/// always correct.
inline const isa detected_isa = isa_supported(isa::avx512) ? isa::avx512
                                : isa_supported(isa::avx2) ? isa::avx2
                                                           : isa::portable;

inline isa best_isa() noexcept { return detected_isa; }

#if GRADCLIP_X86_DISPATCH

// Each region compiles its functions for one instruction set; nothing in them runs unless best_isa()
// chose it. The same loops (simd_loops.inc) are included in each. No contraction into FMA: squares are
// rounded before they are added, as in the portable kernels, so a result does not depend on the
// instruction set; the FP64 compensated kernels call FMA by name, as the portable ones call std::fma.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")  // FMA (in AVX-512F too) would skip the rounding of squares
// GCC 12's intrinsics build their "undefined" vectors from themselves (bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace avx2 {

struct f32 {
  using vec = __m256;
  static constexpr std::size_t width = 8;
  static vec zero() noexcept { return _mm256_setzero_ps(); }
  static vec set1(float x) noexcept { return _mm256_set1_ps(x); }
  static vec load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static vec load(const Eigen::half* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static vec load(const Eigen::bfloat16* p) noexcept {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, vec v) noexcept { _mm256_storeu_ps(p, v); }
  static void store(Eigen::half* p, vec v) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  // Eigen's rounding: add 0x7fff plus the lowest kept bit, truncate; NaN becomes a signed quiet NaN.
  static void store(Eigen::bfloat16* p, vec v) noexcept {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i result = _mm256_blendv_epi8(rounded, quiet, nan);
    // packus works per 128-bit half: gather the two low quadwords.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static vec add_square(vec acc, vec v) noexcept { return _mm256_add_ps(acc, _mm256_mul_ps(v, v)); }
  static vec fmadd(vec a, vec b, vec c) noexcept { return _mm256_fmadd_ps(a, b, c); }  // a b + c, one rounding
  // BF16 pairs in 32-bit lanes: the low and the high elements as FP32.
  static vec low_halves(__m256i pairs) noexcept { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
  static vec high_halves(__m256i pairs) noexcept {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  /// Even and odd elements' lanes back to element order: a holds elements 0-7, b elements 8-15.
  static void interleave(vec& a, vec& b) noexcept {
    const vec low = _mm256_unpacklo_ps(a, b), high = _mm256_unpackhi_ps(a, b);
    a = _mm256_permute2f128_ps(low, high, 0x20);
    b = _mm256_permute2f128_ps(low, high, 0x31);
  }
  static __m256d widen_low(vec v) noexcept { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
  static __m256d widen_high(vec v) noexcept { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
  static vec mul(vec a, vec b) noexcept { return _mm256_mul_ps(a, b); }
};

struct f64 {
  using vec = __m256d;
  static constexpr std::size_t width = 4;
  static vec zero() noexcept { return _mm256_setzero_pd(); }
  static vec set1(double x) noexcept { return _mm256_set1_pd(x); }
  static vec load(const double* p) noexcept { return _mm256_loadu_pd(p); }
  static vec load(const float* p) noexcept { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
  static vec load(const Eigen::half* p) noexcept {
    return _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static vec load(const Eigen::bfloat16* p) noexcept {
    const __m128i wide = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(wide, 16)));
  }
  static void store(double* p, vec v) noexcept { _mm256_storeu_pd(p, v); }
  static void store(float* p, vec v) noexcept { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
  static vec add_square(vec acc, vec v) noexcept { return _mm256_add_pd(acc, _mm256_mul_pd(v, v)); }
  static vec add(vec a, vec b) noexcept { return _mm256_add_pd(a, b); }
  static vec mul(vec a, vec b) noexcept { return _mm256_mul_pd(a, b); }
  static vec abs(vec v) noexcept { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), v); }
  static vec max(vec a, vec b) noexcept { return _mm256_max_pd(a, b); }
  static vec fmadd(vec a, vec b, vec c) noexcept { return _mm256_fmadd_pd(a, b, c); }  // a b + c, one rounding
  static vec fmsub(vec a, vec b, vec c) noexcept { return _mm256_fmsub_pd(a, b, c); }  // a b - c, one rounding
  /// Bit j set where lo <= |v_j| < hi.
  static unsigned within(vec v, vec lo, vec hi) noexcept {
    const vec a = abs(v);
    return static_cast<unsigned>(
        _mm256_movemask_pd(_mm256_and_pd(_mm256_cmp_pd(a, lo, _CMP_GE_OQ), _mm256_cmp_pd(a, hi, _CMP_LT_OQ))));
  }
  static double max_lane(vec v) noexcept {
    const __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
  }
  // For the p-norm loops and divide (see scalar::f64).
  using mask = __m256d;
  static vec broadcast(double x) noexcept { return _mm256_set1_pd(x); }
  static double lane(vec v) noexcept { return _mm256_cvtsd_f64(v); }
  static vec sub(vec a, vec b) noexcept { return _mm256_sub_pd(a, b); }
  static vec div(vec a, vec b) noexcept { return _mm256_div_pd(a, b); }
  static mask less(vec a, vec b) noexcept { return _mm256_cmp_pd(a, b, _CMP_LT_OQ); }
  static vec select(mask m, vec a, vec b) noexcept { return _mm256_blendv_pd(a, b, m); }
  static vec keep(mask m, vec v) noexcept { return _mm256_and_pd(m, v); }
  static vec exponent_field(vec v) noexcept {  // the field in the low bits of 2^52 + field, then 2^52 off
    const __m256i field = _mm256_srli_epi64(_mm256_castpd_si256(v), 52);
    const __m256i biased = _mm256_or_si256(field, _mm256_set1_epi64x(0x4330000000000000));
    return _mm256_sub_pd(_mm256_castsi256_pd(biased), _mm256_set1_pd(0x1p52));
  }
  static vec significand(vec v) noexcept {
    const __m256i bits = _mm256_and_si256(_mm256_castpd_si256(v), _mm256_set1_epi64x(0x000fffffffffffff));
    return _mm256_castsi256_pd(_mm256_or_si256(bits, _mm256_set1_epi64x(0x3ff0000000000000)));
  }
  static vec power_of_two(vec t) noexcept {
    const __m256i biased = _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023));
    return _mm256_castsi256_pd(_mm256_slli_epi64(biased, 52));
  }
};

struct ints {
  using vec = __m256i;
  template <class Bits>
  static constexpr std::size_t width = 32 / sizeof(Bits);
  static vec zero() noexcept { return _mm256_setzero_si256(); }
  static vec load(const void* p) noexcept { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // Magnitudes fit in 15 or 31 bits, so the signed maximum works.
  template <class Bits>
  static vec max_magnitude(vec top, vec b) noexcept {
    if constexpr (sizeof(Bits) == 2)
      return _mm256_max_epi16(top, _mm256_and_si256(b, _mm256_set1_epi16(0x7fff)));
    else
      return _mm256_max_epi32(top, _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)));
  }
  template <class Bits>
  static Bits max_lane(vec v) noexcept {
    Bits lanes[width<Bits>];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), v);
    return *std::max_element(lanes, lanes + width<Bits>);
  }
};

#include <gradclip/detail/p_norm_loops.inc>
#include <gradclip/detail/simd_loops.inc>

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
#pragma GCC optimize("fp-contract=off")  // FMA (in AVX-512F too) would skip the rounding of squares
#endif
// The masked (maskz) forms of the intrinsics: GCC 12's unmasked ones start from an "undefined" vector
// that -Wmaybe-uninitialized reports wherever they are inlined (GCC bug 105593).
namespace avx512 {

struct f32 {
  using vec = __m512;
  static constexpr std::size_t width = 16;
  static vec zero() noexcept { return _mm512_setzero_ps(); }
  static vec set1(float x) noexcept { return _mm512_set1_ps(x); }
  // Two 256-bit loads: streaming from DRAM they ran 1.3x faster than one 512-bit load on the AMD
  // EPYC (Zen 5) that the benchmarks come from, and no slower in cache.
  static vec load(const float* p) noexcept {
    return _mm512_insertf32x8(_mm512_zextps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 8), 1);
  }
  static vec load(const Eigen::half* p) noexcept {
    return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static vec load(const Eigen::bfloat16* p) noexcept {
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, wide, 16));
  }
  static void store(float* p, vec v) noexcept { _mm512_storeu_ps(p, v); }
  static void store(Eigen::half* p, vec v) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(Eigen::bfloat16* p, vec v) noexcept {  // see avx2::f32
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i high = _mm512_maskz_srli_epi32(0xffff, bits, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_maskz_srli_epi32(0xffff, _mm512_add_epi32(bits, bias), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
    const __m512i result = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(0xffff, result));
  }
  static vec add_square(vec acc, vec v) noexcept { return _mm512_add_ps(acc, _mm512_mul_ps(v, v)); }
  static vec fmadd(vec a, vec b, vec c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static vec low_halves(__m512i pairs) noexcept {  // see avx2::f32
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, pairs, 16));
  }
  static vec high_halves(__m512i pairs) noexcept {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static void interleave(vec& a, vec& b) noexcept {
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const vec first = _mm512_permutex2var_ps(a, low, b);
    b = _mm512_permutex2var_ps(a, high, b);
    a = first;
  }
  static __m512d widen_low(vec v) noexcept { return _mm512_maskz_cvtps_pd(0xff, _mm512_castps512_ps256(v)); }
  static __m512d widen_high(vec v) noexcept {
    return _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 1));
  }
  static vec mul(vec a, vec b) noexcept { return _mm512_mul_ps(a, b); }
};

struct f64 {
  using vec = __m512d;
  static constexpr std::size_t width = 8;
  static vec zero() noexcept { return _mm512_setzero_pd(); }
  static vec set1(double x) noexcept { return _mm512_set1_pd(x); }
  static vec load(const double* p) noexcept {  // see f32::load
    return _mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_loadu_pd(p)), _mm256_loadu_pd(p + 4), 1);
  }
  static vec load(const float* p) noexcept { return _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(p)); }
  static vec load(const Eigen::half* p) noexcept {
    return _mm512_maskz_cvtps_pd(0xff, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static vec load(const Eigen::bfloat16* p) noexcept {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_maskz_cvtps_pd(0xff, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  static void store(double* p, vec v) noexcept { _mm512_storeu_pd(p, v); }
  static void store(float* p, vec v) noexcept { _mm256_storeu_ps(p, _mm512_maskz_cvtpd_ps(0xff, v)); }
  static vec add_square(vec acc, vec v) noexcept { return _mm512_add_pd(acc, _mm512_mul_pd(v, v)); }
  static vec add(vec a, vec b) noexcept { return _mm512_add_pd(a, b); }
  static vec mul(vec a, vec b) noexcept { return _mm512_mul_pd(a, b); }
  static vec abs(vec v) noexcept { return _mm512_abs_pd(v); }
  static vec max(vec a, vec b) noexcept { return _mm512_maskz_max_pd(0xff, a, b); }
  static vec fmadd(vec a, vec b, vec c) noexcept { return _mm512_fmadd_pd(a, b, c); }
  static vec fmsub(vec a, vec b, vec c) noexcept { return _mm512_fmsub_pd(a, b, c); }
  static unsigned within(vec v, vec lo, vec hi) noexcept {
    const vec a = abs(v);
    return _mm512_mask_cmp_pd_mask(_mm512_cmp_pd_mask(a, lo, _CMP_GE_OQ), a, hi, _CMP_LT_OQ);
  }
  static double max_lane(vec v) noexcept {  // the halves' maximum, then avx2's shuffles
    return avx2::f64::max_lane(_mm256_max_pd(_mm512_castpd512_pd256(v), _mm512_maskz_extractf64x4_pd(0xf, v, 1)));
  }
  // For the p-norm loops and divide (see scalar::f64).
  using mask = __mmask8;
  static vec broadcast(double x) noexcept { return _mm512_set1_pd(x); }
  static double lane(vec v) noexcept { return _mm512_cvtsd_f64(v); }
  static vec sub(vec a, vec b) noexcept { return _mm512_sub_pd(a, b); }
  static vec div(vec a, vec b) noexcept { return _mm512_div_pd(a, b); }
  static mask less(vec a, vec b) noexcept { return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ); }
  static vec select(mask m, vec a, vec b) noexcept { return _mm512_mask_blend_pd(m, a, b); }
  static vec keep(mask m, vec v) noexcept { return _mm512_maskz_mov_pd(m, v); }
  static vec exponent_field(vec v) noexcept {  // see avx2::f64
    const __m512i field = _mm512_maskz_srli_epi64(0xff, _mm512_castpd_si512(v), 52);
    const __m512i biased = _mm512_or_si512(field, _mm512_set1_epi64(0x4330000000000000));
    return _mm512_sub_pd(_mm512_castsi512_pd(biased), _mm512_set1_pd(0x1p52));
  }
  static vec significand(vec v) noexcept {
    const __m512i bits = _mm512_and_si512(_mm512_castpd_si512(v), _mm512_set1_epi64(0x000fffffffffffff));
    return _mm512_castsi512_pd(_mm512_or_si512(bits, _mm512_set1_epi64(0x3ff0000000000000)));
  }
  static vec power_of_two(vec t) noexcept {
    const __m512i biased = _mm512_add_epi64(_mm512_castpd_si512(t), _mm512_set1_epi64(1023));
    return _mm512_castsi512_pd(_mm512_maskz_slli_epi64(0xff, biased, 52));
  }
};

struct ints {
  using vec = __m512i;
  template <class Bits>
  static constexpr std::size_t width = 64 / sizeof(Bits);
  static vec zero() noexcept { return _mm512_setzero_si512(); }
  static vec load(const void* p) noexcept { return _mm512_loadu_si512(p); }
  template <class Bits>  // see avx2::ints
  static vec max_magnitude(vec top, vec b) noexcept {
    if constexpr (sizeof(Bits) == 2)
      return _mm512_max_epi16(top, _mm512_and_si512(b, _mm512_set1_epi16(0x7fff)));
    else
      return _mm512_max_epi32(top, _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)));
  }
  template <class Bits>
  static Bits max_lane(vec v) noexcept {
    Bits lanes[width<Bits>];
    _mm512_storeu_si512(lanes, v);
    return *std::max_element(lanes, lanes + width<Bits>);
  }
};

#include <gradclip/detail/p_norm_loops.inc>
#include <gradclip/detail/simd_loops.inc>

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // GRADCLIP_X86_DISPATCH

/// portable::block_sums on the kernels of `target` (which must be supported).
template <class Acc, bool Ranged, class T>
double block_sums([[maybe_unused]] isa target, const T* p, std::size_t n, double min_sum, std::size_t& done) noexcept {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::block_sums<Acc, Ranged>(p, n, min_sum, done);
  if (target == isa::avx2) return avx2::block_sums<Acc, Ranged>(p, n, min_sum, done);
#endif
  return portable::block_sums<Acc, Ranged>(p, n, min_sum, done);
}

/// portable::compensated_squares on the kernels of `target` (which must be supported).
template <bool Ranged>
portable::double_double compensated_squares([[maybe_unused]] isa target, const double* p, std::size_t n, double lo,
                                            double hi, std::size_t& done) noexcept {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::compensated_squares<Ranged>(p, n, lo, hi, done);
  if (target == isa::avx2) return avx2::compensated_squares<Ranged>(p, n, lo, hi, done);
#endif
  return portable::compensated_squares<Ranged>(p, n, lo, hi, done);
}

/// portable::multiply_compensated on the kernels of `target` (which must be supported).
inline void multiply_compensated([[maybe_unused]] isa target, double* p, std::size_t n, const scaled& c) noexcept {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::multiply_compensated(p, n, c);
  if (target == isa::avx2) return avx2::multiply_compensated(p, n, c);
#endif
  portable::multiply_compensated(p, n, c);
}

/// portable::multiply on the kernels of `target` (which must be supported). 16-bit elements scaled in
/// FP64 (coefficients outside FP32's normal range, rare) stay portable.
template <class Compute, class T>
void multiply([[maybe_unused]] isa target, T* p, std::size_t n, Compute c) noexcept {
#if GRADCLIP_X86_DISPATCH
  if constexpr (std::is_same_v<Compute, float> || std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (target == isa::avx512) return avx512::multiply<Compute>(p, n, c);
    if (target == isa::avx2) return avx2::multiply<Compute>(p, n, c);
  }
#endif
  portable::multiply<Compute>(p, n, c);
}

/// portable::divide on the kernels of `target` (which must be supported).
template <class T>
void divide([[maybe_unused]] isa target, T* p, std::size_t n, double s) noexcept {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return avx512::divide(p, n, s);
  if (target == isa::avx2) return avx2::divide(p, n, s);
#endif
  portable::divide(p, n, s);
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
