// The numerics every kernel shares, whatever its instruction set: block and lane layouts, compensated
// sums and their merges, the range rule of unscaled block sums, and the exact FP64 products. Scalar
// code, never contracted into FMA, so that each instruction set's kernels can match it bit for bit.
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

// Products and squares are rounded before they are added, as in the vector kernels.
GRADCLIP_FP_CONTRACT_OFF_BEGIN
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
// rounding of a square-then-add, so the vector kernels use it and stay bit-identical.
template <class T, class Acc>
inline constexpr bool exact_squares = (2 * std::numeric_limits<T>::digits <= std::numeric_limits<Acc>::digits) &&
                                      (2 * std::numeric_limits<T>::max_exponent <
                                       std::numeric_limits<Acc>::max_exponent) &&
                                      (2 * (std::numeric_limits<T>::min_exponent - std::numeric_limits<T>::digits) >
                                       std::numeric_limits<Acc>::min_exponent);

// Runs this short cost more in a vector kernel's setup than in its loop (many small tensors): the
// reductions and the scaling handle them element by element.
inline constexpr std::size_t short_run = 32;

// Many independent accumulators (128 bytes of them): they hide the add latency, let every instruction
// set fill the same lanes in the same order and, as a side effect, sum pairwise-like (error ~ n/lanes
// instead of n).
template <class Acc>
inline constexpr std::size_t lanes = 128 / sizeof(Acc);

// The compensated FP64 sum of squares keeps twice as many: each of its steps waits for the lane's last
// addition, and 32 lanes give AVX-512 four chains (in cache on AMD Zen 5, 0.82 of a plain read against
// 0.71 with two in a bare loop).
inline constexpr std::size_t compensated_lanes = 2 * lanes<double>;

// FP32 sums of squares are carried into FP64 lanes every `chain` squares per lane, so a lane's FP32
// partial is rounded at most chain - 1 times. 16-bit elements, whose squares are exact in FP32, carry
// once per 32 (31 roundings, 2^-19 relative): the carry's FP32-to-FP64 conversions share a port with
// the FP16 ones, which bound the speed in cache. FP32 elements, whose FP32 squares round, carry every 8.
// FP64 lanes sum a whole block before the carry.
template <class T, class Acc>
inline constexpr std::size_t chain = !std::is_same_v<Acc, float> ? block_size / lanes<Acc>
                                     : sizeof(T) == 2            ? 32
                                                                 : 8;
template <class T, class Acc>
inline constexpr std::size_t chunk = chain<T, Acc>* lanes<Acc>;

/// The lanes summed pairwise: halves first, then quarters, down to one.
template <class Acc, std::size_t L>
inline Acc sum_lanes(const Acc (&acc)[L]) noexcept {
  Acc partial[L];
  std::copy(acc, acc + L, partial);
  for (std::size_t width = L / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) partial[j] += partial[j + width];
  return partial[0];
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
  const double square = rounded(x * x);
  const double total = sum + square;
  const double moved = total - sum;
  const double lost = sum - (total - moved);
  compensation += lost + std::fma(x, x, -moved);
  sum = total;
}

/// One step of the offset sum of squares (compensated_squares, kernels.inc) on a lane: the rounded square
/// added to the lane's sum, which its offset keeps at least as large as the square, so the addition's
/// error is square - (total - sum) exactly (Fast2Sum); with the square's own error (x^2 - square) that is
/// x^2 - (total - sum), one FMA, added to the lane's compensation. Returns the square. The vector kernels
/// take the same steps.
inline double add_square_offset(double& sum, double& compensation, double x) noexcept {
  const double square = rounded(x * x);
  const double total = sum + square;
  compensation += std::fma(x, x, -(total - sum));
  sum = total;
  return square;
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

/// x rounded to FP32 "to odd" (when inexact, the neighbour whose last bit is 1): rounding that once more
/// to 16 bits (11 or 8 digits, at least two fewer) gives the correct rounding of x.
inline float round_to_odd_float(double x) noexcept {
  const float f = static_cast<float>(x);
  if (std::isnan(x) || static_cast<double>(f) == x || (bits_of(f) & 1u) != 0) return f;
  const bool away_from_zero = std::abs(x) > std::abs(static_cast<double>(f));
  return float_from_bits(away_from_zero ? bits_of(f) + 1u : bits_of(f) - 1u);
}

/// Whether s is a power of two whose reciprocal is an FP32 number (s in [2^-127, 2^149]). Then x / s of a
/// 16-bit x is x * (1 / s) computed in FP32, rounded once to x's type: that product is exact unless it
/// lies below 2^-137 (x has at most 11 significant digits), where it and its rounding both round to zero.
inline bool float_reciprocal_is_exact(double s) noexcept {
  int e = 0;
  return std::frexp(s, &e) == 0.5 && e >= -126 && e <= 150;  // s = 2^(e - 1)
}

/// How a p-norm block's terms are computed: (|x| 2^-E)^3 or ^4 by products, or 2^(p (log2 |x| - E)) by
/// polynomials for any p.
enum class power_kind { cube, fourth, general };

/// What the terms of a run at scale 2^E need, computed once per scale.
struct power_scale {
  double order;   // p
  double unit;    // 2^-E (products only: a normal double)
  double offset;  // 1023 + E: a biased exponent field minus offset is log2 |x|'s integer part minus E
};

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
GRADCLIP_FP_CONTRACT_OFF_END
