// clip_by_norm and clip_by_value: semantics, non-finite handling, bad input, accuracy and properties.
#include <gradclip/clip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
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

TYPED_TEST(ClipTyped, ClipByValueClampsToTheLimitRoundedDown) {
  using T = TypeParam;
  std::vector<T> g{T(0.05f),
                   T(-3),
                   T(3),
                   std::numeric_limits<T>::infinity(),
                   -std::numeric_limits<T>::infinity(),
                   std::numeric_limits<T>::quiet_NaN()};
  gradclip::clip_by_value(g, 0.1);
  EXPECT_EQ(static_cast<double>(g[0]), static_cast<double>(T(0.05f)));
  for (std::size_t i = 1; i < 5; ++i) {
    EXPECT_LE(std::abs(static_cast<double>(g[i])), 0.1);
    EXPECT_GT(std::abs(static_cast<double>(g[i])), 0.1 * (1 - 2 * epsilon_of<T>()));
  }
  EXPECT_LT(static_cast<double>(g[1]), 0.0);
  EXPECT_TRUE(std::isnan(static_cast<double>(g[5])));
  std::vector<T> h{T(-7), T(7)};
  const auto before = h;
  gradclip::clip_by_value(h, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(same_bits(h, before));
  gradclip::clip_by_value(h, 1e300);  // beyond T's range: every finite value already fits
  EXPECT_TRUE(same_bits(h, before));
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
  const auto result = gradclip::clip_by_norm(g, 1.0);
  EXPECT_TRUE(std::isfinite(result.norm));
  EXPECT_NEAR(result.norm, 84852.8, 0.1);
  for (const auto& x : g) EXPECT_NEAR(static_cast<float>(x), 0.7071f, 5e-4f);
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
