// clip_stats: counts, fractions and norms over a scripted sequence of results, reset, the log line, and
// element_count for single gradients and groups.
#include <gradclip/clip_stats.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <sstream>
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
  std::ostringstream line;
  line << stats;
  EXPECT_EQ(line.str(), "steps=6 clipped=2 clip_fraction=0.5 nonfinite=2 mean_norm=2 max_norm=4 norm_per_sqrt_n=0.1");

  clip_stats without_count;
  without_count.record({2.0, 0.5, true, true});
  std::ostringstream short_line;
  short_line << without_count;
  EXPECT_EQ(short_line.str(), "steps=1 clipped=1 clip_fraction=1 nonfinite=0 mean_norm=2 max_norm=2");
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
