// clip_stats: counts, fractions, norms, skips and thresholds over a scripted sequence of results, reset,
// the log line, the exact round trip of the whole state, and element_count for single gradients and groups;
// norm quantiles against torch.quantile's formula on a sorted copy (and long double), the sketch's error
// bound on long streams, per-tensor shares against binary128, and no allocation in steady state.
#include <gradclip/clip_stats.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// Every allocation of the process is counted, so a test can assert that recording made none.
namespace {
std::atomic<long> allocation_count{0};

void* counted_allocation(std::size_t size) {
  allocation_count.fetch_add(1, std::memory_order_relaxed);
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return counted_allocation(size); }
void* operator new[](std::size_t size) { return counted_allocation(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using gradclip::clip_result;
using gradclip::clip_stats;
using gradclip::tensor_report;
using gradclip::tensor_stats;
using gradclip_test::quad;

constexpr double inf = std::numeric_limits<double>::infinity();

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
  EXPECT_TRUE(std::isnan(stats.norm_quantile(0.5)));
  EXPECT_EQ(stats.element_count(), 100u);
  EXPECT_EQ(stats, clip_stats(100));
  stats.record({3.0, 1.0, false, true});
  EXPECT_EQ(stats.mean_norm(), 3.0);
  EXPECT_EQ(stats.max_norm(), 3.0);
  EXPECT_EQ(stats.norm_quantile(0.5), 3.0);
  EXPECT_EQ(stats.mean_norm_per_sqrt_n(), 0.3);
}

TEST(ClipStats, OnlyNonFiniteStepsGiveNoNorms) {
  clip_stats stats;
  stats.record({INFINITY, 1.0, false, false});
  EXPECT_EQ(stats.steps(), 1u);
  EXPECT_EQ(stats.clip_fraction(), 0.0);
  EXPECT_TRUE(std::isnan(stats.mean_norm()));
  EXPECT_TRUE(std::isnan(stats.mean_norm_per_sqrt_n()));  // no element count either
  EXPECT_TRUE(std::isnan(stats.norm_quantile(0.0)));
  EXPECT_TRUE(std::isnan(stats.norm_quantile(1.0)));
}

TEST(ClipStats, PrintsOneLogLine) {
  clip_stats stats(400);
  for (const auto& step : scripted) stats.record(step);
  // Finite norms 0.5 1.5 2 4: p50 at position 1.5 is 1.75, p90 at 2.7 is 2 + 0.7 * 2, p99 at 2.97.
  EXPECT_EQ(stats.log_line(),
            "steps=6 clipped=2 clip_fraction=0.5 nonfinite=2 mean_norm=2 max_norm=4 p50=1.75 p90=3.4 p99=3.94 "
            "norm_per_sqrt_n=0.1");

  clip_stats without_count;
  without_count.record({2.0, 0.5, true, true});
  EXPECT_EQ(without_count.log_line(),
            "steps=1 clipped=1 clip_fraction=1 nonfinite=0 mean_norm=2 max_norm=2 p50=2 p90=2 p99=2");

  clip_stats none;  // no finite step: no quantiles
  none.record({NAN, 1.0, false, false});
  EXPECT_EQ(none.log_line(), "steps=1 clipped=0 clip_fraction=0 nonfinite=1 mean_norm=nan max_norm=nan");
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
            "steps=5 clipped=1 clip_fraction=0.25 nonfinite=1 mean_norm=23.5 max_norm=90 p50=1.5 p90=63.6 "
            "p99=87.36 skipped=1 mean_threshold=2.66667 last_threshold=4");
  stats.reset();
  EXPECT_EQ(stats.skipped_steps(), 0u);
  EXPECT_TRUE(std::isnan(stats.mean_threshold()));
  EXPECT_TRUE(std::isnan(stats.last_threshold()));
}

TEST(ClipStats, AFiniteStepWithoutANormThrowsAndChangesNothing) {
  clip_stats stats(10);
  stats.record({2.0, 0.5, true, true});
  const clip_stats before = stats;
  for (double bad : {std::nan(""), -1.0, -inf}) {
    try {
      stats.record({bad, 1.0, false, true});
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_stats::record:", 0), 0u) << e.what();
    }
    EXPECT_EQ(stats, before);
  }
  stats.record({NAN, 1.0, false, false});  // a non-finite step may have any norm
  EXPECT_EQ(stats.nonfinite_steps(), 1u);
  clip_stats zero, negative_zero;
  zero.record({0.0, 1.0, false, true});
  negative_zero.record({-0.0, 1.0, false, true});
  EXPECT_EQ(negative_zero, zero);
  EXPECT_FALSE(std::signbit(negative_zero.norm_quantile(0.5)));
}

// --- Quantiles --------------------------------------------------------------------------------------

// torch.quantile(v, q) with interpolation='linear' (aten/src/ATen/native/Sorting.cpp, quantile_compute,
// and at::lerp in ATen/native/Lerp.h), transcribed on its own: the ranks q * last_index, their
// truncation and ceiling, and lerp's two-sided form with each operation rounded (volatile: never
// contracted into an FMA). +inf: gradclip's rule, not torch's NaN.
double torch_quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const auto last_index = static_cast<double>(v.size() - 1);
  const double rank = q * last_index;
  const auto ranks_below = static_cast<std::size_t>(rank);
  const auto ranks_above = static_cast<std::size_t>(std::ceil(rank));
  const double weight = rank - static_cast<double>(ranks_below);
  const double self = v[ranks_below], end = v[ranks_above];
  if (end == inf) return weight == 0 ? self : inf;
  volatile double difference = end - self;
  if (std::abs(weight) < 0.5) {
    volatile double step = weight * difference;
    return self + step;
  }
  volatile double complement = 1.0 - weight;
  volatile double back = difference * complement;
  return end - back;
}

// The linear interpolation at the same position, in long double, rounded once to double.
long double long_double_quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double rank = q * static_cast<double>(v.size() - 1);
  const auto below = static_cast<std::size_t>(rank);
  const auto above = std::min(below + 1, v.size() - 1);
  const long double weight = static_cast<long double>(rank) - below;
  const long double a = v[below], b = v[above];
  return a + weight * (b - a);
}

std::vector<double> quantile_grid(std::mt19937_64& rng) {
  std::vector<double> qs{0.0, 1.0, 0.5, 0.9, 0.99, 0.25, 0.75, 0.01, 0.1, 1.0 / 3, 2.0 / 3, 0.999, 1e-9, 1 - 1e-9};
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int i = 0; i < 50; ++i) qs.push_back(uniform(rng));
  return qs;
}

TEST(ClipStatsQuantile, ExactIntervalsAreTorchQuantileBitForBit) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937_64 rng(gradclip_test::seed);
  std::uniform_real_distribution<double> exponent(-30.0, 30.0);
  for (std::size_t n : {1u, 2u, 3u, 7u, 100u, 1000u, 4096u}) {
    std::vector<double> norms(n);
    for (double& x : norms) x = std::exp2(exponent(rng));
    if (n > 3) norms[1] = norms[2];  // ties
    clip_stats stats;
    for (double x : norms) stats.record({x, 1.0, false, true});
    ASSERT_TRUE(stats.quantiles_exact());
    EXPECT_EQ(stats.quantile_error_bound(), 0.0);
    for (double q : quantile_grid(rng)) {
      const double got = stats.norm_quantile(q);
      EXPECT_EQ(got, torch_quantile(norms, q)) << "n " << n << " q " << q;
      // Within the two roundings' few ulps of the interpolation in long double.
      const long double reference = long_double_quantile(norms, q);
      EXPECT_LE(std::abs(got - reference), 4 * DBL_EPSILON * reference) << "n " << n << " q " << q;
    }
    EXPECT_EQ(stats.norm_quantile(0.0), *std::min_element(norms.begin(), norms.end()));
    EXPECT_EQ(stats.norm_quantile(1.0), *std::max_element(norms.begin(), norms.end()));
  }
}

TEST(ClipStatsQuantile, TheUpperHalfInterpolatesFromTheUpperEnd) {
  // Weights of 0.5 and more use end - (end - self) * (1 - weight), as torch.lerp does: on pairs where
  // that differs from self + weight * (end - self), the quantile is the former.
  std::mt19937_64 rng(gradclip_test::seed + 1);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int differing = 0;
  for (int i = 0; i < 2000; ++i) {
    const double a = uniform(rng), b = a + uniform(rng), q = 0.5 + uniform(rng) / 2;
    clip_stats pair;
    pair.record({b, 1.0, false, true});
    pair.record({a, 1.0, false, true});
    volatile double difference = b - a, complement = 1.0 - q, back = difference * complement, step = q * difference;
    const double upper = b - back, lower = a + step;
    EXPECT_EQ(pair.norm_quantile(q), upper) << a << ' ' << b << ' ' << q;
    differing += upper != lower;
  }
  EXPECT_GT(differing, 100);  // the two forms differ often enough for this to tell them apart
  clip_stats stats;
  stats.record({0.0, 1.0, false, true});
  stats.record({1.0, 1.0, false, true});
  EXPECT_EQ(stats.norm_quantile(0.75), 0.75);  // 1 - (1 - 0) * 0.25
}

TEST(ClipStatsQuantile, QOutsideTheUnitIntervalThrows) {
  clip_stats stats;
  stats.record({1.0, 1.0, false, true});
  clip_stats empty;
  for (double q : {-0.01, 1.01, -inf, inf, std::nan("")}) {
    for (const clip_stats* s : {&stats, &empty}) {
      try {
        (void)s->norm_quantile(q);
        ADD_FAILURE() << q;
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_stats::norm_quantile:", 0), 0u) << e.what();
      }
    }
  }
  EXPECT_TRUE(std::isnan(empty.norm_quantile(0.5)));  // the empty interval, as documented
  EXPECT_EQ(stats.norm_quantile(-0.0), 1.0);
}

TEST(ClipStatsQuantile, InfiniteNormsSortLastAndAreReachedOnlyByWeight) {
  // FP64 norms beyond double's range are +inf on finite steps.
  clip_stats stats;
  for (double x : {inf, 1.0, 2.0}) stats.record({x, 1.0, false, true});
  EXPECT_EQ(stats.norm_quantile(0.0), 1.0);
  EXPECT_EQ(stats.norm_quantile(0.25), 1.5);
  EXPECT_EQ(stats.norm_quantile(0.5), 2.0);  // position 1: exactly the finite 2 (torch: NaN)
  EXPECT_EQ(stats.norm_quantile(0.75), inf);
  EXPECT_EQ(stats.norm_quantile(1.0), inf);
  EXPECT_EQ(stats.max_norm(), inf);
  clip_stats only_inf;
  only_inf.record({inf, 1.0, false, true});
  EXPECT_EQ(only_inf.norm_quantile(0.5), inf);
  EXPECT_EQ(only_inf.log_line(),
            "steps=1 clipped=0 clip_fraction=0 nonfinite=0 mean_norm=inf max_norm=inf p50=inf p90=inf p99=inf");
}

// --- The sketch --------------------------------------------------------------------------------------

struct stream {
  const char* name;
  std::vector<double> norms;
};

std::vector<stream> long_streams(std::size_t n) {
  std::mt19937_64 rng(gradclip_test::seed + 7);
  std::vector<stream> out;
  std::uniform_real_distribution<double> exponent(-12.0, 12.0);
  std::vector<double> random(n);
  for (double& x : random) x = std::exp2(exponent(rng));
  out.push_back({"random", random});
  std::vector<double> sorted = random;
  std::sort(sorted.begin(), sorted.end());
  out.push_back({"sorted", sorted});
  out.push_back({"reverse sorted", std::vector<double>(sorted.rbegin(), sorted.rend())});
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<double> pareto(n), cauchy(n), stationary(n);
  for (double& x : pareto) x = std::pow(1.0 - uniform(rng), -1.0 / 0.3);  // tail index 0.3: up to ~1e15
  for (double& x : cauchy) x = std::abs(std::tan(3.141592653589793 * (uniform(rng) - 0.5)));
  std::normal_distribution<double> normal(1.0, 0.1);
  for (double& x : stationary) x = std::abs(normal(rng));
  out.push_back({"pareto", pareto});
  out.push_back({"abs cauchy", cauchy});
  out.push_back({"stationary", stationary});
  out.push_back({"constant", std::vector<double>(n, 0.3)});
  // Zeros, subnormals, FP64 norms near the top and +inf among ordinary ones.
  std::vector<double> extremes = random;
  for (std::size_t i = 0; i < n; i += 11) extremes[i] = 0.0;
  for (std::size_t i = 5; i < n; i += 13)
    extremes[i] = std::ldexp(1.0 + uniform(rng), -1074 + static_cast<int>(i % 50));
  for (std::size_t i = 3; i < n; i += 17) extremes[i] = std::ldexp(1.0 + uniform(rng), 1023);
  for (std::size_t i = 7; i < n; i += 101) extremes[i] = inf;
  out.push_back({"zeros, subnormals, huge and inf", extremes});
  // Two modes: clipping early, converged late.
  std::vector<double> two_modes(n);
  for (std::size_t i = 0; i < n; ++i) two_modes[i] = i < n / 3 ? 300.0 * (1 + uniform(rng)) : 0.5 * normal(rng);
  out.push_back({"two modes", two_modes});
  return out;
}

// |sketched - exact| within the documented bound: e on each order statistic, relatively (absolutely
// e * 2^-1022 below it), so e * Q + 2e * 2^-1022 on their interpolation, plus its few ulps of rounding
// on each side (8 * 2^-53 * Q covers both).
void expect_within_bound(const clip_stats& stats, const std::vector<double>& norms, double q, const char* name) {
  const double e = stats.quantile_error_bound();
  const double exact = torch_quantile(norms, q);
  const double got = stats.norm_quantile(q);
  if (std::isinf(exact)) {
    EXPECT_EQ(got, exact) << name << " q " << q;
    return;
  }
  const double bound = (e + 8 * std::ldexp(1.0, -53)) * exact + 2 * e * DBL_MIN;
  EXPECT_LE(std::abs(got - exact), bound) << name << " q " << q << " exact " << exact << " got " << got;
}

TEST(ClipStatsSketch, LongStreamsStayWithinTheBound) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937_64 rng(gradclip_test::seed + 8);
  const std::vector<double> qs = quantile_grid(rng);
  for (const stream& s : long_streams(30000)) {
    clip_stats stats;
    for (std::size_t i = 0; i < s.norms.size(); ++i) {
      stats.record({s.norms[i], 1.0, false, true});
      if (i + 1 == clip_stats::default_exact_capacity) {
        EXPECT_TRUE(stats.quantiles_exact()) << s.name;
        EXPECT_EQ(stats.norm_quantile(0.9),
                  torch_quantile(std::vector<double>(s.norms.begin(), s.norms.begin() + 4096), 0.9));
      }
    }
    ASSERT_FALSE(stats.quantiles_exact()) << s.name;
    // None of these streams fills more than 4096 buckets at k = 7 (24 binades, sparse tails, subnormals in
    // one binade's 128 buckets): k stays 7.
    EXPECT_EQ(stats.quantile_error_bound(), std::ldexp(1.0, -8)) << s.name;
    double worst = 0.0;
    for (double q : qs) {
      expect_within_bound(stats, s.norms, q, s.name);
      const double exact = torch_quantile(s.norms, q);
      if (exact >= DBL_MIN && std::isfinite(exact))
        worst = std::max(worst, std::abs(stats.norm_quantile(q) - exact) / exact);
      if (std::string(s.name) == "constant") {
        EXPECT_EQ(stats.norm_quantile(q), 0.3) << q;  // clamped to [min, max]
      }
    }
    EXPECT_EQ(stats.norm_quantile(0.0), *std::min_element(s.norms.begin(), s.norms.end())) << s.name;
    EXPECT_EQ(stats.norm_quantile(1.0), *std::max_element(s.norms.begin(), s.norms.end())) << s.name;
    std::printf("%-32s worst relative error %.3g (bound %.3g)\n", s.name, worst, stats.quantile_error_bound());
  }
}

TEST(ClipStatsSketch, TheSketchDoesNotDependOnTheOrder) {
  const stream s = long_streams(20000)[0];
  std::vector<double> sorted = s.norms;
  std::sort(sorted.begin(), sorted.end());
  clip_stats random, ascending, descending;
  for (double x : s.norms) random.record({x, 1.0, false, true});
  for (double x : sorted) ascending.record({x, 1.0, false, true});
  for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) descending.record({*it, 1.0, false, true});
  for (double q : {0.0, 0.01, 0.3, 0.5, 0.9, 0.99, 1.0}) {
    EXPECT_EQ(ascending.norm_quantile(q), random.norm_quantile(q)) << q;
    EXPECT_EQ(descending.norm_quantile(q), random.norm_quantile(q)) << q;
  }
}

TEST(ClipStatsSketch, EveryBucketOfThirtyOneBinadesKeepsSevenBits) {
  // 31 binades, [1, 2^31), every bucket of each at k = 7, with 0 and +inf: 3970 buckets, no coarsening.
  std::vector<double> norms{0.0, inf};
  for (int e = 0; e <= 30; ++e)
    for (int j = 0; j < 128; ++j) norms.push_back(std::ldexp(1.0 + (j + 0.25) / 128.0, e));
  clip_stats stats(0, 0);  // sketched from the first step
  for (double x : norms) stats.record({x, 1.0, false, true});
  EXPECT_FALSE(stats.quantiles_exact());
  EXPECT_EQ(stats.quantile_error_bound(), std::ldexp(1.0, -8));
  std::mt19937_64 rng(gradclip_test::seed + 9);
  for (double q : quantile_grid(rng)) expect_within_bound(stats, norms, q, "31 binades");
}

TEST(ClipStatsSketch, AdversarialStreamsCoarsenButKeepTheirBound) {
  // Every exponent of double (the subnormals too), each with many mantissas: the buckets must coarsen,
  // down to k = 1 (2 buckets per binade, 4096 in all with 0 and +inf), and the bound must follow.
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937_64 rng(gradclip_test::seed + 10);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::vector<double> norms{0.0, inf, DBL_MAX, DBL_TRUE_MIN};
  for (int e = -1074; e <= 1023; ++e)
    for (int j = 0; j < 8; ++j) norms.push_back(std::ldexp(mantissa(rng), e));  // rounds in the subnormals
  std::shuffle(norms.begin(), norms.end(), rng);
  clip_stats stats;
  std::vector<double> seen;
  double last_bound = 0.0;
  for (double x : norms) {
    stats.record({x, 1.0, false, true});
    seen.push_back(x);
    const double bound = stats.quantile_error_bound();
    if (bound != last_bound && seen.size() > clip_stats::default_exact_capacity + 1) {
      // Just coarsened: the bound holds on the stream so far.
      for (double q : {0.0, 0.001, 0.2, 0.5, 0.77, 0.999, 1.0}) expect_within_bound(stats, seen, q, "prefix");
    }
    last_bound = bound;
  }
  EXPECT_EQ(stats.quantile_error_bound(), 0.25);
  for (double q : quantile_grid(rng)) expect_within_bound(stats, norms, q, "every exponent");

  // Buckets every other one (the worst case for merging pairs) at k = 7: several coarsenings at once.
  std::vector<double> alternate;
  for (int e = -10; e < 30; ++e)
    for (int j = 0; j < 128; j += 2) alternate.push_back(std::ldexp(1.0 + (j + 0.5) / 128.0, e));
  clip_stats sparse(0, 0);
  for (double x : alternate) sparse.record({x, 1.0, false, true});
  EXPECT_EQ(sparse.quantile_error_bound(), std::ldexp(1.0, -8));  // 2560 buckets fit
  for (int e = 30; e < 60; ++e)
    for (int j = 0; j < 128; j += 2) {
      const double x = std::ldexp(1.0 + (j + 0.5) / 128.0, e);
      alternate.push_back(x);
      sparse.record({x, 1.0, false, true});
    }
  // 70 binades of 64 buckets: 4480 > 4096 at k = 7, and at k = 6 (no pair merges), 2240 at k = 5.
  EXPECT_EQ(sparse.quantile_error_bound(), std::ldexp(1.0, -6));
  for (double q : quantile_grid(rng)) expect_within_bound(sparse, alternate, q, "alternate buckets");
}

// --- Per-tensor shares -------------------------------------------------------------------------------

tensor_report report_of(const std::vector<double>& norms) {
  std::vector<tensor_stats> tensors(norms.size());
  for (std::size_t i = 0; i < norms.size(); ++i) {
    tensors[i].norm = norms[i];
    tensors[i].size = 1;
  }
  tensor_report report;
  report.assign(std::move(tensors));
  return report;
}

// The global norm the report's tensors make, in double (+inf past double's range), as a call reports it.
clip_result result_of(const std::vector<double>& norms) {
  quad sum = 0;
  for (double x : norms) sum += quad(x) * quad(x);
  return {static_cast<double>(gradclip_test::quad_sqrt(sum)), 1.0, false, true};
}

// Each tensor's sum of squared norms over the total, in binary128 (whose range holds 1.8e308 squared).
std::vector<quad> reference_shares(const std::vector<std::vector<double>>& steps) {
  std::vector<quad> sums(steps.front().size(), 0);
  quad total = 0;
  for (const auto& step : steps)
    for (std::size_t i = 0; i < step.size(); ++i) {
      const quad x = std::min(step[i], DBL_MAX);  // +inf counts as the largest double, as documented
      sums[i] += x * x;
      total += x * x;
    }
  for (quad& s : sums) s /= total;
  return sums;
}

void expect_shares(const clip_stats& stats, const std::vector<std::vector<double>>& steps, const char* name) {
  const std::vector<quad> reference = reference_shares(steps);
  const std::vector<double> shares = stats.tensor_shares();
  ASSERT_EQ(shares.size(), reference.size()) << name;
  // One rounding per square, scaling and addition of each step, and the total: (steps + tensors + 4) u,
  // and what underflows where a tensor is below 2^-1022 of the interval's largest.
  const double relative = static_cast<double>(steps.size() + reference.size() + 4) * std::ldexp(1.0, -53);
  for (std::size_t i = 0; i < shares.size(); ++i) {
    const double expected = static_cast<double>(reference[i]);
    EXPECT_LE(std::abs(shares[i] - expected), relative * expected + 1e-300) << name << " tensor " << i;
    EXPECT_EQ(stats.tensor_share(i), shares[i]);
  }
}

TEST(ClipStatsShares, SharesOfTheSquaredNormMatchBinary128) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937_64 rng(gradclip_test::seed + 11);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const std::size_t tensors = 148;              // GPT-2 small's parameter list
  for (double spread : {4.0, 200.0, 2000.0}) {  // binades between tensors' norms
    std::vector<std::vector<double>> steps;
    clip_stats stats;
    for (int s = 0; s < 300; ++s) {
      std::vector<double> norms(tensors);
      const double level = (uniform(rng) - 0.5) * spread / 4;  // steps of very different sizes too
      for (double& x : norms)
        x = std::min(std::exp2(std::clamp(level + (uniform(rng) - 0.5) * spread, -1074.0, 1023.9)), DBL_MAX);
      norms[s % tensors] = 0.0;
      stats.record(result_of(norms), report_of(norms));
      steps.push_back(norms);
    }
    EXPECT_EQ(stats.tensor_count(), tensors);
    EXPECT_EQ(stats.report_steps(), 300u);
    expect_shares(stats, steps, "random");
  }
}

TEST(ClipStatsShares, HugeNormsDoNotOverflow) {
  clip_stats stats;
  std::vector<std::vector<double>> steps{
      {DBL_MAX, DBL_MAX / 2, 1e308},  // squares far past double's range
      {1e-300, 3e-300, 0.0},          // a tiny step after them: negligible, but not NaN
      {DBL_MAX, DBL_MAX, DBL_MAX},
  };
  for (const auto& step : steps) stats.record(result_of(step), report_of(step));
  expect_shares(stats, steps, "huge then tiny");
  const double total = stats.tensor_share(0) + stats.tensor_share(1) + stats.tensor_share(2);
  EXPECT_NEAR(total, 1.0, 4 * DBL_EPSILON);

  // The other order: a tiny interval first, then a huge step rescales it.
  clip_stats rising;
  std::vector<std::vector<double>> up{{1e-310, 2e-310}, {1e-300, 0.0}, {1e300, 1e-300}, {3e307, DBL_MAX}};
  for (const auto& step : up) rising.record(result_of(step), report_of(step));
  expect_shares(rising, up, "rising");

  // +inf tensor norms (FP64 past double's range) count as DBL_MAX.
  clip_stats infinite;
  std::vector<std::vector<double>> with_inf{{inf, DBL_MAX, 1.0}};
  for (const auto& step : with_inf) infinite.record(result_of(step), report_of(step));
  expect_shares(infinite, with_inf, "inf");
  EXPECT_EQ(infinite.tensor_share(0), 0.5);
  EXPECT_EQ(infinite.tensor_share(1), 0.5);
}

TEST(ClipStatsShares, ExactSharesOfSmallIntegers) {
  clip_stats stats;
  stats.record({5.0, 1.0, false, true}, report_of({3.0, 4.0}));   // 9 and 16
  stats.record({2.0, 1.0, false, true}, report_of({0.0, 2.0}));   // 0 and 4
  stats.record({NAN, 1.0, false, false}, report_of({NAN, 1.0}));  // non-finite: stays out
  EXPECT_EQ(stats.report_steps(), 2u);
  EXPECT_EQ(stats.tensor_share(0), 9.0 / 29);
  EXPECT_EQ(stats.tensor_share(1), 20.0 / 29);
  stats.record({3.0, 1.0, false, true});  // without a report: the shares do not change
  EXPECT_EQ(stats.tensor_share(0), 9.0 / 29);
  EXPECT_EQ(stats.report_steps(), 2u);
}

TEST(ClipStatsShares, NoSquaredNormGivesNaNShares) {
  clip_stats stats;
  EXPECT_EQ(stats.tensor_count(), 0u);
  EXPECT_TRUE(stats.tensor_shares().empty());
  stats.record({0.0, 1.0, false, true}, report_of({0.0, 0.0}));
  EXPECT_EQ(stats.tensor_count(), 2u);
  EXPECT_TRUE(std::isnan(stats.tensor_share(0)));
  EXPECT_TRUE(std::isnan(stats.tensor_shares()[1]));
  clip_stats fresh;  // an empty report before any other adds nothing
  fresh.record({1.0, 1.0, false, true}, tensor_report{});
  EXPECT_EQ(fresh.tensor_count(), 0u);
  EXPECT_EQ(fresh.report_steps(), 0u);
}

TEST(ClipStatsShares, BadReportsThrowAndChangeNothing) {
  clip_stats stats;
  stats.record({5.0, 1.0, false, true}, report_of({3.0, 4.0}));
  const clip_stats before = stats;
  const auto expect_throws = [&](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_stats::", 0), 0u) << e.what();
    }
    EXPECT_EQ(stats, before) << what;
  };
  expect_throws([&] { stats.record({5.0, 1.0, false, true}, report_of({3.0, 4.0, 0.0})); }, "another size");
  expect_throws([&] { stats.record({NAN, 1.0, false, false}, report_of({3.0})); }, "another size, non-finite");
  expect_throws([&] { stats.record({5.0, 1.0, false, true}, tensor_report{}); }, "empty after two");
  expect_throws([&] { stats.record({5.0, 1.0, false, true}, report_of({NAN, 4.0})); }, "NaN on a finite step");
  expect_throws([&] { stats.record({5.0, 1.0, false, true}, report_of({-3.0, 4.0})); }, "negative");
  expect_throws([&] { stats.record({NAN, 1.0, false, true}, report_of({3.0, 4.0})); }, "NaN step norm");
  expect_throws([&] { (void)stats.tensor_share(2); }, "index");
  stats.reset();  // a new interval may have another group
  stats.record({1.0, 1.0, false, true}, report_of({1.0, 0.0, 0.0}));
  EXPECT_EQ(stats.tensor_shares(), (std::vector<double>{1.0, 0.0, 0.0}));
}

// --- State -------------------------------------------------------------------------------------------

// Every kind of state a clip_stats reaches, by name.
std::vector<std::pair<std::string, clip_stats>> states() {
  std::vector<std::pair<std::string, clip_stats>> out;
  out.emplace_back("default", clip_stats());
  clip_stats scripted_stats(12345);
  for (const auto& step : scripted) scripted_stats.record(step);
  for (const auto& step : controlled) scripted_stats.record(step);
  scripted_stats.record({0.1, 1.0, false, true, 0.30000000000000004});  // digits a decimal print would lose
  out.emplace_back("scripted", scripted_stats);
  clip_stats nonfinite_only;
  nonfinite_only.record({NAN, 1.0, false, false});
  out.emplace_back("non-finite only", nonfinite_only);
  clip_stats full(7, 64);
  for (int i = 0; i < 64; ++i) full.record({std::ldexp(1.0 + i / 64.0, i - 32), 1.0, i % 3 == 0, true});
  out.emplace_back("exact and full", full);
  clip_stats sketched = full;
  for (int i = 0; i < 1000; ++i) sketched.record({std::ldexp(1.0 + i / 1000.0, i % 40), 1.0, false, true});
  sketched.record({0.0, 1.0, false, true});
  sketched.record({inf, 1.0, false, true});
  out.emplace_back("sketched", sketched);
  clip_stats coarse(0, 0);
  for (int e = -1074; e <= 1023; e += 1)
    for (double m : {1.0, 1.3, 1.7}) coarse.record({std::ldexp(m, e), 1.0, false, true});
  out.emplace_back("coarsened", coarse);
  clip_stats shares;
  shares.record({5.0, 1.0, false, true}, report_of({3.0, 4.0, 0.0}));
  shares.record({DBL_MAX, 1.0, false, true}, report_of({DBL_MAX, 1e300, 1e-300}));
  shares.record({NAN, 1.0, false, false}, report_of({NAN, inf, 0.0}));
  out.emplace_back("shares", shares);
  clip_stats tiny_shares;
  tiny_shares.record({1e-310, 1.0, false, true}, report_of({1e-310}));
  out.emplace_back("subnormal shares", tiny_shares);
  clip_stats report_before_finite;
  report_before_finite.record({NAN, 1.0, false, false}, report_of({NAN, 1.0}));
  out.emplace_back("tensor count only", report_before_finite);
  clip_stats after_reset = sketched;
  after_reset.reset();
  after_reset.record({2.0, 1.0, false, true}, report_of({2.0}));
  out.emplace_back("after reset", after_reset);
  return out;
}

TEST(ClipStats, StreamsRoundTripEveryStateExactly) {
  for (auto& [name, stats] : states()) {
    std::stringstream saved;
    saved << stats;
    clip_stats restored(99, 3);
    restored.record({1.0, 1.0, false, true}, report_of({1.0}));
    ASSERT_TRUE(saved >> restored) << name;
    EXPECT_EQ(restored, stats) << name;
    EXPECT_EQ(restored.element_count(), stats.element_count()) << name;
    EXPECT_EQ(restored.exact_capacity(), stats.exact_capacity()) << name;
    EXPECT_EQ(restored.log_line(), stats.log_line()) << name;
    EXPECT_EQ(restored.quantile_error_bound(), stats.quantile_error_bound()) << name;
    for (double q : {0.0, 0.3, 0.5, 0.99, 1.0}) {
      const double a = restored.norm_quantile(q), b = stats.norm_quantile(q);
      EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << name << " q " << q;
    }
    const auto sa = restored.tensor_shares(), sb = stats.tensor_shares();
    ASSERT_EQ(sa.size(), sb.size()) << name;
    for (std::size_t i = 0; i < sa.size(); ++i)
      EXPECT_TRUE(sa[i] == sb[i] || (std::isnan(sa[i]) && std::isnan(sb[i]))) << name;
    // A second round trip writes the same text, and both continue identically.
    std::stringstream again;
    again << restored;
    EXPECT_EQ(again.str(), saved.str()) << name;
    const std::size_t tensors = stats.tensor_count() == 0 ? 2 : stats.tensor_count();
    for (int i = 0; i < 5000; ++i) {
      const clip_result step{std::ldexp(1.0 + i / 5000.0, i % 50 - 25), 1.0, i % 2 == 0, i % 7 != 0, 1.0};
      const tensor_report report = report_of(std::vector<double>(tensors, step.norm));
      stats.record(step, report);
      restored.record(step, report);
    }
    EXPECT_EQ(restored, stats) << name;
  }
}

TEST(ClipStats, CopiesAreIndependentAndEqualityComparesTheWholeState) {
  const auto all = states();
  for (std::size_t i = 0; i < all.size(); ++i)
    for (std::size_t j = 0; j < all.size(); ++j) EXPECT_EQ(all[i].second == all[j].second, i == j) << i << ' ' << j;
  clip_stats a = all[4].second;  // sketched
  clip_stats b = a;
  b.record({1.0, 1.0, false, true});
  EXPECT_NE(a, b);
  EXPECT_EQ(a, all[4].second);
  clip_stats c, d;  // the same counts and sums, other norms: only the quantile state differs
  c.record({1.0, 1.0, false, true});
  c.record({3.0, 1.0, false, true});
  d.record({2.0, 1.0, false, true});
  d.record({2.0, 1.0, false, true});
  EXPECT_EQ(c.mean_norm(), d.mean_norm());
  EXPECT_NE(c, d);
}

/// The saved state's words, and the text they make.
std::vector<std::string> words_of(const clip_stats& s) {
  std::stringstream saved;
  saved << s;
  std::vector<std::string> words;
  for (std::string w; saved >> w;) words.push_back(w);
  return words;
}
std::string text_of(const std::vector<std::string>& words) {
  std::string text;
  for (const auto& w : words) text += (text.empty() ? "" : " ") + w;
  return text;
}
std::string hex_of(double x) {
  std::ostringstream out;
  gradclip::detail::write_exact(out, x);
  return out.str().substr(1);
}

TEST(ClipStats, MalformedStateIsRejectedAndLeavesTheTargetUnchanged) {
  clip_stats stats(10);
  stats.record({2.0, 0.5, true, true});
  std::stringstream saved;
  saved << stats;
  const std::string text = saved.str();
  std::vector<std::string> bad{
      "",                                               // empty
      "gradclip::zclip" + text.substr(text.find(' ')),  // another type's tag
      text.substr(0, text.size() - 5),                  // truncated
  };
  // Word by word (tag 0; sizes 1-8: element count, exact capacity, steps, clipped, non-finite, skipped,
  // threshold steps, report steps; doubles 9-13: norm sum, max, min, threshold sum, last threshold;
  // then the exact norms' count and values, k, the buckets' count and (key, count) pairs, the shares'
  // exponent, count and sums).
  const auto edited = [](const clip_stats& s, std::size_t word, const std::string& value) {
    auto words = words_of(s);
    words.at(word) = value;
    return text_of(words);
  };
  bad.push_back(edited(stats, 13, "0x12"));  // a double that is not 16 hex digits
  bad.push_back(edited(stats, 4, "5"));      // more clipped steps than steps
  clip_stats exact;                          // norms 1 and 3
  exact.record({3.0, 1.0, false, true});
  exact.record({1.0, 1.0, false, true});
  ASSERT_EQ(words_of(exact).at(14), "2");
  bad.push_back(edited(exact, 15, hex_of(3.0)));   // not ascending
  bad.push_back(edited(exact, 16, hex_of(NAN)));   // NaN norm
  bad.push_back(edited(exact, 15, hex_of(-0.0)));  // -0 (record() stores +0)
  bad.push_back(edited(exact, 10, hex_of(4.0)));   // max is not the largest norm
  bad.push_back(edited(exact, 11, hex_of(0.5)));   // min is not the smallest
  bad.push_back(edited(exact, 14, "1"));           // fewer norms than finite steps
  bad.push_back(edited(exact, 2, "1"));            // more norms than the exact capacity
  bad.push_back(edited(exact, 17, "6"));           // k while exact is always 7
  bad.push_back(edited(exact, 8, "1"));            // a report step without tensors
  clip_stats sketched(0, 0);                       // norms 1, 1 and 3: buckets (key(1), 2) and (key(3), 1)
  for (double x : {1.0, 3.0, 1.0}) sketched.record({x, 1.0, false, true});
  const auto words = words_of(sketched);
  ASSERT_EQ(words.at(14), "0");
  ASSERT_EQ(words.at(16), "2");
  bad.push_back(edited(sketched, 15, "8"));                                            // k above 7
  bad.push_back(edited(sketched, 18, "1"));                                            // counts that do not sum to 3
  bad.push_back(edited(sketched, 18, "0"));                                            // an empty bucket
  bad.push_back(edited(sketched, 19, words.at(17)));                                   // keys not ascending
  bad.push_back(edited(sketched, 19, std::to_string((std::size_t{0x7ff} << 7) + 2)));  // a NaN's key
  bad.push_back(edited(sketched, 16, "5000"));              // more buckets than sketch_buckets
  bad.push_back(edited(sketched, 11, hex_of(1.5)));         // min outside the first bucket
  bad.push_back(edited(sketched, 2, "3"));                  // sketched within the exact capacity
  bad.push_back(edited(sketched, 14, "1 " + hex_of(1.0)));  // exact norms beside the buckets
  clip_stats shared;
  shared.record({5.0, 1.0, false, true}, report_of({3.0, 4.0}));
  const auto share_words = words_of(shared);
  const std::size_t exponent = share_words.size() - 4;
  bad.push_back(edited(shared, exponent, "3"));               // an odd exponent
  bad.push_back(edited(shared, exponent, "5000"));            // beyond any 2g
  bad.push_back(edited(shared, exponent + 2, hex_of(-1.0)));  // a negative sum
  bad.push_back(edited(shared, exponent + 2, hex_of(inf)));   // an infinite sum
  bad.push_back(edited(shared, exponent + 3, hex_of(0.25)));  // largest sum below 1
  bad.push_back(edited(shared, exponent + 1, "3"));           // more sums than the input holds
  clip_stats zero_shares;
  zero_shares.record({0.0, 1.0, false, true}, report_of({0.0}));
  bad.push_back(edited(zero_shares, words_of(zero_shares).size() - 3, "2"));  // zeros with an exponent
  for (const auto& input : bad) {
    clip_stats target(7);
    target.record({1.0, 1.0, false, true});
    const clip_stats before = target;
    std::istringstream in(input);
    in >> target;
    EXPECT_TRUE(in.fail()) << input;
    EXPECT_EQ(target, before) << input;
  }
  // The edits above change one word of a valid state: unedited, each reads back.
  for (const clip_stats* s : {&exact, &sketched, &shared, &zero_shares}) {
    std::istringstream in(text_of(words_of(*s)));
    clip_stats target;
    EXPECT_TRUE(in >> target);
    EXPECT_EQ(target, *s);
  }
}

// --- Memory ------------------------------------------------------------------------------------------

long allocations_in(const std::function<void()>& f) {
  const long before = allocation_count.load();
  f();
  return allocation_count.load() - before;
}

TEST(ClipStats, SteadyStateIntervalsAllocateNothing) {
  // One interval reserves the exact norms, the sketch and the shares; reset() keeps them, so the next
  // intervals, exact or sketched, allocate nothing.
  const std::size_t tensors = 148;
  std::vector<tensor_report> reports;
  for (int i = 0; i < 4; ++i) reports.push_back(report_of(std::vector<double>(tensors, 0.5 + i)));
  const auto interval = [&](clip_stats& stats, int steps) {
    for (int i = 0; i < steps; ++i)
      stats.record({std::ldexp(1.0 + i / 7919.0, i % 61 - 30), 1.0, i % 3 == 0, i % 50 != 0, 2.0}, reports[i % 4]);
  };
  clip_stats stats(1000);
  interval(stats, 10000);
  stats.reset();
  EXPECT_EQ(allocations_in([&] {
              for (int steps : {10000, 100, 10000}) {
                interval(stats, steps);
                stats.reset();
              }
            }),
            0);
  clip_stats plain;  // record(result) alone, the same
  plain.record({1.0, 1.0, false, true});
  plain.reset();
  EXPECT_EQ(allocations_in([&] {
              for (int i = 0; i < 3000; ++i) plain.record({1.0 + i, 1.0, false, true});
            }),
            0);
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
