// clip_by_group_norms: each group clipped by its own threshold, equal to separate clip_by_global_norm calls.
#include <gradclip/clip.hpp>
#include <gradclip/group_clip.hpp>
#include <gradclip/norm.hpp>

#include "reference.hpp"

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
using gradclip::grad_view;
using gradclip::on_nonfinite;

void expect_same_result(const gradclip::clip_result& got, const gradclip::clip_result& expected) {
  EXPECT_EQ(got.norm, expected.norm);
  EXPECT_EQ(got.coefficient, expected.coefficient);
  EXPECT_EQ(got.clipped, expected.clipped);
  EXPECT_EQ(got.finite, expected.finite);
}

// A model's gradients: FP16 embeddings, FP32 weights and FP64 biases, and an identical copy.
struct model {
  std::vector<Eigen::half> embedding;
  std::vector<float> w1, w2;
  std::vector<double> b1;

  explicit model(std::uint64_t s) {
    std::mt19937_64 rng(s);
    embedding = random_gradient<Eigen::half>(5000, rng, 0.5);
    w1 = random_gradient<float>(3000, rng, 0.01);
    w2 = random_gradient<float>(100, rng, 0.1);
    b1 = random_gradient<double>(30, rng, 0.1);
  }
  std::vector<grad_view> embeddings() { return {grad_view(embedding)}; }
  std::vector<grad_view> rest() { return {grad_view(w1), grad_view(b1), grad_view(w2)}; }
};

template <class Policy>
void expect_equal_to_separate_calls(double embedding_threshold, double rest_threshold, gradclip::options opt = {}) {
  model together(seed), separate(seed);
  const auto results = gradclip::clip_by_group_norms<Policy>(
      {{"embeddings", together.embeddings(), embedding_threshold}, {"rest", together.rest(), rest_threshold}}, opt);
  auto embeddings = separate.embeddings();
  auto rest = separate.rest();
  const auto expected_embeddings = gradclip::clip_by_global_norm<Policy>(embeddings, embedding_threshold, opt);
  const auto expected_rest = gradclip::clip_by_global_norm<Policy>(rest, rest_threshold, opt);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].name, "embeddings");
  EXPECT_EQ(results[1].name, "rest");
  expect_same_result(results[0].result, expected_embeddings);
  expect_same_result(results[1].result, expected_rest);
  EXPECT_TRUE(same_bits(together.embedding, separate.embedding));
  EXPECT_TRUE(same_bits(together.w1, separate.w1));
  EXPECT_TRUE(same_bits(together.w2, separate.w2));
  EXPECT_TRUE(same_bits(together.b1, separate.b1));
}

TEST(GroupClip, ResultsEqualSeparateGlobalNormCalls) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (auto [e, r] : {std::pair<double, double>{1.0, 0.1}, {1e3, 0.1}, {1.0, 1e3}, {1e3, 1e3}, {0.0, 0.0}}) {
    expect_equal_to_separate_calls<gradclip::robust>(e, r);
    expect_equal_to_separate_calls<gradclip::max_scale>(e, r, {on_nonfinite::propagate, 1e-6});
    expect_equal_to_separate_calls<gradclip::promote>(e, r);
  }
}

TEST(GroupClip, ThresholdRatioFixesTheRelativeScaleOfClippedGroups) {
  model m(seed);
  const model original(seed);
  const auto results = gradclip::clip_by_group_norms({{"embeddings", m.embeddings(), 4.0}, {"rest", m.rest(), 0.5}});
  ASSERT_TRUE(results[0].result.clipped && results[1].result.clipped);
  // Each group is the exact projection onto its threshold's sphere, g * max_norm / ||g|| with the group's own
  // exact norm, each element within one ulp (robust; the rest has no FP16 or BF16 member: numerics.md).
  const quad embeddings_norm = exact_norm(original.embedding);
  for (std::size_t i = 0; i < m.embedding.size(); ++i)
    ASSERT_LE(ulps(m.embedding[i], to_quad(original.embedding[i]) * quad(4.0) / embeddings_norm), 1.0) << i;
  const quad rest_norm =
      quad_sqrt(exact_norm(original.w1) * exact_norm(original.w1) + exact_norm(original.b1) * exact_norm(original.b1) +
                exact_norm(original.w2) * exact_norm(original.w2));
  const auto expect_projection = [&](const auto& clipped, const auto& before) {
    for (std::size_t i = 0; i < clipped.size(); ++i)
      ASSERT_LE(ulps(clipped[i], to_quad(before[i]) * quad(0.5) / rest_norm), 1.0) << i;
  };
  expect_projection(m.w1, original.w1);
  expect_projection(m.b1, original.b1);
  expect_projection(m.w2, original.w2);
  // So the norms' ratio is 8 within the elements' one ulp (FP16: 2^-10 relative; FP32 and FP64: 2^-23) and
  // the two computed norms' bounds (16 * 2^-24, 36 * 2^-53).
  const double ratio_bound = 0x1p-10 + 0x1p-23 + robust_norm_bound<Eigen::half>() + robust_norm_bound<float>();
  EXPECT_LE(relative_error(gradclip::global_norm(m.embeddings()) / gradclip::global_norm(m.rest()), quad(8)),
            ratio_bound * (1 + ratio_bound));
}

TEST(GroupClip, PNormGroupsEqualSeparatePNormCalls) {
  for (double p : {1.0, 3.0, std::numeric_limits<double>::infinity()}) {
    model together(seed), separate(seed);
    const gradclip::options type{gradclip::on_nonfinite::skip, 0.0, gradclip::norm_type{p}};
    const auto results = gradclip::clip_by_group_norms(
        {{"embeddings", together.embeddings(), 2.0}, {"rest", together.rest(), 0.01}}, type);
    auto embeddings = separate.embeddings();
    auto rest = separate.rest();
    expect_same_result(results[0].result, gradclip::clip_by_global_norm(embeddings, 2.0, type));
    expect_same_result(results[1].result, gradclip::clip_by_global_norm(rest, 0.01, type));
    EXPECT_TRUE(same_bits(together.embedding, separate.embedding));
    EXPECT_TRUE(same_bits(together.w1, separate.w1));
  }
}

TEST(GroupClip, NonFiniteGroupsAreHandledOneByOneExceptError) {
  model m(seed);
  m.w2[7] = std::numeric_limits<float>::quiet_NaN();
  const model copy = m;
  auto results = gradclip::clip_by_group_norms({{"embeddings", m.embeddings(), 1.0}, {"rest", m.rest(), 1.0}});
  EXPECT_TRUE(results[0].result.finite && results[0].result.clipped);
  EXPECT_FALSE(results[1].result.finite || results[1].result.clipped);
  EXPECT_TRUE(same_bits(m.w1, copy.w1));
  // error: nothing is modified, not even the finite group listed first.
  model n = copy;
  try {
    (void)gradclip::clip_by_group_norms({{"embeddings", n.embeddings(), 1.0}, {"rest", n.rest(), 1.0}},
                                        {on_nonfinite::error});
    ADD_FAILURE() << "no exception";
  } catch (const gradclip::nonfinite_error& e) {
    EXPECT_NE(std::string(e.what()).find("group \"rest\""), std::string::npos) << e.what();
  }
  EXPECT_TRUE(same_bits(n.embedding, copy.embedding));
}

TEST(GroupClip, BadThresholdsAndOrdersThrowNamingTheGroup) {
  model m(seed);
  const model copy = m;
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      (void)gradclip::clip_by_group_norms({{"embeddings", m.embeddings(), 1e-3}, {"rest", m.rest(), bad}});
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_by_group_norms: group \"rest\":", 0), 0u) << e.what();
    }
  }
  EXPECT_THROW((void)gradclip::clip_by_group_norms({{"rest", m.rest(), 1.0}},
                                                   {on_nonfinite::skip, 0.0, gradclip::norm_type{0.0}}),
               std::invalid_argument);
  EXPECT_TRUE(same_bits(m.embedding, copy.embedding));
  EXPECT_TRUE(same_bits(m.w1, copy.w1));
}

TEST(GroupClip, EmptyGroupsAndNoGroups) {
  EXPECT_TRUE(gradclip::clip_by_group_norms({}).empty());
  const auto results = gradclip::clip_by_group_norms({{"nothing", {}, 1.0}});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].result.norm, 0.0);
  EXPECT_FALSE(results[0].result.clipped);
}

}  // namespace
