// loss_scaler: the state machine, the order unscale-check-clip, the fused path against unscale followed by
// clip_by_global_norm and against binary128, non-power-of-two scales, single gradients and groups.
#include <gradclip/clip.hpp>
#include <gradclip/controller.hpp>
#include <gradclip/loss_scaler.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::clip_result;
using gradclip::loss_scaler;
using gradclip::loss_scaler_config;
using gradclip::on_nonfinite;

template <class T>
class LossScalerTyped : public ::testing::Test {};
TYPED_TEST_SUITE(LossScalerTyped, element_types);

loss_scaler scaler_with(double init_scale, int growth_interval = 2000) {
  loss_scaler_config config;
  config.init_scale = init_scale;
  config.growth_interval = growth_interval;
  return loss_scaler(config);
}

constexpr clip_result finite_step{1.0, 1.0, false, true};
constexpr clip_result overflow_step{INFINITY, 1.0, false, false};

TEST(LossScaler, DefaultsAreThoseOfPyTorchsGradScaler) {
  const loss_scaler scaler;
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.config().growth_factor, 2.0);
  EXPECT_EQ(scaler.config().backoff_factor, 0.5);
  EXPECT_EQ(scaler.config().growth_interval, 2000);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScaler, BadConfigurationsThrowInvalidArgumentNamingTheClass) {
  const auto expect_rejected = [](const std::function<void(loss_scaler_config&)>& change, const char* what) {
    loss_scaler_config config;
    change(config);
    try {
      loss_scaler scaler(config);
      ADD_FAILURE() << "accepted " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::loss_scaler: ", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  for (double bad : std::vector<double>{0.0, -1.0, NAN, INFINITY, 0x1p128, 0x1p-127})
    expect_rejected([&](loss_scaler_config& c) { c.init_scale = bad; }, "init_scale");
  for (double bad : std::vector<double>{1.0, 0.5, -2.0, NAN, INFINITY})
    expect_rejected([&](loss_scaler_config& c) { c.growth_factor = bad; }, "growth_factor");
  for (double bad : std::vector<double>{0.0, 1.0, -0.5, 1.5, NAN, INFINITY})
    expect_rejected([&](loss_scaler_config& c) { c.backoff_factor = bad; }, "backoff_factor");
  for (int bad : {0, -1}) expect_rejected([&](loss_scaler_config& c) { c.growth_interval = bad; }, "growth_interval");
  EXPECT_NO_THROW(scaler_with(loss_scaler::smallest_scale));
  EXPECT_NO_THROW(scaler_with(loss_scaler::largest_scale));
}

TEST(LossScaler, OverflowBacksOffAndResetsTheCount) {
  loss_scaler scaler = scaler_with(1024.0, 3);
  scaler.update(finite_step);
  scaler.update(finite_step);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  scaler.update(overflow_step);
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // The two finite steps before the overflow no longer count: growth needs three new ones.
  scaler.update(finite_step);
  scaler.update(finite_step);
  EXPECT_EQ(scaler.scale(), 512.0);
  scaler.update(finite_step);
  EXPECT_EQ(scaler.scale(), 1024.0);
}

TEST(LossScaler, GrowsAfterExactlyGrowthIntervalFiniteSteps) {
  loss_scaler scaler = scaler_with(8.0, 5);
  for (int round = 1; round <= 3; ++round) {
    for (int i = 1; i < 5; ++i) {
      scaler.update(finite_step);
      ASSERT_EQ(scaler.scale(), std::ldexp(8.0, round - 1)) << "grew after " << i << " steps";
    }
    scaler.update(finite_step);
    ASSERT_EQ(scaler.scale(), std::ldexp(8.0, round));
    ASSERT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(LossScaler, ScaleStaysFiniteAndNonzeroForever) {
  loss_scaler falling = scaler_with(1.0);
  for (int i = 0; i < 10000; ++i) falling.update(overflow_step);
  EXPECT_EQ(falling.scale(), loss_scaler::smallest_scale);
  EXPECT_GT(static_cast<float>(falling.scale()), 0.0f);

  loss_scaler rising = scaler_with(1.0, 1);
  for (int i = 0; i < 10000; ++i) rising.update(finite_step);
  EXPECT_EQ(rising.scale(), loss_scaler::largest_scale);
  EXPECT_TRUE(std::isfinite(static_cast<float>(rising.scale())));
}

TEST(LossScaler, NonPowerOfTwoFactorsStayInBounds) {
  loss_scaler_config config;
  config.init_scale = 3.0;
  config.growth_factor = 3.0;
  config.backoff_factor = 0.3;
  config.growth_interval = 1;
  loss_scaler scaler(config);
  scaler.update(finite_step);
  EXPECT_EQ(scaler.scale(), 9.0);
  scaler.update(overflow_step);
  EXPECT_EQ(scaler.scale(), static_cast<double>(static_cast<float>(9.0 * 0.3)));
  for (int i = 0; i < 1000; ++i) scaler.update(finite_step);
  EXPECT_EQ(scaler.scale(), loss_scaler::largest_scale);
}

TEST(LossScaler, ScaleIsAlwaysAnFP32Number) {
  loss_scaler_config config;
  config.init_scale = 0.1;  // rounded to FP32 at once
  config.growth_factor = 3.0;
  config.growth_interval = 1;
  loss_scaler scaler(config);
  float expected = 0.1f;
  EXPECT_EQ(scaler.scale(), static_cast<double>(expected));
  for (int step = 0; step < 40; ++step) {  // 3^k leaves FP32's 24 bits after 16 steps
    scaler.update(finite_step);
    expected = static_cast<float>(static_cast<double>(expected) * 3.0);
    ASSERT_EQ(scaler.scale(), static_cast<double>(expected)) << "step " << step;
  }
}

TEST(LossScaler, CheckpointMidRunRestoresTheSameScales) {
  loss_scaler_config config;
  config.init_scale = 1000.0;
  config.growth_factor = 1.7;
  config.backoff_factor = 0.37;
  config.growth_interval = 3;
  loss_scaler original(config);
  std::mt19937_64 rng(seed + 7);
  std::vector<bool> overflow(300);
  for (std::size_t i = 0; i < overflow.size(); ++i) overflow[i] = rng() % 5 == 0;
  for (std::size_t i = 0; i < 150; ++i) original.update(overflow[i] ? overflow_step : finite_step);

  std::stringstream saved;
  saved << original;
  loss_scaler restored;
  saved >> restored;
  ASSERT_FALSE(saved.fail()) << saved.str();
  loss_scaler from_state_dict(original.state_dict());
  for (std::size_t i = 150; i < overflow.size(); ++i) {
    const clip_result step = overflow[i] ? overflow_step : finite_step;
    original.update(step);
    restored.update(step);
    from_state_dict.update(step);
    ASSERT_EQ(restored.scale(), original.scale()) << "step " << i;
    ASSERT_EQ(restored.growth_tracker(), original.growth_tracker()) << "step " << i;
    ASSERT_EQ(from_state_dict.scale(), original.scale()) << "step " << i;
  }
  const gradclip::loss_scaler_state state = original.state_dict();
  EXPECT_EQ(state.growth_factor, 1.7);
  EXPECT_EQ(state.backoff_factor, 0.37);
  EXPECT_EQ(state.growth_interval, 3);
  EXPECT_EQ(state.growth_tracker, original.growth_tracker());
}

TEST(LossScaler, MalformedOrInvalidStateLeavesTheScalerUnchanged) {
  loss_scaler scaler = scaler_with(512.0);
  std::stringstream bad_tracker("512 2 0.5 4 9");  // growth_tracker beyond growth_interval
  bad_tracker >> scaler;
  EXPECT_TRUE(bad_tracker.fail());
  std::stringstream truncated("512 2");
  truncated >> scaler;
  EXPECT_TRUE(truncated.fail());
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.config().growth_interval, 2000);
  gradclip::loss_scaler_state state = scaler.state_dict();
  state.growth_tracker = -1;
  EXPECT_THROW(scaler.load_state_dict(state), std::invalid_argument);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

// A controller that clips to a fixed threshold or skips, and remembers what it was told.
struct recording_controller {
  double threshold = 2.0;
  bool skip = false;
  std::vector<clip_result> seen;
  gradclip::threshold_decision decide(double) const { return {threshold, skip}; }
  double fallback_threshold() const { return threshold; }
  void update(const clip_result& step) { seen.push_back(step); }
};

TEST(LossScaler, ControllersSetTheThresholdOfTheUnscaledNorm) {
  static_assert(gradclip::is_threshold_controller_v<recording_controller>);
  std::vector<float> g{3.0f * 1024, 4.0f * 1024};  // g = [3, 4] scaled by S = 1024
  recording_controller controller;
  const clip_result step = scaler_with(1024.0).unscale_and_clip(g, controller);
  EXPECT_EQ(step.norm, 5.0);
  EXPECT_EQ(step.threshold, 2.0);
  EXPECT_TRUE(step.clipped && !step.skip);
  EXPECT_EQ(g[0], static_cast<float>(3.0 * 2.0 / 5.0));
  ASSERT_EQ(controller.seen.size(), 1u);
  EXPECT_EQ(controller.seen[0].norm, 5.0);

  // A skipped step is left untouched, still scaled, and reported as skipped.
  controller.skip = true;
  std::vector<float> h{3.0f * 1024, 4.0f * 1024};
  const auto before = h;
  const clip_result skipped = scaler_with(1024.0).unscale_and_clip(h, controller);
  EXPECT_TRUE(skipped.skip);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_TRUE(same_bits(h, before));
  EXPECT_EQ(controller.seen.size(), 2u);
}

TEST(LossScaler, Fp64SubnormalQuotientsAreRoundedOnce) {
  // 7 * 2^-1074 / 5 = 1.4 * 2^-1074, whose correct rounding is 2^-1074 (a division in two steps,
  // by 1.25 then by 4, rounds it to 2 * 2^-1074).
  std::vector<double> g{7 * 0x1p-1074, -7 * 0x1p-1074, 0x1p-1022};
  const auto r = scaler_with(5.0).unscale(g);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(g[0], 0x1p-1074);
  EXPECT_EQ(g[1], -0x1p-1074);
  EXPECT_EQ(g[2], static_cast<double>(to_quad(0x1p-1022) / 5));
}

// The seed's order on FP16 data: a true gradient of 300 scaled by 65536 overflows FP16 in the backward pass;
// the overflow is detected before any clipping, the step is skipped and S halved until the scaled gradient
// fits; then the unscaled gradient, not the scaled one, is clipped.
TEST(LossScaler, OverflowingFP16GradientIsDetectedSkippedAndTheScaleHalved) {
  loss_scaler scaler;
  int skipped = 0;
  for (;;) {
    std::vector<Eigen::half> grad{Eigen::half(300.0f * static_cast<float>(scaler.scale()))};  // the backward pass
    const auto before = grad;
    const double scale_before = scaler.scale();
    const clip_result step = scaler.unscale_and_clip(grad, 1.0);
    scaler.update(step);
    if (step.finite) {
      EXPECT_EQ(step.norm, 300.0);
      EXPECT_TRUE(step.clipped);
      EXPECT_DOUBLE_EQ(step.coefficient, 1.0 / 300.0);
      EXPECT_EQ(static_cast<float>(grad[0]), 1.0f);
      break;
    }
    EXPECT_TRUE(std::isinf(static_cast<float>(before[0])));
    EXPECT_TRUE(same_bits(grad, before)) << "a non-finite gradient was modified";
    EXPECT_FALSE(step.clipped);
    EXPECT_EQ(step.coefficient, 1.0);
    EXPECT_EQ(scaler.scale(), scale_before / 2);
    ++skipped;
    ASSERT_LT(skipped, 20);
  }
  EXPECT_EQ(skipped, 9);  // 65536 -> 128, the largest power of two with 300 * S <= 65504
  EXPECT_EQ(scaler.scale(), 128.0);
}

// Clipping before unscaling makes the threshold S times smaller: the pitfall the fused call removes.
TEST(LossScaler, FusedCallClipsTheUnscaledGradientNotTheScaledOne) {
  loss_scaler scaler = scaler_with(1024.0);
  std::vector<float> grad{3.0f * 1024, 4.0f * 1024};  // true gradient [3, 4], norm 5
  const clip_result step = scaler.unscale_and_clip(grad, 10.0);
  EXPECT_FALSE(step.clipped);
  EXPECT_EQ(step.norm, 5.0);
  EXPECT_EQ(grad, (std::vector<float>{3.0f, 4.0f}));
}

template <class T>
std::vector<T> scaled_copy(const std::vector<double>& g, double scale) {
  std::vector<T> v(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) v[i] = static_cast<T>(g[i] * scale);
  return v;
}

// The fused path against binary128 (one ulp, as clip_by_norm), and against unscale followed by
// clip_by_global_norm, which rounds twice: the two agree within one rounding.
template <class T>
void check_fused_against_two_steps(double scale) {
  SCOPED_TRACE(type_name<T>() + " scale " + std::to_string(scale) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 40);
  std::vector<std::vector<T>> fused;
  for (std::size_t n : {1u, 37u, 1024u, 3000u}) fused.push_back(scaled_copy<T>(random_gradient<double>(n, rng), scale));
  auto two_steps = fused;
  const auto original = fused;

  quad sum = 0;
  for (const auto& g : original)
    for (T x : g) sum += (to_quad(x) / static_cast<quad>(scale)) * (to_quad(x) / static_cast<quad>(scale));
  const quad exact_unscaled_norm = quad_sqrt(sum);
  const double max_norm = static_cast<double>(exact_unscaled_norm) / 3;

  loss_scaler scaler = scaler_with(scale);
  const clip_result f = scaler.unscale_and_clip(fused, max_norm);
  const clip_result u = scaler.unscale(two_steps);
  const clip_result c = gradclip::clip_by_global_norm(two_steps, max_norm);

  ASSERT_TRUE(f.finite && f.clipped);
  EXPECT_LE(relative_error(f.norm, exact_unscaled_norm), robust_norm_bound<T>());
  EXPECT_LE(relative_error(u.norm, exact_unscaled_norm), robust_norm_bound<T>());
  EXPECT_FALSE(u.clipped);
  EXPECT_EQ(u.coefficient, 1.0);
  // The coefficient is the correctly rounded max_norm / norm from the unrounded root, the norm within b =
  // robust_norm_bound of the exact one (numerics.md): within b / (1 - b) + 2^-52 of the exact quotient.
  const double b = robust_norm_bound<T>();
  EXPECT_LE(relative_error(f.coefficient, static_cast<quad>(max_norm) / exact_unscaled_norm), b / (1 - b) + 0x1p-52);
  EXPECT_NEAR(f.coefficient, c.coefficient, epsilon_of<T>() * f.coefficient);  // c saw the rounded g / S
  // One ulp as clip_by_norm; FP64 with a scale that is not a power of two rounds c / m first: 1.5 (and then
  // differs from the two steps by up to two ulps instead of one).
  const double fused_bound = std::is_same_v<T, double> && std::ldexp(1.0, std::ilogb(scale)) != scale ? 1.5 : 1.0;
  for (std::size_t j = 0; j < fused.size(); ++j)
    for (std::size_t i = 0; i < fused[j].size(); ++i) {
      const quad exact =
          to_quad(original[j][i]) / static_cast<quad>(scale) * static_cast<quad>(max_norm) / exact_unscaled_norm;
      ASSERT_LE(ulps(fused[j][i], exact), fused_bound) << "fused, gradient " << j << " element " << i;
      ASSERT_LE(ulps(two_steps[j][i], exact), 2.0) << "two steps, gradient " << j << " element " << i;
      ASSERT_LE(ulps(fused[j][i], to_quad(two_steps[j][i])), 2 * fused_bound - 1)
          << "gradient " << j << " element " << i;
    }
}

TYPED_TEST(LossScalerTyped, FusedEqualsUnscaleThenClipWithinOneRounding) {
  check_fused_against_two_steps<TypeParam>(1024.0);  // power of two: the unscale itself is exact
  check_fused_against_two_steps<TypeParam>(3000.0);  // not a power of two
  check_fused_against_two_steps<TypeParam>(0.25);    // after many backoffs
}

TYPED_TEST(LossScalerTyped, PowerOfTwoScaleUnscalesExactly) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 41);
  const double scale = 4096.0;
  std::vector<T> g = scaled_copy<T>(random_gradient<double>(2000, rng), scale);
  const auto original = g;
  loss_scaler scaler = scaler_with(scale);
  const clip_result r = scaler.unscale(g);
  EXPECT_TRUE(r.finite);
  EXPECT_FALSE(r.clipped);
  for (std::size_t i = 0; i < g.size(); ++i)
    ASSERT_EQ(static_cast<double>(g[i]), static_cast<double>(static_cast<T>(static_cast<double>(original[i]) / scale)))
        << "element " << i;
}

TYPED_TEST(LossScalerTyped, NonPowerOfTwoScaleUnscalesWithOneRounding) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 42);
  for (double scale : {3.0, 1000.0, 0.3, 5000.1}) {  // S * N(0, 1) fits FP16
    std::vector<T> g = scaled_copy<T>(random_gradient<double>(5000, rng), scale);
    const auto original = g;
    loss_scaler scaler = scaler_with(scale);
    const clip_result r = scaler.unscale(g);
    EXPECT_TRUE(r.finite);
    // Correctly rounded x / S: within half a unit in the last place (x / S is never a tie here).
    for (std::size_t i = 0; i < g.size(); ++i)
      ASSERT_LE(ulps(g[i], to_quad(original[i]) / static_cast<quad>(scaler.scale())), 0.5)
          << "scale " << scale << " element " << i << ": " << static_cast<double>(original[i]) << " -> "
          << static_cast<double>(g[i]);
  }
}

TYPED_TEST(LossScalerTyped, NonFiniteGradientsFollowTheOptions) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<std::vector<T>> group{{T(1), T(2)}, {T(3), inf}};
  const auto original = group;
  loss_scaler scaler = scaler_with(8.0);

  const clip_result skipped = scaler.unscale_and_clip(group, 1.0);
  EXPECT_FALSE(skipped.finite);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_EQ(skipped.coefficient, 1.0);
  EXPECT_TRUE(same_bits(group[0], original[0]) && same_bits(group[1], original[1]));

  try {
    (void)scaler.unscale_and_clip(group, 1.0, {on_nonfinite::error});
    ADD_FAILURE() << "no exception";
  } catch (const gradclip::nonfinite_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("gradclip::loss_scaler::unscale_and_clip", 0), 0u) << e.what();
  }
  EXPECT_TRUE(same_bits(group[0], original[0]) && same_bits(group[1], original[1]));

  const clip_result propagated = scaler.unscale_and_clip(group, 1.0, {on_nonfinite::propagate});
  EXPECT_FALSE(propagated.finite);
  EXPECT_EQ(propagated.coefficient, 0.0);
  EXPECT_EQ(static_cast<double>(group[0][0]), 0.0);

  std::vector<T> with_nan{T(1), nan};
  const clip_result r = scaler.unscale(with_nan);
  EXPECT_FALSE(r.finite);
  EXPECT_TRUE(std::isnan(r.norm));
  EXPECT_EQ(static_cast<double>(with_nan[0]), 1.0 / 8.0);  // unscaled: unscale has nothing to skip
  EXPECT_TRUE(std::isnan(static_cast<double>(with_nan[1])));
}

// PyTorch's unscale_ on [1024, -2048, inf] with S = 65536 gives [1/64, -1/32, inf]: an unscale divides,
// it never multiplies by a coefficient that a non-finite norm made NaN.
TYPED_TEST(LossScalerTyped, UnscaleDividesFiniteElementsUnderEveryNonFiniteSetting) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  const std::vector<T> original{T(1024), T(-2048), inf};
  for (const on_nonfinite setting : {on_nonfinite::skip, on_nonfinite::propagate}) {
    std::vector<T> g = original;
    const clip_result r = scaler_with(65536.0).unscale(g, {setting});
    EXPECT_FALSE(r.finite);
    EXPECT_FALSE(r.clipped);
    EXPECT_EQ(r.coefficient, 1.0);
    EXPECT_EQ(static_cast<double>(g[0]), 1.0 / 64);
    EXPECT_EQ(static_cast<double>(g[1]), -1.0 / 32);
    EXPECT_EQ(static_cast<double>(g[2]), std::numeric_limits<double>::infinity());
  }
  std::vector<T> g = original;
  EXPECT_THROW((void)scaler_with(65536.0).unscale(g, {on_nonfinite::error}), gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(g, original));
}

TYPED_TEST(LossScalerTyped, SingleGradientsAndGroupsAgree) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 43);
  const std::vector<T> a = scaled_copy<T>(random_gradient<double>(300, rng), 64.0);
  const std::vector<T> b = scaled_copy<T>(random_gradient<double>(500, rng), 64.0);
  std::vector<T> concatenated = a;
  concatenated.insert(concatenated.end(), b.begin(), b.end());

  loss_scaler scaler = scaler_with(64.0);
  const clip_result single = scaler.unscale_and_clip(concatenated, 2.0);

  Eigen::Matrix<T, Eigen::Dynamic, 1> matrix = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(a.data(), 300);
  Eigen::Tensor<T, 2> tensor(20, 25);
  std::copy(b.begin(), b.end(), tensor.data());
  const clip_result group = scaler.unscale_and_clip({gradclip::grad_view(matrix), gradclip::grad_view(tensor)}, 2.0);

  // The same squares summed in another order (chain and block boundaries differ): each norm is within the
  // bound of the exact one, so the two agree within twice the bound, and so do their coefficients.
  const double bound = robust_norm_bound<T>();
  EXPECT_NEAR(single.norm, group.norm, 2 * bound * single.norm);
  EXPECT_NEAR(single.coefficient, group.coefficient, 2 * bound * single.coefficient);
  for (int i = 0; i < 300; ++i) ASSERT_LE(ulps(matrix[i], to_quad(concatenated[i])), 1.0) << "element " << i;
  for (int i = 0; i < 500; ++i)
    ASSERT_LE(ulps(tensor.data()[i], to_quad(concatenated[300 + i])), 1.0) << "element " << 300 + i;
}

TEST(LossScaler, MixedTypeGroupOfGradViews) {
  std::vector<Eigen::half> weights{Eigen::half(3.0f * 512), Eigen::half(0.0f)};
  Eigen::VectorXf bias(1);
  bias << 4.0f * 512;
  std::vector<gradclip::grad_view> group{gradclip::grad_view(weights), gradclip::grad_view(bias)};
  loss_scaler scaler = scaler_with(512.0);
  const clip_result r = scaler.unscale_and_clip(group, 1.0);
  EXPECT_EQ(r.norm, 5.0);
  EXPECT_EQ(static_cast<float>(weights[0]), static_cast<float>(Eigen::half(0.6f)));
  EXPECT_FLOAT_EQ(bias[0], 0.8f);
}

TEST(LossScaler, UnscaledNormBeyondDoubleRangeStillClipsRight) {
  std::vector<double> g{1.5e308, 1.5e308};
  loss_scaler scaler = scaler_with(0x1p-20);
  const clip_result r = scaler.unscale_and_clip(g, 1.0);
  EXPECT_TRUE(r.finite);
  EXPECT_TRUE(r.clipped);
  EXPECT_EQ(r.norm, INFINITY);  // 2.1e308 * 2^20 exceeds double, but the clip works on the scaled form
  // One ulp of the exact projection 1.5e308 / (1.5e308 * sqrt(2)), as clip_by_norm (a power-of-two scale;
  // mixed_precision.md).
  const quad exact = to_quad(1.5e308) / (to_quad(1.5e308) * quad_sqrt(2));
  EXPECT_LE(ulps(g[0], exact), 1.0);
  EXPECT_LE(ulps(g[1], exact), 1.0);
}

TEST(LossScaler, LargeScaleUnscalesTinyFP16GradientsWithoutOverflowingTheNorm) {
  // 2^-30 survives in FP16 only scaled: 2^-30 * 2^40 = 1024. Unscaled it rounds to zero in FP16, but its
  // norm is still reported exactly.
  std::vector<Eigen::half> g{Eigen::half(1024.0f), Eigen::half(1024.0f)};
  loss_scaler scaler = scaler_with(0x1p40);
  const clip_result r = scaler.unscale(g);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(r.norm, std::sqrt(2.0) * 0x1p-30);
  EXPECT_EQ(static_cast<float>(g[0]), 0.0f);
}

TEST(LossScaler, UnitScaleBelowThresholdWritesNothing) {
  std::vector<float> g{0.1f, 0.2f};
  const auto original = g;
  loss_scaler scaler = scaler_with(1.0);
  const clip_result r = scaler.unscale_and_clip(g, 1.0);
  EXPECT_FALSE(r.clipped);
  EXPECT_EQ(r.coefficient, 1.0);
  EXPECT_TRUE(same_bits(g, original));
}

TEST(LossScaler, EmptyGradientsAndGroups) {
  loss_scaler scaler;
  std::vector<float> empty;
  std::vector<std::vector<float>> empty_group;
  const clip_result a = scaler.unscale_and_clip(empty, 1.0);
  const clip_result b = scaler.unscale_and_clip(empty_group, 1.0);
  EXPECT_EQ(a.norm, 0.0);
  EXPECT_EQ(b.norm, 0.0);
  EXPECT_TRUE(a.finite && b.finite);
}

TEST(LossScaler, BadArgumentsThrowInvalidArgumentNamingTheFunction) {
  loss_scaler scaler;
  std::vector<float> g{1.0f};
  const auto expect_named = [&](auto call, const std::string& function) {
    try {
      call();
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(function + ":", 0), 0u) << e.what();
    }
    EXPECT_EQ(g[0], 1.0f);
  };
  expect_named([&] { (void)scaler.unscale_and_clip(g, -1.0); }, "gradclip::loss_scaler::unscale_and_clip");
  expect_named([&] { (void)scaler.unscale_and_clip(g, NAN); }, "gradclip::loss_scaler::unscale_and_clip");
  expect_named([&] { (void)scaler.unscale(g, {on_nonfinite::skip, -1.0}); }, "gradclip::loss_scaler::unscale");
}

TEST(LossScaler, PoliciesCanBeChosen) {
  // naive squares the scaled FP16 gradient in FP16: (300 * 128)^2 overflows it, robust does not.
  std::vector<Eigen::half> naive_grad{Eigen::half(300.0f * 128)};
  std::vector<Eigen::half> robust_grad = naive_grad;
  loss_scaler scaler = scaler_with(128.0);
  EXPECT_FALSE(scaler.unscale_and_clip<gradclip::naive>(naive_grad, 1.0).finite);
  EXPECT_TRUE(scaler.unscale_and_clip<gradclip::robust>(robust_grad, 1.0).finite);
  std::vector<Eigen::half> promote_grad{Eigen::half(300.0f * 128)};
  EXPECT_TRUE(scaler.unscale_and_clip<gradclip::promote>(promote_grad, 1.0).finite);
  EXPECT_EQ(static_cast<float>(promote_grad[0]), 1.0f);
}

}  // namespace
