// update_clip.hpp: clip_update_by_rms, clip_updates_by_rms, stable_adamw_factor and spam_clip against binary128
// references, at the extremes of every type, with non-finite inputs under each option, and SPAM step by step.
#include <gradclip/update_clip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::on_nonfinite;

template <class T>
class UpdateClipTyped : public ::testing::Test {};
TYPED_TEST_SUITE(UpdateClipTyped, element_types);

template <class F>
void expect_invalid_argument(F&& f, const std::string& prefix) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected std::invalid_argument starting with " << prefix;
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

// ---- clip_update_by_rms

template <class T>
quad exact_rms(const std::vector<T>& u) {
  return exact_norm(u) / quad_sqrt(static_cast<quad>(u.size()));
}

// The RMS within robust's norm bound, and every element within one ulp of u * max_rms / (RMS + eps).
template <class T>
void expect_rms_clip(std::vector<T> u, double max_rms, double eps = 0.0) {
  const auto original = u;
  const quad rms = exact_rms(original);
  const auto r = gradclip::clip_update_by_rms(u, max_rms, {on_nonfinite::skip, eps});
  EXPECT_TRUE(r.finite);
  EXPECT_TRUE(r.clipped);
  EXPECT_EQ(r.threshold, max_rms);
  EXPECT_LE(relative_error(r.norm, rms), robust_norm_bound<T>()) << type_name<T>();
  const quad c = static_cast<quad>(max_rms) / (rms + static_cast<quad>(eps));
  EXPECT_LE(relative_error(r.coefficient, c), robust_norm_bound<T>());  // the RMS's error, and 2^-53 more
  for (std::size_t i = 0; i < u.size(); ++i)
    ASSERT_LE(ulps(u[i], to_quad(original[i]) * c), 1.0) << type_name<T>() << " element " << i;
}

TYPED_TEST(UpdateClipTyped, RmsClipIsTheExactProjectionWithinOneUlp) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 100);
  for (std::size_t n : {1u, 7u, 33u, 1024u, 5000u, 40000u}) {
    const auto u = random_gradient<T>(n, rng, 3.0);
    const double rms = static_cast<double>(exact_rms(u));
    expect_rms_clip(u, rms / 3);
    expect_rms_clip(u, rms / 1.5, rms / 10);  // epsilon is added to the RMS
  }
}

TYPED_TEST(UpdateClipTyped, RmsAtOrBelowTheThresholdLeavesTheUpdateBitForBit) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 101);
  const auto original = random_gradient<T>(3000, rng);
  const double rms = static_cast<double>(exact_rms(original));
  for (double max_rms : {rms * 1.001, 2 * rms, std::numeric_limits<double>::infinity()}) {
    auto u = original;
    const auto r = gradclip::clip_update_by_rms(u, max_rms);
    EXPECT_FALSE(r.clipped);
    EXPECT_EQ(r.coefficient, 1.0);
    EXPECT_TRUE(same_bits(u, original));
  }
  // With epsilon, an RMS below max_rms still clips once max_rms / (RMS + eps) < 1.
  auto u = original;
  EXPECT_TRUE(gradclip::clip_update_by_rms(u, rms * 1.001, {on_nonfinite::skip, rms * 0.01}).clipped);
}

TYPED_TEST(UpdateClipTyped, ExtremeUpdatesAreClippedWithoutOverflow) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max();
  const T tiny = std::numeric_limits<T>::denorm_min();
  // FP16: every square here overflows FP16 (and its naive sum of squares is inf); FP64: the norm of
  // 3000 maxima exceeds double, their RMS does not.
  expect_rms_clip(std::vector<T>(3000, max), 1.0);
  expect_rms_clip(std::vector<T>{max, -max, T(1), tiny}, 0.5);
  expect_rms_clip(std::vector<T>{T(300.0f), T(-400.0f)}, 1.0);
  expect_rms_clip(std::vector<T>{tiny, -tiny, tiny}, static_cast<double>(tiny) / 2);
  std::vector<T> maxima(3000, max);
  const auto r = gradclip::clip_update_by_rms(maxima, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(r.finite);
  EXPECT_LE(relative_error(r.norm, to_quad(max)), robust_norm_bound<T>());
}

TYPED_TEST(UpdateClipTyped, EmptyAndZeroUpdatesAreLeftAlone) {
  using T = TypeParam;
  std::vector<T> empty;
  const auto e = gradclip::clip_update_by_rms(empty, 1.0);
  EXPECT_TRUE(e.finite);
  EXPECT_FALSE(e.clipped);
  EXPECT_EQ(e.norm, 0.0);
  EXPECT_EQ(e.coefficient, 1.0);
  std::vector<T> zeros(10, T(0.0f));
  const auto original = zeros;
  for (double max_rms : {0.0, 1.0}) {
    const auto z = gradclip::clip_update_by_rms(zeros, max_rms);
    EXPECT_FALSE(z.clipped);
    EXPECT_EQ(z.norm, 0.0);
    EXPECT_TRUE(same_bits(zeros, original));
  }
  // max_rms = 0 clips a non-zero update to zero, as clip_by_norm does.
  std::vector<T> one{T(1.0f), T(-2.0f)};
  const auto r = gradclip::clip_update_by_rms(one, 0.0);
  EXPECT_TRUE(r.clipped);
  EXPECT_EQ(static_cast<double>(one[0]), 0.0);
}

TYPED_TEST(UpdateClipTyped, NonFiniteUpdatesFollowOptions) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const T bad : {inf, nan}) {
    const std::vector<T> original{T(1.0f), bad, T(-3.0f)};
    auto u = original;
    const auto skipped = gradclip::clip_update_by_rms(u, 1.0);
    EXPECT_FALSE(skipped.finite);
    EXPECT_FALSE(skipped.clipped);
    EXPECT_EQ(skipped.coefficient, 1.0);
    EXPECT_TRUE(same_bits(u, original));
    EXPECT_THROW((void)gradclip::clip_update_by_rms(u, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
    EXPECT_TRUE(same_bits(u, original));
    const auto propagated = gradclip::clip_update_by_rms(u, 1.0, {on_nonfinite::propagate});
    EXPECT_FALSE(propagated.finite);
    EXPECT_TRUE(propagated.clipped);
    if (std::isinf(static_cast<double>(bad))) {
      EXPECT_EQ(propagated.coefficient, 0.0);  // 1 / (inf RMS): the finite elements become 0
      EXPECT_EQ(static_cast<double>(u[0]), 0.0);
    } else {
      EXPECT_TRUE(std::isnan(propagated.coefficient));
      EXPECT_TRUE(std::isnan(static_cast<double>(u[0])));
    }
  }
}

TYPED_TEST(UpdateClipTyped, EigenObjectsContainersAndRawBuffersAgree) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 102);
  const auto values = random_gradient<T>(6 * 40, rng);
  const double max_rms = static_cast<double>(exact_rms(values)) / 2;
  auto reference = values;
  const auto expected = gradclip::clip_update_by_rms(reference, max_rms);
  using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  matrix m = Eigen::Map<const matrix>(values.data(), 6, 40);
  EXPECT_EQ(gradclip::clip_update_by_rms(m, max_rms).coefficient, expected.coefficient);
  EXPECT_EQ(std::memcmp(m.data(), reference.data(), values.size() * sizeof(T)), 0);
  Eigen::Tensor<T, 2> t(6, 40);
  std::copy(values.begin(), values.end(), t.data());
  EXPECT_EQ(gradclip::clip_update_by_rms(t, max_rms).coefficient, expected.coefficient);
  EXPECT_EQ(std::memcmp(t.data(), reference.data(), values.size() * sizeof(T)), 0);
  auto raw = values;
  EXPECT_EQ(gradclip::clip_update_by_rms(raw.data(), raw.size(), max_rms).coefficient, expected.coefficient);
  EXPECT_TRUE(same_bits(raw, reference));
  // A block of a larger matrix (strided, so its columns sum as short runs: the same bound, other bits):
  // its own RMS, the rest of the matrix untouched.
  matrix big = matrix::Zero(10, 40);
  big.topRows(6) = Eigen::Map<const matrix>(values.data(), 6, 40);
  const auto r = gradclip::clip_update_by_rms(big.topRows(6), max_rms);
  EXPECT_LE(relative_error(r.norm, exact_rms(values)), robust_norm_bound<T>());
  const quad c = static_cast<quad>(max_rms) / exact_rms(values);
  for (Eigen::Index i = 0; i < big.size(); ++i) {
    const T x = big.data()[i];
    if (i % 10 >= 6)
      ASSERT_EQ(static_cast<double>(x), 0.0);
    else
      ASSERT_LE(ulps(x, to_quad(values[static_cast<std::size_t>(i / 10 * 6 + i % 10)]) * c), 1.0) << i;
  }
}

TEST(UpdateClip, EachUpdateOfARangeIsClippedByItsOwnRms) {
  std::mt19937_64 rng(seed + 103);
  auto a = random_gradient<Eigen::half>(500, rng, 100.0);  // RMS ~100
  auto b = random_gradient<float>(70, rng, 0.1);           // RMS ~0.1: below the threshold
  auto c = random_gradient<double>(3000, rng, 10.0);
  auto a1 = a;
  auto c1 = c;
  const auto b0 = b;
  const auto ra = gradclip::clip_update_by_rms(a1, 1.0);
  const auto rc = gradclip::clip_update_by_rms(c1, 1.0);
  std::vector<gradclip::grad_view> updates{a, b, c};
  const auto results = gradclip::clip_updates_by_rms(updates, 1.0);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[0].coefficient, ra.coefficient);
  EXPECT_FALSE(results[1].clipped);
  EXPECT_EQ(results[2].coefficient, rc.coefficient);
  EXPECT_TRUE(same_bits(a, a1));
  EXPECT_TRUE(same_bits(b, b0));
  EXPECT_TRUE(same_bits(c, c1));
  EXPECT_EQ(gradclip::clip_updates_by_rms({a, b}, 1.0).size(), 2u);
  // error: nothing is written when any update is not finite; skip: only that update is left alone.
  auto x = random_gradient<float>(100, rng, 10.0), y = x;
  y[3] = std::numeric_limits<float>::quiet_NaN();
  const auto x0 = x, y0 = y;
  std::vector<std::vector<float>> group{x, y};
  EXPECT_THROW((void)gradclip::clip_updates_by_rms(group, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(group[0], x0));
  const auto skipped = gradclip::clip_updates_by_rms(group, 1.0);
  EXPECT_TRUE(skipped[0].clipped);
  EXPECT_FALSE(skipped[1].finite);
  EXPECT_TRUE(same_bits(group[1], y0));
}

TEST(UpdateClip, BadArgumentsThrowNamingTheFunction) {
  std::vector<float> u{1.0f, 2.0f};
  const std::string f = "gradclip::clip_update_by_rms";
  expect_invalid_argument([&] { (void)gradclip::clip_update_by_rms(u, -1.0); }, f + ": max_rms");
  expect_invalid_argument([&] { (void)gradclip::clip_update_by_rms(u, std::nan("")); }, f + ": max_rms");
  expect_invalid_argument(
      [&] {
        (void)gradclip::clip_update_by_rms(u, 1.0, {on_nonfinite::skip, 0.0, gradclip::l1_norm});
      },
      f + ": options::norm");
  expect_invalid_argument([&] { (void)gradclip::clip_update_by_rms(u, 1.0, {on_nonfinite::skip, -1.0}); }, f);
  std::vector<std::vector<float>> group{u};
  expect_invalid_argument([&] { (void)gradclip::clip_updates_by_rms(group, -1.0); }, "gradclip::clip_updates_by_rms");
}

TEST(UpdateClip, ThreadsGiveTheSameBits) {
  std::mt19937_64 rng(seed + 104);
  const auto original = random_gradient<float>((std::size_t{3} << 20) + 12345, rng);
  const double max_rms = static_cast<double>(exact_rms(original)) / 2;
  auto one = original;
  const auto r1 = gradclip::clip_update_by_rms(one, max_rms);
  for (unsigned threads : {2u, 3u, 8u}) {
    auto many = original;
    gradclip::options opt;
    opt.threads = threads;
    const auto r = gradclip::clip_update_by_rms(many, max_rms, opt);
    EXPECT_EQ(r.norm, r1.norm);
    EXPECT_EQ(r.coefficient, r1.coefficient);
    EXPECT_TRUE(same_bits(many, one));
  }
}

// ---- stable_adamw_factor

template <class T, class V>
quad exact_factor(const std::vector<T>& g, const std::vector<V>& v, double eps) {
  if (g.empty()) return 1;
  const quad eps_squared = static_cast<quad>(eps) * static_cast<quad>(eps);
  quad sum = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const quad m = to_quad(v[i]) > eps_squared ? to_quad(v[i]) : eps_squared;
    sum += to_quad(g[i]) * to_quad(g[i]) / m;
  }
  const quad rms = quad_sqrt(sum / static_cast<quad>(g.size()));
  return rms > 1 ? 1 / rms : quad(1);
}

template <class T, class V>
void expect_factor(const std::vector<T>& g, const std::vector<V>& v, double eps) {
  const double f = gradclip::stable_adamw_factor(g, v, eps);
  const quad exact = exact_factor(g, v, eps);
  EXPECT_GT(f, 0.0);
  EXPECT_LE(f, 1.0);
  if (exact == 1)
    EXPECT_EQ(f, 1.0);
  else if (exact < quad(std::numeric_limits<double>::denorm_min()) / 2)
    EXPECT_EQ(f, std::numeric_limits<double>::denorm_min());
  else
    EXPECT_LE(relative_error(f, exact), 1e-14) << type_name<T>() << " g, " << type_name<V>() << " v, n " << g.size();
}

template <class T, class V>
void random_factor_cases(std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t n : {1u, 17u, 1000u, 5000u, 100003u}) {
    for (double scale : {0.1, 1.0, 30.0}) {
      const auto g = random_gradient<T>(n, rng, scale);
      std::vector<V> v(n);
      for (auto& x : v) x = static_cast<V>(0.25 + std::abs(normal(rng)));  // g^2 / v: mean ~ scale^2
      for (std::size_t i = 0; i < n; i += 7) v[i] = V(0);                  // max(v, eps^2) = eps^2 there
      expect_factor(g, v, 1.0);
      expect_factor(g, v, 0.5);
    }
  }
}

TYPED_TEST(UpdateClipTyped, StableAdamwFactorMatchesTheBinary128Reference) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 200);
  random_factor_cases<TypeParam, float>(rng);
  random_factor_cases<TypeParam, double>(rng);
}

template <class T, class V>
void extreme_factor_cases() {
  const T max = std::numeric_limits<T>::max();
  const T tiny = std::numeric_limits<T>::denorm_min();
  const V vmax = std::numeric_limits<V>::max(), vtiny = std::numeric_limits<V>::denorm_min();
  // FP16 g whose squares overflow FP16, tiny and zero v, eps whose square underflows double.
  for (double eps : {1e-6, 1e-30, 1e-160, 1e-300}) {
    expect_factor(std::vector<T>{max, -max, T(1.0f)}, std::vector<V>{vtiny, V(0), V(1)}, eps);
    expect_factor(std::vector<T>(3000, max), std::vector<V>(3000, vtiny), eps);
    expect_factor(std::vector<T>{tiny, max}, std::vector<V>{vmax, vmax}, eps);
    expect_factor(std::vector<T>{tiny, tiny}, std::vector<V>{V(0), vtiny}, eps);
  }
}

TYPED_TEST(UpdateClipTyped, StableAdamwFactorNeverOverflows) {
  extreme_factor_cases<TypeParam, float>();
  extreme_factor_cases<TypeParam, double>();
}

TEST(UpdateClip, StableAdamwFactorBelowDoublesRangeIsTheSmallestPositiveDouble) {
  // g^2 / eps^2 = 1e600 / 1e-600: the exact factor is 1e-600.
  const std::vector<double> g{1e300, 1e300};
  const std::vector<double> v{0.0, 0.0};
  EXPECT_EQ(gradclip::stable_adamw_factor(g, v, 1e-300), std::numeric_limits<double>::denorm_min());
  expect_factor(std::vector<double>{1e200}, std::vector<double>{1e-200}, 1e-300);  // 1e-300, in range
}

TYPED_TEST(UpdateClipTyped, StableAdamwFactorNonFiniteInputsFollowOptions) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::vector<float> v{1.0f, 1e-4f, 2.0f};
  for (const T bad : {inf, -inf, nan}) {
    const std::vector<T> g{T(3.0f), bad, T(-1.0f)};
    EXPECT_EQ(gradclip::stable_adamw_factor(g, v, 1e-6), 1.0);
    EXPECT_THROW((void)gradclip::stable_adamw_factor(g, v, 1e-6, {on_nonfinite::error}), gradclip::nonfinite_error);
    const double propagated = gradclip::stable_adamw_factor(g, v, 1e-6, {on_nonfinite::propagate});
    if (std::isnan(static_cast<double>(bad)))
      EXPECT_TRUE(std::isnan(propagated));
    else
      EXPECT_EQ(propagated, 0.0);  // an infinite term: 1 / inf
  }
  const std::vector<T> g{T(3.0f), T(40.0f), T(-1.0f)};
  for (const float bad_v : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const std::vector<float> w{1.0f, bad_v, 2.0f};
    EXPECT_EQ(gradclip::stable_adamw_factor(g, w, 1e-6), 1.0);
    EXPECT_THROW((void)gradclip::stable_adamw_factor(g, w, 1e-6, {on_nonfinite::error}), gradclip::nonfinite_error);
    const double propagated = gradclip::stable_adamw_factor(g, w, 1e-6, {on_nonfinite::propagate});
    if (std::isnan(bad_v)) {
      EXPECT_TRUE(std::isnan(propagated));
    } else {  // g^2 / inf = 0: the mean of 9, 0 and 0.5
      EXPECT_LE(relative_error(propagated, 1 / quad_sqrt(quad(9.5) / 3)), 1e-15);
    }
  }
}

// The same rules where the vector kernels group four terms per division (index 77), divide per element
// (970) and take the tail (995) of a 1000-element tensor; v beyond their range is summed exactly.
template <class T, class V>
void long_nonfinite_factor_cases() {
  const double eps = 1e-6;
  const T g_bad[] = {std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity(),
                     std::numeric_limits<T>::quiet_NaN()};
  const V v_bad[] = {std::numeric_limits<V>::infinity(), -std::numeric_limits<V>::infinity(),
                     std::numeric_limits<V>::quiet_NaN()};
  for (std::size_t at : {77u, 970u, 995u}) {
    SCOPED_TRACE(type_name<T>() + " g, " + type_name<V>() + " v, index " + std::to_string(at));
    for (int k = 0; k < 6; ++k) {
      std::vector<T> g(1000, T(0.5f));
      std::vector<V> v(1000, V(1));
      if (k < 3)
        g[at] = g_bad[k];
      else
        v[at] = v_bad[k - 3];
      EXPECT_EQ(gradclip::stable_adamw_factor(g, v, eps), 1.0);
      EXPECT_THROW((void)gradclip::stable_adamw_factor(g, v, eps, {on_nonfinite::error}), gradclip::nonfinite_error);
      const double propagated = gradclip::stable_adamw_factor(g, v, eps, {on_nonfinite::propagate});
      if (k == 2 || k == 5)
        EXPECT_TRUE(std::isnan(propagated));
      else if (k < 3)
        EXPECT_EQ(propagated, 0.0);
      else if (k == 3)  // g^2 / inf = 0: the mean stays below 1
        EXPECT_EQ(propagated, 1.0);
      else  // max(-inf, eps^2) = eps^2
        EXPECT_LE(relative_error(propagated, 1 / quad_sqrt((quad(0.25) * 999 + quad(0.25) / quad(1e-12)) / 1000)),
                  1e-14);
    }
    std::vector<T> g(1000, T(0.5f));
    std::vector<V> v(1000, V(1e-6f));
    v[at] = std::numeric_limits<V>::max();
    expect_factor(g, v, eps);
  }
}

TYPED_TEST(UpdateClipTyped, StableAdamwFactorNonFiniteInputsInLongTensors) {
  long_nonfinite_factor_cases<TypeParam, float>();
  long_nonfinite_factor_cases<TypeParam, double>();
}

TEST(UpdateClip, StableAdamwFactorPairsElementsInStorageOrder) {
  std::mt19937_64 rng(seed + 201);
  const auto gv = random_gradient<float>(40 * 30, rng, 20.0);
  std::vector<float> vv(gv.size());
  for (auto& x : vv) x = 0.5f + static_cast<float>(rng() % 1000) / 100.0f;
  const double expected = gradclip::stable_adamw_factor(gv, vv, 1e-6);
  EXPECT_LT(expected, 1.0);
  const Eigen::MatrixXf g = Eigen::Map<const Eigen::MatrixXf>(gv.data(), 40, 30);
  const Eigen::MatrixXf v = Eigen::Map<const Eigen::MatrixXf>(vv.data(), 40, 30);
  EXPECT_EQ(gradclip::stable_adamw_factor(g, v, 1e-6), expected);
  EXPECT_EQ(gradclip::stable_adamw_factor(gv.data(), vv.data(), gv.size(), 1e-6), expected);
  // Strided views (a block of a larger matrix, a map with an inner stride) give the contiguous bits.
  Eigen::MatrixXf big = Eigen::MatrixXf::Zero(50, 30);
  big.topRows(40) = g;
  EXPECT_EQ(gradclip::stable_adamw_factor(big.topRows(40), v, 1e-6), expected);
  std::vector<float> spaced(2 * gv.size());
  for (std::size_t i = 0; i < gv.size(); ++i) spaced[2 * i] = gv[i];
  const Eigen::Map<const Eigen::VectorXf, 0, Eigen::InnerStride<2>> strided(spaced.data(),
                                                                            static_cast<Eigen::Index>(gv.size()));
  EXPECT_EQ(gradclip::stable_adamw_factor(strided, vv, 1e-6), expected);
  const std::string f = "gradclip::stable_adamw_factor";
  const std::vector<float> shorter(vv.begin(), vv.end() - 1);
  expect_invalid_argument([&] { (void)gradclip::stable_adamw_factor(gv, shorter, 1e-6); }, f + ": g has 1200");
  const Eigen::MatrixXf reshaped = Eigen::Map<const Eigen::MatrixXf>(vv.data(), 30, 40);
  expect_invalid_argument([&] { (void)gradclip::stable_adamw_factor(g, reshaped, 1e-6); }, f + ": g and v");
  const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major = v;
  expect_invalid_argument([&] { (void)gradclip::stable_adamw_factor(g, row_major, 1e-6); }, f + ": g and v");
  Eigen::Tensor<float, 2> tg(40, 30), tv(30, 40);
  tg.setZero();
  tv.setZero();
  expect_invalid_argument([&] { (void)gradclip::stable_adamw_factor(tg, tv, 1e-6); }, f + ": g and v");
  for (double eps : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()})
    expect_invalid_argument([&] { (void)gradclip::stable_adamw_factor(gv, vv, eps); }, f + ": eps");
  EXPECT_EQ(gradclip::stable_adamw_factor(std::vector<float>{}, std::vector<double>{}, 1e-6), 1.0);
}

TEST(UpdateClip, StableAdamwFactorThreadsGiveTheSameBits) {
  std::mt19937_64 rng(seed + 202);
  const std::size_t n = (std::size_t{3} << 20) + 777;
  const auto g = random_gradient<Eigen::bfloat16>(n, rng, 5.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(0.5 + static_cast<double>(rng() % 4096) / 1024);
  const double one = gradclip::stable_adamw_factor(g, v, 1e-8);
  EXPECT_LE(relative_error(one, exact_factor(g, v, 1e-8)), 1e-14);
  for (unsigned threads : {2u, 3u, 8u}) {
    gradclip::options opt;
    opt.threads = threads;
    EXPECT_EQ(gradclip::stable_adamw_factor(g, v, 1e-8, opt), one);
  }
}

// ---- spam_clip

// The reference's test in binary128, where theta * v and g^2 are exact: g^2 > theta v with v > 0.
template <class T, class V>
bool exceeds(T g, V v, double theta) {
  return to_quad(v) > 0 && to_quad(g) * to_quad(g) > static_cast<quad>(theta) * to_quad(v);
}

template <class T>
double widen(T x) {
  return static_cast<double>(x);
}

// Every element clipped exactly where the exact test says (FP64 g: away from the boundary), to within
// one ulp of sign(g) sqrt(theta v) and never above |g|; the others bit for bit untouched.
template <class T, class V>
void expect_spam(const std::vector<T>& original, const std::vector<V>& v, double theta) {
  auto g = original;
  const std::size_t count = gradclip::spam_clip(g, v, theta);
  std::size_t expected = 0, ambiguous = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const bool clip = exceeds(original[i], v[i], theta);
    if constexpr (std::is_same_v<T, double>) {
      const quad square = to_quad(original[i]) * to_quad(original[i]), t = static_cast<quad>(theta) * to_quad(v[i]);
      if (t > 0 && quad_abs(square - t) < t * quad(0x1p-50)) {  // within FP64's rounding of g^2: either way
        ++ambiguous;
        const quad root = quad_sqrt(t);
        // |g| and the root then lie within 2^-51 of each other (4 ulps): kept or clipped, g is within that.
        ASSERT_LE(ulps(g[i], to_quad(original[i]) < 0 ? -root : root), 4.0);
        continue;
      }
    }
    expected += clip;
    if (!clip) {
      ASSERT_TRUE(same_bits(std::vector<T>{g[i]}, std::vector<T>{original[i]})) << type_name<T>() << " element " << i;
      continue;
    }
    const quad root = quad_sqrt(static_cast<quad>(theta) * to_quad(v[i]));
    const quad exact = to_quad(original[i]) < 0 ? -root : root;
    ASSERT_LE(ulps(g[i], exact), 1.0) << type_name<T>() << " element " << i;
    ASSERT_LE(std::abs(static_cast<double>(g[i])), std::abs(static_cast<double>(original[i])));
  }
  EXPECT_GE(count, expected);
  EXPECT_LE(count, expected + ambiguous);
}

template <class T, class V>
void random_spam_cases(std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t n : {1u, 31u, 1024u, 4099u, 50000u}) {
    auto g = random_gradient<T>(n, rng);
    std::vector<V> v(n);
    for (auto& x : v) x = static_cast<V>(normal(rng) * normal(rng));  // |v| spans decades; some v < 0
    for (std::size_t i = 0; i < n; i += 13) v[i] = V(0);
    for (std::size_t i = 5; i < n; i += 37) g[i] = static_cast<T>(static_cast<double>(g[i]) * 400);  // spikes
    expect_spam(g, v, 5000.0);
    expect_spam(g, v, 1.0);
    expect_spam(g, v, 1e-3);
  }
  // Near the boundary: v = g^2 / theta rounded to V, and its neighbours.
  std::vector<T> g;
  std::vector<V> v;
  for (int k = 0; k < 3000; ++k) {
    const T x = static_cast<T>(normal(rng) * 10);
    const V w = static_cast<V>(static_cast<double>(x) * static_cast<double>(x) / 3.0);
    for (const V candidate : {w, std::nextafter(w, V(0)), std::nextafter(w, std::numeric_limits<V>::max())}) {
      g.push_back(x);
      v.push_back(candidate);
    }
  }
  expect_spam(g, v, 3.0);
}

TYPED_TEST(UpdateClipTyped, SpamClipsExactlyWhereTheSquareExceedsThetaV) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 300);
  random_spam_cases<TypeParam, float>(rng);
  random_spam_cases<TypeParam, double>(rng);
}

TYPED_TEST(UpdateClipTyped, SpamExtremesDoNotOverflow) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max(), tiny = std::numeric_limits<T>::denorm_min();
  // theta * v beyond FP32 (and FP16) range; g^2 beyond every type's range; subnormal v.
  expect_spam(std::vector<T>{max, -max, T(1.0f)}, std::vector<float>{3e38f, 1e-45f, 1e-45f}, 5000.0);
  expect_spam(std::vector<T>{max, -max, tiny, -tiny}, std::vector<double>{1e306, 1e-320, 1e-320, 1e-300}, 5000.0);
  expect_spam(std::vector<T>{max, tiny}, std::vector<double>{std::numeric_limits<double>::max(), 4.9e-324}, 1e300);
  expect_spam(std::vector<T>{max, tiny}, std::vector<double>{1e-300, 4.9e-324}, 1e-300);
}

TEST(UpdateClip, SpamExtremeFp64Values) {
  // g^2 overflows double; theta v does not: clipped to sqrt(5000 * 1e306) = 7.07e154.
  expect_spam(std::vector<double>{1e300, -1e300}, std::vector<double>{1e306, 1e306}, 5000.0);
  // Subnormal squares: 1e-318 > 5000 * 4.9e-324 (clipped), 1e-320 < it (kept).
  expect_spam(std::vector<double>{1e-159, 1e-160}, std::vector<double>{4.9e-324, 4.9e-324}, 5000.0);
}

TYPED_TEST(UpdateClipTyped, SpamLeavesElementsWithoutHistoryAlone) {
  using T = TypeParam;
  std::vector<T> g{T(1000.0f), T(-3.0f), T(0.5f)};
  const auto original = g;
  // The reference's mask g^2 > theta * 0 would zero these: gradclip leaves v <= 0 alone.
  EXPECT_EQ(gradclip::spam_clip(g, std::vector<float>{0.0f, -0.0f, -1.0f}, 5000.0), 0u);
  EXPECT_TRUE(same_bits(g, original));
}

TYPED_TEST(UpdateClipTyped, SpamNonFiniteElementsFollowOptions) {
  using T = TypeParam;
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const float vinf = std::numeric_limits<float>::infinity(), vnan = std::numeric_limits<float>::quiet_NaN();
  // Element 0 spikes (clipped in every mode); 1: g = +inf; 2: g = -inf; 3: g NaN; 4, 5: v inf and NaN.
  const std::vector<T> original{T(100.0f), inf, -inf, nan, T(100.0f), T(100.0f), T(0.5f)};
  const std::vector<float> v{1.0f, 1.0f, 1.0f, 1.0f, vinf, vnan, 1.0f};
  auto g = original;
  EXPECT_EQ(gradclip::spam_clip(g, v, 50.0), 1u);
  EXPECT_LE(ulps(g[0], quad_sqrt(quad(50))), 1.0);
  for (std::size_t i = 1; i < g.size(); ++i)
    EXPECT_TRUE(same_bits(std::vector<T>{g[i]}, std::vector<T>{original[i]})) << i;
  g = original;
  EXPECT_THROW(gradclip::spam_clip(g, v, 50.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(g, original));
  g = original;
  EXPECT_EQ(gradclip::spam_clip(g, v, 50.0, {on_nonfinite::propagate}), 3u);  // the reference clips +-inf
  EXPECT_LE(ulps(g[1], quad_sqrt(quad(50))), 1.0);
  EXPECT_LE(ulps(g[2], -quad_sqrt(quad(50))), 1.0);
  for (std::size_t i = 3; i < g.size(); ++i)
    EXPECT_TRUE(same_bits(std::vector<T>{g[i]}, std::vector<T>{original[i]})) << i;
  // A finite g with a NaN v under error throws too.
  std::vector<T> finite{T(1.0f)};
  EXPECT_THROW(gradclip::spam_clip(finite, std::vector<float>{vnan}, 50.0, {on_nonfinite::error}),
               gradclip::nonfinite_error);
}

TEST(UpdateClip, SpamPairingThreadsAndBadArguments) {
  std::mt19937_64 rng(seed + 301);
  const std::size_t n = (std::size_t{2} << 20) + 99;
  auto original = random_gradient<Eigen::half>(n, rng);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(static_cast<double>(rng() % 1000) / 5000.0);
  for (std::size_t i = 0; i < n; i += 501) original[i] = Eigen::half(200.0f);
  auto one = original;
  const std::size_t count = gradclip::spam_clip(one, v, 5000.0);
  EXPECT_GT(count, n / 600);
  for (unsigned threads : {2u, 5u}) {
    auto many = original;
    gradclip::options opt;
    opt.threads = threads;
    EXPECT_EQ(gradclip::spam_clip(many, v, 5000.0, opt), count);
    EXPECT_TRUE(same_bits(many, one));
  }
  // A strided g gives the contiguous result.
  std::vector<Eigen::half> spaced(2 * n, Eigen::half(7.0f));
  for (std::size_t i = 0; i < n; ++i) spaced[2 * i] = original[i];
  Eigen::Map<Eigen::Matrix<Eigen::half, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<2>> strided(
      spaced.data(), static_cast<Eigen::Index>(n));
  EXPECT_EQ(gradclip::spam_clip(strided, v, 5000.0), count);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(spaced[2 * i]), Eigen::numext::bit_cast<std::uint16_t>(one[i]));
    ASSERT_EQ(static_cast<float>(spaced[2 * i + 1]), 7.0f);
  }
  auto raw = original;
  EXPECT_EQ(gradclip::spam_clip(raw.data(), v.data(), n, 5000.0), count);
  const std::string f = "gradclip::spam_clip";
  for (double theta : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()})
    expect_invalid_argument([&] { (void)gradclip::spam_clip(raw, v, theta); }, f + ": theta");
  std::vector<float> shorter(10);
  expect_invalid_argument([&] { (void)gradclip::spam_clip(raw, shorter, 5000.0); }, f + ": g has");
}

// SPAM's optimizer (the reference's AdamW with spike-aware clipping, no masks or resets) step by step: a
// long double transcription, and gradclip's spam_clip on the reference's previous v at every step.
TEST(UpdateClip, SpamMatchesTheReferenceStepByStep) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr std::size_t n = 600, steps = 400, grad_accu_steps = 20;
  constexpr long double theta = 5000, beta2 = 0.999L;
  std::mt19937_64 rng(seed + 302);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<long double> v_ref(n, 0);
  std::vector<double> v_lib(n, 0);  // the library's own run: v from its own clipped gradients
  std::size_t total = 0;
  for (std::size_t step = 1; step <= steps; ++step) {
    std::vector<float> g(n);
    for (auto& x : g) x = static_cast<float>(normal(rng) * (1 + 0.5 * std::sin(step / 30.0)));
    for (auto& x : g)
      if (uniform(rng) < 0.01) x *= 2000.0f;  // spikes: g^2 ~ 4e6 v, far above 5000 v
    // The reference (SPAM.py): mask = g^2 > theta * v; g[mask] = sign(g) sqrt(v * theta); then the EMA.
    std::vector<long double> clipped(n);
    std::size_t mask_count = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const long double x = g[i];
      const bool mask = step >= grad_accu_steps && x * x > theta * v_ref[i];
      mask_count += mask;
      clipped[i] = mask ? (x < 0 ? -1 : 1) * std::sqrt(v_ref[i] * theta) : x;
    }
    if (step >= grad_accu_steps) {
      std::vector<float> ours = g;
      std::vector<double> v_prev(v_ref.begin(), v_ref.end());
      ASSERT_EQ(gradclip::spam_clip(ours, v_prev, 5000.0), mask_count) << "step " << step;
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_LE(std::abs(ours[i] - static_cast<double>(clipped[i])),
                  0x1p-23 * std::abs(static_cast<double>(clipped[i])))
            << "step " << step << " element " << i;
      std::vector<float> own = g;
      total += gradclip::spam_clip(own, v_lib, 5000.0);
      for (std::size_t i = 0; i < n; ++i) v_lib[i] = 0.999 * v_lib[i] + 0.001 * double(own[i]) * own[i];
    } else {
      for (std::size_t i = 0; i < n; ++i) v_lib[i] = 0.999 * v_lib[i] + 0.001 * double(g[i]) * g[i];
    }
    for (std::size_t i = 0; i < n; ++i) v_ref[i] = beta2 * v_ref[i] + (1 - beta2) * clipped[i] * clipped[i];
  }
  EXPECT_GT(total, steps * n / 200);
  // The library's run keeps FP32 gradients, so its clipped values and v carry FP32 roundings (2^-24).
  for (std::size_t i = 0; i < n; ++i)
    EXPECT_LE(std::abs(v_lib[i] - static_cast<double>(v_ref[i])), 1e-6 * static_cast<double>(v_ref[i])) << i;
}

}  // namespace
