// Gradient front-ends: Eigen tensors of any rank, tensor maps, dense objects and blocks, containers,
// raw buffers, grad_view, and groups (global norms) including groups that mix element types.
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <array>
#include <cstring>
#include <functional>
#include <random>
#include <utility>
#include <vector>

namespace {

using namespace gradclip_test;

template <class T>
class FrontEndTyped : public ::testing::Test {};
TYPED_TEST_SUITE(FrontEndTyped, element_types);

template <class T>
std::vector<T> values(std::size_t n, std::uint64_t salt) {
  std::mt19937_64 rng(seed + salt);
  return random_gradient<T>(n, rng);
}

TYPED_TEST(FrontEndTyped, TensorsOfEveryRankKeepTypeAndShape) {
  using T = TypeParam;
  Eigen::Tensor<T, 0> scalar;
  scalar() = T(-4);
  EXPECT_EQ(gradclip::norm(scalar), 4.0);
  (void)gradclip::clip_by_norm(scalar, 1.0);
  EXPECT_EQ(static_cast<double>(scalar()), -1.0);

  Eigen::Tensor<T, 3> t(3, 4, 5);
  const auto v = values<T>(60, 1);
  std::copy(v.begin(), v.end(), t.data());
  EXPECT_EQ(gradclip::norm(t), gradclip::norm(v));
  const auto expected = [&] {
    auto copy = v;
    (void)gradclip::clip_by_norm(copy, 0.5);
    return copy;
  }();
  const auto result = gradclip::clip_by_norm(t, 0.5);
  EXPECT_TRUE(result.clipped);
  EXPECT_EQ(t.dimension(0), 3);
  EXPECT_EQ(t.dimension(2), 5);
  EXPECT_EQ(std::memcmp(t.data(), expected.data(), 60 * sizeof(T)), 0);
}

TYPED_TEST(FrontEndTyped, TensorMapOverARawGradientBuffer) {
  using T = TypeParam;
  auto buffer = values<T>(64, 2);
  const double before = gradclip::norm(buffer);
  Eigen::TensorMap<Eigen::Tensor<T, 2>> map(buffer.data(), 8, 8);
  EXPECT_EQ(gradclip::norm(map), before);
  (void)gradclip::clip_by_norm(map, before / 2);
  EXPECT_NEAR(gradclip::norm(buffer), before / 2, before * epsilon_of<T>());
  Eigen::TensorFixedSize<T, Eigen::Sizes<2, 2>> fixed;
  fixed.setConstant(T(1));
  EXPECT_EQ(gradclip::norm(fixed), 2.0);
}

TYPED_TEST(FrontEndTyped, DenseMatricesArraysMapsAndContiguousBlocks) {
  using T = TypeParam;
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  const auto v = values<T>(30, 3);
  Matrix m = Eigen::Map<const Matrix>(v.data(), 5, 6);
  EXPECT_EQ(gradclip::norm(m), gradclip::norm(v));
  Eigen::Array<T, Eigen::Dynamic, 1> a = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(v.data(), 30);
  EXPECT_EQ(gradclip::norm(a), gradclip::norm(v));
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = m;
  EXPECT_EQ(gradclip::norm(row_major), gradclip::norm(v));
  // Whole columns of a column-major matrix are contiguous.
  EXPECT_EQ(gradclip::norm(m.leftCols(2)), gradclip::norm(v.data(), 10));
  auto copy = v;
  Eigen::Map<Matrix> map(copy.data(), 5, 6);
  (void)gradclip::clip_by_norm(map, 0.25);
  EXPECT_NEAR(gradclip::norm(copy), 0.25, 0.25 * 2 * epsilon_of<T>());
}

TYPED_TEST(FrontEndTyped, StridedBlocksRowsAndInnerStridesTouchOnlyTheirElements) {
  using T = TypeParam;
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  const auto v = values<T>(2000 * 3, 4);
  Matrix m = Eigen::Map<const Matrix>(v.data(), 2000, 3);
  const Matrix original = m;
  auto check_block = [&](auto&& block, bool one_run) {
    std::vector<T> elements;
    for (Eigen::Index j = 0; j < block.cols(); ++j)
      for (Eigen::Index i = 0; i < block.rows(); ++i) elements.push_back(block(i, j));
    // Summed by segment (gathered in runs of up to 1 024), so in another order than the contiguous copy:
    // both within the bound of the exact norm. One gathered run is the copy's order: the same bits.
    const quad exact = exact_norm(elements);
    EXPECT_LE(relative_error(gradclip::norm(block), exact), robust_norm_bound<T>());
    EXPECT_LE(relative_error(gradclip::norm(elements), exact), robust_norm_bound<T>());
    if (one_run) {
      EXPECT_EQ(gradclip::norm(block), gradclip::norm(elements));
    }
    auto expected = elements;
    (void)gradclip::clip_by_norm(expected, 0.125);
    (void)gradclip::clip_by_norm(block, 0.125);
    std::size_t k = 0;
    for (Eigen::Index j = 0; j < block.cols(); ++j)
      for (Eigen::Index i = 0; i < block.rows(); ++i, ++k) ASSERT_LE(ulps(block(i, j), to_quad(expected[k])), 1.0);
  };
  check_block(m.block(10, 1, 1500, 2), false);  // segments with an outer stride
  check_block(m.row(7), true);                  // inner stride 2000
  Eigen::Map<Matrix, 0, Eigen::Stride<Eigen::Dynamic, 2>> every_other(m.data(), 500, 3,
                                                                      Eigen::Stride<Eigen::Dynamic, 2>(2000, 2));
  check_block(every_other, false);  // inner stride 2 and outer stride 2000, more than one gather block
  // Elements outside the blocks are untouched.
  for (auto [i, j] : {std::pair{1, 0}, std::pair{1999, 0}, std::pair{9, 1}, std::pair{1511, 2}})
    EXPECT_EQ(static_cast<double>(m(i, j)), static_cast<double>(original(i, j)));
}

TYPED_TEST(FrontEndTyped, GlobalNormEqualsTheNormOfTheConcatenation) {
  using T = TypeParam;
  std::vector<std::vector<T>> group;
  std::vector<T> all;
  for (std::size_t n : {0u, 1u, 100u, 1500u, 3u}) {
    group.push_back(values<T>(n, 5 + n));
    all.insert(all.end(), group.back().begin(), group.back().end());
  }
  const quad exact = exact_norm(all);
  EXPECT_LE(relative_error(gradclip::global_norm(group), exact), robust_norm_bound<T>());
  EXPECT_LE(relative_error(gradclip::global_norm<gradclip::max_scale>(group), exact), chain_norm_bound<T>());
  auto clipped_all = all;
  const auto single = gradclip::clip_by_norm(clipped_all, 1.0);
  const auto global = gradclip::clip_by_global_norm(group, 1.0);
  EXPECT_EQ(global.clipped, single.clipped);
  // Members and the concatenation are summed in different chains and blocks: each norm within the bound.
  EXPECT_NEAR(global.coefficient, single.coefficient, single.coefficient * 2 * robust_norm_bound<T>());
  std::size_t k = 0;
  for (const auto& g : group)
    for (const T& x : g) {
      const quad expected = to_quad(all[k++]) / exact;
      ASSERT_LE(ulps(x, expected), 1.0);
    }
}

TEST(FrontEnd, EmptyGroupsAndGroupsOfEmptyGradients) {
  std::vector<Eigen::Tensor<float, 2>> none;
  EXPECT_EQ(gradclip::global_norm(none), 0.0);
  const auto result = gradclip::clip_by_global_norm(none, 1.0);
  EXPECT_FALSE(result.clipped);
  std::vector<Eigen::Tensor<float, 2>> empties(3, Eigen::Tensor<float, 2>(0, 4));
  EXPECT_EQ(gradclip::global_norm(empties), 0.0);
}

TEST(FrontEnd, MixedElementTypesShareOneGlobalNorm) {
  Eigen::Tensor<Eigen::half, 2> weights(16, 8);
  weights.setConstant(Eigen::half(300.0f));
  Eigen::VectorXf bias = Eigen::VectorXf::Constant(8, 400.0f);
  std::vector<Eigen::bfloat16> embedding(100, Eigen::bfloat16(2.0f));
  std::vector<double> head{1e300};
  std::vector<gradclip::grad_view> group{weights, bias, embedding};
  EXPECT_EQ(group[0].type(), gradclip::dtype::float16);
  EXPECT_EQ(group[1].type(), gradclip::dtype::float32);
  EXPECT_EQ(group[2].size(), 100u);
  const double exact = std::sqrt(128 * 90000.0 + 8 * 160000.0 + 100 * 4.0);
  EXPECT_NEAR(gradclip::global_norm(group) / exact, 1.0, 1e-15);
  const auto result = gradclip::clip_by_global_norm(group, 1.0);
  // FP16 elements of a group with FP16 and BF16 members: one ulp plus 16 * 2^-24 relative of the exact
  // projection (numerics.md); a relative error r is at most r * 2^11 FP16 ulps.
  const quad exact_group_norm = quad_sqrt(quad(128 * 90000.0 + 8 * 160000.0 + 100 * 4.0));
  EXPECT_LE(ulps(weights(3, 3), quad(300) / exact_group_norm), 1.0 + robust_norm_bound<Eigen::half>() * 0x1p11);
  EXPECT_NEAR(bias(0), 400.0 / exact, 400.0 / exact * 1e-7);
  EXPECT_NEAR(result.coefficient, 1.0 / exact, 1e-15 / exact);
  // A temporary group of views works too, and one huge FP64 member dominates safely.
  const quad bias_norm = exact_norm(bias.data(), static_cast<std::size_t>(bias.size()));
  const auto with_head = gradclip::clip_by_global_norm({gradclip::grad_view(bias), gradclip::grad_view(head)}, 1.0);
  EXPECT_NEAR(with_head.norm, 1e300, 1e285);
  // FP64 and FP32 members only: robust's one ulp of the exact projection (numerics.md).
  EXPECT_LE(ulps(head[0], to_quad(1e300) / quad_sqrt(to_quad(1e300) * to_quad(1e300) + bias_norm * bias_norm)), 1.0);
}

TEST(FrontEnd, RangesOfPointersReferenceWrappersAndMaps) {
  Eigen::MatrixXf a = Eigen::MatrixXf::Constant(2, 2, 3.0f);
  Eigen::MatrixXf b = Eigen::MatrixXf::Constant(1, 1, 4.0f);
  std::vector<Eigen::MatrixXf*> pointers{&a, &b};
  EXPECT_LE(relative_error(gradclip::global_norm(pointers), quad_sqrt(52)), robust_norm_bound<float>());
  std::vector<std::reference_wrapper<Eigen::MatrixXf>> refs{a, b};
  EXPECT_EQ(gradclip::global_norm(refs), gradclip::global_norm(pointers));
  std::array<Eigen::Map<Eigen::VectorXf>, 2> maps{Eigen::Map<Eigen::VectorXf>(a.data(), 4),
                                                  Eigen::Map<Eigen::VectorXf>(b.data(), 1)};
  (void)gradclip::clip_by_global_norm(maps, 1.0);
  // robust's one ulp of the exact projection (numerics.md), and the norm's bound on the clipped elements.
  EXPECT_LE(ulps(b(0, 0), quad(4) / quad_sqrt(52)), 1.0);
  for (int k = 0; k < 4; ++k) EXPECT_LE(ulps(a.data()[k], quad(3) / quad_sqrt(52)), 1.0) << k;
  std::vector<gradclip::grad_view> raw{gradclip::grad_view(a.data(), 4)};
  EXPECT_LE(relative_error(gradclip::global_norm(raw), exact_norm(a.data(), 4)), robust_norm_bound<float>());
}

TEST(FrontEnd, NonFiniteAnywhereInAGroupSkipsTheWholeGroup) {
  std::vector<std::vector<float>> group{{1.0f, 2.0f}, {3.0f, std::numeric_limits<float>::infinity()}, {5.0f}};
  const auto before = group;
  const auto result = gradclip::clip_by_global_norm(group, 1.0);
  EXPECT_FALSE(result.finite);
  EXPECT_EQ(group, before);
  EXPECT_THROW((void)gradclip::clip_by_global_norm(group, 1.0, {gradclip::on_nonfinite::error}),
               gradclip::nonfinite_error);
  EXPECT_EQ(group, before);
}

}  // namespace
