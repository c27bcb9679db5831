// adaptive_clip (AGC) against a direct binary128 implementation of Optax's formula.
#include <gradclip/adaptive_clip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::on_nonfinite;

template <class T>
class AdaptiveClipTyped : public ::testing::Test {};
TYPED_TEST_SUITE(AdaptiveClipTyped, element_types);

using quad_units = std::vector<std::vector<quad>>;

/// Optax's adaptive_grad_clip on one unit, in binary128: the exact clipped values.
std::vector<quad> optax_unit(const std::vector<quad>& g, const std::vector<quad>& w, double clipping, double eps,
                             bool& clipped) {
  quad gs = 0, ws = 0;
  for (quad x : g) gs += x * x;
  for (quad x : w) ws += x * x;
  const quad g_norm = quad_sqrt(gs), w_norm = quad_sqrt(ws);
  const quad max_norm = quad(clipping) * (w_norm > quad(eps) ? w_norm : quad(eps));
  clipped = !(g_norm < max_norm);
  if (!clipped) return g;
  const quad coefficient = max_norm / (g_norm > quad(1e-6) ? g_norm : quad(1e-6));
  std::vector<quad> out;
  for (quad x : g) out.push_back(x * coefficient);
  return out;
}

/// Rows of a rows x cols column-major matrix, as binary128 units.
template <class M>
quad_units rows_of(const M& m) {
  quad_units units(static_cast<std::size_t>(m.rows()));
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) units[static_cast<std::size_t>(i)].push_back(to_quad(m(i, j)));
  return units;
}

template <class T>
Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> random_matrix(Eigen::Index rows, Eigen::Index cols,
                                                               std::mt19937_64& rng, double scale) {
  const auto values = random_gradient<T>(static_cast<std::size_t>(rows * cols), rng, scale);
  return Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>>(values.data(), rows, cols);
}

// Each clipped element within one unit in the last place of T; for FP64 add the errors of the two unit
// norms (column sweeps round like two-level sums) and of the coefficient's product and quotient.
template <class T>
double allowed_ulps() {
  return std::is_same_v<T, double> ? 8.0 : 1.0;
}

template <class T, class W>
void expect_matches_optax(Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> g, const W& w, double clipping,
                          double eps = 1e-3) {
  const quad_units g_units = rows_of(g), w_units = rows_of(w);
  const auto original = g;
  const auto result = gradclip::adaptive_clip(g, w, clipping, eps);
  EXPECT_TRUE(result.finite);
  const bool vector = g.rows() == 1 || g.cols() == 1;
  ASSERT_EQ(result.units, g.size() == 0 ? 0u : vector ? 1u : static_cast<std::size_t>(g.rows()));
  std::size_t clipped_units = 0;
  if (vector) {
    // One unit: the whole (column or row) vector.
    std::vector<quad> gv, wv;
    for (const auto& u : g_units) gv.insert(gv.end(), u.begin(), u.end());
    for (const auto& u : w_units) wv.insert(wv.end(), u.begin(), u.end());
    bool clipped = false;
    const auto exact = optax_unit(gv, wv, clipping, eps, clipped);
    clipped_units += clipped;
    for (Eigen::Index k = 0; k < g.size(); ++k)
      ASSERT_LE(ulps(g.data()[k], exact[static_cast<std::size_t>(k)]), allowed_ulps<T>()) << "element " << k;
  } else {
    for (Eigen::Index i = 0; i < g.rows(); ++i) {
      bool clipped = false;
      const auto exact = optax_unit(g_units[static_cast<std::size_t>(i)], w_units[static_cast<std::size_t>(i)],
                                    clipping, eps, clipped);
      clipped_units += clipped;
      for (Eigen::Index j = 0; j < g.cols(); ++j) {
        if (!clipped)
          ASSERT_EQ(static_cast<double>(g(i, j)), static_cast<double>(original(i, j)));
        else
          ASSERT_LE(ulps(g(i, j), exact[static_cast<std::size_t>(j)]), allowed_ulps<T>())
              << "row " << i << " column " << j;
      }
    }
  }
  EXPECT_EQ(result.clipped, clipped_units);
}

TYPED_TEST(AdaptiveClipTyped, RandomWeightsMatchOptaxRowByRow) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto [rows, cols] : {std::pair<int, int>{64, 300}, {7, 2000}, {3, 1}, {1, 5}, {2, 2}}) {
    // Gradients of mixed sizes so that some rows clip and some do not.
    auto g = random_matrix<T>(rows, cols, rng, 0.01);
    for (int i = 0; i < rows; i += 2) g.row(i) *= T(50.0f);
    const auto w = random_matrix<T>(rows, cols, rng, 0.05);
    expect_matches_optax(g, w, 0.01);
    expect_matches_optax(g, w, 0.1);
  }
}

TYPED_TEST(AdaptiveClipTyped, ZeroWeightsUseEpsAndZeroGradientsStayUntouched) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  const auto g = random_matrix<T>(8, 40, rng, 1.0);
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> zero_w =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>::Zero(8, 40);
  expect_matches_optax(g, zero_w, 0.01);       // max_norm = 0.01 * 1e-3 for every row
  expect_matches_optax(g, zero_w, 0.5, 0.02);  // a different eps
  // A zero gradient unit: 0 < max_norm, untouched, not counted.
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> zero_g =
      Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>::Zero(8, 40);
  const auto w = random_matrix<T>(8, 40, rng, 1.0);
  auto result = gradclip::adaptive_clip(zero_g, w, 0.01);
  EXPECT_EQ(result.units, 8u);
  EXPECT_EQ(result.clipped, 0u);
  EXPECT_EQ(result.min_coefficient, 1.0);
  EXPECT_TRUE(zero_g.isZero());
  // clipping = 0: every unit "clips" by 0 (Optax's where picks the scaled branch), zero stays zero.
  result = gradclip::adaptive_clip(zero_g, w, 0.0);
  EXPECT_EQ(result.clipped, 8u);
  EXPECT_EQ(result.min_coefficient, 0.0);
  EXPECT_TRUE(zero_g.isZero());
}

TEST(AdaptiveClip, Optaxs1e6GuardEngagesForTinyGradients) {
  // max_norm = 1e-4 * 1e-3 = 1e-7 <= ||g|| = 5e-7 < 1e-6: coefficient 1e-7 / 1e-6, not 1e-7 / 5e-7.
  Eigen::VectorXd g(2), w = Eigen::VectorXd::Zero(2);
  g << 3e-7, 4e-7;
  const auto result = gradclip::adaptive_clip(g, w, 1e-4);
  EXPECT_EQ(result.clipped, 1u);
  // Neither norm enters (both floors engage): the coefficient is 1e-4 * 1e-3 / 1e-6 rounded twice (the
  // threshold's product and the quotient), each element once more (2 and 3 roundings of 2^-53, to first order).
  const quad coefficient = to_quad(1e-4) * to_quad(1e-3) / to_quad(1e-6);
  EXPECT_LE(relative_error(result.min_coefficient, coefficient), 2.01 * 0x1p-53);
  EXPECT_LE(relative_error(g(0), to_quad(3e-7) * coefficient), 3.01 * 0x1p-53);
  EXPECT_LE(relative_error(g(1), to_quad(4e-7) * coefficient), 3.01 * 0x1p-53);
}

TEST(AdaptiveClip, LayoutsAndTensorsUseTheFirstDimension) {
  std::mt19937_64 rng(seed);
  const auto base_g = random_matrix<float>(6, 9, rng, 1.0);
  const auto base_w = random_matrix<float>(6, 9, rng, 0.1);
  auto expected = base_g;
  const auto reference = gradclip::adaptive_clip(expected, base_w, 0.05);
  ASSERT_GT(reference.clipped, 0u);

  // Row-major gradient with column-major FP64 weights.
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = base_g;
  const Eigen::MatrixXd weights64 = base_w.cast<double>();
  auto result = gradclip::adaptive_clip(row_major, weights64, 0.05);
  EXPECT_EQ(result.clipped, reference.clipped);
  // Each element within the one ulp of FP32 of Optax's exact value (allowed_ulps), as the column sweep's.
  const quad_units g_units = rows_of(base_g), w_units = rows_of(base_w);
  const auto expect_optax_rows = [&](const auto& element) {
    for (int i = 0; i < 6; ++i) {
      bool clipped = false;
      const auto exact =
          optax_unit(g_units[static_cast<std::size_t>(i)], w_units[static_cast<std::size_t>(i)], 0.05, 1e-3, clipped);
      for (int j = 0; j < 9; ++j)
        EXPECT_LE(ulps(element(i, j), exact[static_cast<std::size_t>(j)]), allowed_ulps<float>())
            << "row " << i << " column " << j;
    }
  };
  expect_optax_rows([&](int i, int j) { return row_major(i, j); });

  // A block (strided rows and columns) of a larger matrix.
  Eigen::MatrixXf big = Eigen::MatrixXf::Zero(10, 12);
  big.block(2, 1, 6, 9) = base_g;
  result = gradclip::adaptive_clip(big.block(2, 1, 6, 9), base_w, 0.05);
  EXPECT_TRUE(big.block(2, 1, 6, 9) == expected);
  EXPECT_EQ(big.col(0).squaredNorm(), 0.0f);

  // Eigen tensors: t(i, j) like m(i, j), column- and row-major.
  Eigen::Tensor<float, 2> t(6, 9), tw(6, 9);
  Eigen::Tensor<float, 2, Eigen::RowMajor> rt(6, 9);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 9; ++j) {
      t(i, j) = rt(i, j) = base_g(i, j);
      tw(i, j) = base_w(i, j);
    }
  result = gradclip::adaptive_clip(t, tw, 0.05);
  EXPECT_EQ(result.units, 6u);
  (void)gradclip::adaptive_clip(rt, tw, 0.05);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 9; ++j) EXPECT_EQ(t(i, j), expected(i, j));
  // Contiguous rows sum in another order than the column sweep: each within its bound of Optax's value.
  expect_optax_rows([&](int i, int j) { return rt(i, j); });

  // Rank 4 ([out, in, kh, kw]): unit i is everything with first index i.
  Eigen::Tensor<double, 4> conv(3, 2, 2, 2), conv_w(3, 2, 2, 2);
  conv.setConstant(1.0);
  conv_w.setConstant(0.5);  // ||w_u|| = 0.5 * sqrt(8), ||g_u|| = sqrt(8)
  result = gradclip::adaptive_clip(conv, conv_w, 0.1);
  EXPECT_EQ(result.units, 3u);
  EXPECT_EQ(result.clipped, 3u);
  // Optax's 1 * 0.1 * ||w_u|| / ||g_u|| = 0.1 * 0.5 exactly, within the FP64 allowance.
  EXPECT_LE(ulps(conv(2, 1, 0, 1), to_quad(0.1) / 2), allowed_ulps<double>());

  // A tensor with one dimension above 1 is a vector: one unit.
  Eigen::Tensor<float, 3> column(1, 5, 1), column_w(1, 5, 1);
  column.setConstant(1.0f);
  column_w.setConstant(1.0f);
  result = gradclip::adaptive_clip(column, column_w, 0.1);
  EXPECT_EQ(result.units, 1u);
  // Optax's 1 * 0.1 * ||w|| / ||g|| = 0.1 (the double) exactly, within FP32's one ulp.
  EXPECT_LE(ulps(column(0, 3, 0), to_quad(0.1)), allowed_ulps<float>());
}

TEST(AdaptiveClip, Fp64BeyondDoubleRangeStillClips) {
  Eigen::MatrixXd g(2, 2), w(2, 2);
  g << 1.5e308, 1.5e308, 1.0, 0.0;
  w << 1e308, 1e308, 1.0, 0.0;
  const auto result = gradclip::adaptive_clip(g, w, 0.5);
  // Row 0: max_norm = 0.5 * sqrt(2) * 1e308, ||g|| = sqrt(2) * 1.5e308: coefficient 1/3.
  EXPECT_EQ(result.clipped, 2u);
  // Row 0 within the FP64 allowance of Optax's exact value; row 1's norms (of [1, 0]) and its coefficient
  // 0.5 / 1 are exact, so its elements are too.
  const quad w_norm = quad_sqrt(2 * to_quad(1e308) * to_quad(1e308));
  const quad g_norm = quad_sqrt(2 * to_quad(1.5e308) * to_quad(1.5e308));
  EXPECT_LE(ulps(g(0, 0), to_quad(1.5e308) * quad(0.5) * w_norm / g_norm), allowed_ulps<double>());
  EXPECT_LE(ulps(g(0, 1), to_quad(1.5e308) * quad(0.5) * w_norm / g_norm), allowed_ulps<double>());
  EXPECT_EQ(g(1, 0), 0.5);
  EXPECT_EQ(g(1, 1), 0.0);
}

TEST(AdaptiveClip, NonFiniteUnitsFollowTheOption) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Eigen::MatrixXd g(2, 2), w = Eigen::MatrixXd::Ones(2, 2);
  g << 10.0, 10.0, std::numeric_limits<double>::infinity(), 1.0;
  const Eigen::MatrixXd original = g;
  // skip is per unit, as clip_by_norm's is per call: the infinite row keeps its bits, the finite one clips.
  Eigen::MatrixXd skipped = g;
  auto result = gradclip::adaptive_clip(skipped, w, 0.1);
  EXPECT_FALSE(result.finite);
  EXPECT_EQ(result.clipped, 1u);
  EXPECT_TRUE(skipped.row(1) == original.row(1));
  EXPECT_NEAR(skipped(0, 0), 0.1, 1e-16);
  // error: nothing is written, not even the finite row.
  EXPECT_THROW((void)gradclip::adaptive_clip(g, w, 0.1, 1e-3, on_nonfinite::error), gradclip::nonfinite_error);
  EXPECT_TRUE(g == original);
  // propagate is Optax's arithmetic: the infinite row is multiplied by max_norm / inf = 0.
  result = gradclip::adaptive_clip(g, w, 0.1, 1e-3, on_nonfinite::propagate);
  EXPECT_FALSE(result.finite);
  EXPECT_EQ(result.clipped, 2u);
  EXPECT_TRUE(std::isnan(g(1, 0)));  // inf * 0
  EXPECT_EQ(g(1, 1), 0.0);
  EXPECT_NEAR(g(0, 0), 0.1, 1e-16);
  // NaN weights: the unit's max_norm is NaN, so Optax scales its gradient by NaN.
  Eigen::MatrixXd g2 = Eigen::MatrixXd::Ones(2, 2), w2 = Eigen::MatrixXd::Ones(2, 2);
  w2(0, 1) = nan;
  result = gradclip::adaptive_clip(g2, w2, 0.1, 1e-3, on_nonfinite::propagate);
  EXPECT_TRUE(std::isnan(g2(0, 0)));
  EXPECT_NEAR(g2(1, 0), 0.1, 1e-16);  // the finite row is clipped as usual
}

template <class F>
void expect_invalid(F&& call) {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("gradclip::adaptive_clip:", 0), 0u) << e.what();
  }
}

TEST(AdaptiveClip, BadInputThrowsBeforeTouchingAnything) {
  Eigen::MatrixXf g = Eigen::MatrixXf::Constant(3, 4, 5.0f), w = Eigen::MatrixXf::Ones(3, 4);
  const Eigen::MatrixXf original = g;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double clipping : {-0.01, nan, std::numeric_limits<double>::infinity()})
    expect_invalid([&] { (void)gradclip::adaptive_clip(g, w, clipping); });
  for (double eps : {-1e-3, nan}) expect_invalid([&] { (void)gradclip::adaptive_clip(g, w, 0.01, eps); });
  const Eigen::MatrixXf transposed = Eigen::MatrixXf::Ones(4, 3);
  expect_invalid([&] { (void)gradclip::adaptive_clip(g, transposed, 0.01); });
  Eigen::Tensor<float, 3> t(3, 4, 1), tw(3, 1, 4);
  t.setConstant(1.0f);
  tw.setConstant(1.0f);
  expect_invalid([&] { (void)gradclip::adaptive_clip(t, tw, 0.01); });
  EXPECT_TRUE(g == original);
}

TEST(AdaptiveClip, EmptyGradientsHaveNoUnits) {
  Eigen::MatrixXf g(0, 5), w(0, 5);
  const auto result = gradclip::adaptive_clip(g, w, 0.01);
  EXPECT_EQ(result.units, 0u);
  EXPECT_TRUE(result.finite);
  std::vector<float> v, vw;
  EXPECT_EQ(gradclip::adaptive_clip(v, vw, 0.01).units, 0u);
}

// Column-major rows (units that interleave) over more than one piece of columns, and row-major rows:
// 1, 2 and 3 threads clip to the same bits, every row clipping.
template <int Order>
void expect_same_bits_for_any_thread_count(Eigen::Index rows, Eigen::Index cols) {
  using matrix = Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic, Order>;
  std::mt19937_64 rng(20261204);
  const matrix grad = random_matrix<Eigen::half>(rows, cols, rng, 1.0);
  const matrix weights = random_matrix<Eigen::half>(rows, cols, rng, 1.0);
  std::vector<matrix> clipped;
  for (unsigned threads : {1u, 2u, 3u}) {
    clipped.push_back(grad);
    gradclip::options opt;
    opt.threads = threads;
    const auto r = gradclip::adaptive_clip(clipped.back(), weights, 0.01, 1e-3, opt);
    EXPECT_EQ(r.clipped, static_cast<std::size_t>(rows));
  }
  for (std::size_t k = 1; k < clipped.size(); ++k) {
    SCOPED_TRACE(std::to_string(k + 1) + " threads");
    EXPECT_EQ(std::memcmp(clipped[k].data(), clipped[0].data(), sizeof(Eigen::half) * clipped[0].size()), 0);
  }
  EXPECT_NE(std::memcmp(clipped[0].data(), grad.data(), sizeof(Eigen::half) * grad.size()), 0);
}

TEST(AdaptiveClip, AnyThreadCountGivesTheSameBits) {
  expect_same_bits_for_any_thread_count<Eigen::ColMajor>(1100, 3000);
  expect_same_bits_for_any_thread_count<Eigen::RowMajor>(1100, 3000);
}

// A training loop calls adaptive_clip with the same shapes every step: the per-unit arrays of a call (parts,
// plans, coefficients: about 200 bytes a unit) come from the thread's kept blocks (detail/scratch.hpp),
// and a repeated call takes no new one. glibc gives such freed blocks back to the system, and faulting
// them in again on every call cost as much as the call's own memory traffic on a VM.
TEST(AdaptiveClip, RepeatedCallsReuseTheirPerUnitMemory) {
  for (const unsigned threads : {1u, 2u}) {
    std::mt19937_64 rng(7);
    Eigen::MatrixXf grad = random_matrix<float>(4096, 8, rng, 1.0), weights = random_matrix<float>(4096, 8, rng, 1.0);
    gradclip::options opt;
    opt.threads = threads;
    gradclip::detail::scratch_blocks* blocks = gradclip::detail::this_threads_blocks();
    ASSERT_NE(blocks, nullptr);
    double clipping = 0.5;
    (void)gradclip::adaptive_clip(grad, weights, clipping, 1e-3, opt);
    const std::size_t kept = blocks->kept_bytes();
    EXPECT_GE(kept, std::size_t(2 * 4096) * sizeof(gradclip::partial_norm)) << threads << " threads";
    for (int call = 0; call < 3; ++call) {
      clipping *= 0.9;
      const auto r = gradclip::adaptive_clip(grad, weights, clipping, 1e-3, opt);
      EXPECT_GT(r.clipped, 0u);
      EXPECT_EQ(blocks->kept_bytes(), kept) << threads << " threads, call " << call;
    }
  }
}

}  // namespace
