// partial_norm: merging scaled sums of squares is exact, order-independent and range-safe.
#include <gradclip/norm.hpp>
#include <gradclip/tensor_units.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::partial_norm;

TEST(PartialNorm, MergesPartsOfWildlyDifferentScales) {
  partial_norm total;
  total.merge({600, 2.0, true});   // 2 * 4^600
  total.merge({-600, 3.0, true});  // negligible
  total.merge({599, 4.0, true});   // 4 * 4^599 = 1 * 4^600
  EXPECT_EQ(total.exponent, 600);
  EXPECT_EQ(total.sum, 3.0);
  EXPECT_EQ(total.norm(), std::ldexp(std::sqrt(3.0), 600));
}

TEST(PartialNorm, EmptyPartsAreNeutral) {
  partial_norm total{-900, 1.0, true};
  total.merge({});
  total.merge({1000, 0.0, true});
  EXPECT_EQ(total.exponent, -900);
  EXPECT_EQ(total.sum, 1.0);
  partial_norm empty;
  empty.merge(total);
  EXPECT_EQ(empty.exponent, -900);
}

TEST(PartialNorm, NonFinitePartsPoisonTheTotalAndNaNWins) {
  partial_norm total{3, 1.0, true};
  total.merge({0, INFINITY, false});
  EXPECT_FALSE(total.finite);
  EXPECT_EQ(total.norm(), INFINITY);
  total.merge({5, 2.0, true});
  EXPECT_EQ(total.norm(), INFINITY);
  total.merge({0, NAN, false});
  EXPECT_TRUE(std::isnan(total.norm()));
  total.merge({0, INFINITY, false});
  EXPECT_TRUE(std::isnan(total.norm()));
}

TEST(PartialNorm, MergeOrderChangesTheNormByAtMostOneRounding) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 20);
  std::vector<std::vector<double>> shards;
  std::vector<double> all;
  for (int i = 0; i < 16; ++i) {
    shards.push_back(
        random_gradient<double>(1 + rng() % 3000, rng, std::ldexp(1.0, static_cast<int>(rng() % 1200) - 600)));
    all.insert(all.end(), shards.back().begin(), shards.back().end());
  }
  std::vector<partial_norm> parts;
  for (const auto& s : shards) parts.push_back(gradclip::partial_global_norm(std::vector<std::vector<double>>{s}));
  const quad exact = exact_norm(all);
  for (int trial = 0; trial < 10; ++trial) {
    std::shuffle(parts.begin(), parts.end(), rng);
    partial_norm total;
    for (const auto& p : parts) total.merge(p);
    EXPECT_LE(relative_error(total.norm(), exact), robust_norm_bound<double>());
  }
}

// The exact value of a part, in binary128 (whose exponent range holds every partial_norm the tests build).
quad exact_sum_of(const partial_norm& p) {
  quad v = p.sum;
  for (int i = 0; i < p.exponent; ++i) v *= 4;
  for (int i = 0; i > p.exponent; --i) v /= 4;
  return v;
}

// Parts as ranks of a sharded job produce them: sums of very different scales, some zero.
std::vector<partial_norm> random_parts(std::mt19937_64& rng, int count) {
  std::vector<partial_norm> parts;
  for (int i = 0; i < count; ++i) {
    if (rng() % 5 == 0) {
      parts.push_back({});
      continue;
    }
    const double sum =
        std::ldexp(1.0 + static_cast<double>(rng() >> 11) * 0x1p-53, static_cast<int>(rng() % 200) - 100);
    parts.push_back({static_cast<int>(rng() % 40) - 20, sum, true});
  }
  return parts;
}

TEST(PartialNorm, MergeIsCommutativeBitForBit) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 21);
  const auto parts = random_parts(rng, 200);
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    partial_norm ab = parts[i], ba = parts[i + 1];
    ab.merge(parts[i + 1]);
    ba.merge(parts[i]);
    EXPECT_EQ(ab.exponent, ba.exponent);
    EXPECT_EQ(ab.sum, ba.sum);
  }
}

TEST(PartialNorm, MergeOrderChangesTheSumByAtMostOneRoundingPerMerge) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 22);
  auto parts = random_parts(rng, 32);
  quad exact = 0;
  for (const auto& p : parts) exact += exact_sum_of(p);
  const double bound = static_cast<double>(parts.size() - 1) * 0x1p-53;
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(parts.begin(), parts.end(), rng);
    partial_norm total;
    for (const auto& p : parts) total.merge(p);
    EXPECT_LE(static_cast<double>(quad_abs(exact_sum_of(total) - exact) / exact), bound);
  }
}

TEST(PartialNorm, UnscaledPartsNearDoublesMaximumMergeWithoutOverflow) {
  partial_norm total{0, 1.5e308, true};
  total.merge({0, 1.5e308, true});
  EXPECT_TRUE(total.finite);
  EXPECT_DOUBLE_EQ(total.norm(), std::sqrt(1.5e308) * std::sqrt(2.0));
}

TEST(PartialNorm, NormalizedKeepsTheValueExactly) {
  for (const partial_norm p :
       {partial_norm{0, 1.0, true}, partial_norm{3, 0x1p-1074, true}, partial_norm{-7, 1.7e308, true},
        partial_norm{0, 3.999, true}, partial_norm{5, 0.3, true}}) {
    const partial_norm n = p.normalized();
    EXPECT_GE(n.sum, 1.0);
    EXPECT_LT(n.sum, 4.0);
    EXPECT_TRUE(exact_sum_of(n) == exact_sum_of(p));
  }
  EXPECT_EQ(partial_norm({9, 0.0, true}).normalized().exponent, 0);
  EXPECT_TRUE(std::isnan(partial_norm({0, NAN, false}).normalized().sum));
}

// The two-collective scheme, with the all-reduces simulated in every order a library might use.
TEST(PartialNorm, ReductionWithDoubleSumsMatchesMergingWithinOneRoundingPerRank) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 23);
  auto parts = random_parts(rng, 64);
  quad exact = 0;
  for (const auto& p : parts) exact += exact_sum_of(p);
  int e = partial_norm::no_exponent;
  for (const auto& p : parts) e = std::max(e, p.reduction_exponent());
  for (int trial = 0; trial < 10; ++trial) {
    std::shuffle(parts.begin(), parts.end(), rng);
    double s = 0;
    for (const auto& p : parts) {
      const double contribution = p.reduction_sum(e);
      EXPECT_GE(contribution, 0.0);
      EXPECT_LT(contribution, 4.0);
      s += contribution;
    }
    const partial_norm total = partial_norm::from_reduction(e, s);
    EXPECT_LE(static_cast<double>(quad_abs(exact_sum_of(total) - exact) / exact), parts.size() * 0x1p-53);
  }
}

TEST(PartialNorm, ReductionWithExactSumsIsCorrectlyRounded) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 24);
  for (int round = 0; round < 50; ++round) {
    const auto parts = random_parts(rng, 1 + static_cast<int>(rng() % 40));
    quad exact = 0;
    for (const auto& p : parts) exact += exact_sum_of(p);
    int e = partial_norm::no_exponent;
    for (const auto& p : parts) e = std::max(e, p.reduction_exponent());
    partial_norm::exact_sum s{};
    for (const auto& p : parts) {
      const auto limbs = p.reduction_exact_sum(e);
      for (std::size_t j = 0; j < s.size(); ++j) s[j] += limbs[j];
    }
    const partial_norm total = partial_norm::from_reduction(e, s);
    if (exact == 0) {
      EXPECT_EQ(total.sum, 0.0);
      continue;
    }
    // Correct rounding of the exact total, up to the 2^-94 fixed-point resolution of each part.
    EXPECT_LE(static_cast<double>(quad_abs(exact_sum_of(total) - exact) / exact), 0x1p-53 + parts.size() * 0x1p-94);
  }
}

TEST(PartialNorm, ReductionCarriesNonFinitePartsAndEmptyRanks) {
  const partial_norm nan{0, NAN, false}, inf{0, INFINITY, false}, zero{}, one{0, 1.0, true};
  const auto reduce = [](std::vector<partial_norm> parts) {
    int e = partial_norm::no_exponent;
    for (const auto& p : parts) e = std::max(e, p.reduction_exponent());
    partial_norm::exact_sum s{};
    double d = 0;
    for (const auto& p : parts) {
      const auto limbs = p.reduction_exact_sum(e);
      for (std::size_t j = 0; j < s.size(); ++j) s[j] += limbs[j];
      d += p.reduction_sum(e);
    }
    const partial_norm exact = partial_norm::from_reduction(e, s), floating = partial_norm::from_reduction(e, d);
    EXPECT_EQ(exact.finite, floating.finite);
    EXPECT_EQ(std::isnan(exact.norm()), std::isnan(floating.norm()));
    if (exact.finite) {
      EXPECT_EQ(exact.norm(), floating.norm());
    }
    return exact;
  };
  EXPECT_EQ(reduce({zero, zero}).norm(), 0.0);
  EXPECT_EQ(reduce({}).norm(), 0.0);
  EXPECT_EQ(reduce({zero, one, zero}).norm(), 1.0);
  EXPECT_EQ(reduce({one, inf}).norm(), INFINITY);
  EXPECT_FALSE(reduce({inf, zero}).finite);
  EXPECT_TRUE(std::isnan(reduce({inf, one, nan}).norm()));
}

// gradclip::mpi reduces a kind as its row says. The exact integer SUM holds sums below 2^2 only, so its
// rows must be those whose normalized sums, in [1, 2^p), stay below 4: p <= 2.
TEST(NormKind, OnlyKindsWhoseRescaledSumsStayBelowFourReduceByExactSum) {
  using gradclip::detail::norm_kind;
  using gradclip::detail::rank_reduction;
  std::mt19937_64 rng(seed + 25);
  for (double p : {0.25, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 1000.0}) {
    EXPECT_EQ(norm_kind{p}.ranks() == rank_reduction::exact_sum, p <= 2.0) << p;
    if (norm_kind{p}.ranks() != rank_reduction::exact_sum) continue;
    for (int round = 0; round < 1000; ++round) {
      const partial_norm part{
          static_cast<int>(rng() % 2001) - 1000,
          std::ldexp(0.5 + 0x1p-64 * static_cast<double>(rng()), static_cast<int>(rng() % 401) - 200), true, p};
      const double sum = part.reduction_sum(part.reduction_exponent());
      EXPECT_GE(sum, 1.0) << p;
      EXPECT_LT(sum, 4.0) << p;
    }
  }
  EXPECT_EQ(norm_kind{INFINITY}.ranks(), rank_reduction::maximum_bits);
}

// Only the L2 norm reduces on the policies' sums of squares; every other kind on the p-norm kernels, the
// same under every policy.
TEST(NormKind, OnlyL2ReducesOnThePolicysSumOfSquares) {
  using gradclip::detail::norm_kind;
  using gradclip::detail::run_kernel;
  for (double p : {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 7.5, 1000.0, double{INFINITY}})
    EXPECT_EQ(norm_kind{p}.kernel() == run_kernel::sum_of_squares, p == 2.0) << p;
}

// Element counts add on every merge, whatever the parts hold: a zero part, a non-finite one, a part of
// the maximum, parts that overflow together; normalized keeps them.
TEST(PartialNorm, ElementCountsAddOnEveryMerge) {
  partial_norm total{3, 1.0, true, 2.0, 0.0, 5};
  total.merge({0, 0.0, true, 2.0, 0.0, 7});  // zero
  EXPECT_EQ(total.elements, 12u);
  total.merge({0, std::numeric_limits<double>::max(), true, 2.0, 0.0, 1});
  total.merge({0, std::numeric_limits<double>::max(), true, 2.0, 0.0, 2});  // overflows unscaled
  EXPECT_TRUE(total.finite);
  EXPECT_EQ(total.elements, 15u);
  EXPECT_EQ(total.normalized().elements, 15u);
  total.merge(partial_norm::nonfinite(INFINITY));
  total.merge({0, 1.0, true, 2.0, 0.0, 4});
  EXPECT_FALSE(total.finite);
  EXPECT_EQ(total.elements, 19u);
  EXPECT_EQ(total.normalized().elements, 19u);
  partial_norm wrong_kind{0, 1.0, true, 1.0, 0.0, 1};
  wrong_kind.merge({0, 1.0, true, 2.0, 0.0, 2});
  EXPECT_EQ(wrong_kind.elements, 3u);
  partial_norm maximum{0, 1.0, true, INFINITY, 0.0, 6};
  maximum.merge({9, 1.5, true, INFINITY, 0.0, 10});
  EXPECT_EQ(maximum.elements, 16u);
  EXPECT_EQ(partial_norm{}.normalized().elements, 0u);
  EXPECT_EQ((partial_norm{0, 0.0, true, 2.0, 0.0, 8}.normalized().elements), 8u);
  // The two all-reduces' results take the summed count.
  const partial_norm part{4, 1.5, true, 2.0, 0.0, 3};
  const int e = part.reduction_exponent();
  EXPECT_EQ(partial_norm::from_reduction(e, part.reduction_sum(e), 2.0, 11).elements, 11u);
  EXPECT_EQ(partial_norm::from_reduction(e, part.reduction_exact_sum(e), 2.0, 12).elements, 12u);
  EXPECT_EQ(partial_norm::from_reduction(e, partial_norm::nonfinite(NAN).reduction_exact_sum(e), 2.0, 13).elements,
            13u);
  EXPECT_EQ(partial_norm::from_reduction(e, part.reduction_exact_sum(e)).norm(),
            partial_norm::from_reduction(e, part.reduction_exact_sum(e), 2.0, 12).norm());
}

// Every reduction counts the elements its part covers: each kind, each thread count, contiguous runs,
// strided views and interleaved units (the one-sweep path), gradients with NaN, and empty ones.
TEST(PartialNorm, ReductionsCountTheirElementsOnEveryThreadCount) {
  std::mt19937_64 rng(seed + 26);
  std::normal_distribution<double> normal;
  std::vector<Eigen::VectorXd> vectors;
  for (Eigen::Index n : {0, 1, 17, 1000, 70000}) {
    vectors.emplace_back(n);
    for (Eigen::Index i = 0; i < n; ++i) vectors.back()[i] = normal(rng);
  }
  Eigen::MatrixXf matrix = Eigen::MatrixXf::Random(300, 257);
  std::vector<gradclip::grad_view> group;
  std::uint64_t total = 0;
  for (auto& v : vectors) group.emplace_back(v), total += static_cast<std::uint64_t>(v.size());
  group.emplace_back(matrix), total += static_cast<std::uint64_t>(matrix.size());
  for (double p : {2.0, 1.0, 3.0, 0.5, double{INFINITY}}) {
    for (unsigned threads : {1u, 2u, 3u}) {
      gradclip::options opt;
      opt.norm = gradclip::norm_type{p};
      opt.threads = threads;
      EXPECT_EQ(gradclip::partial_global_norm(group, opt).elements, total) << p << ", " << threads;
      EXPECT_EQ(gradclip::partial_global_norm<gradclip::promote>(group, opt).elements, total) << p;
      vectors[3][5] = NAN;
      EXPECT_EQ(gradclip::partial_global_norm(group, opt).elements, total) << p << ", " << threads;
      vectors[3][5] = 0.0;
    }
  }
}

// The units of a column-major matrix (its rows) interleave: robust L2 sums them in one sweep over the
// columns (pipeline.hpp, reduce_columns), which builds parts itself. Each row's part counts its columns,
// on the sweep, on the rescans of rows outside its range (a huge or NaN element), and on every thread count.
TEST(PartialNorm, InterleavedUnitsCountTheirElements) {
  for (double p : {2.0, 1.0}) {
    for (unsigned threads : {1u, 2u, 3u}) {
      Eigen::MatrixXd fp64 = Eigen::MatrixXd::Random(64, 300);
      Eigen::MatrixXf fp32 = Eigen::MatrixXf::Random(64, 300);
      fp64(3, 7) = 1e300, fp64(4, 8) = NAN, fp32(3, 7) = 3e38f, fp32(5, 9) = INFINITY;
      gradclip::options opt;
      opt.norm = gradclip::norm_type{p};
      opt.threads = threads;
      const auto check = [&](auto& m) {
        const auto split = gradclip::detail::split_units(m);
        ASSERT_TRUE(split.interleaved());
        const auto parts =
            gradclip::detail::reduce_units<gradclip::robust>(gradclip::detail::consecutive_units(split), opt);
        for (std::size_t u = 0; u < 64; ++u)
          EXPECT_EQ(parts[u].elements, 300u) << u << ", p = " << p << ", " << threads;
      };
      check(fp64);
      check(fp32);
    }
  }
}

}  // namespace
