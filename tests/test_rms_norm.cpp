// The RMS norm ||g||_2 / sqrt(n) (gradclip::rms_norm), a norm kind whose root needs the element count:
// norms and clips against a binary128 reference sqrt(sum x^2 / n), every thread count, values near the
// types' maxima, NaN and Inf, loss scaling, and the front-ends that take options::norm.
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::on_nonfinite;

gradclip::options rms(on_nonfinite nonfinite = on_nonfinite::skip, unsigned threads = 1) {
  return {nonfinite, 0.0, gradclip::rms_norm, threads};
}

/// sqrt(sum x^2 / n) over the concatenation, in binary128; 0 for no elements.
template <class T>
quad exact_rms(const std::vector<std::vector<T>>& grads) {
  quad sum = 0;
  std::uint64_t n = 0;
  for (const auto& g : grads)
    for (const T& x : g) sum += to_quad(x) * to_quad(x), ++n;
  return n == 0 ? quad(0) : quad_sqrt(sum / quad(n));
}

// The row: parts of the RMS norm merge as L2's, and the root divides by the merged count at any scale.
TEST(RmsNorm, PartsMergeAsL2AndTheRootDividesByTheCount) {
  using gradclip::partial_norm;
  const double key = gradclip::rms_norm.p();
  partial_norm part{0, 8.0, true, key, 0.0, 2};
  EXPECT_EQ(part.norm(), 2.0);
  part.merge({0, 10.0, true, key, 0.0, 7});  // 18 / 9
  EXPECT_EQ(part.norm(), std::sqrt(2.0));
  EXPECT_EQ(part.elements, 9u);
  const partial_norm big{700, 12.0, true, key, 0.0, 3};  // 12 * 4^700 / 3
  EXPECT_EQ(gradclip::detail::norm_scaled(big).mantissa, 1.0);
  EXPECT_EQ(gradclip::detail::norm_scaled(big).exponent, 701);
  EXPECT_EQ(gradclip::detail::norm_scaled(big.normalized()).exponent, 701);
  partial_norm l2{0, 8.0, true, 2.0, 0.0, 2};
  l2.merge(part);  // a different kind: NaN
  EXPECT_TRUE(std::isnan(l2.norm()));
  EXPECT_EQ((partial_norm{0, 1.0, true, key}.norm()), std::numeric_limits<double>::infinity());  // no count
  EXPECT_FALSE(gradclip::detail::norm_kind{key}.p_norm());
  EXPECT_TRUE(gradclip::detail::norm_kind{key}.accepted());
}

template <class T>
class RmsTyped : public ::testing::Test {};
TYPED_TEST_SUITE(RmsTyped, element_types);

// The division by n and the root round once more than the L2 norm's root alone, but in double-double
// (partial_norm keeps the quotient's tail): the RMS norm has the L2 norm's bound.
TYPED_TEST(RmsTyped, NormsOfTensorsAndGroupsWithinTheL2Bound) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 40);
  for (std::size_t n : {1u, 3u, 7u, 1000u, 1023u, 4099u, 100000u}) {
    const auto g = random_gradient<T>(n, rng, 0.01);
    const double got = gradclip::norm(g, rms());
    EXPECT_LE(relative_error(got, exact_rms(std::vector<std::vector<T>>{g})), robust_norm_bound<T>()) << n;
    EXPECT_EQ(gradclip::norm(g.data(), g.size(), rms()), got);
  }
  const std::vector<std::vector<T>> group{
      random_gradient<T>(1500, rng, 0.01), random_gradient<T>(3, rng, 100.0), {}, random_gradient<T>(700, rng, 1e-3)};
  EXPECT_LE(relative_error(gradclip::global_norm(group, rms()), exact_rms(group)), robust_norm_bound<T>());
  EXPECT_EQ(gradclip::partial_global_norm(group, rms()).elements, 2203u);
  // options::report: each gradient's own RMS norm.
  gradclip::tensor_report report;
  gradclip::options with_report = rms();
  with_report.report = &report;
  (void)gradclip::global_norm(group, with_report);
  ASSERT_EQ(report.size(), group.size());
  for (std::size_t k = 0; k < group.size(); ++k)
    EXPECT_LE(relative_error(report[k].norm, exact_rms(std::vector<std::vector<T>>{group[k]})), robust_norm_bound<T>())
        << k;
}

TYPED_TEST(RmsTyped, EveryThreadCountGivesTheSameBits) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 41);
  std::vector<std::vector<T>> group;
  for (std::size_t n : {300000u, 0u, 17u, 70000u}) group.push_back(random_gradient<T>(n, rng, 1.0));
  const double one = gradclip::global_norm(group, rms());
  auto clipped_once = group;
  const auto first = gradclip::clip_by_global_norm(clipped_once, one / 3, rms());
  for (unsigned threads : {2u, 3u}) {
    EXPECT_EQ(gradclip::global_norm(group, rms(on_nonfinite::skip, threads)), one) << threads;
    auto clipped = group;
    const auto result = gradclip::clip_by_global_norm(clipped, one / 3, rms(on_nonfinite::skip, threads));
    EXPECT_EQ(result.norm, first.norm);
    EXPECT_EQ(result.coefficient, first.coefficient);
    for (std::size_t k = 0; k < group.size(); ++k) EXPECT_TRUE(same_bits(clipped[k], clipped_once[k])) << threads;
  }
}

TYPED_TEST(RmsTyped, EmptyAndZeroGradientsHaveNormZero) {
  using T = TypeParam;
  std::vector<T> empty, zeros(2000, T(0));
  EXPECT_EQ(gradclip::norm(empty, rms()), 0.0);
  EXPECT_EQ(gradclip::norm(zeros, rms()), 0.0);
  std::vector<std::vector<T>> group{{}, {}, zeros};
  EXPECT_EQ(gradclip::global_norm(group, rms()), 0.0);
  const auto result = gradclip::clip_by_global_norm(group, 1.0, rms());
  EXPECT_FALSE(result.clipped);
  EXPECT_EQ(result.norm, 0.0);
  std::vector<std::vector<T>> nothing;
  EXPECT_EQ(gradclip::global_norm(nothing, rms()), 0.0);
}

// Clipping by the RMS norm is the projection g * max / rms: one rounding to T, plus for FP64 the norm's
// own error (as for the p-norms, test_p_norm.cpp).
TYPED_TEST(RmsTyped, ClippingIsTheExactProjection) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 42);
  const double max_ulps = std::is_same_v<T, double> ? 4.0 : 1.0;
  std::vector<std::vector<T>> group{random_gradient<T>(3000, rng, 1.0), {}, random_gradient<T>(5, rng, 10.0)};
  const auto original = group;
  const quad exact = exact_rms(original);
  const auto result = gradclip::clip_by_global_norm(group, 0.25, rms());
  EXPECT_TRUE(result.clipped && result.finite);
  EXPECT_EQ(result.norm, gradclip::global_norm(original, rms()));
  EXPECT_LE(relative_error(result.norm, exact), robust_norm_bound<T>());
  for (std::size_t k = 0; k < group.size(); ++k)
    for (std::size_t i = 0; i < group[k].size(); ++i)
      ASSERT_LE(ulps(group[k][i], to_quad(original[k][i]) * quad(0.25) / exact), max_ulps) << k << ", " << i;
  auto single = original[0];
  const auto by_norm = gradclip::clip_by_norm(single, 0.25, rms());
  EXPECT_LE(relative_error(by_norm.norm, exact_rms(std::vector<std::vector<T>>{original[0]})), robust_norm_bound<T>());
  EXPECT_TRUE(by_norm.clipped);
  auto untouched = original;
  EXPECT_FALSE(gradclip::clip_by_global_norm(untouched, 1e6, rms()).clipped);
  for (std::size_t k = 0; k < group.size(); ++k) EXPECT_TRUE(same_bits(untouched[k], original[k]));
}

// Near the types' maxima the sum of squares leaves FP64 (1e300) and FP32 (FP16's 60000): the RMS norm is
// still the value itself, where the L2 norm of the FP64 values exceeds double's range.
TYPED_TEST(RmsTyped, ValuesNearTheMaximumDoNotOverflow) {
  using T = TypeParam;
  const double big = std::is_same_v<T, double> ? 1.5e308 : std::is_same_v<T, Eigen::half> ? 60000.0 : 3e38;
  const T value = static_cast<T>(std::is_same_v<T, Eigen::bfloat16> ? 3e38 : big);
  std::vector<T> g(5000, value);
  g[7] = -value;
  const double got = gradclip::norm(g, rms());
  EXPECT_LE(relative_error(got, exact_rms(std::vector<std::vector<T>>{g})), robust_norm_bound<T>());
  const auto result = gradclip::clip_by_norm(g, 1.0, rms());
  EXPECT_TRUE(result.finite && result.clipped);
  EXPECT_EQ(static_cast<double>(g[0]), 1.0);
  EXPECT_EQ(static_cast<double>(g[7]), -1.0);
  std::vector<double> fp64(3000, 1e300);
  EXPECT_LE(relative_error(gradclip::norm(fp64, rms()), quad(1e300)), robust_norm_bound<double>());
}

TYPED_TEST(RmsTyped, NonFiniteElementsFollowTheOption) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T infinity = std::numeric_limits<T>::infinity();
  std::vector<T> with_nan(2000, T(1));
  with_nan[1500] = nan;
  std::vector<T> with_inf(2000, T(1));
  with_inf[3] = -infinity;
  EXPECT_TRUE(std::isnan(gradclip::norm(with_nan, rms())));
  EXPECT_EQ(gradclip::norm(with_inf, rms()), std::numeric_limits<double>::infinity());
  for (const auto& bad : {with_nan, with_inf}) {
    auto g = bad;
    auto result = gradclip::clip_by_norm(g, 1.0, rms());
    EXPECT_FALSE(result.finite || result.clipped);
    EXPECT_TRUE(same_bits(g, bad));
    EXPECT_THROW((void)gradclip::clip_by_norm(g, 1.0, rms(on_nonfinite::error)), gradclip::nonfinite_error);
    EXPECT_TRUE(same_bits(g, bad));
    result = gradclip::clip_by_norm(g, 1.0, rms(on_nonfinite::propagate));
    EXPECT_FALSE(result.finite);
    EXPECT_TRUE(std::isnan(static_cast<double>(g[0])) || static_cast<double>(g[0]) == 0.0);
  }
}

// The loss scaler divides the RMS norm by S as it divides the L2 norm: for S a power of two the norm of
// the unscaled gradients exactly, else within the bound.
TEST(RmsNorm, LossScalerUnscalesTheRmsNorm) {
  std::mt19937_64 rng(seed + 43);
  for (double scale : {65536.0, 3.0 * 1024}) {
    const auto g = random_gradient<float>(5000, rng, 1e-3);
    std::vector<std::vector<float>> scaled{g};
    for (float& x : scaled[0]) x = static_cast<float>(static_cast<double>(x) * scale);
    gradclip::loss_scaler_config config;
    config.init_scale = scale;
    const gradclip::loss_scaler scaler(config);
    auto grads = scaled;
    const auto result = scaler.unscale_and_clip(grads, 1e-4, rms());
    quad sum = 0;
    for (float x : scaled[0]) sum += to_quad(x) * to_quad(x);
    const quad exact = quad_sqrt(sum / quad(g.size())) / quad(scale);
    EXPECT_LE(relative_error(result.norm, exact), robust_norm_bound<float>()) << scale;
    EXPECT_TRUE(result.clipped && result.finite);
    if (scale == 65536.0) {
      std::vector<std::vector<float>> divided = scaled;
      for (float& x : divided[0]) x = static_cast<float>(static_cast<double>(x) / scale);
      EXPECT_EQ(result.norm, gradclip::global_norm(divided, rms()));
    }
  }
}

// Per-unit front-ends: adaptive clipping compares each row's RMS norm with its weights' (the counts
// cancel, so the result is the L2 one's up to rounding), group clipping takes each group's RMS norm.
TEST(RmsNorm, GroupAndAdaptiveClippingTakeIt) {
  std::mt19937_64 rng(seed + 44);
  std::vector<float> a = random_gradient<float>(1000, rng, 1.0), b = random_gradient<float>(10, rng, 1.0);
  const auto a0 = a, b0 = b;
  const auto results = gradclip::clip_by_group_norms(
      {{"a", {gradclip::grad_view(a)}, 0.5}, {"b", {gradclip::grad_view(b)}, 1e6}}, rms());
  EXPECT_LE(relative_error(results[0].result.norm, exact_rms(std::vector<std::vector<float>>{a0})),
            robust_norm_bound<float>());
  EXPECT_TRUE(results[0].result.clipped);
  EXPECT_FALSE(results[1].result.clipped);
  EXPECT_TRUE(same_bits(b, b0));

  // Rows of a column-major matrix: the one-sweep path counts each row's columns.
  Eigen::MatrixXf grad = Eigen::MatrixXf::Random(40, 300), weights = Eigen::MatrixXf::Random(40, 300);
  grad.row(3) *= 1000.0f;
  Eigen::MatrixXf by_rms = grad, by_l2 = grad;
  gradclip::options l2 = rms();
  l2.norm = gradclip::l2_norm;
  const auto r_rms = gradclip::adaptive_clip(by_rms, weights, 0.01, 1e-3, rms());
  const auto r_l2 = gradclip::adaptive_clip(by_l2, weights, 0.01, 1e-3, l2);
  EXPECT_EQ(r_rms.clipped, r_l2.clipped);
  EXPECT_GE(r_rms.clipped, 1u);
  EXPECT_LE((by_rms - by_l2).cwiseAbs().maxCoeff(), 1e-6f * by_l2.cwiseAbs().maxCoeff());

  gradclip::adagc controller;
  std::vector<std::vector<float>> tensors{a0, b0};
  const auto per_tensor = gradclip::clip_per_tensor(tensors, controller, rms());
  EXPECT_LE(relative_error(per_tensor[0].norm, exact_rms(std::vector<std::vector<float>>{a0})),
            robust_norm_bound<float>());
  EXPECT_LE(relative_error(per_tensor[1].norm, exact_rms(std::vector<std::vector<float>>{b0})),
            robust_norm_bound<float>());
}

// The front-ends that take the L2 norm only keep refusing the RMS norm: per-example clipping, and update
// clipping, whose own RMS divides by the n it knows.
TEST(RmsNorm, L2OnlyFrontEndsRefuseIt) {
  Eigen::MatrixXf batch = Eigen::MatrixXf::Random(8, 16);  // 8 examples of 16 elements
  Eigen::VectorXf sums = Eigen::VectorXf::Zero(16);
  const Eigen::MatrixXf batch0 = batch;
  std::vector<float> update(100, 1.0f);
  const auto original = update;
  const auto expect_refused = [](auto&& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_refused([&] { (void)gradclip::clip_per_example(std::tie(batch), std::tie(sums), 1.0, rms()); },
                 "per-example clipping takes the L2 norm only");
  expect_refused([&] { (void)gradclip::clip_update_by_rms(update, 1.0, rms()); }, "must be the L2 norm");
  EXPECT_TRUE(same_bits(update, original));
  EXPECT_EQ(batch, batch0);
  EXPECT_TRUE((sums.array() == 0.0f).all());
}

}  // namespace
