// Independent references for the tests: binary128 sums of squares and helpers over element types.
#pragma once

#include <Eigen/Core>

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace gradclip_test {

// GCC has no __float128 on AArch64, where long double is binary128 itself.
#if defined(__aarch64__)
using quad = long double;
static_assert(LDBL_MANT_DIG == 113,
              "The tests' binary128 references need long double to be binary128 on AArch64 (Linux).");
#else
using quad = __float128;
#endif

inline quad quad_abs(quad x) { return x < 0 ? -x : x; }

/// sqrt in binary128 by Newton's method from a double estimate, scaled by powers of four so the
/// estimate exists for every value (no libquadmath needed, so clang builds the tests too).
inline quad quad_sqrt(quad s) {
  if (s <= 0) return 0;
  if (s - s != 0) return s;  // inf or NaN
  int halves = 0;
  while (s > quad(1e300)) {
    s /= quad(0x1p600);
    halves += 300;
  }
  while (s < quad(1e-300)) {
    s *= quad(0x1p600);
    halves -= 300;
  }
  quad x = std::sqrt(static_cast<double>(s));
  for (int i = 0; i < 4; ++i) x = (x + s / x) / 2;
  for (; halves > 0; halves -= 300) x *= quad(0x1p300);
  for (; halves < 0; halves += 300) x /= quad(0x1p300);
  return x;
}

template <class T>
quad to_quad(T x) {
  return static_cast<quad>(static_cast<double>(x));
}

/// The exact L2 norm (to binary128 precision) of the concatenation of the given spans.
template <class T>
quad exact_norm(const T* p, std::size_t n) {
  quad sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += to_quad(p[i]) * to_quad(p[i]);
  return quad_sqrt(sum);
}
template <class T>
quad exact_norm(const std::vector<T>& v) {
  return exact_norm(v.data(), v.size());
}

/// The sum of |x|^p (to binary128 precision) of the values for an integer p >= 1, their largest magnitude
/// for p = inf: what exact_p_root turns into the p-norm.
inline quad exact_p_sum(const std::vector<quad>& values, double p) {
  quad sum = 0;
  if (std::isinf(p)) {
    for (const quad x : values) sum = quad_abs(x) > sum ? quad_abs(x) : sum;
    return sum;
  }
  const int k = static_cast<int>(p);
  for (const quad x : values) {
    quad power = 1;
    for (int i = 0; i < k; ++i) power *= quad_abs(x);
    sum += power;
  }
  return sum;
}

/// The p-th root of an exact_p_sum: Newton's method from a double estimate for p >= 3 (sums between
/// about 1e-100 and 1e100); the sum itself for p = 1 and p = inf.
inline quad exact_p_root(quad sum, double p) {
  if (std::isinf(p) || sum == 0) return sum;  // before the conversion, which is undefined for inf
  const int k = static_cast<int>(p);
  if (k == 1) return sum;
  if (k == 2) return quad_sqrt(sum);
  quad r = std::pow(static_cast<double>(sum), 1.0 / p);
  for (int iteration = 0; iteration < 6; ++iteration) {
    quad power = 1;
    for (int i = 0; i < k - 1; ++i) power *= r;
    r -= (power * r - sum) / (k * power);
  }
  return r;
}

/// The exact p-norm (to binary128 precision) of the concatenation of the given values, for p = 1, 2, an
/// integer p >= 3 or p = inf (the largest magnitude).
inline quad exact_p_norm(const std::vector<quad>& values, double p) { return exact_p_root(exact_p_sum(values, p), p); }

/// |got - exact| / exact, with +inf accepted only for an exact value beyond double's range, and the
/// rounding of a result below double's normal range (which no policy can avoid) forgiven.
inline double relative_error(double got, quad exact) {
  if (std::isinf(got) && got > 0) return exact > quad(1.7976931348623157e308) ? 0.0 : INFINITY;
  if (exact == 0) return got == 0 ? 0.0 : INFINITY;
  quad error = quad_abs(static_cast<quad>(got) - exact);
  const quad half_subnormal = quad(0x1p-1074) / 2;
  if (exact < quad(0x1p-1022)) error = error > half_subnormal ? error - half_subnormal : 0;
  return static_cast<double>(error / exact);
}

/// The machine epsilon of T, 2^(1 - digits). (Eigen 3.4's numeric_limits<half>::epsilon() is 2^-13,
/// not 2^-10, so the tests derive it from the digits instead.)
template <class T>
double epsilon_of() {
  return std::ldexp(1.0, 1 - std::numeric_limits<T>::digits);
}

/// The documented relative error bound of the robust policy's L2 norm of T elements (policies.hpp),
/// exactly. FP16 and BF16 square exactly in FP32 and sum in chains of at most 32 squares (at most 31 FP32
/// additions, 31 * 2^-24 on the sum of squares, half that on its root), the rest in FP64: 16 * 2^-24.
/// FP32 squares exactly in FP64 lanes of 64 terms per block (63 additions, 4 more merging the 16 lanes),
/// blocks and parts compensated (2 roundings): 69 * 2^-53 on the sum, half that and the root's rounding on
/// the norm, 36 * 2^-53. FP64: compensated, within 2^-53 on the sum, 1.5 * 2^-53 on the norm.
template <class T>
constexpr double robust_norm_bound() {
  return sizeof(T) == 2 ? 16 * 0x1p-24 : std::is_same_v<T, float> ? 36 * 0x1p-53 : 1.5 * 0x1p-53;
}

/// The documented bound of promote and max_scale (policies.hpp): 16-bit elements as robust's; FP32 ones
/// square with a rounding in chains of 8 (a square and 7 additions per term: 8 * 2^-24); FP64 input sums
/// 64 squares per lane, lanes pairwise and blocks compensated (80 * 2^-53).
template <class T>
constexpr double chain_norm_bound() {
  return std::is_same_v<T, double> ? 80 * 0x1p-53 : sizeof(T) == 2 ? 16 * 0x1p-24 : 8 * 0x1p-24;
}

/// The distance from got to exact in units in the last place of T at exact.
template <class T>
double ulps(T got, quad exact) {
  const double e = static_cast<double>(exact);
  double spacing;
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    const T rounded = static_cast<T>(e);
    spacing =
        static_cast<double>(std::nextafter(std::abs(rounded), std::numeric_limits<T>::infinity()) - std::abs(rounded));
  } else {
    const int digits = std::numeric_limits<T>::digits;
    const int min_exponent = std::numeric_limits<T>::min_exponent;
    int exponent = e == 0 ? min_exponent : std::ilogb(e) + 1;
    if (exponent < min_exponent) exponent = min_exponent;
    spacing = std::ldexp(1.0, exponent - digits);
  }
  return static_cast<double>(quad_abs(to_quad(got) - exact) / static_cast<quad>(spacing));
}

/// True when both hold the same elements bit for bit (NaN payloads and the sign of zero included).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  // Empty vectors may have null data(), which memcmp must not be given even for 0 bytes.
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, Eigen::half>)
    return "float16";
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>)
    return "bfloat16";
  else if constexpr (std::is_same_v<T, float>)
    return "float32";
  else
    return "float64";
}

/// A fixed seed, printed by the tests that use it so a failure can be replayed.
inline constexpr std::uint64_t seed = 20261202;

/// n values of T: normal magnitudes times 2^spread_exponent, random signs.
template <class T>
std::vector<T> random_gradient(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(normal(rng) * scale);
  return v;
}

}  // namespace gradclip_test
