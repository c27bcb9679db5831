// options::threads: the same bits as one thread for every thread count (a fixed partition merged in a
// fixed order), every element scaled exactly once, small work on the caller.
#define EIGEN_USE_THREADS  // Eigen::ThreadPoolDevice
#include <gradclip/eigen_executor.hpp>
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using namespace gradclip_test;

gradclip::options threaded(unsigned count, gradclip::on_nonfinite nonfinite = gradclip::on_nonfinite::skip) {
  return {nonfinite, 0.0, gradclip::l2_norm, count};
}

template <class T>
class Parallel : public ::testing::Test {};
TYPED_TEST_SUITE(Parallel, element_types);

// Elements for `threads` grains of work, plus a tail that is not a whole block.
template <class T>
std::size_t elements_for(unsigned grains) {
  return grains * gradclip::detail::piece_elements + 777;
}

TYPED_TEST(Parallel, EveryNormIsTheSameBitsOnEveryThreadCount) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto g = random_gradient<T>(elements_for<T>(5), rng);
  EXPECT_LE(relative_error(gradclip::norm(g.data(), g.size()), exact_norm(g)), robust_norm_bound<T>());
  for (const auto type : {gradclip::l2_norm, gradclip::l1_norm, gradclip::inf_norm, gradclip::norm_type{3.0}}) {
    gradclip::options opt = threaded(1);
    opt.norm = type;
    const double one = gradclip::norm(g.data(), g.size(), opt);
    for (unsigned count : {0u, 2u, 3u, 4u, 7u, 16u}) {
      opt.threads = count;
      EXPECT_EQ(gradclip::norm(g.data(), g.size(), opt), one) << count << " threads, p = " << type.p();
    }
  }
}

TYPED_TEST(Parallel, ClipScalesEveryElementOnceLikeOneThread) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed + 1));
  std::mt19937_64 rng(seed + 1);
  const auto original = random_gradient<T>(elements_for<T>(2), rng);
  const double max_norm = 0.25 * gradclip::norm(original.data(), original.size());
  auto serial = original;
  const auto one = gradclip::clip_by_norm(serial.data(), serial.size(), max_norm);
  for (unsigned count : {2u, 3u, 16u}) {
    auto work = original;
    const auto many = gradclip::clip_by_norm(work.data(), work.size(), max_norm, threaded(count));
    EXPECT_TRUE(many.clipped);
    EXPECT_EQ(many.coefficient, one.coefficient) << count << " threads";
    EXPECT_TRUE(same_bits(work, serial)) << count << " threads";
    // Each element is the projection of its original within an ulp (a missed or doubled slice is off by 4x).
    const quad exact_coefficient = static_cast<quad>(max_norm) / exact_norm(original);
    double worst = 0;
    for (std::size_t i = 0; i < original.size(); ++i)
      worst = std::max(worst, ulps(work[i], to_quad(original[i]) * exact_coefficient));
    EXPECT_LE(worst, 1.0) << count << " threads";
  }
}

TYPED_TEST(Parallel, BelowThresholdAndNonFiniteGradientsAreLeftUntouched) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 2);
  auto g = random_gradient<T>(elements_for<T>(2), rng);
  const auto original = g;
  const auto result = gradclip::clip_by_norm(g.data(), g.size(), 1e30, threaded(2));
  EXPECT_FALSE(result.clipped);
  EXPECT_EQ(result.coefficient, 1.0);
  EXPECT_TRUE(same_bits(g, original));

  g[g.size() - 3] = std::numeric_limits<T>::quiet_NaN();
  const auto with_nan = g;
  const auto skipped = gradclip::clip_by_norm(g.data(), g.size(), 1.0, threaded(2));
  EXPECT_FALSE(skipped.finite);
  EXPECT_TRUE(same_bits(g, with_nan));
  EXPECT_THROW((void)gradclip::clip_by_norm(g.data(), g.size(), 1.0, threaded(2, gradclip::on_nonfinite::error)),
               gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(g, with_nan));
}

TEST(Parallel, BadArgumentsThrowNamingTheFunction) {
  std::vector<float> g(16, 1.0f);
  try {
    (void)gradclip::clip_by_norm(g.data(), g.size(), -1.0, threaded(2));
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gradclip::clip_by_norm"), std::string::npos) << e.what();
  }
  std::vector<std::vector<float>> group{g};
  try {
    (void)gradclip::clip_by_global_norm(group, std::nan(""), threaded(2));
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

  const double one = gradclip::global_norm(group);
  EXPECT_LE(relative_error(one, exact), robust_norm_bound<Eigen::half>());
  for (unsigned count : {2u, 4u, 16u}) {
    EXPECT_EQ(gradclip::global_norm(group, threaded(count)), one) << count;
    EXPECT_EQ(gradclip::partial_global_norm(group, threaded(count)).norm(), one) << count;
  }

  const Eigen::MatrixXd before = matrix;
  const auto small_before = small;
  const auto large_before = large;
  const double max_norm = 0.5 * static_cast<double>(exact);
  const auto result = gradclip::clip_by_global_norm(group, max_norm, threaded(4));
  ASSERT_TRUE(result.clipped);
  const quad c = static_cast<quad>(max_norm) / exact;
  // One rounding, plus the coefficient's error, which is the FP16 member's norm bound (docs/numerics.md,
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

// An Eigen pool the caller already has gives the same bits as gradclip's own pool and as one thread.
TEST(Parallel, EigenThreadPoolsRunTheSamePartition) {
  std::mt19937_64 rng(seed + 4);
  const auto original = random_gradient<float>(3 * gradclip::detail::piece_elements + 5, rng);
  Eigen::ThreadPool threads(3);
  Eigen::ThreadPoolDevice device(&threads, 3);
  const gradclip::eigen_executor<Eigen::ThreadPoolDevice> on_device(device);
  const gradclip::eigen_executor<Eigen::ThreadPoolInterface> on_pool(threads);
  auto serial = original;
  const auto one = gradclip::clip_by_norm(serial.data(), serial.size(), 1.0);
  for (const gradclip::executor* pool :
       {static_cast<const gradclip::executor*>(&on_device), static_cast<const gradclip::executor*>(&on_pool)}) {
    gradclip::options opt = threaded(4);
    opt.pool = pool;
    EXPECT_EQ(gradclip::norm(original.data(), original.size(), opt), one.norm);
    auto work = original;
    const auto many = gradclip::clip_by_norm(work.data(), work.size(), 1.0, opt);
    EXPECT_EQ(many.coefficient, one.coefficient);
    EXPECT_TRUE(same_bits(work, serial));
  }
}

TEST(Parallel, SmallWorkStaysOnTheCallerAndLargeWorkIsShared) {
  unsigned used = 0;
  const std::vector<std::vector<float>> tiny{std::vector<float>(1000, 1.0f)};
  using layout = gradclip::detail::whole_group<const std::vector<std::vector<float>>>;
  EXPECT_TRUE(gradclip::detail::pieces_for_threads<true>(layout{tiny}, 8, used).empty());
  EXPECT_EQ(used, 1u);
  // Three pieces' worth: three threads at most, however many are offered; the pieces cover every element.
  const std::vector<std::vector<float>> three{std::vector<float>(3 * gradclip::detail::piece_elements)};
  const auto pieces = gradclip::detail::pieces_for_threads<true>(layout{three}, 8, used);
  EXPECT_EQ(used, 3u);
  ASSERT_EQ(pieces.size(), 3u);
  std::size_t covered = 0;
  for (const auto& piece : pieces) covered += piece.bytes() / sizeof(float);
  EXPECT_EQ(covered, three[0].size());
}

}  // namespace
