// Norms of single gradients under every policy, against a binary128 reference.
#include <gradclip/norm.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::max_scale;
using gradclip::naive;
using gradclip::promote;
using gradclip::robust;

template <class T>
class NormTyped : public ::testing::Test {};
TYPED_TEST_SUITE(NormTyped, element_types);

// The documented relative error bound of each policy for n elements of T (policies.hpp, docs/numerics.md).
template <class Policy, class T>
double bound(std::size_t n) {
  if constexpr (std::is_same_v<Policy, robust>) return robust_norm_bound<T>();
  if constexpr (std::is_same_v<Policy, naive>) return static_cast<double>(n) * epsilon_of<T>();
  return chain_norm_bound<T>();
}

template <class Policy, class T>
void expect_norm_within_bound(const std::vector<T>& g) {
  const quad exact = exact_norm(g);
  const double got = gradclip::norm<Policy>(g.data(), g.size());
  EXPECT_LE(relative_error(got, exact), (bound<Policy, T>(g.size())))
      << "n = " << g.size() << ", got " << got << ", exact " << static_cast<double>(exact);
}

TYPED_TEST(NormTyped, RandomGradientsWithinTheDocumentedBoundOfEveryPolicy) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t n : {1u, 7u, 31u, 32u, 33u, 1000u, 1023u, 1024u, 1025u, 4099u, 100000u}) {
    const auto g = random_gradient<T>(n, rng, 0.01);
    expect_norm_within_bound<robust>(g);
    expect_norm_within_bound<max_scale>(g);
    expect_norm_within_bound<promote>(g);
  }
  // naive squares in T: only meaningful while n * max^2 stays far inside T's range.
  const auto small = random_gradient<T>(100, rng, 0.01);
  expect_norm_within_bound<naive>(small);
}

TYPED_TEST(NormTyped, EmptyAndZeroGradientsHaveNormZero) {
  using T = TypeParam;
  const std::vector<T> empty, zeros(1000, T(0));
  for (const auto* g : {&empty, &zeros}) {
    EXPECT_EQ(gradclip::norm<robust>(*g), 0.0);
    EXPECT_EQ(gradclip::norm<max_scale>(*g), 0.0);
    EXPECT_EQ(gradclip::norm<promote>(*g), 0.0);
    EXPECT_EQ(gradclip::norm<naive>(*g), 0.0);
  }
}

TYPED_TEST(NormTyped, RobustAndMaxScaleHandleTheWholeFiniteRange) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max();
  const T min_subnormal = std::numeric_limits<T>::denorm_min();
  const T min_normal = std::numeric_limits<T>::min();
  const std::vector<std::vector<T>> cases{
      {max, max},
      {max, -max, max, T(1)},
      {min_subnormal},
      {min_subnormal, min_subnormal, min_subnormal},
      {min_normal, min_subnormal, T(0)},
      {max, min_subnormal},
      std::vector<T>(5000, max),
      std::vector<T>(3000, min_subnormal),
  };
  for (const auto& g : cases) {
    const quad exact = exact_norm(g);
    EXPECT_LE(relative_error(gradclip::norm<robust>(g), exact), (bound<robust, T>(g.size())))
        << type_name<T>() << " n=" << g.size();
    EXPECT_LE(relative_error(gradclip::norm<max_scale>(g), exact), (bound<max_scale, T>(g.size())))
        << type_name<T>() << " n=" << g.size();
  }
}

TYPED_TEST(NormTyped, MixedMagnitudesAcrossBlocksMergeExactly) {
  using T = TypeParam;
  // Blocks whose scales differ by hundreds of binades: one block near the maximum, one tiny, one normal.
  std::vector<T> g(3 * 1024, T(0));
  for (std::size_t i = 0; i < 1024; ++i) {
    g[i] = static_cast<T>(std::ldexp((1 + i % 7) / 8.0, std::numeric_limits<T>::max_exponent - 2));
    g[1024 + i] = static_cast<T>(std::ldexp(1.0 + i % 5, std::numeric_limits<T>::min_exponent));
    g[2048 + i] = static_cast<T>(0.5 + i % 3);
  }
  const quad exact = exact_norm(g);
  EXPECT_LE(relative_error(gradclip::norm<robust>(g), exact), (bound<robust, T>(g.size())));
  EXPECT_LE(relative_error(gradclip::norm<max_scale>(g), exact), (bound<max_scale, T>(g.size())));
}

TYPED_TEST(NormTyped, NonFiniteElementsGiveNaNOrInf) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<T> g(2000, T(1));
  g[1500] = inf;
  EXPECT_EQ(gradclip::norm<robust>(g), INFINITY);
  EXPECT_EQ(gradclip::norm<max_scale>(g), INFINITY);
  EXPECT_EQ(gradclip::norm<promote>(g), INFINITY);
  g[1500] = -inf;
  EXPECT_EQ(gradclip::norm<robust>(g), INFINITY);
  g[3] = nan;
  EXPECT_TRUE(std::isnan(gradclip::norm<robust>(g)));
  EXPECT_TRUE(std::isnan(gradclip::norm<max_scale>(g)));
  EXPECT_TRUE(std::isnan(gradclip::norm<promote>(g)));
  EXPECT_TRUE(std::isnan(gradclip::norm<naive>(g)));
}

TYPED_TEST(NormTyped, PowerOfTwoScalingScalesTheNormExactly) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 1);
  // Magnitudes in [1, 2), so every scaled element stays normal and the scaling is exact.
  std::uniform_real_distribution<double> magnitude(1.0, 2.0);
  std::vector<T> g(3001);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<T>((i % 2 ? -1 : 1) * magnitude(rng));
  const double base = gradclip::norm<robust>(g);
  for (int k : {-8, -3, 1, 5, 9}) {
    std::vector<T> scaled(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) scaled[i] = static_cast<T>(std::ldexp(static_cast<double>(g[i]), k));
    EXPECT_EQ(gradclip::norm<robust>(scaled), std::ldexp(base, k)) << "k = " << k;
  }
}

TEST(Norm, SeedRegressionsInHalfPrecision) {
  const std::vector<Eigen::half> single{Eigen::half(300.0f)};
  EXPECT_EQ(gradclip::norm<robust>(single), 300.0);
  EXPECT_EQ(gradclip::norm<promote>(single), 300.0);
  EXPECT_EQ(gradclip::norm<max_scale>(single), 300.0);
  EXPECT_EQ(gradclip::norm<naive>(single), INFINITY) << "300^2 = 90000 overflows FP16";

  const std::vector<Eigen::half> tens(1024, Eigen::half(10.0f));
  EXPECT_EQ(gradclip::norm<robust>(tens), 320.0);
  EXPECT_EQ(gradclip::norm<naive>(tens), INFINITY) << "1024 * 100 overflows FP16";

  const std::vector<Eigen::half> big(2, Eigen::half(60000.0f));
  const quad exact = exact_norm(big);
  EXPECT_NEAR(static_cast<double>(exact), 84852.8, 0.1);
  EXPECT_LE(relative_error(gradclip::norm<robust>(big), exact), 1e-15);
  EXPECT_LE(relative_error(gradclip::norm<promote>(big), exact), 1e-7);
}

TEST(Norm, ExtremesThatOverflowPromoteButNotRobust) {
  const std::vector<float> f32{1e20f, 1e20f};
  EXPECT_EQ(gradclip::norm<promote>(f32), INFINITY);
  EXPECT_LE(relative_error(gradclip::norm<robust>(f32), exact_norm(f32)), 1e-15);
  EXPECT_LE(relative_error(gradclip::norm<max_scale>(f32), exact_norm(f32)), 1e-7);

  const std::vector<double> f64{1e300, 1e300};
  EXPECT_EQ(gradclip::norm<promote>(f64), INFINITY);
  EXPECT_LE(relative_error(gradclip::norm<robust>(f64), exact_norm(f64)), 1e-15);

  const std::vector<double> beyond{1.5e308, 1.5e308};  // norm 2.1e308 > DBL_MAX
  EXPECT_EQ(gradclip::norm<robust>(beyond), INFINITY);
  EXPECT_EQ(gradclip::norm<max_scale>(beyond), INFINITY);

  const Eigen::bfloat16 bf_max = std::numeric_limits<Eigen::bfloat16>::max();
  const std::vector<Eigen::bfloat16> bf16{bf_max, bf_max};
  EXPECT_EQ(gradclip::norm<promote>(bf16), INFINITY);
  EXPECT_LE(relative_error(gradclip::norm<robust>(bf16), exact_norm(bf16)), 1e-15);
}

TEST(Norm, TinyValuesWhoseSquaresUnderflow) {
  const std::vector<float> f32(10, 1e-30f);  // squares 1e-60 underflow FP32
  EXPECT_EQ(gradclip::norm<promote>(f32), 0.0);
  EXPECT_LE(relative_error(gradclip::norm<robust>(f32), exact_norm(f32)), robust_norm_bound<float>());
  EXPECT_LE(relative_error(gradclip::norm<max_scale>(f32), exact_norm(f32)), chain_norm_bound<float>());

  const std::vector<double> f64(10, 1e-200);
  EXPECT_EQ(gradclip::norm<promote>(f64), 0.0);
  EXPECT_LE(relative_error(gradclip::norm<robust>(f64), exact_norm(f64)), robust_norm_bound<double>());

  const std::vector<Eigen::half> subnormal_half(4, std::numeric_limits<Eigen::half>::denorm_min());
  EXPECT_LE(relative_error(gradclip::norm<robust>(subnormal_half), exact_norm(subnormal_half)), 1e-15);
  EXPECT_LE(relative_error(gradclip::norm<promote>(subnormal_half), exact_norm(subnormal_half)), 1e-7);
  EXPECT_EQ(gradclip::norm<naive>(subnormal_half), 0.0) << "6e-8 squared flushes to zero in FP16";
}

TEST(Norm, AgreesWithEigenStableNorm) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 2);
  for (double scale : {1e-300, 1e-20, 1.0, 1e20, 1e300}) {
    const auto v = random_gradient<double>(5000, rng, scale);
    const Eigen::Map<const Eigen::VectorXd> map(v.data(), static_cast<Eigen::Index>(v.size()));
    EXPECT_NEAR(gradclip::norm(map) / map.stableNorm(), 1.0, 1e-13) << "scale " << scale;
  }
}

TEST(Norm, RawPointerOverloadMatchesTheContainer) {
  const std::vector<float> g{3.0f, 4.0f};
  EXPECT_EQ(gradclip::norm(g.data(), g.size()), 5.0);
  EXPECT_EQ(gradclip::norm(g), 5.0);
}

}  // namespace
