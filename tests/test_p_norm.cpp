// L1, L-infinity and general p-norms and clipping by them, against a binary128 reference.
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::norm_type;

/// The options of a call by the p-norm, p = inf for the max norm.
gradclip::options by(norm_type type, gradclip::on_nonfinite nonfinite = gradclip::on_nonfinite::skip) {
  return {nonfinite, 0.0, type};
}
using gradclip::on_nonfinite;

template <class T>
class PNormTyped : public ::testing::Test {};
TYPED_TEST_SUITE(PNormTyped, element_types);

constexpr double inf = std::numeric_limits<double>::infinity();
// The orders the reference below computes exactly in binary128 (fractional ones through square roots).
const std::vector<double> orders{0.5, 1.0, 1.5, 2.0, 3.0, 4.0, inf};

/// cbrt in binary128 by Newton's method from a double estimate, scaled by powers of 2^900 like quad_sqrt.
quad quad_cbrt(quad s) {
  if (s <= 0) return 0;
  int thirds = 0;
  while (s > quad(1e300)) {
    s /= quad(0x1p900);
    thirds += 300;
  }
  while (s < quad(1e-300)) {
    s *= quad(0x1p900);
    thirds -= 300;
  }
  quad x = std::cbrt(static_cast<double>(s));
  for (int i = 0; i < 4; ++i) x -= (x * x * x - s) / (3 * x * x);
  for (; thirds > 0; thirds -= 300) x *= quad(0x1p300);
  for (; thirds < 0; thirds += 300) x /= quad(0x1p300);
  return x;
}

quad quad_power(quad a, double p) {
  if (p == 0.5) return quad_sqrt(a);
  if (p == 1.5) return a * quad_sqrt(a);
  if (p == 3.0) return a * a * a;
  if (p == 4.0) return (a * a) * (a * a);
  return p == 2.0 ? a * a : a;
}

quad quad_root(quad s, double p) {
  if (p == 0.5) return s * s;
  if (p == 1.5) return quad_cbrt(s * s);
  if (p == 3.0) return quad_cbrt(s);
  if (p == 4.0) return quad_sqrt(quad_sqrt(s));
  return p == 2.0 ? quad_sqrt(s) : s;
}

/// The exact p-norm (to binary128 precision) of the concatenation of the given gradients.
template <class T>
quad exact_p_norm(const std::vector<std::vector<T>>& grads, double p) {
  quad sum = 0, top = 0;
  for (const auto& g : grads)
    for (const T& x : g) {
      const quad a = quad_abs(to_quad(x));
      top = a > top ? a : top;
      sum += quad_power(a, p);
    }
  return std::isinf(p) ? top : quad_root(sum, p);
}
template <class T>
quad exact_p_norm(const std::vector<T>& g, double p) {
  return exact_p_norm(std::vector<std::vector<T>>{g}, p);
}

// The documented bound for every p >= 0.5 (FP64 sums, one pow per element and one per block merge), except
// p = 2, which is the robust L2 norm itself and has its bound (FP32 chains for FP16 and BF16).
template <class T>
double bound(double p) {
  return p == 2.0 ? robust_norm_bound<T>() : 1e-12;
}

template <class T>
void expect_norm_within_bound(const std::vector<T>& g, double p) {
  const quad exact = exact_p_norm(g, p);
  const double got = gradclip::norm(g, by(norm_type{p}));
  EXPECT_LE(relative_error(got, exact), bound<T>(p)) << type_name<T>() << " p = " << p << ", n = " << g.size()
                                                     << ", got " << got << ", exact " << static_cast<double>(exact);
  EXPECT_EQ(gradclip::norm(g.data(), g.size(), by(norm_type{p})), got) << "the raw-buffer overload differs";
}

TYPED_TEST(PNormTyped, RandomGradientsWithinBoundForEveryOrder) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t n : {1u, 7u, 31u, 1023u, 1024u, 1025u, 4099u, 100000u}) {
    const auto g = random_gradient<T>(n, rng, 0.01);
    for (double p : orders) expect_norm_within_bound(g, p);
  }
}

TYPED_TEST(PNormTyped, WholeFiniteRangeIncludingMaximaAndSubnormals) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max();
  const T tiny = std::numeric_limits<T>::denorm_min();
  const T min_normal = std::numeric_limits<T>::min();
  const std::vector<std::vector<T>> cases{{max, max},
                                          {max, -max, max, T(1)},
                                          {tiny},
                                          {tiny, tiny, min_normal},
                                          {max, tiny},
                                          {T(-0.0), tiny},
                                          {min_normal, T(1)},
                                          std::vector<T>(3000, max),
                                          std::vector<T>(3000, tiny)};
  for (const auto& g : cases)
    for (double p : orders) expect_norm_within_bound(g, p);
}

TYPED_TEST(PNormTyped, EmptyAndZeroGradientsHaveNormZero) {
  using T = TypeParam;
  const std::vector<T> empty, zeros(2000, T(0));
  for (double p : {0.5, 1.0, 3.0, 100.0, inf}) {
    EXPECT_EQ(gradclip::norm(empty, by(norm_type{p})), 0.0);
    EXPECT_EQ(gradclip::norm(zeros, by(norm_type{p})), 0.0);
  }
}

TYPED_TEST(PNormTyped, GlobalNormIsTheNormOfTheConcatenation) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<T>> grads{
      random_gradient<T>(1500, rng, 0.01), random_gradient<T>(3, rng, 100.0), {}, random_gradient<T>(700, rng, 1e-3)};
  for (double p : orders) {
    const quad exact = exact_p_norm(grads, p);
    EXPECT_LE(relative_error(gradclip::global_norm(grads, by(norm_type{p})), exact), bound<T>(p)) << "p = " << p;
  }
  // inf: the largest of the gradients' max norms, exactly.
  double largest = 0;
  for (const auto& g : grads) largest = std::max(largest, gradclip::norm(g, by(gradclip::inf_norm)));
  EXPECT_EQ(gradclip::global_norm(grads, by(gradclip::inf_norm)), largest);
}

TEST(PNorm, MixedElementTypesInOneGroup) {
  std::vector<Eigen::half> w{Eigen::half(60000.0f), Eigen::half(-60000.0f)};
  Eigen::VectorXf b(2);
  b << 3.0f, -4.0f;
  EXPECT_EQ(gradclip::global_norm({gradclip::grad_view(w), gradclip::grad_view(b)}, by(gradclip::l1_norm)), 120007.0);
  EXPECT_EQ(gradclip::global_norm({gradclip::grad_view(w), gradclip::grad_view(b)}, by(gradclip::inf_norm)), 60000.0);
}

TEST(PNorm, SmallAndLargeOrders) {
  const std::vector<double> ones(2, 1.0);
  // (1 + 1)^(1/0.01) = 2^100 exactly; 3000 ones give 3000^100 > double's range: +inf, like the L2 norm of
  // FP64 input beyond it.
  EXPECT_NEAR(gradclip::norm(ones, by(norm_type{0.01})) / 0x1p100, 1.0, 1e-13);
  EXPECT_EQ(gradclip::norm(std::vector<double>(3000, 1.0), by(norm_type{0.01})), inf);
  // Large p approaches the max norm from above: max <= ||g||_p <= n^(1/p) max.
  std::mt19937_64 rng(seed);
  const auto g = random_gradient<double>(5000, rng, 1e300);
  const double top = gradclip::norm(g, by(gradclip::inf_norm));
  for (double p : {64.0, 65.0, 100.0, 1000.0}) {
    const double got = gradclip::norm(g, by(norm_type{p}));
    EXPECT_GE(got, top * (1 - 1e-15)) << "p = " << p;
    EXPECT_LE(got, top * std::pow(5000.0, 1 / p) * (1 + 1e-12)) << "p = " << p;
  }
  // Power-of-two scaling invariance, whatever p (2^-1000 g is near 1, 2^-1900 g near 1e-272).
  for (double p : {0.3, 1.0, 2.5, 7.0, 100.0, inf}) {
    std::vector<double> near_one = g, tiny = g;
    for (double& x : near_one) x = std::ldexp(x, -1000);
    for (double& x : tiny) x = std::ldexp(x, -1900);
    EXPECT_NEAR(std::ldexp(gradclip::norm(tiny, by(norm_type{p})), 900) / gradclip::norm(near_one, by(norm_type{p})),
                1.0, 1e-14)
        << "p = " << p;
  }
}

TYPED_TEST(PNormTyped, ClippingIsTheExactProjection) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  // One rounding to T, plus for FP64 the norm's own error (a few units of 2^-53, doubled for p = 0.5).
  const double max_ulps = std::is_same_v<T, double> ? 4.0 : 1.0;
  for (double p : orders) {
    auto g = random_gradient<T>(3000, rng, 1.0);
    const auto original = g;
    const quad exact_norm_value = exact_p_norm(original, p);
    const auto result = gradclip::clip_by_norm(g, 0.5, by(norm_type{p}));
    EXPECT_TRUE(result.clipped && result.finite);
    EXPECT_LE(relative_error(result.norm, exact_norm_value), bound<T>(p)) << type_name<T>() << " p = " << p;
    for (std::size_t i = 0; i < g.size(); ++i) {
      const quad exact = to_quad(original[i]) * quad(0.5) / exact_norm_value;
      ASSERT_LE(ulps(g[i], exact), max_ulps) << type_name<T>() << " p = " << p << " element " << i;
    }
  }
}

TYPED_TEST(PNormTyped, BelowThresholdIsUntouchedAndL2IsTheCorePath) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  auto g = random_gradient<T>(500, rng, 0.01);
  const auto original = g;
  for (double p : orders) {
    const auto result = gradclip::clip_by_norm(g, 1e6, by(norm_type{p}));
    EXPECT_FALSE(result.clipped);
    EXPECT_EQ(result.coefficient, 1.0);
    EXPECT_TRUE(same_bits(g, original));
  }
  auto core = original;
  const auto expected = gradclip::clip_by_norm(core, 0.01);
  const auto got = gradclip::clip_by_norm(g, 0.01, by(gradclip::l2_norm));
  EXPECT_EQ(got.norm, expected.norm);
  EXPECT_EQ(got.coefficient, expected.coefficient);
  EXPECT_TRUE(same_bits(g, core));
}

TEST(PNorm, Fp64BeyondDoubleRangeStillClips) {
  const double big = 1.5e308;
  for (double p : {0.5, 1.0, 1.5, 3.0}) {
    std::vector<double> g{big, big};
    const auto result = gradclip::clip_by_norm(g, 1.0, by(norm_type{p}));
    EXPECT_EQ(result.norm, inf) << "p = " << p;
    EXPECT_TRUE(result.finite && result.clipped);
    const double expected = 1.0 / std::pow(2.0, 1.0 / p);  // each element of the unit-p-norm direction
    EXPECT_NEAR(g[0], expected, 1e-15) << "p = " << p;
    EXPECT_EQ(g[0], g[1]);
  }
}

TYPED_TEST(PNormTyped, Bf16AndFp16NearTheirMaximumClipInTheirOwnType) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max();
  std::vector<T> g{max, T(0), -max};
  const auto result = gradclip::clip_by_norm(g, 2.0, by(gradclip::l1_norm));
  EXPECT_TRUE(result.clipped && result.finite);
  EXPECT_EQ(static_cast<double>(g[0]), 1.0);
  EXPECT_EQ(static_cast<double>(g[2]), -1.0);
}

TYPED_TEST(PNormTyped, NonFiniteElementsFollowTheOption) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T infinity = std::numeric_limits<T>::infinity();
  for (double p : orders) {
    if (p == 2.0) continue;  // the core path, tested in test_clip
    std::vector<T> with_nan(2000, T(1));
    with_nan[1500] = nan;
    std::vector<T> with_inf(2000, T(1));
    with_inf[3] = -infinity;
    EXPECT_TRUE(std::isnan(gradclip::norm(with_nan, by(norm_type{p})))) << "p = " << p;
    EXPECT_EQ(gradclip::norm(with_inf, by(norm_type{p})), inf) << "p = " << p;
    auto g = with_inf;
    auto result = gradclip::clip_by_norm(g, 1.0, by(norm_type{p}));
    EXPECT_FALSE(result.finite || result.clipped);
    EXPECT_TRUE(same_bits(g, with_inf));
    EXPECT_THROW((void)gradclip::clip_by_norm(g, 1.0, by(norm_type{p}, on_nonfinite::error)),
                 gradclip::nonfinite_error);
    EXPECT_TRUE(same_bits(g, with_inf));
    result = gradclip::clip_by_norm(g, 1.0, by(norm_type{p}, on_nonfinite::propagate));
    EXPECT_EQ(result.coefficient, 0.0);
    EXPECT_EQ(static_cast<double>(g[0]), 0.0);
  }
}

template <class F>
void expect_invalid(F&& call, const std::string& function) {
  try {
    call();
    ADD_FAILURE() << "no exception from " << function;
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind(function + ":", 0), 0u) << e.what();
  }
}

TEST(PNorm, BadOrdersAndThresholdsThrowBeforeTouchingAnything) {
  std::vector<float> g{3.0f, 4.0f};
  const auto original = g;
  std::vector<std::vector<float>> group{g};
  for (double p : {0.0, -1.0, -inf, 1000.5, 1e300, std::numeric_limits<double>::quiet_NaN()}) {
    expect_invalid([&] { (void)gradclip::norm(g, by(norm_type{p})); }, "gradclip::norm");
    expect_invalid([&] { (void)gradclip::norm(g.data(), g.size(), by(norm_type{p})); }, "gradclip::norm");
    expect_invalid([&] { (void)gradclip::global_norm(group, by(norm_type{p})); }, "gradclip::global_norm");
    expect_invalid([&] { (void)gradclip::clip_by_norm(g, 1.0, by(norm_type{p})); }, "gradclip::clip_by_norm");
    expect_invalid([&] { (void)gradclip::clip_by_global_norm(group, 1.0, by(norm_type{p})); },
                   "gradclip::clip_by_global_norm");
  }
  for (double max_norm : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    expect_invalid([&] { (void)gradclip::clip_by_norm(g, max_norm, by(gradclip::l1_norm)); }, "gradclip::clip_by_norm");
    expect_invalid([&] { (void)gradclip::clip_by_global_norm(group, max_norm, by(gradclip::inf_norm)); },
                   "gradclip::clip_by_global_norm");
  }
  EXPECT_EQ(g, original);
  EXPECT_EQ(group[0], original);
}

TEST(PNorm, GlobalClipUsesOneCoefficient) {
  std::vector<std::vector<double>> grads{{3.0, -4.0}, {12.0}};
  const auto result = gradclip::clip_by_global_norm(grads, 2.0, by(gradclip::inf_norm));
  EXPECT_EQ(result.norm, 12.0);
  EXPECT_EQ(grads[1][0], 2.0);
  EXPECT_DOUBLE_EQ(grads[0][1], -4.0 / 6.0);
  std::vector<float> a{1.0f, 1.0f};
  Eigen::VectorXd b(2);
  b << 1.0, 1.0;
  const auto mixed =
      gradclip::clip_by_global_norm({gradclip::grad_view(a), gradclip::grad_view(b)}, 2.0, by(gradclip::l1_norm));
  EXPECT_EQ(mixed.norm, 4.0);
  EXPECT_EQ(a[0], 0.5f);
  EXPECT_EQ(b(1), 0.5);
}

}  // namespace
