// Per-example clipping (per_example.hpp), ghost norms (ghost_norm.hpp) and the adaptive bound
// (adaptive_bound.hpp) against direct binary128 implementations of the formulas.
#include <gradclip/adaptive_bound.hpp>
#include <gradclip/ghost_norm.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/per_example.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::on_nonfinite;

template <class T>
class PerExampleTyped : public ::testing::Test {};
using ElementTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(PerExampleTyped, ElementTypes);

/// One per-example tensor as the test sees it: example i's elements in the tensor's own order.
using batch_values = std::vector<std::vector<quad>>;

template <class T>
batch_values random_batch(std::size_t examples, std::size_t size, std::mt19937_64& rng, double scale) {
  batch_values b(examples);
  for (auto& example : b)
    for (T x : random_gradient<T>(size, rng, scale)) example.push_back(to_quad(x));
  return b;
}

/// A [B, rows, cols] tensor holding `values` (example i's element k at k's place in the layout order).
template <class T, int Layout>
Eigen::Tensor<T, 3, Layout> tensor_of(const batch_values& values, Eigen::Index rows, Eigen::Index cols) {
  Eigen::Tensor<T, 3, Layout> t(static_cast<Eigen::Index>(values.size()), rows, cols);
  for (Eigen::Index i = 0; i < t.dimension(0); ++i)
    for (Eigen::Index r = 0; r < rows; ++r)
      for (Eigen::Index c = 0; c < cols; ++c) {
        const Eigen::Index k = Layout == Eigen::RowMajor ? r * cols + c : r + rows * c;
        t(i, r, c) = T(static_cast<double>(values[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)]));
      }
  return t;
}

/// A B x n matrix whose row i is example i.
template <class M>
M matrix_of(const batch_values& values) {
  M m(static_cast<Eigen::Index>(values.size()), values.empty() ? 0 : static_cast<Eigen::Index>(values[0].size()));
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index k = 0; k < m.cols(); ++k)
      m(i, k) =
          typename M::Scalar(static_cast<double>(values[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)]));
  return m;
}

/// Opacus's flat clipping in binary128: n_i over every tensor, f_i = min(1, C / (n_i + epsilon)), the
/// weighted sums and, for the error bound, the sums of |f_i g_i|.
struct reference_sums {
  std::vector<quad> norms, factors;
  std::vector<std::vector<quad>> sums, magnitudes;
  std::size_t clipped = 0;
};

reference_sums opacus_reference(const std::vector<batch_values>& tensors, double max_norm, double epsilon = 0,
                                const std::vector<bool>& left_out = {}) {
  reference_sums r;
  const std::size_t examples = tensors.empty() ? 0 : tensors[0].size();
  for (std::size_t i = 0; i < examples; ++i) {
    quad s = 0;
    for (const auto& t : tensors)
      for (quad x : t[i]) s += x * x;
    r.norms.push_back(quad_sqrt(s));
    const quad f = quad(max_norm) / (r.norms.back() + quad(epsilon));
    r.factors.push_back(f < 1 ? f : quad(1));
    r.clipped += f < 1 ? 1 : 0;
  }
  for (const auto& t : tensors) {
    const std::size_t n = examples == 0 ? 0 : t[0].size();
    std::vector<quad> sum(n, 0), magnitude(n, 0);
    for (std::size_t i = 0; i < examples; ++i) {
      if (!left_out.empty() && left_out[i]) continue;
      for (std::size_t k = 0; k < n; ++k) {
        sum[k] += r.factors[i] * t[i][k];
        magnitude[k] += quad_abs(r.factors[i] * t[i][k]);
      }
    }
    r.sums.push_back(sum);
    r.magnitudes.push_back(magnitude);
  }
  return r;
}

/// The error bound of one clipped sum: the norm's error moves f_i (norm_bound), the product rounds once
/// (2^-24: FP32, or FP64 for FP64 input), B additions in the accumulator (unit acc_unit) each add at
/// most acc_unit of the running sum of magnitudes, and the final rounding to the output (out_unit).
struct sum_bound {
  double norm_bound, acc_unit, out_unit;
  std::size_t examples;
  double operator()(quad exact, quad magnitude) const {
    const double product = acc_unit == 0x1p-53 ? 0x1p-53 : 0x1p-24;
    return (norm_bound + product + static_cast<double>(examples) * acc_unit) * static_cast<double>(magnitude) +
           out_unit * static_cast<double>(quad_abs(exact)) + 1e-300;
  }
};

template <class U, class S>
void expect_sum_near(const S& sum, const std::vector<quad>& exact, const std::vector<quad>& magnitude,
                     const sum_bound& bound, const std::string& what) {
  ASSERT_EQ(static_cast<std::size_t>(sum.size()), exact.size()) << what;
  for (std::size_t k = 0; k < exact.size(); ++k) {
    const double got = static_cast<double>(sum.data()[k]);
    EXPECT_LE(std::abs(static_cast<double>(to_quad(got) - exact[k])), bound(exact[k], magnitude[k]))
        << what << " element " << k << ": got " << got << ", exact " << static_cast<double>(exact[k]);
  }
}

template <class T>
sum_bound bound_for(std::size_t examples, double out_unit) {
  const double acc = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;
  return {robust_norm_bound<T>(), acc, out_unit, examples};
}

// ---- Flat clip-and-accumulate

TYPED_TEST(PerExampleTyped, NormsAndSumsMatchBinary128InBothStorageOrders) {
  using T = TypeParam;
  using acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::mt19937_64 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>());
  const std::size_t examples = 37;  // not a multiple of any vector width: the tails run too
  const std::vector<batch_values> values{
      random_batch<T>(examples, 3 * 5, rng, 1.0), random_batch<T>(examples, 4 * 2, rng, 2.0),
      random_batch<T>(examples, 6, rng, 0.5), random_batch<T>(examples, 7, rng, 1.0)};
  const auto w = tensor_of<T, Eigen::ColMajor>(values[0], 3, 5);  // examples interleaved
  const auto v = tensor_of<T, Eigen::RowMajor>(values[1], 4, 2);  // examples contiguous
  const auto m = matrix_of<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>>(values[2]);
  const auto r = matrix_of<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(values[3]);
  const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> r_map(r.data(), r.rows(),
                                                                                                  r.cols());
  const double max_norm = 7.4;  // about the median norm: sqrt(15 + 8 * 4 + 6 / 4 + 7)
  const reference_sums want = opacus_reference(values, max_norm);
  ASSERT_GT(want.clipped, examples / 5);
  ASSERT_LT(want.clipped, examples - examples / 5);

  Eigen::Tensor<acc, 2> sum_w(3, 5);
  Eigen::Tensor<acc, 2, Eigen::RowMajor> sum_v(4, 2);
  Eigen::Matrix<acc, Eigen::Dynamic, 1> sum_m(6);
  std::vector<T> sum_r(7);  // a container: FP16 sums in FP16
  std::vector<double> norms;
  const auto result =
      gradclip::clip_per_example(std::tie(w, v, m, r_map), std::tie(sum_w, sum_v, sum_m, sum_r), max_norm, {}, norms);
  EXPECT_EQ(result.examples, examples);
  EXPECT_EQ(result.clipped, want.clipped);
  EXPECT_EQ(result.nonfinite, 0u);
  EXPECT_TRUE(result.finite);
  EXPECT_EQ(result.unclipped(), examples - want.clipped);
  ASSERT_EQ(norms.size(), examples);
  for (std::size_t i = 0; i < examples; ++i)
    EXPECT_LE(relative_error(norms[i], want.norms[i]), robust_norm_bound<T>()) << "example " << i;
  const sum_bound wide = bound_for<T>(examples, std::is_same_v<acc, double> ? 0x1p-53 : 0x1p-24);
  expect_sum_near<acc>(sum_w, want.sums[0], want.magnitudes[0], wide, "column-major tensor");
  expect_sum_near<acc>(sum_v, want.sums[1], want.magnitudes[1], wide, "row-major tensor");
  expect_sum_near<acc>(sum_m, want.sums[2], want.magnitudes[2], wide, "column-major matrix");
  expect_sum_near<T>(sum_r, want.sums[3], want.magnitudes[3], bound_for<T>(examples, epsilon_of<T>() / 2),
                     "row-major map into its own type");
}

TYPED_TEST(PerExampleTyped, RangesOfTensorsAndOfMapsGiveTheSameSums) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  const std::size_t examples = 9;
  const batch_values a = random_batch<T>(examples, 4 * 3, rng, 1.0), b = random_batch<T>(examples, 4 * 3, rng, 3.0);
  std::vector<Eigen::Tensor<T, 3>> tensors{tensor_of<T, Eigen::ColMajor>(a, 4, 3),
                                           tensor_of<T, Eigen::ColMajor>(b, 4, 3)};
  std::vector<Eigen::TensorMap<Eigen::Tensor<T, 3>>> maps;
  for (auto& t : tensors) maps.emplace_back(t.data(), t.dimensions());
  std::vector<Eigen::Tensor<double, 2>> from_tensors(2, Eigen::Tensor<double, 2>(4, 3)), from_maps = from_tensors;
  const auto first = gradclip::clip_per_example(tensors, from_tensors, 2.0);
  const auto second = gradclip::clip_per_example(maps, from_maps, 2.0);
  EXPECT_EQ(first.clipped, second.clipped);
  for (std::size_t k = 0; k < 2; ++k)
    for (Eigen::Index j = 0; j < 12; ++j) EXPECT_EQ(from_tensors[k].data()[j], from_maps[k].data()[j]);
  const reference_sums want = opacus_reference({a, b}, 2.0);
  for (std::size_t k = 0; k < 2; ++k)
    expect_sum_near<double>(from_tensors[k], want.sums[k], want.magnitudes[k], bound_for<T>(examples, 0x1p-53),
                            "tensor " + std::to_string(k));
}

TEST(PerExample, Fp16ExamplesWithNormsAbove256ClipWhereANaiveFp16SumOverflows) {
  std::mt19937_64 rng(seed);
  const std::size_t examples = 16, size = 300;
  batch_values values = random_batch<Eigen::half>(examples, size, rng, 200.0);  // norms ~ 3500
  Eigen::Tensor<Eigen::half, 2, Eigen::RowMajor> g(static_cast<Eigen::Index>(examples),
                                                   static_cast<Eigen::Index>(size));
  for (std::size_t i = 0; i < examples; ++i)
    for (std::size_t k = 0; k < size; ++k)
      g(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(k)) = Eigen::half(static_cast<double>(values[i][k]));
  // The textbook FP16 sum of squares overflows on every example.
  EXPECT_TRUE(std::isinf(gradclip::norm<gradclip::naive>(g.data(), size)));
  Eigen::Tensor<float, 1> sum(static_cast<Eigen::Index>(size));
  std::vector<double> norms;
  const auto result = gradclip::clip_per_example(std::tie(g), std::tie(sum), 1.0, {}, norms);
  const reference_sums want = opacus_reference({values}, 1.0);
  EXPECT_TRUE(result.finite);
  EXPECT_EQ(result.clipped, examples);
  for (std::size_t i = 0; i < examples; ++i) {
    EXPECT_GT(norms[i], 256.0);
    EXPECT_LE(relative_error(norms[i], want.norms[i]), robust_norm_bound<Eigen::half>());
  }
  expect_sum_near<float>(sum, want.sums[0], want.magnitudes[0], bound_for<Eigen::half>(examples, 0x1p-24), "sum");
}

TEST(PerExample, BatchesOfOneAndZero) {
  std::mt19937_64 rng(seed);
  const batch_values one = random_batch<float>(1, 6, rng, 5.0);
  const auto t = tensor_of<float, Eigen::ColMajor>(one, 2, 3);
  Eigen::MatrixXf sum(2, 3);
  const auto result = gradclip::clip_per_example(std::tie(t), std::tie(sum), 1.0);
  EXPECT_EQ(result.examples, 1u);
  const reference_sums want = opacus_reference({one}, 1.0);
  expect_sum_near<float>(sum, want.sums[0], want.magnitudes[0], bound_for<float>(1, 0x1p-24), "B = 1");

  Eigen::Tensor<Eigen::half, 3> empty(0, 2, 3);
  Eigen::Tensor<float, 2> zero_sum(2, 3);
  zero_sum.setConstant(7.0f);
  std::vector<double> norms{1.0};
  const auto none = gradclip::clip_per_example(std::tie(empty), std::tie(zero_sum), 1.0, {}, norms);
  EXPECT_EQ(none.examples, 0u);
  EXPECT_EQ(none.clipped, 0u);
  EXPECT_TRUE(norms.empty());
  for (Eigen::Index k = 0; k < zero_sum.size(); ++k) EXPECT_EQ(zero_sum.data()[k], 0.0f);
}

TEST(PerExample, ExamplesOfOneElementEach) {
  // [B] and [B, 1]: each example is a scalar (Optax's vector rule must not make the batch one unit).
  Eigen::Tensor<float, 1> scalars(3);
  scalars.setValues({3.0f, -0.5f, 4.0f});
  Eigen::MatrixXd column(3, 1);
  column << 4.0, 0.0, -3.0;
  float sum_scalars = 0;
  Eigen::Matrix<double, 1, 1> sum_column;
  std::vector<double> norms;
  const auto result = gradclip::clip_per_example(
      std::tie(scalars, column), std::make_tuple(gradclip::grad_view(&sum_scalars, 1), std::ref(sum_column)), 1.0, {},
      norms);
  EXPECT_EQ(result.examples, 3u);
  EXPECT_EQ(result.clipped, 2u);
  EXPECT_EQ(norms, (std::vector<double>{5.0, 0.5, 5.0}));
  EXPECT_FLOAT_EQ(sum_scalars, 0.6f - 0.5f + 0.8f);
  EXPECT_DOUBLE_EQ(sum_column(0), 0.8 - 0.6);
}

template <class F>
void expect_invalid(F&& call, const std::string& function, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no exception; expected one mentioning " << fragment;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(function, 0), 0u) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << what;
  }
}

TEST(PerExample, BadShapesThrowBeforeAnythingIsWritten) {
  Eigen::Tensor<float, 3> a(4, 2, 3), b(5, 2, 3);
  a.setConstant(1.0f);
  b.setConstant(1.0f);
  Eigen::Tensor<float, 2> s1(2, 3), s2(2, 3), wrong(3, 2);
  Eigen::Tensor<float, 2, Eigen::RowMajor> row_major(2, 3);
  for (auto* s : {&s1, &s2, &wrong}) s->setConstant(7.0f);
  row_major.setConstant(7.0f);
  const std::string f = "gradclip::clip_per_example";
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a, b), std::tie(s1, s2), 1.0); }, f, "batch size 5");
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a, a), std::tie(s1, wrong), 1.0); }, f,
                 "sums[1] has shape [3, 2]");
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a, a), std::tie(s1), 1.0); }, f, "but 1 sums");
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a, a), std::tie(s1, row_major), 1.0); }, f,
                 "storage order");
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a), std::tie(s1), -1.0); }, f, "max_norm");
  expect_invalid(
      [&] {
        (void)gradclip::clip_per_example(std::tie(a), std::tie(s1), 1.0, {on_nonfinite::skip, -1.0});
      },
      f, "epsilon");
  expect_invalid(
      [&] {
        (void)gradclip::clip_per_example(std::tie(a), std::tie(s1), 1.0, {on_nonfinite::skip, 0.0, gradclip::l1_norm});
      },
      f, "L2");
  std::vector<float> short_buffer(5, 7.0f);
  expect_invalid([&] { (void)gradclip::clip_per_example(std::tie(a), std::tie(short_buffer), 1.0); }, f, "sums[0]");
  for (auto* s : {&s1, &s2, &wrong})
    for (Eigen::Index k = 0; k < s->size(); ++k) EXPECT_EQ(s->data()[k], 7.0f);
  for (float x : short_buffer) EXPECT_EQ(x, 7.0f);
  expect_invalid([&] { gradclip::accumulate_per_example(std::tie(a), std::tie(s1), gradclip::per_example_plan{}); },
                 "gradclip::accumulate_per_example", "the plan has 0 examples");
}

/// A batch of 6 examples of 4 elements; example 1 holds a NaN, example 4 an Inf.
struct nonfinite_batch {
  batch_values values;
  Eigen::MatrixXf grads;
  nonfinite_batch() {
    std::mt19937_64 rng(seed);
    values = random_batch<float>(6, 4, rng, 1.0);
    grads = matrix_of<Eigen::MatrixXf>(values);
    grads(1, 2) = std::numeric_limits<float>::quiet_NaN();
    grads(4, 0) = std::numeric_limits<float>::infinity();
  }
};

TEST(PerExample, NonfiniteSkipLeavesTheExamplesOutAndCountsThem) {
  nonfinite_batch batch;
  Eigen::VectorXf sum(4);
  const auto result = gradclip::clip_per_example(std::tie(batch.grads), std::tie(sum), 0.5);
  EXPECT_FALSE(result.finite);
  EXPECT_EQ(result.nonfinite, 2u);
  EXPECT_EQ(result.examples, 6u);
  const reference_sums want = opacus_reference({batch.values}, 0.5, 0, {false, true, false, false, true, false});
  std::size_t clipped = 0;
  for (std::size_t i : {0, 2, 3, 5}) clipped += want.factors[i] < 1;
  EXPECT_EQ(result.clipped, clipped);
  expect_sum_near<float>(sum, want.sums[0], want.magnitudes[0], bound_for<float>(6, 0x1p-24), "sum");
}

TEST(PerExample, NonfiniteErrorThrowsAndWritesNothing) {
  nonfinite_batch batch;
  Eigen::VectorXf sum = Eigen::VectorXf::Constant(4, 7.0f);
  std::vector<double> norms{3.0};
  EXPECT_THROW(
      (void)gradclip::clip_per_example(std::tie(batch.grads), std::tie(sum), 0.5, {on_nonfinite::error}, norms),
      gradclip::nonfinite_error);
  EXPECT_EQ(norms, std::vector<double>{3.0});
  for (float x : sum) EXPECT_EQ(x, 7.0f);
}

TEST(PerExample, NonfinitePropagateIsOpacusArithmetic) {
  nonfinite_batch batch;
  batch.grads(1, 2) = 0.0f;  // only the Inf example: its factor is 0, so 0 * Inf = NaN, 0 * x = 0 elsewhere
  batch.values[1][2] = 0;
  Eigen::VectorXf sum(4);
  const auto result = gradclip::clip_per_example(std::tie(batch.grads), std::tie(sum), 0.5, {on_nonfinite::propagate});
  EXPECT_EQ(result.nonfinite, 1u);
  EXPECT_TRUE(std::isnan(sum(0)));
  const reference_sums want = opacus_reference({batch.values}, 0.5, 0, {false, false, false, false, true, false});
  for (Eigen::Index k = 1; k < 4; ++k)
    EXPECT_LE(std::abs(static_cast<double>(to_quad(sum(k)) - want.sums[0][static_cast<std::size_t>(k)])),
              bound_for<float>(6, 0x1p-24)(want.sums[0][static_cast<std::size_t>(k)],
                                           want.magnitudes[0][static_cast<std::size_t>(k)]));
  batch.grads(1, 2) = std::numeric_limits<float>::quiet_NaN();  // a NaN norm: a NaN factor, every sum NaN
  (void)gradclip::clip_per_example(std::tie(batch.grads), std::tie(sum), 0.5, {on_nonfinite::propagate});
  for (float x : sum) EXPECT_TRUE(std::isnan(x));
}

TEST(PerExample, EpsilonEntersTheFactorAsInOpacus) {
  std::mt19937_64 rng(seed);
  const batch_values values = random_batch<double>(8, 5, rng, 1.0);
  const auto g = matrix_of<Eigen::MatrixXd>(values);
  Eigen::VectorXd sum(5);
  const auto result = gradclip::clip_per_example(std::tie(g), std::tie(sum), 1.5, {on_nonfinite::skip, 0.25});
  const reference_sums want = opacus_reference({values}, 1.5, 0.25);
  EXPECT_EQ(result.clipped, want.clipped);
  expect_sum_near<double>(sum, want.sums[0], want.magnitudes[0], bound_for<double>(8, 0x1p-53), "sum");
}

TEST(PerExample, PerLayerClipsEachTensorToItsOwnBound) {
  std::mt19937_64 rng(seed);
  const std::size_t examples = 11;
  const batch_values a = random_batch<Eigen::half>(examples, 10, rng, 1.0),
                     b = random_batch<Eigen::half>(examples, 3, rng, 0.1);
  const auto ga = matrix_of<Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic>>(a);
  const auto gb = matrix_of<Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic>>(b);
  Eigen::VectorXf sa(10), sb(3);
  const auto result = gradclip::clip_per_example_per_layer(std::tie(ga, gb), std::tie(sa, sb), {3.0, 0.1});
  const reference_sums want_a = opacus_reference({a}, 3.0), want_b = opacus_reference({b}, 0.1);
  std::size_t clipped = 0;
  for (std::size_t i = 0; i < examples; ++i) clipped += want_a.factors[i] < 1 || want_b.factors[i] < 1;
  EXPECT_EQ(result.clipped, clipped);
  expect_sum_near<float>(sa, want_a.sums[0], want_a.magnitudes[0], bound_for<Eigen::half>(examples, 0x1p-24), "a");
  expect_sum_near<float>(sb, want_b.sums[0], want_b.magnitudes[0], bound_for<Eigen::half>(examples, 0x1p-24), "b");

  // One bound split equally: each of the K = 2 tensors to C / sqrt(2).
  const double share = 2.0 / std::sqrt(2.0);
  (void)gradclip::clip_per_example_per_layer(std::tie(ga, gb), std::tie(sa, sb), gradclip::equal_split{2.0});
  const reference_sums split_a = opacus_reference({a}, share), split_b = opacus_reference({b}, share);
  expect_sum_near<float>(sa, split_a.sums[0], split_a.magnitudes[0], bound_for<Eigen::half>(examples, 0x1p-24), "a");
  expect_sum_near<float>(sb, split_b.sums[0], split_b.magnitudes[0], bound_for<Eigen::half>(examples, 0x1p-24), "b");
  expect_invalid(
      [&] { (void)gradclip::clip_per_example_per_layer(std::tie(ga, gb), std::tie(sa, sb), std::vector<double>{1.0}); },
      "gradclip::clip_per_example_per_layer", "1 max_norms for 2 tensors");
}

// ---- Ghost norms

/// Example i's weight-gradient norm materialized in binary128: ||sum_t b_t a_t^T||_F^2 (+ ||sum_t b_t||^2).
template <class A, class B>
std::vector<quad> materialized_squares(const A& a, const B& b, std::size_t steps, bool bias) {
  std::vector<quad> squares;
  for (Eigen::Index first = 0; first < a.rows(); first += static_cast<Eigen::Index>(steps)) {
    quad s = 0;
    for (Eigen::Index j = 0; j < b.cols(); ++j) {
      quad column = 0;
      for (Eigen::Index k = 0; k < a.cols(); ++k) {
        quad w = 0;
        for (Eigen::Index t = first; t < first + static_cast<Eigen::Index>(steps); ++t)
          w += to_quad(b(t, j)) * to_quad(a(t, k));
        s += w * w;
      }
      for (Eigen::Index t = first; t < first + static_cast<Eigen::Index>(steps); ++t) column += to_quad(b(t, j));
      if (bias) s += column * column;
    }
    squares.push_back(s);
  }
  return squares;
}

/// The FP64 matrix products' bound: (T + d_in + d_out + T^2 + 4) * 2^-53 times (sum_t ||a_t|| ||b_t||)^2
/// (plus the bias), which bounds the sums of absolute products in both forms (Cauchy-Schwarz).
template <class A, class B>
std::vector<quad> ghost_error_bounds(const A& a, const B& b, std::size_t steps) {
  std::vector<quad> bounds;
  const double terms = static_cast<double>(steps + static_cast<std::size_t>(a.cols() + b.cols()) + steps * steps + 4);
  for (Eigen::Index first = 0; first < a.rows(); first += static_cast<Eigen::Index>(steps)) {
    quad s = 0, bias = 0;
    for (Eigen::Index t = first; t < first + static_cast<Eigen::Index>(steps); ++t) {
      quad na = 0, nb = 0;
      for (Eigen::Index k = 0; k < a.cols(); ++k) na += to_quad(a(t, k)) * to_quad(a(t, k));
      for (Eigen::Index j = 0; j < b.cols(); ++j) nb += to_quad(b(t, j)) * to_quad(b(t, j));
      s += quad_sqrt(na) * quad_sqrt(nb);
      bias += quad_sqrt(nb);
    }
    bounds.push_back(quad(terms * 0x1p-53) * (s * s + bias * bias));
  }
  return bounds;
}

template <class T>
void expect_ghost_norms_match(std::size_t examples, std::size_t steps, Eigen::Index d_in, Eigen::Index d_out,
                              double scale, gradclip::ghost_form form) {
  std::mt19937_64 rng(seed + steps);
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  const Eigen::Index rows = static_cast<Eigen::Index>(examples * steps);
  const auto av = random_gradient<T>(static_cast<std::size_t>(rows * d_in), rng, scale);
  const auto bv = random_gradient<T>(static_cast<std::size_t>(rows * d_out), rng, scale);
  const matrix a = Eigen::Map<const matrix>(av.data(), rows, d_in);
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> b =
      Eigen::Map<const matrix>(bv.data(), rows, d_out);
  std::vector<gradclip::partial_norm> parts;
  (void)gradclip::add_ghost_norms(parts, a, b, steps, true, form);
  const std::vector<quad> exact = materialized_squares(a, b, steps, true);
  const std::vector<quad> bounds = ghost_error_bounds(a, b, steps);
  ASSERT_EQ(parts.size(), examples);
  for (std::size_t i = 0; i < examples; ++i) {
    if (steps == 1) {  // two robust row norms multiplied, the bias's merged: twice the norm bound and a rounding
      EXPECT_LE(relative_error(parts[i].norm(), quad_sqrt(exact[i])), 2 * robust_norm_bound<T>() + 0x1p-52)
          << "example " << i;
    } else {
      // The part's sum of squares, sum * 4^exponent, also where the norm exceeds double's range.
      quad got = to_quad(parts[i].sum);
      for (int e = 0; e < parts[i].exponent; ++e) got *= 4;
      for (int e = 0; e > parts[i].exponent; --e) got /= 4;
      EXPECT_LE(static_cast<double>(quad_abs(got - exact[i]) / bounds[i]), 1.0) << "example " << i;
    }
  }
}

TYPED_TEST(PerExampleTyped, GhostNormsMatchTheMaterializedGradients) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>());
  expect_ghost_norms_match<T>(13, 1, 7, 5, 1.0, gradclip::ghost_form::automatic);
  expect_ghost_norms_match<T>(6, 4, 9, 3, 1.0, gradclip::ghost_form::gram);
  expect_ghost_norms_match<T>(6, 4, 9, 3, 1.0, gradclip::ghost_form::direct);
  // Large magnitudes: FP16 squares of 30000 overflow FP16, Gram entries of FP64 1e300 overflow FP64.
  const double large = std::is_same_v<T, Eigen::half> ? 1e4 : std::is_same_v<T, double> ? 1e300 : 1e36;
  expect_ghost_norms_match<T>(5, 3, 4, 6, large, gradclip::ghost_form::gram);
  expect_ghost_norms_match<T>(5, 3, 4, 6, large, gradclip::ghost_form::direct);
  expect_ghost_norms_match<T>(5, 1, 4, 6, large, gradclip::ghost_form::automatic);
}

TEST(GhostNorm, AutomaticPicksTheCheaperForm) {
  Eigen::MatrixXf a = Eigen::MatrixXf::Ones(8, 64), b = Eigen::MatrixXf::Ones(8, 64);
  std::vector<gradclip::partial_norm> parts;
  EXPECT_EQ(gradclip::add_ghost_norms(parts, a, b, 4), gradclip::ghost_form::gram);  // 4 * 128 < 64 * 64
  Eigen::MatrixXf c = Eigen::MatrixXf::Ones(256, 8), d = Eigen::MatrixXf::Ones(256, 8);
  parts.clear();
  EXPECT_EQ(gradclip::add_ghost_norms(parts, c, d, 128), gradclip::ghost_form::direct);  // 128 * 16 > 8 * 8
}

TEST(GhostNorm, NonfiniteInputsMakeTheExampleNonfinite) {
  Eigen::MatrixXf a = Eigen::MatrixXf::Ones(6, 3), b = Eigen::MatrixXf::Ones(6, 2);
  a(2, 1) = std::numeric_limits<float>::quiet_NaN();  // example 1 of T = 2
  b(5, 0) = std::numeric_limits<float>::infinity();   // example 2
  std::vector<gradclip::partial_norm> parts;
  (void)gradclip::add_ghost_norms(parts, a, b, 2);
  EXPECT_TRUE(parts[0].finite);
  EXPECT_TRUE(std::isnan(parts[1].norm()));
  EXPECT_TRUE(std::isinf(parts[2].norm()));
}

TEST(GhostNorm, BadShapesThrow) {
  Eigen::MatrixXf a(6, 3), b(5, 2), c(6, 2);
  std::vector<gradclip::partial_norm> parts;
  const std::string f = "gradclip::add_ghost_norms";
  expect_invalid([&] { (void)gradclip::add_ghost_norms(parts, a, b, 1); }, f, "inputs have 6 rows");
  expect_invalid([&] { (void)gradclip::add_ghost_norms(parts, a, c, 4); }, f, "whole number");
  expect_invalid([&] { (void)gradclip::add_ghost_norms(parts, a, c, 0); }, f, "steps");
  parts.resize(2);
  expect_invalid([&] { (void)gradclip::add_ghost_norms(parts, a, c, 1); }, f, "2 parts for 6 examples");
  gradclip::per_example_plan plan = gradclip::plan_per_example(std::vector<gradclip::partial_norm>(6), 1.0);
  Eigen::MatrixXf wrong(3, 2), weight = Eigen::MatrixXf::Constant(2, 3, 7.0f);
  Eigen::VectorXf bias(3);
  const std::string g = "gradclip::ghost_weighted_sum";
  expect_invalid([&] { gradclip::ghost_weighted_sum(plan, a, c, 1, wrong); }, g, "expected d_out x d_in = 2 x 3");
  expect_invalid([&] { gradclip::ghost_weighted_sum(plan, a, c, 1, weight, bias); }, g, "bias_sum has 3");
  expect_invalid([&] { gradclip::ghost_weighted_sum(plan, a, c, 2, weight); }, g, "the plan has 6 examples");
  for (float x : weight.reshaped()) EXPECT_EQ(x, 7.0f);
}

/// A model of a flat tensor (an embedding's per-example gradient) and a dense layer: ghost clipping and
/// clip_per_example on the materialized dense gradients agree, and both match binary128.
template <class T>
void expect_ghost_clip_matches(std::size_t steps, double scale, double fixed_max_norm = 0) {
  std::mt19937_64 rng(seed + 7 * steps);
  const std::size_t examples = 10;
  const Eigen::Index d_in = 5, d_out = 3, rows = static_cast<Eigen::Index>(examples * steps);
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  const auto av = random_gradient<T>(static_cast<std::size_t>(rows * d_in), rng, scale);
  const auto bv = random_gradient<T>(static_cast<std::size_t>(rows * d_out), rng, scale);
  const matrix x = Eigen::Map<const matrix>(av.data(), rows, d_in),
               dy = Eigen::Map<const matrix>(bv.data(), rows, d_out);
  const batch_values embedding = random_batch<T>(examples, 4, rng, scale);
  const auto e = matrix_of<matrix>(embedding);

  // The dense layer's per-example gradients in binary128: W_i = sum_t dy_t x_t^T ([d_out, d_in], row-major), b_i,
  // and sum_t |dy_t x_t^T|, which bounds what the GEMM adds up.
  batch_values dense_w(examples), dense_b(examples), dense_abs(examples);
  for (std::size_t i = 0; i < examples; ++i)
    for (Eigen::Index j = 0; j < d_out; ++j) {
      quad column = 0;
      for (Eigen::Index k = 0; k < d_in; ++k) {
        quad w = 0, magnitude = 0;
        for (std::size_t t = i * steps; t < (i + 1) * steps; ++t) {
          w += to_quad(dy(static_cast<Eigen::Index>(t), j)) * to_quad(x(static_cast<Eigen::Index>(t), k));
          magnitude +=
              quad_abs(to_quad(dy(static_cast<Eigen::Index>(t), j)) * to_quad(x(static_cast<Eigen::Index>(t), k)));
        }
        dense_w[i].push_back(w);
        dense_abs[i].push_back(magnitude);
      }
      for (std::size_t t = i * steps; t < (i + 1) * steps; ++t) column += to_quad(dy(static_cast<Eigen::Index>(t), j));
      dense_b[i].push_back(column);
    }
  // About the median norm: sqrt(E||e||^2 + E||W||^2 + E||b||^2) for unit-variance elements times scale.
  const double s2 = scale * scale, t = static_cast<double>(steps);
  const double max_norm = fixed_max_norm > 0 ? fixed_max_norm : std::sqrt(4 * s2 + 15 * t * s2 * s2 + 3 * t * s2);
  reference_sums want = opacus_reference({embedding, dense_w, dense_b}, max_norm);
  for (std::size_t k = 0; k < want.magnitudes[1].size(); ++k) {
    want.magnitudes[1][k] = 0;
    for (std::size_t i = 0; i < examples; ++i) want.magnitudes[1][k] += want.factors[i] * dense_abs[i][k];
  }

  std::vector<gradclip::partial_norm> parts = gradclip::per_example_partial_norms(std::tie(e));
  (void)gradclip::add_ghost_norms(parts, x, dy, steps);
  const gradclip::per_example_plan plan = gradclip::plan_per_example(parts, max_norm);
  EXPECT_EQ(plan.result.clipped, want.clipped);
  Eigen::VectorXf sum_e(4);
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> sum_w(d_out, d_in);
  Eigen::VectorXf sum_b(d_out);
  gradclip::accumulate_per_example(std::tie(e), std::tie(sum_e), plan);
  gradclip::ghost_weighted_sum(plan, x, dy, steps, sum_w, sum_b);
  // The GEMM adds B*T products per element in the accumulator; the factors carry the ghost norm's error.
  sum_bound bound = bound_for<T>(examples * steps, 0x1p-24);
  bound.norm_bound = std::is_same_v<T, double> ? 1e-13 : 1e-6;
  expect_sum_near<float>(sum_e, want.sums[0], want.magnitudes[0], bound, "embedding");
  expect_sum_near<float>(sum_w, want.sums[1], want.magnitudes[1], bound, "dense weight");
  expect_sum_near<float>(sum_b, want.sums[2], want.magnitudes[2], bound, "dense bias");
}

TYPED_TEST(PerExampleTyped, GhostClippingMatchesMaterializedClipping) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>());
  expect_ghost_clip_matches<T>(1, 1.0);
  expect_ghost_clip_matches<T>(3, 1.0);
  if constexpr (std::is_same_v<T, Eigen::half>) expect_ghost_clip_matches<T>(3, 1e4);  // squares overflow FP16
  if constexpr (std::is_same_v<T, float>) expect_ghost_clip_matches<T>(2, 1e30, 1.0);  // products overflow FP32
}

TEST(GhostNorm, LeftOutExamplesDoNotReachTheSum) {
  Eigen::MatrixXf x = Eigen::MatrixXf::Ones(4, 2), dy = Eigen::MatrixXf::Ones(4, 1);
  x(1, 0) = std::numeric_limits<float>::quiet_NaN();
  std::vector<gradclip::partial_norm> parts;
  (void)gradclip::add_ghost_norms(parts, x, dy, 1);
  const auto plan = gradclip::plan_per_example(parts, 100.0);
  EXPECT_EQ(plan.result.nonfinite, 1u);
  Eigen::MatrixXf w(1, 2);
  Eigen::VectorXf b(1);
  gradclip::ghost_weighted_sum(plan, x, dy, 1, w, b);
  EXPECT_EQ(w(0, 0), 3.0f);
  EXPECT_EQ(w(0, 1), 3.0f);
  EXPECT_EQ(b(0), 3.0f);
}

// ---- Adaptive bound

TEST(AdaptiveBound, FollowsTheGeometricUpdate) {
  gradclip::adaptive_bound bound;
  EXPECT_EQ(bound.value(), 1.0);
  bound.update(48.0, 64.0);  // b = 0.75 > 0.5: C shrinks
  EXPECT_DOUBLE_EQ(bound.value(), std::exp(-0.2 * 0.25));
  bound.update(-3.0, 64.0);  // noise may push the count below zero
  EXPECT_DOUBLE_EQ(bound.value(), std::exp(-0.2 * 0.25) * std::exp(-0.2 * (-3.0 / 64.0 - 0.5)));
  EXPECT_EQ(bound.steps(), 2u);
}

TEST(AdaptiveBound, TracksTheQuantileOfTheNorms) {
  // Norms uniform in [0, 10): the 0.3-quantile is 3.
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 10.0);
  gradclip::adaptive_bound_config config;
  config.target_unclipped = 0.3;
  gradclip::adaptive_bound bound(config);
  for (int step = 0; step < 2000; ++step) {
    std::size_t unclipped = 0;
    for (int i = 0; i < 256; ++i) unclipped += uniform(rng) <= bound.value();
    bound.update(static_cast<double>(unclipped), 256.0);
  }
  EXPECT_NEAR(bound.value(), 3.0, 0.3);
}

TEST(AdaptiveBound, IsClampedToItsRange) {
  gradclip::adaptive_bound_config config;
  config.min_bound = 0.5;
  config.max_bound = 2.0;
  gradclip::adaptive_bound bound(config);
  for (int i = 0; i < 100; ++i) bound.update(0.0, 10.0);
  EXPECT_EQ(bound.value(), 2.0);
  for (int i = 0; i < 100; ++i) bound.update(10.0, 10.0);
  EXPECT_EQ(bound.value(), 0.5);
}

TEST(AdaptiveBound, BadConfigurationsAndArgumentsThrowNamingTheField) {
  const auto bad = [](auto edit, const std::string& field) {
    gradclip::adaptive_bound_config config;
    edit(config);
    expect_invalid([&] { gradclip::adaptive_bound b(config); }, "gradclip::adaptive_bound_config", field);
  };
  bad([](auto& c) { c.target_unclipped = 1.5; }, "target_unclipped");
  bad([](auto& c) { c.learning_rate = -1; }, "learning_rate");
  bad([](auto& c) { c.learning_rate = NAN; }, "learning_rate");
  bad([](auto& c) { c.min_bound = 0; }, "min_bound");
  bad([](auto& c) { c.max_bound = 1e-300; }, "max_bound");
  bad([](auto& c) { c.initial = INFINITY; }, "initial");
  gradclip::adaptive_bound bound;
  expect_invalid([&] { bound.update(1.0, 0.0); }, "gradclip::adaptive_bound::update", "expected_batch");
  expect_invalid([&] { bound.update(NAN, 8.0); }, "gradclip::adaptive_bound::update", "unclipped");
}

TEST(AdaptiveBound, CheckpointsRoundTripExactly) {
  gradclip::adaptive_bound_config config;
  config.initial = 0.1;
  config.learning_rate = 0.3;
  config.max_bound = 7.0;
  gradclip::adaptive_bound bound(config);
  for (double count : {1.0, 17.5, 3.25}) bound.update(count, 10.0);
  std::stringstream saved;
  saved << bound;
  gradclip::adaptive_bound loaded;
  saved >> loaded;
  ASSERT_TRUE(saved);
  std::stringstream again;
  again << loaded;
  EXPECT_EQ(saved.str(), again.str());
  EXPECT_EQ(loaded.value(), bound.value());
  EXPECT_EQ(loaded.steps(), 3u);
  EXPECT_EQ(loaded.config().max_bound, 7.0);
  bound.update(2.0, 10.0);
  loaded.update(2.0, 10.0);
  EXPECT_EQ(loaded.value(), bound.value());

  std::stringstream malformed("gradclip::adaptive_bound 0x3ff0000000000000 junk");
  gradclip::adaptive_bound untouched;
  malformed >> untouched;
  EXPECT_TRUE(malformed.fail());
  EXPECT_EQ(untouched.value(), 1.0);
  EXPECT_EQ(untouched.steps(), 0u);
}

// Column-major batches (examples interleave) and row-major ones, large enough for several pieces of the
// norms pass and several blocks of the sums: 1, 2 and 3 threads give the same sums and norms, bit for
// bit, with one example left out (skip) so that the masked kernels run too.
template <int Layout, class T>
void expect_same_bits_for_any_thread_count(Eigen::Index examples, Eigen::Index size) {
  std::mt19937_64 rng(20261204);
  const auto values = random_gradient<T>(static_cast<std::size_t>(examples * size), rng, 0.01);
  for (bool with_nan : {false, true}) {
    Eigen::Tensor<T, 2, Layout> batch(examples, size);
    std::copy(values.begin(), values.end(), batch.data());
    if (with_nan) batch(examples / 2, size / 3) = std::numeric_limits<T>::quiet_NaN();
    std::vector<std::vector<float>> sums;
    std::vector<std::vector<double>> norms;
    for (unsigned threads : {1u, 2u, 3u}) {
      Eigen::Tensor<float, 1> sum(size);
      std::vector<double> n;
      gradclip::options opt;
      opt.threads = threads;
      opt.nonfinite = on_nonfinite::skip;
      const auto r = gradclip::clip_per_example(std::tie(batch), std::tie(sum), 0.5, opt, n);
      EXPECT_GT(r.clipped, 0u);
      sums.emplace_back(sum.data(), sum.data() + sum.size());
      norms.push_back(n);
    }
    for (std::size_t k = 1; k < sums.size(); ++k) {
      SCOPED_TRACE(std::to_string(k + 1) + " threads" + (with_nan ? ", one example skipped" : ""));
      EXPECT_TRUE(same_bits(sums[k], sums[0]));
      EXPECT_TRUE(same_bits(norms[k], norms[0]));
    }
  }
}

TEST(PerExample, AnyThreadCountGivesTheSameBitsColumnMajor) {
  expect_same_bits_for_any_thread_count<Eigen::ColMajor, Eigen::half>(67, 40000);
  expect_same_bits_for_any_thread_count<Eigen::ColMajor, Eigen::bfloat16>(64, 40000);
  expect_same_bits_for_any_thread_count<Eigen::ColMajor, float>(130, 20000);
}

TEST(PerExample, AnyThreadCountGivesTheSameBitsRowMajor) {
  expect_same_bits_for_any_thread_count<Eigen::RowMajor, Eigen::half>(67, 40000);
  expect_same_bits_for_any_thread_count<Eigen::RowMajor, Eigen::bfloat16>(9, 300000);
}

}  // namespace
