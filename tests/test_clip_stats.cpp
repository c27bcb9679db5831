// clip_stats: counts, fractions, norms, skips and thresholds over a scripted sequence of results, reset,
// the log line, the exact round trip of the whole state, and element_count for single gradients and groups.
#include <gradclip/clip_stats.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using gradclip::clip_result;
using gradclip::clip_stats;

// A training interval: clipped, below threshold, overflow (skipped), clipped, NaN (skipped), below.
const std::vector<clip_result> scripted{
    {2.0, 0.5, true, true},  {0.5, 1.0, false, true},  {INFINITY, 1.0, false, false},
    {4.0, 0.25, true, true}, {NAN, 1.0, false, false}, {1.5, 1.0, false, true},
};

TEST(ClipStats, CountsAndNormsOverAScriptedSequence) {
  clip_stats stats(400);
  for (const auto& step : scripted) stats.record(step);
  EXPECT_EQ(stats.steps(), 6u);
  EXPECT_EQ(stats.finite_steps(), 4u);
  EXPECT_EQ(stats.clipped_steps(), 2u);
  EXPECT_EQ(stats.nonfinite_steps(), 2u);
  EXPECT_EQ(stats.clip_fraction(), 0.5);  // clipped / finite steps: overflows are not clipping decisions
  EXPECT_EQ(stats.mean_norm(), 2.0);      // (2 + 0.5 + 4 + 1.5) / 4: non-finite norms stay out
  EXPECT_EQ(stats.max_norm(), 4.0);
  EXPECT_EQ(stats.mean_norm_per_sqrt_n(), 0.1);  // 2 / sqrt(400)
}

TEST(ClipStats, ResetStartsANewIntervalAndKeepsTheElementCount) {
  clip_stats stats(100);
  for (const auto& step : scripted) stats.record(step);
  stats.reset();
  EXPECT_EQ(stats.steps(), 0u);
  EXPECT_EQ(stats.clipped_steps(), 0u);
  EXPECT_EQ(stats.nonfinite_steps(), 0u);
  EXPECT_EQ(stats.clip_fraction(), 0.0);
  EXPECT_TRUE(std::isnan(stats.mean_norm()));
  EXPECT_TRUE(std::isnan(stats.max_norm()));
  EXPECT_EQ(stats.element_count(), 100u);
  stats.record({3.0, 1.0, false, true});
  EXPECT_EQ(stats.mean_norm(), 3.0);
  EXPECT_EQ(stats.max_norm(), 3.0);
  EXPECT_EQ(stats.mean_norm_per_sqrt_n(), 0.3);
}

TEST(ClipStats, OnlyNonFiniteStepsGiveNoNorms) {
  clip_stats stats;
  stats.record({INFINITY, 1.0, false, false});
  EXPECT_EQ(stats.steps(), 1u);
  EXPECT_EQ(stats.clip_fraction(), 0.0);
  EXPECT_TRUE(std::isnan(stats.mean_norm()));
  EXPECT_TRUE(std::isnan(stats.mean_norm_per_sqrt_n()));  // no element count either
}

TEST(ClipStats, PrintsOneLogLine) {
  clip_stats stats(400);
  for (const auto& step : scripted) stats.record(step);
  EXPECT_EQ(stats.log_line(),
            "steps=6 clipped=2 clip_fraction=0.5 nonfinite=2 mean_norm=2 max_norm=4 norm_per_sqrt_n=0.1");

  clip_stats without_count;
  without_count.record({2.0, 0.5, true, true});
  EXPECT_EQ(without_count.log_line(), "steps=1 clipped=1 clip_fraction=1 nonfinite=0 mean_norm=2 max_norm=2");
}

// A controller's interval: thresholds that move, a skipped spike, a NaN step whose threshold stays out.
const std::vector<clip_result> controlled{
    {2.0, 0.75, true, true, 1.5},  {1.0, 1.0, false, true, 2.5}, {90.0, 1.0, false, true, 4.0, true},
    {NAN, 1.0, false, false, 8.0}, {1.0, 1.0, false, true},  // no threshold (+inf)
};

TEST(ClipStats, CountsSkipsAndThresholds) {
  clip_stats stats;
  for (const auto& step : controlled) stats.record(step);
  EXPECT_EQ(stats.steps(), 5u);
  EXPECT_EQ(stats.finite_steps(), 4u);
  EXPECT_EQ(stats.skipped_steps(), 1u);
  EXPECT_EQ(stats.clipped_steps(), 1u);
  EXPECT_EQ(stats.mean_threshold(), 8.0 / 3);  // (1.5 + 2.5 + 4) / 3: the NaN step's and +inf stay out
  EXPECT_EQ(stats.last_threshold(), 4.0);
  EXPECT_EQ(stats.log_line(),
            "steps=5 clipped=1 clip_fraction=0.25 nonfinite=1 mean_norm=23.5 max_norm=90 skipped=1 "
            "mean_threshold=2.66667 last_threshold=4");
  stats.reset();
  EXPECT_EQ(stats.skipped_steps(), 0u);
  EXPECT_TRUE(std::isnan(stats.mean_threshold()));
  EXPECT_TRUE(std::isnan(stats.last_threshold()));
}

TEST(ClipStats, StreamsRoundTripTheWholeStateExactly) {
  clip_stats stats(12345);
  for (const auto& step : scripted) stats.record(step);
  for (const auto& step : controlled) stats.record(step);
  stats.record({0.1, 1.0, false, true, 0.30000000000000004});  // digits a decimal print would lose
  std::stringstream saved;
  saved << stats;
  clip_stats restored;
  ASSERT_TRUE(saved >> restored);
  EXPECT_EQ(restored, stats);
  EXPECT_EQ(restored.element_count(), 12345u);
  EXPECT_EQ(restored.mean_threshold(), stats.mean_threshold());
  EXPECT_EQ(restored.last_threshold(), 0.30000000000000004);
  EXPECT_EQ(restored.log_line(), stats.log_line());
  // Both continue identically.
  stats.record({3.0, 1.0, false, true, 2.0});
  restored.record({3.0, 1.0, false, true, 2.0});
  EXPECT_EQ(restored, stats);
}

TEST(ClipStats, MalformedStateIsRejectedAndLeavesTheTargetUnchanged) {
  clip_stats stats(10);
  stats.record({2.0, 0.5, true, true});
  std::stringstream saved;
  saved << stats;
  const std::string text = saved.str();
  const std::vector<std::string> bad{
      "",                                                  // empty
      "gradclip::zclip" + text.substr(text.find(' ')),     // another type's tag
      text.substr(0, text.size() - 5),                     // truncated
      text.substr(0, text.rfind(' ')) + " 0x12",           // a double that is not 16 hex digits
      "gradclip::clip_stats 0 1 2 0 0 0 0x0 0x0 0x0 0x0",  // more clipped steps than steps
  };
  for (const auto& input : bad) {
    clip_stats target(7);
    target.record({1.0, 1.0, false, true});
    const clip_stats before = target;
    std::istringstream in(input);
    in >> target;
    EXPECT_TRUE(in.fail()) << input;
    EXPECT_EQ(target, before) << input;
  }
}

TEST(ClipStats, ElementCountOfGradientsAndGroups) {
  std::vector<float> v(7);
  Eigen::MatrixXd m(3, 4);
  Eigen::Tensor<Eigen::half, 3> t(2, 3, 4);
  EXPECT_EQ(gradclip::element_count(v), 7u);
  EXPECT_EQ(gradclip::element_count(m), 12u);
  EXPECT_EQ(gradclip::element_count(m.block(0, 0, 2, 2)), 4u);
  EXPECT_EQ(gradclip::element_count(std::vector<std::vector<float>>{v, v}), 14u);
  std::vector<gradclip::grad_view> mixed{gradclip::grad_view(v), gradclip::grad_view(m), gradclip::grad_view(t)};
  EXPECT_EQ(gradclip::element_count(mixed), 43u);
}

}  // namespace
