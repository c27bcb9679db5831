// The threaded overloads: the same results as one thread within the documented bounds, the same bits
// on every run with the same thread count, every element scaled exactly once, small work on the caller.
#include <gradclip/parallel.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::threads;

template <class T>
class Parallel : public ::testing::Test {};
using ElementTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(Parallel, ElementTypes);

// Elements for `threads` grains of work, plus a tail that is not a whole block.
template <class T>
std::size_t elements_for(unsigned grains) {
  return grains * gradclip::parallel_grain_bytes / sizeof(T) + 777;
}

TYPED_TEST(Parallel, NormMatchesTheExactNormOnEveryThreadCount) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto g = random_gradient<T>(elements_for<T>(3), rng);
  const quad exact = exact_norm(g);
  for (unsigned count : {1u, 2u, 3u, 4u, 7u}) {
    const double got = gradclip::norm(g.data(), g.size(), threads{count});
    EXPECT_LE(relative_error(got, exact), robust_norm_bound<T>()) << count << " threads";
    // The same thread count gives the same bits, whatever the scheduling.
    EXPECT_EQ(gradclip::norm(g.data(), g.size(), threads{count}), got) << count << " threads";
  }
  EXPECT_EQ(gradclip::norm(g.data(), g.size(), threads{1}), gradclip::norm(g.data(), g.size()));
  EXPECT_EQ(gradclip::norm(g.data(), g.size(), threads{0}), gradclip::norm(g.data(), g.size()));
}

TYPED_TEST(Parallel, ClipScalesEveryElementOnceLikeOneThread) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed + 1));
  std::mt19937_64 rng(seed + 1);
  const auto original = random_gradient<T>(elements_for<T>(2), rng);
  const double max_norm = 0.25 * gradclip::norm(original.data(), original.size());
  auto serial = original;
  const auto one = gradclip::clip_by_norm(serial.data(), serial.size(), max_norm);
  for (unsigned count : {2u, 3u}) {
    auto threaded = original;
    const auto many = gradclip::clip_by_norm(threaded.data(), threaded.size(), max_norm, {}, threads{count});
    EXPECT_TRUE(many.clipped);
    EXPECT_LE(std::abs(many.coefficient - one.coefficient), robust_norm_bound<T>() * 2 * one.coefficient);
    // Each element is the projection of its original within an ulp (a missed or doubled slice is off by 4x).
    const quad exact_coefficient = static_cast<quad>(max_norm) / exact_norm(original);
    double worst = 0;
    for (std::size_t i = 0; i < original.size(); ++i)
      worst = std::max(worst, ulps(threaded[i], to_quad(original[i]) * exact_coefficient));
    EXPECT_LE(worst, 1.0) << count << " threads";
  }
}

TYPED_TEST(Parallel, BelowThresholdAndNonFiniteGradientsAreLeftUntouched) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 2);
  auto g = random_gradient<T>(elements_for<T>(2), rng);
  const auto original = g;
  const auto result = gradclip::clip_by_norm(g.data(), g.size(), 1e30, {}, threads{2});
  EXPECT_FALSE(result.clipped);
  EXPECT_EQ(result.coefficient, 1.0);
  EXPECT_TRUE(same_bits(g, original));

  g[g.size() - 3] = std::numeric_limits<T>::quiet_NaN();
  const auto with_nan = g;
  const auto skipped = gradclip::clip_by_norm(g.data(), g.size(), 1.0, {}, threads{2});
  EXPECT_FALSE(skipped.finite);
  EXPECT_TRUE(same_bits(g, with_nan));
  EXPECT_THROW((void)gradclip::clip_by_norm(g.data(), g.size(), 1.0, {gradclip::on_nonfinite::error}, threads{2}),
               gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(g, with_nan));
}

TEST(Parallel, BadArgumentsThrowNamingTheFunction) {
  std::vector<float> g(16, 1.0f);
  try {
    (void)gradclip::clip_by_norm(g.data(), g.size(), -1.0, {}, threads{2});
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gradclip::clip_by_norm"), std::string::npos) << e.what();
  }
  std::vector<std::vector<float>> group{g};
  try {
    (void)gradclip::clip_by_global_norm(group, std::nan(""), {}, threads{2});
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gradclip::clip_by_global_norm"), std::string::npos) << e.what();
  }
}

// A group mixing element types, many small tensors, a large one and a strided block: the global norm
// and the clip agree with the concatenation, whichever thread each piece lands on.
TEST(Parallel, MixedGroupsWithStridedMembers) {
  SCOPED_TRACE("seed " + std::to_string(seed + 3));
  std::mt19937_64 rng(seed + 3);
  auto large = random_gradient<Eigen::half>(elements_for<Eigen::half>(3), rng);
  std::vector<std::vector<float>> small;
  for (int k = 0; k < 300; ++k) small.push_back(random_gradient<float>(1000 + k, rng));
  Eigen::MatrixXd matrix = Eigen::MatrixXd::Random(700, 900);
  auto block = matrix.block(3, 5, 600, 800);  // strided: columns of 600 out of 700

  std::vector<gradclip::grad_view> group{gradclip::grad_view(large.data(), large.size()), block};
  for (auto& s : small) group.emplace_back(s);

  quad sum = 0;
  for (auto x : large) sum += to_quad(x) * to_quad(x);
  for (const auto& s : small)
    for (auto x : s) sum += to_quad(x) * to_quad(x);
  for (Eigen::Index j = 0; j < block.cols(); ++j)
    for (Eigen::Index i = 0; i < block.rows(); ++i) sum += to_quad(block(i, j)) * to_quad(block(i, j));
  const quad exact = quad_sqrt(sum);

  for (unsigned count : {1u, 2u, 4u}) {
    EXPECT_LE(relative_error(gradclip::global_norm(group, threads{count}), exact), robust_norm_bound<Eigen::half>())
        << count;
    const auto part = gradclip::partial_global_norm(group, threads{count});
    EXPECT_EQ(part.norm(), gradclip::global_norm(group, threads{count}));
  }

  const Eigen::MatrixXd before = matrix;
  const auto small_before = small;
  const auto large_before = large;
  const double max_norm = 0.5 * static_cast<double>(exact);
  const auto result = gradclip::clip_by_global_norm(group, max_norm, {}, threads{4});
  ASSERT_TRUE(result.clipped);
  const quad c = static_cast<quad>(max_norm) / exact;
  // One rounding, plus the coefficient's error, which is the FP16 member's norm bound (README,
  // "Policies"): a relative error r is at most r * 2^digits ulps of T.
  const auto within = [](auto got, quad expected) {
    using T = decltype(got);
    return ulps(got, expected) <=
           1 + robust_norm_bound<Eigen::half>() * std::ldexp(1.0, std::numeric_limits<T>::digits);
  };
  for (Eigen::Index j = 0; j < matrix.cols(); ++j)
    for (Eigen::Index i = 0; i < matrix.rows(); ++i) {
      const bool inside = i >= 3 && i < 603 && j >= 5 && j < 805;
      if (inside)
        ASSERT_TRUE(within(matrix(i, j), to_quad(before(i, j)) * c)) << i << "," << j;
      else
        ASSERT_EQ(matrix(i, j), before(i, j)) << "outside the block: " << i << "," << j;
    }
  for (std::size_t k = 0; k < small.size(); ++k)
    for (std::size_t i = 0; i < small[k].size(); ++i)
      ASSERT_TRUE(within(small[k][i], to_quad(small_before[k][i]) * c)) << "tensor " << k;
  for (std::size_t i = 0; i < large.size(); ++i) ASSERT_LE(ulps(large[i], to_quad(large_before[i]) * c), 1.0) << i;
}

TEST(Parallel, SmallWorkStaysOnTheCaller) {
  unsigned used = 0;
  const std::vector<std::vector<float>> tiny{std::vector<float>(1000, 1.0f)};
  EXPECT_TRUE(gradclip::detail::split_group(tiny, 8, used).empty());
  EXPECT_EQ(used, 1u);
  // Three grains' worth: at most three threads, however many are offered.
  const std::vector<std::vector<float>> three{std::vector<float>(3 * gradclip::parallel_grain_bytes / 4)};
  const auto pieces = gradclip::detail::split_group(three, 8, used);
  EXPECT_EQ(used, 3u);
  const auto bounds = gradclip::detail::balanced_runs(pieces, used);
  ASSERT_EQ(bounds.size(), 4u);
  std::size_t covered = 0;
  for (unsigned k = 0; k < used; ++k) {
    std::size_t bytes = 0;
    for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) bytes += pieces[i].bytes;
    EXPECT_GE(bytes, gradclip::parallel_grain_bytes / 2) << "thread " << k;
    covered += bytes;
  }
  EXPECT_EQ(covered, 3 * gradclip::parallel_grain_bytes);
}

}  // namespace
