// options::report and clip_coefficient: per-tensor counts against counts taken on the widened values,
// per-tensor norms against binary128 within the documented bound, results and written bits identical with
// and without a report for one and two threads, a report left as it was by a call that throws, the first
// non-finite gradient named by nonfinite_error, the loss scaler's underflow counts, and clip_coefficient
// returning clip_by_global_norm's result, bit for bit, without writing.
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"
#include "reference.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using gradclip_test::quad;

template <class T>
using vector_of = Eigen::Matrix<T, Eigen::Dynamic, 1>;

template <class T>
std::vector<T> as_std(const vector_of<T>& v) {
  return std::vector<T>(v.data(), v.data() + v.size());
}

/// What a report must say about one gradient, counted on values widened to double.
struct expected_counts {
  std::size_t nan = 0, inf = 0, zeros = 0, subnormals = 0;
  double max_abs = 0;
  double max_abs_not_nan = 0;  // what a census (detail/census.hpp) keeps
};

template <class T>
expected_counts count_widened(const vector_of<T>& v) {
  const double min_normal = static_cast<double>(std::numeric_limits<T>::min());
  expected_counts c;
  for (Eigen::Index i = 0; i < v.size(); ++i) {
    const double x = static_cast<double>(v[i]);
    if (std::isnan(x)) {
      ++c.nan;
      continue;
    }
    if (std::isinf(x)) ++c.inf;
    if (x == 0) ++c.zeros;
    if (x != 0 && std::abs(x) < min_normal) ++c.subnormals;
    c.max_abs = std::max(c.max_abs, std::abs(x));
  }
  c.max_abs_not_nan = c.max_abs;
  if (c.nan) c.max_abs = std::numeric_limits<double>::quiet_NaN();
  return c;
}

/// A report entry's counts and max_abs against those counted independently (NaN max_abs when a NaN was
/// read).
void expect_counts(const gradclip::tensor_stats& t, const expected_counts& c, std::size_t size) {
  EXPECT_EQ(t.size, size);
  EXPECT_EQ(t.nan, c.nan);
  EXPECT_EQ(t.inf, c.inf);
  EXPECT_EQ(t.zeros, c.zeros);
  EXPECT_EQ(t.subnormals, c.subnormals);
  if (c.nan)
    EXPECT_TRUE(std::isnan(t.max_abs));
  else
    EXPECT_EQ(t.max_abs, c.max_abs);
}

/// Three gradients of T with zeros, subnormals and large values at random places; `special` adds a NaN
/// to the second and an Inf to the third.
template <class T>
std::vector<vector_of<T>> census_group(std::mt19937_64& rng, bool special) {
  const std::vector<std::size_t> sizes{1000, 70001, 9};
  std::vector<vector_of<T>> grads;
  const T subnormal = std::numeric_limits<T>::denorm_min();
  for (std::size_t s : sizes) {
    const std::vector<T> values = gradclip_test::random_gradient<T>(s, rng);
    vector_of<T> v = Eigen::Map<const vector_of<T>>(values.data(), static_cast<Eigen::Index>(s));
    std::uniform_int_distribution<std::size_t> at(0, s - 1);
    for (int k = 0; k < 5; ++k) v[static_cast<Eigen::Index>(at(rng))] = T(0);
    for (int k = 0; k < 3; ++k) v[static_cast<Eigen::Index>(at(rng))] = -subnormal;
    v[static_cast<Eigen::Index>(at(rng))] = static_cast<T>(-1000.0);
    grads.push_back(v);
  }
  if (special) {
    grads[1][70000] = std::numeric_limits<T>::quiet_NaN();
    grads[2][4] = -std::numeric_limits<T>::infinity();
  }
  return grads;
}

template <class T>
class Report : public ::testing::Test {};
TYPED_TEST_SUITE(Report, gradclip_test::element_types);

TYPED_TEST(Report, CountsAndNormsOfEveryGradient) {
  using T = TypeParam;
  std::mt19937_64 rng(gradclip_test::seed);
  for (bool special : {false, true}) {
    auto grads = census_group<T>(rng, special);
    const auto before = grads;
    gradclip::tensor_report report;
    gradclip::options opt;
    opt.report = &report;
    opt.nonfinite = gradclip::on_nonfinite::propagate;
    const auto r = gradclip::clip_by_global_norm(grads, 1.0, opt);
    ASSERT_EQ(report.size(), grads.size());
    for (std::size_t k = 0; k < grads.size(); ++k) {
      SCOPED_TRACE("gradient " + std::to_string(k) + " of " + gradclip_test::type_name<T>());
      const expected_counts c = count_widened(before[k]);
      const gradclip::tensor_stats& t = report[k];
      expect_counts(t, c, static_cast<std::size_t>(before[k].size()));
      EXPECT_GE(t.subnormals, 1u);  // the counts are of the gradients as read, before clipping wrote
      if (c.nan) {
        EXPECT_TRUE(std::isnan(t.norm));
      }
      if (c.inf && !c.nan) {
        EXPECT_EQ(t.norm, std::numeric_limits<double>::infinity());
      }
      if (!c.nan && !c.inf) {
        const quad exact = gradclip_test::exact_norm(as_std(before[k]));
        EXPECT_LE(gradclip_test::relative_error(t.norm, exact), gradclip_test::robust_norm_bound<T>());
      }
    }
    EXPECT_EQ(report.first_nonfinite(), special ? 1u : grads.size());
    EXPECT_EQ(r.finite, !special);
  }
}

TYPED_TEST(Report, ChangesNoResultAndNoBitForOneAndTwoThreads) {
  using T = TypeParam;
  std::mt19937_64 rng(gradclip_test::seed);
  // Large enough that two threads really split the work (a few MiB).
  std::vector<vector_of<T>> grads;
  for (std::size_t s : {std::size_t{1} << 21, std::size_t{300000}, std::size_t{17}}) {
    const std::vector<T> values = gradclip_test::random_gradient<T>(s, rng);
    grads.push_back(Eigen::Map<const vector_of<T>>(values.data(), static_cast<Eigen::Index>(s)));
  }
  for (unsigned threads : {1u, 2u}) {
    for (gradclip::norm_type norm : {gradclip::norm_type(2.0), gradclip::inf_norm, gradclip::norm_type(1.0)}) {
      auto plain = grads, reported = grads;
      gradclip::options opt;
      opt.threads = threads;
      opt.norm = norm;
      const auto expected = gradclip::clip_by_global_norm(plain, 1.0, opt);
      gradclip::tensor_report report;
      opt.report = &report;
      const auto got = gradclip::clip_by_global_norm(reported, 1.0, opt);
      SCOPED_TRACE(std::to_string(threads) + " threads, p = " + std::to_string(norm.p()));
      EXPECT_TRUE(expected.clipped);
      EXPECT_EQ(std::memcmp(&got.norm, &expected.norm, sizeof(double)), 0);
      EXPECT_EQ(std::memcmp(&got.coefficient, &expected.coefficient, sizeof(double)), 0);
      for (std::size_t k = 0; k < grads.size(); ++k)
        EXPECT_TRUE(gradclip_test::same_bits(as_std(plain[k]), as_std(reported[k])));
      ASSERT_EQ(report.size(), grads.size());
      // The group's norm from the tensors' norms: exactly for the max norm, within the bound for L2.
      if (norm.p() == std::numeric_limits<double>::infinity()) {
        double largest = 0;
        for (const auto& t : report) largest = std::max(largest, t.norm);
        EXPECT_EQ(largest, expected.norm);
      }
      if (norm.p() == 2.0) {
        const quad exact = gradclip_test::exact_norm(as_std(grads[0]));
        EXPECT_LE(gradclip_test::relative_error(report[0].norm, exact), gradclip_test::robust_norm_bound<T>());
      }
    }
  }
}

/// Many small gradients, as a model's biases and norms are (up to a little past the reductions' short
/// runs), of random values drawn among zeros, subnormals, the largest finite values, Inf and NaN: each
/// counted as count_widened counts it, and each norm the bits of norm() of that gradient alone, for the
/// L2, RMS, maximum and L1 norms (the gradients of normal numbers alone take the reduction's short path).
TYPED_TEST(Report, SmallGradientsCountedAndNormedAsAlone) {
  using T = TypeParam;
  using limits = std::numeric_limits<T>;
  std::mt19937_64 rng(gradclip_test::seed);
  const std::vector<T> specials{T(0),
                                -T(0),
                                limits::denorm_min(),
                                -limits::min(),
                                static_cast<T>(static_cast<double>(limits::min()) / 2),
                                limits::max(),
                                -limits::max(),
                                limits::infinity(),
                                limits::quiet_NaN()};
  std::vector<vector_of<T>> grads;
  for (std::size_t n = 0; n <= 40; ++n) {
    const std::vector<T> values = gradclip_test::random_gradient<T>(n, rng);
    vector_of<T> v = Eigen::Map<const vector_of<T>>(values.data(), static_cast<Eigen::Index>(n));
    std::uniform_int_distribution<std::size_t> pick(0, 2 * specials.size());  // about half the draws: none
    for (Eigen::Index i = 0; i < v.size(); i += 3) {
      const std::size_t k = pick(rng);
      if (k < specials.size()) v[i] = specials[k];
    }
    grads.push_back(v);
  }
  for (gradclip::norm_type norm :
       {gradclip::norm_type(2.0), gradclip::rms_norm, gradclip::inf_norm, gradclip::norm_type(1.0)}) {
    gradclip::tensor_report report;
    gradclip::options alone{gradclip::on_nonfinite::propagate, 0.0, norm}, opt = alone;
    opt.report = &report;
    (void)gradclip::global_norm(grads, opt);
    ASSERT_EQ(report.size(), grads.size());
    for (std::size_t k = 0; k < grads.size(); ++k) {
      SCOPED_TRACE(std::to_string(k) + " elements, p = " + std::to_string(norm.p()));
      const expected_counts c = count_widened(grads[k]);
      const gradclip::tensor_stats& t = report[k];
      expect_counts(t, c, k);
      const double expected = gradclip::norm(grads[k], alone);
      if (std::isnan(expected))
        EXPECT_TRUE(std::isnan(t.norm));
      else
        EXPECT_EQ(std::memcmp(&t.norm, &expected, sizeof(double)), 0) << t.norm << " != " << expected;
    }
  }
}

/// A gradient of n random values with the specials (zeros of both signs, subnormals, the smallest normal,
/// the largest finite value, Inf, NaN as asked) at each of `places` below n: where the census's vectors,
/// blocks and chunks begin and end, and in the tails.
template <class T>
vector_of<T> with_specials(std::size_t n, const std::vector<std::size_t>& places, bool nonfinite,
                           std::mt19937_64& rng) {
  using limits = std::numeric_limits<T>;
  std::vector<T> specials{T(0),
                          -T(0),
                          limits::denorm_min(),
                          -limits::denorm_min(),
                          -limits::min(),
                          static_cast<T>(static_cast<double>(limits::min()) / 2),
                          limits::max()};
  if (nonfinite) specials.insert(specials.end(), {-limits::infinity(), limits::quiet_NaN()});
  const std::vector<T> values = gradclip_test::random_gradient<T>(n, rng);
  vector_of<T> v = Eigen::Map<const vector_of<T>>(values.data(), static_cast<Eigen::Index>(n));
  std::size_t k = 0;
  for (const std::size_t at : places)
    if (at < n) v[static_cast<Eigen::Index>(at)] = specials[k++ % specials.size()];
  return v;
}

/// Places around the boundaries the census works in: vectors (1 to 32 lanes), the kernels' blocks,
/// the observed chunks, and the last elements of a run of n.
template <class T>
std::vector<std::size_t> boundary_places(std::size_t n) {
  std::vector<std::size_t> places;
  for (std::size_t edge :
       {std::size_t{8}, std::size_t{16}, std::size_t{32}, std::size_t{64}, gradclip::detail::block_for<T>,
        gradclip::detail::observed_chunk, 2 * gradclip::detail::observed_chunk})
    for (std::size_t at : {edge - 1, edge, edge + 1}) places.push_back(at);
  for (std::size_t back : {1, 2, 3, 17}) places.push_back(n - back);
  return places;
}

/// Whole clips with a report, specials at every boundary: the counts are count_widened's, and the norm,
/// the coefficient and every written bit those of the call without a report, on one and two threads.
TYPED_TEST(Report, SpecialsAtChunkBlockAndVectorBoundariesOnOneAndTwoThreads) {
  using T = TypeParam;
  std::mt19937_64 rng(gradclip_test::seed);
  for (bool nonfinite : {false, true}) {
    std::vector<vector_of<T>> grads;
    for (std::size_t n : {std::size_t{33}, std::size_t{100}, gradclip::detail::block_for<T> + 5,
                          3 * gradclip::detail::observed_chunk + 21, std::size_t{1} << 20})
      grads.push_back(with_specials<T>(n, boundary_places<T>(n), nonfinite, rng));
    for (unsigned threads : {1u, 2u}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, " + (nonfinite ? "with" : "without") + " NaN and Inf");
      auto plain = grads, reported = grads;
      gradclip::options opt;
      opt.threads = threads;
      opt.nonfinite = gradclip::on_nonfinite::propagate;
      const auto expected = gradclip::clip_by_global_norm(plain, 1.0, opt);
      gradclip::tensor_report report;
      opt.report = &report;
      const auto got = gradclip::clip_by_global_norm(reported, 1.0, opt);
      EXPECT_EQ(std::memcmp(&got.norm, &expected.norm, sizeof(double)), 0);
      EXPECT_EQ(std::memcmp(&got.coefficient, &expected.coefficient, sizeof(double)), 0);
      ASSERT_EQ(report.size(), grads.size());
      for (std::size_t k = 0; k < grads.size(); ++k) {
        SCOPED_TRACE("gradient " + std::to_string(k));
        EXPECT_TRUE(gradclip_test::same_bits(as_std(plain[k]), as_std(reported[k])));
        const expected_counts c = count_widened(grads[k]);
        const gradclip::tensor_stats& t = report[k];
        expect_counts(t, c, static_cast<std::size_t>(grads[k].size()));
      }
    }
  }
}

/// Blocks where a NaN or an Inf shares every lane with zeros and subnormals (the lanes' least magnitudes
/// then say nothing), and a block of nothing but subnormals and zeros (its largest magnitude subnormal):
/// every count and max_abs as count_widened's, in runs of whole blocks and in a last, partial one.
TYPED_TEST(Report, ZerosAndSubnormalsBesideNaNAndInfInEveryLane) {
  using T = TypeParam;
  using limits = std::numeric_limits<T>;
  const std::size_t block = gradclip::detail::block_for<T>;
  const T half_min = static_cast<T>(static_cast<double>(limits::min()) / 2);  // subnormal, exact
  for (const T fill : {limits::quiet_NaN(), -limits::infinity()})
    for (const std::size_t n : {3 * block, 3 * block + 45}) {
      SCOPED_TRACE(std::to_string(n) + " elements, filled with " + std::to_string(static_cast<double>(fill)));
      vector_of<T> v = vector_of<T>::Constant(static_cast<Eigen::Index>(n), fill);
      for (std::size_t i = 0; i < 64; ++i) {  // a zero or a subnormal in each of the first 64 lanes
        v[static_cast<Eigen::Index>(i)] = i % 2 ? -T(0) : limits::denorm_min();
        v[static_cast<Eigen::Index>(block + 3 * i)] = T(0);
        v[static_cast<Eigen::Index>(2 * block + i)] = i % 3 ? limits::denorm_min() : -half_min;
      }
      for (std::size_t i = 2 * block + 64; i < 3 * block; ++i)  // the third block: no NaN or Inf
        v[static_cast<Eigen::Index>(i)] = i % 5 ? -limits::denorm_min() : T(0);
      for (std::size_t i = 3 * block; i < n; ++i) v[static_cast<Eigen::Index>(i)] = i % 2 ? fill : T(0);
      std::vector<vector_of<T>> grads{v};
      gradclip::tensor_report report;
      gradclip::options opt;
      opt.nonfinite = gradclip::on_nonfinite::propagate;
      opt.report = &report;
      (void)gradclip::clip_by_global_norm(grads, 1.0, opt);
      ASSERT_EQ(report.size(), 1u);
      expect_counts(report[0], count_widened(v), n);
      std::vector<vector_of<T>> third{
          v.segment(static_cast<Eigen::Index>(2 * block), static_cast<Eigen::Index>(block))};
      (void)gradclip::norm(third[0], opt);
      ASSERT_EQ(report.size(), 1u);
      expect_counts(report[0], count_widened(third[0]), block);
      EXPECT_EQ(report[0].max_abs, static_cast<double>(half_min)) << "the largest magnitude is subnormal";
    }
}

#if !defined(GRADCLIP_COMPILED)  // each instruction set's kernels by name: the headers' own, not the library
void expect_same_census(const gradclip::detail::census& got, const expected_counts& c, std::size_t n) {
  EXPECT_EQ(got.size, n);
  EXPECT_EQ(got.nan, c.nan);
  EXPECT_EQ(got.inf, c.inf);
  EXPECT_EQ(got.zeros, c.zeros);
  EXPECT_EQ(got.subnormals, c.subnormals);
  EXPECT_EQ(got.max_abs, c.max_abs_not_nan);
}

/// The sum of squares that counts as it reads (census_observer) on every instruction set this CPU has
/// (run under qemu -cpu Haswell and Nehalem for avx2 and portable): the census is count_widened's and
/// the same on every target, and the partial norm is, bit for bit, that of the same kernel not counting,
/// for each accumulator and with and without max scaling, on runs that end anywhere in a vector or block.
TYPED_TEST(Report, CountingKernelsAgreeOnEveryTargetAndChangeNoSum) {
  using T = TypeParam;
  using gradclip::detail::isa;
  using robust_acc = gradclip::detail::robust_t<T>;
  using promoted_acc = gradclip::detail::promoted_t<T>;
  std::mt19937_64 rng(gradclip_test::seed);
  std::vector<isa> targets{isa::portable};
  for (isa target : {isa::avx2, isa::avx512})
    if (gradclip::detail::isa_supported(target)) targets.push_back(target);
  const auto same_part = [](const gradclip::partial_norm& a, const gradclip::partial_norm& b) {
    return a.exponent == b.exponent && a.finite == b.finite && std::memcmp(&a.sum, &b.sum, sizeof(double)) == 0 &&
           std::memcmp(&a.low, &b.low, sizeof(double)) == 0;
  };
  const std::size_t block = gradclip::detail::block_for<T>, chunk = gradclip::detail::observed_chunk;
  for (bool nonfinite : {false, true})
    for (std::size_t n : {std::size_t{1}, std::size_t{31}, std::size_t{33}, std::size_t{257}, block - 1, block,
                          block + 1, chunk - 3, chunk, chunk + 1, 2 * chunk + 40}) {
      const vector_of<T> v = with_specials<T>(n, boundary_places<T>(n), nonfinite, rng);
      const expected_counts c = count_widened(v);
      const auto check = [&](auto acc, auto max_scales) {
        using Acc = decltype(acc);
        constexpr bool MaxScales = decltype(max_scales)::value;
        SCOPED_TRACE(std::to_string(n) + " elements, " + (nonfinite ? "with" : "without") + " NaN and Inf, Acc of " +
                     std::to_string(sizeof(Acc)) + " bytes, max scaling " + (MaxScales ? "on" : "off"));
        for (isa target : targets) {
          SCOPED_TRACE("target " + std::to_string(static_cast<int>(target)));
          gradclip::detail::census counted;
          const auto [plain, got] = gradclip::detail::with_isa(target, [&](auto k) {
            using K = decltype(k);
            return std::pair{
                gradclip::detail::sum_squares<K, Acc, MaxScales>(v.data(), n, gradclip::detail::no_observer{}),
                gradclip::detail::sum_squares<K, Acc, MaxScales>(v.data(), n,
                                                                 gradclip::detail::census_observer{&counted})};
          });
          EXPECT_TRUE(same_part(plain, got));
          expect_same_census(counted, c, n);
        }
      };
      check(robust_acc{}, std::true_type{});
      check(promoted_acc{}, std::true_type{});
      check(promoted_acc{}, std::false_type{});
    }
}
#endif

TEST(Report, ReusedWithoutStaleEntries) {
  std::vector<vector_of<float>> three(3, vector_of<float>::Ones(10)), one(1, vector_of<float>::Zero(4));
  gradclip::tensor_report report;
  gradclip::options opt;
  opt.report = &report;
  (void)gradclip::clip_by_global_norm(three, 1.0, opt);
  ASSERT_EQ(report.size(), 3u);
  (void)gradclip::clip_by_global_norm(one, 1.0, opt);
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].zeros, 4u);
  EXPECT_EQ(report[0].norm, 0.0);
}

TEST(Report, FilledByNormsSingleGradientsAndBracedLists) {
  vector_of<Eigen::half> h = vector_of<Eigen::half>::Constant(8, Eigen::half(300.0f));
  vector_of<double> d = vector_of<double>::Zero(3);
  gradclip::tensor_report report;
  gradclip::options opt;
  opt.report = &report;
  EXPECT_EQ(gradclip::norm(h, opt), std::sqrt(8.0) * 300);
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].max_abs, 300.0);
  (void)gradclip::clip_by_norm(h, 1.0, opt);
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].norm, std::sqrt(8.0) * 300);  // before clipping
  (void)gradclip::global_norm({h, d}, opt);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[1].zeros, 3u);
  (void)gradclip::clip_by_global_norm({h, d}, 1.0, opt);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[0].size, 8u);
}

TEST(Report, LeftAsItWasByACallThatThrows) {
  std::vector<vector_of<float>> good(2, vector_of<float>::Constant(5, 3.0f));
  std::vector<vector_of<float>> bad{vector_of<float>::Zero(7), vector_of<float>::Zero(7), vector_of<float>::Zero(7)};
  bad[2][1] = std::numeric_limits<float>::infinity();
  gradclip::tensor_report report;
  gradclip::options opt;
  opt.report = &report;
  (void)gradclip::clip_by_global_norm(good, 1.0, opt);
  const auto check_unchanged = [&] {
    ASSERT_EQ(report.size(), 2u);
    EXPECT_EQ(report[0].size, 5u);
    EXPECT_EQ(report[1].max_abs, 3.0);
    EXPECT_EQ(report[1].inf, 0u);
  };
  opt.nonfinite = gradclip::on_nonfinite::error;
  EXPECT_THROW((void)gradclip::clip_by_global_norm(bad, 1.0, opt), gradclip::nonfinite_error);
  check_unchanged();
  EXPECT_THROW((void)gradclip::clip_coefficient(bad, 1.0, opt), gradclip::nonfinite_error);
  check_unchanged();
  opt.nonfinite = gradclip::on_nonfinite::skip;
  EXPECT_THROW((void)gradclip::clip_by_global_norm(bad, -1.0, opt), std::invalid_argument);
  check_unchanged();
  // An executor that throws while the pieces are read or written.
  struct throwing_executor : gradclip::executor {
    void run(unsigned, const std::function<void(unsigned)>&) const override {
      throw std::runtime_error("executor failed");
    }
  } executor;
  std::vector<vector_of<float>> large(2, vector_of<float>::Constant(1 << 20, 1.0f));
  opt.pool = &executor;
  opt.threads = 2;
  EXPECT_THROW((void)gradclip::clip_by_global_norm(large, 1.0, opt), std::runtime_error);
  check_unchanged();
  EXPECT_THROW((void)gradclip::global_norm(large, opt), std::runtime_error);
  check_unchanged();
}

TEST(NonfiniteError, NamesTheFirstNonfiniteGradient) {
  for (bool with_report : {false, true}) {
    std::vector<vector_of<float>> grads(4, vector_of<float>::Ones(100));
    grads[2][7] = std::numeric_limits<float>::quiet_NaN();
    grads[2][8] = std::numeric_limits<float>::quiet_NaN();
    grads[2][9] = -std::numeric_limits<float>::infinity();
    grads[3][0] = std::numeric_limits<float>::infinity();
    gradclip::tensor_report report;
    gradclip::options opt;
    opt.nonfinite = gradclip::on_nonfinite::error;
    if (with_report) opt.report = &report;
    try {
      (void)gradclip::clip_by_global_norm(grads, 1.0, opt);
      ADD_FAILURE() << "no nonfinite_error";
    } catch (const gradclip::nonfinite_error& e) {
      EXPECT_EQ(e.tensor, 2u);
      EXPECT_EQ(e.nan, 2u);
      EXPECT_EQ(e.inf, 1u);
      EXPECT_TRUE(std::isnan(e.norm));
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("gradclip::clip_by_global_norm: ", 0), 0u) << what;
      EXPECT_NE(what.find("gradient 2 is the first with NaN or Inf (2 NaN, 1 Inf)"), std::string::npos) << what;
    }
    EXPECT_TRUE(report.empty());
  }
}

TEST(NonfiniteError, SaysNoElementIsNonfiniteWhenTheNormOverflowed) {
  vector_of<Eigen::half> g = vector_of<Eigen::half>::Constant(2, Eigen::half(60000.0f));
  gradclip::options opt;
  opt.nonfinite = gradclip::on_nonfinite::error;
  try {
    (void)gradclip::clip_by_norm<gradclip::naive>(g, 1.0, opt);
    ADD_FAILURE() << "no nonfinite_error";
  } catch (const gradclip::nonfinite_error& e) {
    EXPECT_EQ(e.tensor, gradclip::nonfinite_error::no_tensor);
    EXPECT_NE(std::string(e.what()).find("no element of these gradients is NaN or Inf"), std::string::npos) << e.what();
  }
}

/// loss_scaler::unscale_and_clip of gradients stored scaled by `scale`, with a max_norm that does not bind,
/// reporting into `report`.
template <class Grads>
gradclip::clip_result unscale_reported(Grads& grads, double scale, gradclip::tensor_report& report) {
  gradclip::loss_scaler_config config;
  config.init_scale = scale;
  gradclip::options opt;
  opt.report = &report;
  return gradclip::loss_scaler(config).unscale_and_clip(grads, 1e6, opt);
}

TEST(Report, LossScalerCountsTheStoredElementsAndUnscalesTheNorm) {
  // An FP16 gradient scaled by S = 2^-10, a loss scale far too low: many of its values flush to zero or
  // become subnormal in storage, which the report shows next to the unscaled norm.
  std::mt19937_64 rng(gradclip_test::seed);
  const double scale = 0x1p-10;
  std::vector<double> exact = gradclip_test::random_gradient<double>(4096, rng, 1e-2);
  vector_of<Eigen::half> g(4096);
  for (std::size_t i = 0; i < exact.size(); ++i) g[static_cast<Eigen::Index>(i)] = Eigen::half(exact[i] * scale);
  const expected_counts stored = count_widened(g);
  ASSERT_GT(stored.subnormals, 1000u);
  gradclip::tensor_report report;
  const vector_of<Eigen::half> before = g;
  const auto r = unscale_reported(g, scale, report);
  ASSERT_EQ(report.size(), 1u);
  EXPECT_EQ(report[0].zeros, stored.zeros);
  EXPECT_EQ(report[0].subnormals, stored.subnormals);
  EXPECT_EQ(report[0].norm, r.norm);  // one gradient: its norm is the group's, g / S
  EXPECT_EQ(report[0].max_abs, stored.max_abs / scale);
  EXPECT_LE(gradclip_test::relative_error(report[0].norm, gradclip_test::exact_norm(as_std(before)) / quad(scale)),
            gradclip_test::robust_norm_bound<Eigen::half>());
  EXPECT_NEAR(report[0].underflow_fraction(), static_cast<double>(stored.zeros + stored.subnormals) / 4096.0, 0.0);
}

TEST(Report, LossScalerUnscalesTheNormsOfSmallGradients) {
  // FP16 gradients of 1 to 40 elements scaled by S = 2^10, every value a normal number: each entry's norm
  // is that of g / S, its max_abs max |g| / S, as for one large gradient.
  std::mt19937_64 rng(gradclip_test::seed);
  const double scale = 0x1p10;
  std::vector<vector_of<Eigen::half>> grads;
  for (std::size_t n = 1; n <= 40; ++n) {
    const std::vector<double> exact = gradclip_test::random_gradient<double>(n, rng, 1e-2);
    vector_of<Eigen::half> g(static_cast<Eigen::Index>(n));
    for (std::size_t i = 0; i < n; ++i) g[static_cast<Eigen::Index>(i)] = Eigen::half(exact[i] * scale);
    const expected_counts stored = count_widened(g);
    ASSERT_EQ(stored.zeros + stored.subnormals, 0u);
    grads.push_back(g);
  }
  const auto before = grads;
  gradclip::tensor_report report;
  (void)unscale_reported(grads, scale, report);
  ASSERT_EQ(report.size(), grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    SCOPED_TRACE(std::to_string(k + 1) + " elements");
    EXPECT_LE(gradclip_test::relative_error(report[k].norm, gradclip_test::exact_norm(as_std(before[k])) / quad(scale)),
              gradclip_test::robust_norm_bound<Eigen::half>());
    EXPECT_EQ(report[k].max_abs, count_widened(before[k]).max_abs / scale);
  }
}

template <class T>
class ClipCoefficient : public ::testing::Test {};
TYPED_TEST_SUITE(ClipCoefficient, gradclip_test::element_types);

template <class Policy, class T>
void expect_coefficient_is_the_clips(double max_norm, gradclip::on_nonfinite mode, bool nonfinite) {
  std::mt19937_64 rng(gradclip_test::seed);
  std::vector<vector_of<T>> grads;
  for (std::size_t s : {std::size_t{5000}, std::size_t{3}, std::size_t{70000}}) {
    const std::vector<T> values = gradclip_test::random_gradient<T>(s, rng);
    grads.push_back(Eigen::Map<const vector_of<T>>(values.data(), static_cast<Eigen::Index>(s)));
  }
  if (nonfinite) grads[1][2] = std::numeric_limits<T>::infinity();
  const auto untouched = grads;
  gradclip::options opt;
  opt.nonfinite = mode;
  const auto plan = gradclip::clip_coefficient<Policy>(grads, max_norm, opt);
  for (std::size_t k = 0; k < grads.size(); ++k)
    EXPECT_TRUE(gradclip_test::same_bits(as_std(grads[k]), as_std(untouched[k])));
  auto clipped = grads;
  const auto r = gradclip::clip_by_global_norm<Policy>(clipped, max_norm, opt);
  EXPECT_EQ(std::memcmp(&plan.norm, &r.norm, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&plan.coefficient, &r.coefficient, sizeof(double)), 0);
  EXPECT_EQ(plan.clipped, r.clipped);
  EXPECT_EQ(plan.finite, r.finite);
  EXPECT_EQ(plan.threshold, r.threshold);
}

TYPED_TEST(ClipCoefficient, IsClipByGlobalNormsResultWithoutWriting) {
  using T = TypeParam;
  for (double max_norm : {0.5, 1e6, 0.0}) {
    expect_coefficient_is_the_clips<gradclip::robust, T>(max_norm, gradclip::on_nonfinite::skip, false);
    expect_coefficient_is_the_clips<gradclip::max_scale, T>(max_norm, gradclip::on_nonfinite::skip, false);
    expect_coefficient_is_the_clips<gradclip::promote, T>(max_norm, gradclip::on_nonfinite::skip, false);
  }
  for (auto mode : {gradclip::on_nonfinite::skip, gradclip::on_nonfinite::propagate})
    expect_coefficient_is_the_clips<gradclip::robust, T>(1.0, mode, true);
}

TEST(ClipCoefficient, SingleGradientsBuffersAndBracedLists) {
  vector_of<Eigen::half> h = vector_of<Eigen::half>::Constant(1, Eigen::half(300.0f));
  vector_of<float> f = vector_of<float>::Constant(2, 1e20f);
  const auto one = gradclip::clip_coefficient(h, 1.0);
  EXPECT_TRUE(one.clipped);
  EXPECT_EQ(one.norm, 300.0);
  EXPECT_EQ(static_cast<float>(h[0]), 300.0f);
  const auto buffer = gradclip::clip_coefficient(f.data(), 2, 1.0);
  const quad exact = gradclip_test::exact_norm(f.data(), 2);
  EXPECT_LE(gradclip_test::relative_error(buffer.norm, exact), gradclip_test::robust_norm_bound<float>());
  const auto list = gradclip::clip_coefficient({h, f}, 1.0);
  auto h2 = h;
  auto f2 = f;
  const auto clipped = gradclip::clip_by_global_norm({h2, f2}, 1.0);
  EXPECT_EQ(list.coefficient, clipped.coefficient);
  EXPECT_EQ(list.norm, clipped.norm);
  EXPECT_THROW((void)gradclip::clip_coefficient(h, -1.0), std::invalid_argument);
  gradclip::tensor_report report;
  gradclip::options opt;
  opt.report = &report;
  (void)gradclip::clip_coefficient({h, f}, 1.0, opt);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_EQ(report[0].max_abs, 300.0);
  EXPECT_EQ(report[1].size, 2u);
}

// A gradient of several pieces (more than detail::piece_elements elements) gets one entry from all of
// them: the norm it has alone (its parts merged in the same order) and the census of every piece, its
// largest magnitude or NaN coming from later pieces; gradients without elements around it get empty entries.
TEST(Report, GradientOfSeveralPiecesCountsEveryPiece) {
  const std::size_t piece = gradclip::detail::piece_elements;
  for (bool nan : {false, true}) {
    for (unsigned threads : {1u, 2u}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, " + (nan ? "with" : "without") + " NaN");
      std::mt19937_64 rng(gradclip_test::seed);
      std::vector<float> big = gradclip_test::random_gradient<float>(2 * piece + 3, rng);
      for (float& x : big)
        if (!std::isnormal(x)) x = 1.0f;  // only the zero and the subnormal below
      big[5] = 0.0f;                      // first piece: a zero and a subnormal
      big[6] = std::numeric_limits<float>::denorm_min();
      big[piece + 1] = -1e30f;                                                // second piece: the largest magnitude
      if (nan) big[2 * piece + 1] = std::numeric_limits<float>::quiet_NaN();  // third piece
      const std::vector<std::vector<float>> grads{{}, big, {}, {1.0f, -2.0f}};
      gradclip::tensor_report report;
      gradclip::options opt;
      opt.threads = threads;
      opt.report = &report;
      (void)gradclip::global_norm(grads, opt);
      ASSERT_EQ(report.size(), 4u);
      gradclip::options alone;
      alone.threads = threads;
      const double expected = gradclip::global_norm(std::vector<std::vector<float>>{big}, alone);
      if (nan) {
        EXPECT_TRUE(std::isnan(report[1].norm));
        EXPECT_TRUE(std::isnan(report[1].max_abs));
      } else {
        EXPECT_EQ(std::memcmp(&report[1].norm, &expected, sizeof(double)), 0);
        EXPECT_EQ(report[1].max_abs, static_cast<double>(1e30f));
      }
      EXPECT_EQ(report[1].size, big.size());
      EXPECT_EQ(report[1].nan, nan ? 1u : 0u);
      EXPECT_EQ(report[1].inf, 0u);
      EXPECT_EQ(report[1].zeros, 1u);
      EXPECT_EQ(report[1].subnormals, 1u);
      for (std::size_t k : {std::size_t{0}, std::size_t{2}}) {
        EXPECT_EQ(report[k].size, 0u);
        EXPECT_EQ(report[k].norm, 0.0);
        EXPECT_EQ(report[k].max_abs, 0.0);
      }
      EXPECT_EQ(report[3].norm, std::sqrt(5.0));
      EXPECT_EQ(report[3].max_abs, 2.0);
    }
  }
}

}  // namespace
