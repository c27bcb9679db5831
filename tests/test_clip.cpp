// clip_by_norm and clip_by_value: semantics, non-finite handling, bad input, accuracy and properties.
#include <gradclip/clip.hpp>
#include <gradclip/norm.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::max_scale;
using gradclip::naive;
using gradclip::on_nonfinite;
using gradclip::promote;
using gradclip::robust;

template <class T>
class ClipTyped : public ::testing::Test {};
TYPED_TEST_SUITE(ClipTyped, element_types);

// Every clipped element within max_ulps of the exact g * max_norm / ||g||, computed in binary128.
template <class T>
void expect_exact_projection(const std::vector<T>& original, const std::vector<T>& clipped, double max_norm,
                             double max_ulps = 1.0) {
  const quad exact_norm_value = exact_norm(original);
  for (std::size_t i = 0; i < original.size(); ++i) {
    const quad exact = to_quad(original[i]) * static_cast<quad>(max_norm) / exact_norm_value;
    ASSERT_LE(ulps(clipped[i], exact), max_ulps)
        << type_name<T>() << " element " << i << ": " << static_cast<double>(original[i]) << " -> "
        << static_cast<double>(clipped[i]);
  }
}

// robust: one ulp. max_scale: one ulp plus its FP32 norm's documented error (chain_norm_bound).
template <class Policy, class T>
void expect_clip_is_projection(std::vector<T> g, double max_norm) {
  const auto original = g;
  const auto result = gradclip::clip_by_norm<Policy>(g, max_norm);
  EXPECT_TRUE(result.finite);
  EXPECT_TRUE(result.clipped);
  const double norm_error_in_ulps =
      std::is_same_v<Policy, max_scale> && !std::is_same_v<T, double> ? chain_norm_bound<T>() / epsilon_of<T>() : 0.0;
  expect_exact_projection(original, g, max_norm, 1.0 + norm_error_in_ulps);
}

TYPED_TEST(ClipTyped, RobustClipIsTheExactProjectionWithinOneUlp) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 10);
  for (std::size_t n : {1u, 5u, 33u, 1024u, 1500u, 20000u}) {
    const auto g = random_gradient<T>(n, rng);
    const double half_norm = static_cast<double>(exact_norm(g)) / 2;
    expect_clip_is_projection<robust>(g, half_norm);
    expect_clip_is_projection<max_scale>(g, half_norm);
  }
}

TYPED_TEST(ClipTyped, RobustClipsExtremeFiniteGradientsCorrectly) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max();
  const T tiny = std::numeric_limits<T>::denorm_min();
  expect_clip_is_projection<robust>(std::vector<T>{max, max}, 1.0);
  expect_clip_is_projection<robust>(std::vector<T>{max, -max, T(1), tiny}, 1.0);
  expect_clip_is_projection<robust>(std::vector<T>(3000, max), 2.0);
  expect_clip_is_projection<max_scale>(std::vector<T>{max, max}, 1.0);
  // Subnormal gradients clipped to half their norm.
  expect_clip_is_projection<robust>(std::vector<T>{tiny, tiny, tiny}, static_cast<double>(tiny));
}

TYPED_TEST(ClipTyped, BelowThresholdGradientsAreLeftBitForBitUntouched) {
  using T = TypeParam;
  std::vector<T> g{T(0.25f), T(-0.5f), T(0.0f), T(-0.0f)};
  const auto original = g;
  for (double max_norm : {1.0, std::sqrt(0.3125), std::numeric_limits<double>::infinity()}) {
    const auto result = gradclip::clip_by_norm(g, max_norm);
    EXPECT_FALSE(result.clipped);
    EXPECT_EQ(result.coefficient, 1.0);
    EXPECT_TRUE(same_bits(g, original));
  }
}

TYPED_TEST(ClipTyped, EmptyAndZeroGradientsAreLeftAlone) {
  using T = TypeParam;
  std::vector<T> empty, zeros(100, T(0));
  for (auto* g : {&empty, &zeros}) {
    const auto before = *g;
    const auto result = gradclip::clip_by_norm(*g, 0.0);
    EXPECT_EQ(result.norm, 0.0);
    EXPECT_FALSE(result.clipped);
    EXPECT_TRUE(same_bits(*g, before));
  }
}

TYPED_TEST(ClipTyped, MaxNormZeroZeroesANonzeroGradient) {
  using T = TypeParam;
  std::vector<T> g{T(1), T(-2), T(3)};
  const auto result = gradclip::clip_by_norm(g, 0.0);
  EXPECT_TRUE(result.clipped);
  EXPECT_EQ(result.coefficient, 0.0);
  for (const T& x : g) EXPECT_EQ(static_cast<double>(x), 0.0);
}

TYPED_TEST(ClipTyped, NonFiniteSkipLeavesEverythingUntouched) {
  using T = TypeParam;
  for (T bad : {std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()}) {
    std::vector<T> g(3000, T(5));
    g[2100] = bad;
    const auto original = g;
    const auto result = gradclip::clip_by_norm(g, 1.0);
    EXPECT_FALSE(result.finite);
    EXPECT_FALSE(result.clipped);
    EXPECT_EQ(result.coefficient, 1.0);
    EXPECT_TRUE(same_bits(g, original));
  }
}

TYPED_TEST(ClipTyped, NonFiniteErrorThrowsAndModifiesNothing) {
  using T = TypeParam;
  std::vector<T> g(10, T(5));
  g[7] = std::numeric_limits<T>::quiet_NaN();
  const auto original = g;
  try {
    (void)gradclip::clip_by_norm(g, 1.0, {on_nonfinite::error});
    FAIL() << "expected gradclip::nonfinite_error";
  } catch (const gradclip::nonfinite_error& e) {
    EXPECT_TRUE(std::isnan(e.norm));
    EXPECT_NE(std::string(e.what()).find("gradclip::clip_by_norm"), std::string::npos);
  }
  EXPECT_TRUE(same_bits(g, original));
}

TYPED_TEST(ClipTyped, NonFinitePropagateBehavesLikePyTorch) {
  using T = TypeParam;
  std::vector<T> g{T(1), std::numeric_limits<T>::infinity(), T(-2)};
  auto result = gradclip::clip_by_norm(g, 1.0, {on_nonfinite::propagate, 1e-6});
  EXPECT_FALSE(result.finite);
  EXPECT_EQ(result.coefficient, 0.0);  // 1 / (inf + 1e-6)
  EXPECT_EQ(static_cast<double>(g[0]), 0.0);
  EXPECT_TRUE(std::isnan(static_cast<double>(g[1])));  // inf * 0
  std::vector<T> h{T(1), std::numeric_limits<T>::quiet_NaN()};
  result = gradclip::clip_by_norm(h, 1.0, {on_nonfinite::propagate});
  EXPECT_TRUE(std::isnan(result.coefficient));
  EXPECT_TRUE(std::isnan(static_cast<double>(h[0])));
  // max_norm = inf never clips a finite gradient, but with an infinite norm inf / inf is NaN, as in
  // PyTorch: the whole gradient becomes NaN.
  std::vector<T> k{T(1), std::numeric_limits<T>::infinity()};
  result = gradclip::clip_by_norm(k, std::numeric_limits<double>::infinity(), {on_nonfinite::propagate});
  EXPECT_TRUE(std::isnan(result.coefficient));
  EXPECT_TRUE(result.clipped);
  EXPECT_TRUE(std::isnan(static_cast<double>(k[0])));
  std::vector<T> finite{T(3), T(4)};
  result = gradclip::clip_by_norm(finite, std::numeric_limits<double>::infinity(), {on_nonfinite::propagate});
  EXPECT_FALSE(result.clipped);
  EXPECT_EQ(static_cast<double>(finite[0]), 3.0);
}

template <class T>
using bits_for =
    std::conditional_t<sizeof(T) == 2, std::uint16_t, std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;

/// limit (>= 0) rounded to nearest T, ties to even, +inf from half an ulp past the largest T (IEEE): by
/// bisection over T's bit patterns and distances in binary128, independently of clip.hpp.
template <class T>
T reference_nearest(double limit) {
  using B = bits_for<T>;
  const auto value = [](B b) { return static_cast<double>(Eigen::numext::bit_cast<T>(b)); };
  B low = 0, high = Eigen::numext::bit_cast<B>(std::numeric_limits<T>::infinity());
  if (limit >= value(high)) return std::numeric_limits<T>::infinity();
  while (high - low > 1) {
    const B middle = static_cast<B>(low + (high - low) / 2);
    (value(middle) <= limit ? low : high) = middle;
  }
  const quad below = to_quad(value(low));
  const quad above =
      std::isinf(value(high)) ? 2 * below - to_quad(value(static_cast<B>(low - 1))) : to_quad(value(high));
  const quad to_low = to_quad(limit) - below, to_high = above - to_quad(limit);
  const bool up = to_high < to_low || (to_high == to_low && (low & 1) != 0);
  return Eigen::numext::bit_cast<T>(up ? high : low);
}

TYPED_TEST(ClipTyped, ClipByValueClampsToTheLimitRoundedToNearest) {
  using T = TypeParam;
  std::vector<T> g{T(0.05f),
                   T(-3),
                   T(3),
                   std::numeric_limits<T>::infinity(),
                   -std::numeric_limits<T>::infinity(),
                   std::numeric_limits<T>::quiet_NaN()};
  gradclip::clip_by_value(g, 0.1);
  EXPECT_EQ(static_cast<double>(g[0]), static_cast<double>(T(0.05f)));
  for (std::size_t i = 1; i < 5; ++i)
    EXPECT_EQ(std::abs(static_cast<double>(g[i])), static_cast<double>(reference_nearest<T>(0.1)));
  EXPECT_LT(static_cast<double>(g[1]), 0.0);
  EXPECT_TRUE(std::isnan(static_cast<double>(g[5])));
  std::vector<T> h{T(-7), T(7)};
  const auto before = h;
  gradclip::clip_by_value(h, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(same_bits(h, before));
  gradclip::clip_by_value(h, 1e300);  // beyond T's range: every finite value already fits
  EXPECT_TRUE(same_bits(h, before));
}

// The bound is the limit rounded to nearest in T, as PyTorch, TensorFlow and Optax round it: ties to even,
// limits that a conversion through float would round twice, limits at and past the largest T (+inf from
// half an ulp past it, so infinities then stay), subnormal and zero limits. Elements at, beside and past
// the bound are clamped to it exactly.
TYPED_TEST(ClipTyped, ClipByValueBoundIsTheLimitRoundedToNearest) {
  using T = TypeParam;
  const int digits = std::numeric_limits<T>::digits;
  const double largest = static_cast<double>(std::numeric_limits<T>::max());
  const double half_ulp_past = largest + std::ldexp(1.0, std::numeric_limits<T>::max_exponent - digits - 1);
  const double tie = 1 + std::ldexp(1.0, -digits);  // halfway between 1 and the next T
  const std::vector<double> limits{4.4,
                                   0.1,
                                   1.0 / 3,
                                   1e-3,
                                   tie,
                                   1 + 3 * std::ldexp(1.0, -digits),
                                   tie + std::ldexp(1.0, -40),  // float rounds it to the tie
                                   tie - std::ldexp(1.0, -40),
                                   largest,
                                   std::nextafter(half_ulp_past, 0.0),
                                   half_ulp_past,
                                   1e300,
                                   static_cast<double>(std::numeric_limits<T>::denorm_min()) * 0.5,
                                   static_cast<double>(std::numeric_limits<T>::denorm_min()) * 0.75,
                                   1e-320,
                                   0.0};
  for (const double limit : limits) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    const T bound = reference_nearest<T>(limit);
    const double b = static_cast<double>(bound);
    std::vector<T> g;
    for (const double x : {b, 2 * b, 0.5 * b, limit, 4.4, 3.0, 1e-3, largest, 0.0})
      for (const double sign : {1.0, -1.0}) g.push_back(T(static_cast<float>(sign * x)));
    g.push_back(std::numeric_limits<T>::infinity());
    g.push_back(-std::numeric_limits<T>::infinity());
    g.push_back(std::numeric_limits<T>::quiet_NaN());
    const auto original = g;
    gradclip::clip_by_value(g, limit);
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double x = static_cast<double>(original[i]);
      const T expected = x > b ? bound : (x < -b ? T(-bound) : original[i]);
      if (std::isnan(x))
        EXPECT_TRUE(std::isnan(static_cast<double>(g[i])));
      else
        EXPECT_EQ(Eigen::numext::bit_cast<bits_for<T>>(g[i]), Eigen::numext::bit_cast<bits_for<T>>(expected))
            << "element " << x << " became " << static_cast<double>(g[i]) << ", expected " << b;
    }
  }
  // Ties to even; the double-rounding trap rounds up; past the largest T by half an ulp, +inf.
  if constexpr (!std::is_same_v<T, double>) {  // FP64's tie is no double
    EXPECT_EQ(static_cast<double>(reference_nearest<T>(tie)), 1.0);
    EXPECT_GT(static_cast<double>(reference_nearest<T>(tie + std::ldexp(1.0, -40))), 1.0);
  }
  EXPECT_EQ(static_cast<double>(reference_nearest<T>(std::nextafter(half_ulp_past, 0.0))), largest);
  EXPECT_TRUE(std::isinf(static_cast<double>(reference_nearest<T>(half_ulp_past))));
}

// The case: FP32 clip_by_value(x, 4.4) clamps to 4.4000001f (PyTorch, TensorFlow, Optax), not 4.3999996f.
TEST(Clip, ClipByValueFloat44ClampsTo44000001) {
  std::vector<float> g{5.0f, -5.0f, 4.0f};
  gradclip::clip_by_value(g, 4.4);
  EXPECT_EQ(g[0], 4.4000001f);
  EXPECT_EQ(g[1], -4.4000001f);
  EXPECT_EQ(g[2], 4.0f);
  EXPECT_GT(static_cast<double>(g[0]), 4.4);
  EXPECT_NE(g[0], 4.3999996f);
}

// A total norm reduced elsewhere, as a double: c = max_norm / (total + epsilon), rounded once, applied as the
// native clip applies it; each element within one ulp of the exact g * max_norm / total (binary128).
TYPED_TEST(ClipTyped, ClipByGlobalNormTakesATotalNormReducedElsewhere) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 27);
  std::vector<std::vector<T>> grads{random_gradient<T>(300, rng), random_gradient<T>(41, rng)};
  const auto original = grads;
  std::vector<T> all = grads[0];
  all.insert(all.end(), grads[1].begin(), grads[1].end());
  const quad exact = exact_norm(all);
  const double total = static_cast<double>(exact);
  const double max_norm = total / 3;
  const auto result = gradclip::clip_by_global_norm(grads, total, max_norm);
  EXPECT_EQ(result.norm, total);
  EXPECT_TRUE(result.clipped);
  EXPECT_TRUE(result.finite);
  EXPECT_EQ(result.coefficient, static_cast<double>(to_quad(max_norm) / to_quad(total)));
  for (std::size_t t = 0; t < grads.size(); ++t)
    for (std::size_t i = 0; i < grads[t].size(); ++i)
      ASSERT_LE(ulps(grads[t][i], to_quad(original[t][i]) * to_quad(max_norm) / to_quad(total)), 1.0) << t << ", " << i;
  // A total at or below max_norm leaves every bit; epsilon enters as in the other overloads.
  auto untouched = original;
  EXPECT_FALSE(gradclip::clip_by_global_norm(untouched, total, total * 2).clipped);
  EXPECT_TRUE(same_bits(untouched[0], original[0]));
  auto with_epsilon = original;
  const auto e = gradclip::clip_by_global_norm(with_epsilon, 4.0, 1.0, {on_nonfinite::propagate, 1.0});
  EXPECT_EQ(e.coefficient, 0.2);
}

TYPED_TEST(ClipTyped, ClipByGlobalNormTotalNormNonFiniteAndBad) {
  using T = TypeParam;
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<T>> grads{{T(3), T(-4)}, {T(1)}};
  const auto original = grads;
  const auto skipped = gradclip::clip_by_global_norm(grads, nan, 1.0);
  EXPECT_FALSE(skipped.finite);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_TRUE(same_bits(grads[0], original[0]));
  EXPECT_THROW((void)gradclip::clip_by_global_norm(grads, inf, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(grads[0], original[0]));
  for (const double bad : {-1.0, -inf}) {
    try {
      (void)gradclip::clip_by_global_norm(grads, bad, 1.0);
      ADD_FAILURE() << "expected std::invalid_argument";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_by_global_norm: total_norm", 0), 0u) << e.what();
    }
  }
  EXPECT_THROW((void)gradclip::clip_by_global_norm(grads, 5.0, -1.0), std::invalid_argument);
  EXPECT_TRUE(same_bits(grads[0], original[0]));
  const auto propagated = gradclip::clip_by_global_norm(grads, inf, 1.0, {on_nonfinite::propagate});
  EXPECT_EQ(propagated.coefficient, 0.0);
  EXPECT_EQ(static_cast<double>(grads[0][1]), 0.0);
}

TYPED_TEST(ClipTyped, ClippedGradientKeepsDirectionAndHasNormMaxNorm) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 11);
  const double eps = epsilon_of<T>();
  for (int trial = 0; trial < 20; ++trial) {
    auto g = random_gradient<T>(1 + rng() % 5000, rng, std::ldexp(1.0, static_cast<int>(rng() % 20) - 5));
    const auto original = g;
    const double max_norm = 0.1 + static_cast<double>(rng() % 100) / 10;
    const auto result = gradclip::clip_by_norm(g, max_norm);
    if (!result.clipped) continue;
    EXPECT_NEAR(gradclip::norm(g) / max_norm, 1.0, 2 * eps);
    // Direction: each element is the original times the one reported coefficient, rounded once.
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double expected = static_cast<double>(original[i]) * result.coefficient;
      EXPECT_LE(std::abs(static_cast<double>(g[i]) - expected),
                std::abs(expected) * eps + static_cast<double>(std::numeric_limits<T>::denorm_min()));
    }
    // Idempotence: clipping again moves each element by at most two roundings (the coefficient 1 - O(eps)).
    const auto once = g;
    const auto again = gradclip::clip_by_norm(g, max_norm);
    if (!again.clipped) continue;
    for (std::size_t i = 0; i < g.size(); ++i)
      EXPECT_LE(std::abs(static_cast<double>(g[i]) - static_cast<double>(once[i])),
                2 * std::abs(static_cast<double>(once[i])) * eps);
  }
}

TEST(Clip, SeedRegressionHalf300) {
  std::vector<Eigen::half> g{Eigen::half(300.0f)};
  const auto result = gradclip::clip_by_norm(g, 1.0);
  EXPECT_EQ(result.norm, 300.0);
  EXPECT_EQ(static_cast<float>(g[0]), 1.0f);
  std::vector<Eigen::half> promoted{Eigen::half(300.0f)};
  EXPECT_EQ(gradclip::clip_by_norm<promote>(promoted, 1.0).norm, 300.0);
  EXPECT_EQ(static_cast<float>(promoted[0]), 1.0f);
  std::vector<Eigen::half> scaled{Eigen::half(300.0f)};
  EXPECT_EQ(gradclip::clip_by_norm<max_scale>(scaled, 1.0).norm, 300.0);
  EXPECT_EQ(static_cast<float>(scaled[0]), 1.0f);
}

TEST(Clip, NaivePropagateReproducesTheBurnBug) {
  std::vector<Eigen::half> g{Eigen::half(300.0f)};
  const auto result = gradclip::clip_by_norm<naive>(g, 1.0, {on_nonfinite::propagate});
  EXPECT_EQ(result.norm, INFINITY);
  EXPECT_EQ(static_cast<float>(g[0]), 0.0f) << "the finite gradient [300] is zeroed";
  std::vector<Eigen::half> skipped{Eigen::half(300.0f)};
  const auto skip = gradclip::clip_by_norm<naive>(skipped, 1.0);
  EXPECT_FALSE(skip.finite);
  EXPECT_EQ(static_cast<float>(skipped[0]), 300.0f) << "with skip the naive overflow is reported, not applied";
}

TEST(Clip, SeedRegression1024TensInHalf) {
  std::vector<Eigen::half> g(1024, Eigen::half(10.0f));
  const auto result = gradclip::clip_by_norm(g, 10.0);
  EXPECT_EQ(result.norm, 320.0);
  for (const auto& x : g) ASSERT_EQ(static_cast<float>(x), 0.3125f);
  std::vector<Eigen::half> h(1024, Eigen::half(10.0f));
  (void)gradclip::clip_by_norm(h, 1.0);
  for (const auto& x : h) ASSERT_EQ(static_cast<float>(x), 0.03125f);
}

TEST(Clip, SeedRegressionHalf60000) {
  std::vector<Eigen::half> g(2, Eigen::half(60000.0f));
  const auto original = g;
  const auto result = gradclip::clip_by_norm(g, 1.0);
  EXPECT_LE(relative_error(result.norm, exact_norm(original)), robust_norm_bound<Eigen::half>());
  expect_exact_projection(original, g, 1.0);
}

TEST(Clip, ExtremeFloat32AndFloat64Gradients) {
  std::vector<float> f32{1e20f, 1e20f};
  const auto original32 = f32;
  auto result = gradclip::clip_by_norm(f32, 1.0);
  EXPECT_LE(relative_error(result.norm, exact_norm(original32)), 1e-15);
  expect_exact_projection(original32, f32, 1.0);

  std::vector<float> promoted{1e20f, 1e20f};
  const auto promote_result = gradclip::clip_by_norm<promote>(promoted, 1.0, {on_nonfinite::propagate});
  EXPECT_EQ(promote_result.norm, INFINITY) << "promote overflows like PyTorch";
  EXPECT_EQ(promoted[0], 0.0f);

  for (double v : {1e300, 1.5e308}) {
    std::vector<double> f64{v, v};
    const auto original64 = f64;
    result = gradclip::clip_by_norm(f64, 1.0);
    EXPECT_TRUE(result.finite);
    EXPECT_TRUE(result.clipped);
    if (v > 1e308) {
      EXPECT_EQ(result.norm, INFINITY) << "the norm exceeds double's range";
    }
    expect_exact_projection(original64, f64, 1.0);
  }
}

TEST(Clip, EpsilonReproducesPyTorchsCoefficient) {
  std::vector<double> g{3.0, 4.0};
  const auto result = gradclip::clip_by_norm(g, 1.0, {on_nonfinite::skip, 1e-6});
  EXPECT_EQ(result.coefficient, 1.0 / (5.0 + 1e-6));
  EXPECT_EQ(g[0], 3.0 * (1.0 / (5.0 + 1e-6)));
}

// PyTorch's rule: clip when max_norm / (norm + epsilon) < 1, also when max_norm - epsilon < norm <= max_norm.
TEST(Clip, EpsilonClipsJustBelowTheThresholdAsPyTorchDoes) {
  const float shrink = 1.0f - 2e-7f;
  std::vector<float> g{0.6f * shrink, 0.8f * shrink};
  const quad norm = exact_norm(g);
  ASSERT_LT(norm, quad(1));
  ASSERT_GT(norm + quad(1e-6), quad(1));  // so PyTorch's coefficient is below 1
  const auto original = g;
  const auto result = gradclip::clip_by_norm(g, 1.0, {on_nonfinite::skip, 1e-6});
  EXPECT_TRUE(result.clipped);
  const quad c = quad(1) / (norm + quad(1e-6));
  EXPECT_LE(relative_error(result.coefficient, c), 1e-15);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_LE(ulps(g[i], to_quad(original[i]) * c), 1.0);
  // Without epsilon the same gradient is below the threshold and left alone.
  auto same = original;
  EXPECT_FALSE(gradclip::clip_by_norm(same, 1.0).clipped);
  EXPECT_TRUE(same_bits(same, original));
}

TEST(Clip, BadArgumentsThrowInvalidArgumentNamingTheFunction) {
  std::vector<float> g{1.0f, 2.0f};
  const auto original = g;
  auto expect_invalid = [&](auto&& call, const char* name) {
    try {
      call();
      FAIL() << "expected std::invalid_argument";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(name, 0), 0u) << e.what();
    }
    EXPECT_EQ(g, original);
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { (void)gradclip::clip_by_norm(g, -1.0); }, "gradclip::clip_by_norm");
  expect_invalid([&] { (void)gradclip::clip_by_norm(g, nan); }, "gradclip::clip_by_norm");
  expect_invalid([&] { (void)gradclip::clip_by_norm(g, 1.0, {on_nonfinite::skip, -1.0}); }, "gradclip::clip_by_norm");
  expect_invalid([&] { (void)gradclip::clip_by_norm(g, 1.0, {on_nonfinite::skip, nan}); }, "gradclip::clip_by_norm");
  expect_invalid(
      [&] {
        (void)gradclip::clip_by_norm(g, 1.0, {static_cast<on_nonfinite>(7), 0.0});
      },
      "gradclip::clip_by_norm");
  expect_invalid([&] { gradclip::clip_by_value(g, -0.5); }, "gradclip::clip_by_value");
  expect_invalid([&] { gradclip::clip_by_value(g, nan); }, "gradclip::clip_by_value");
}

TEST(Clip, RawPointerOverload) {
  float g[] = {3.0f, 4.0f, 0.0f};
  const auto result = gradclip::clip_by_norm(g, 3, 1.0);
  EXPECT_EQ(result.norm, 5.0);
  EXPECT_FLOAT_EQ(g[0], 0.6f);
  EXPECT_FLOAT_EQ(g[1], 0.8f);
}

}  // namespace
