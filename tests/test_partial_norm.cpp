// partial_norm: merging scaled sums of squares is exact, order-independent and range-safe.
#include <gradclip/norm.hpp>

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
    EXPECT_LE(relative_error(total.norm(), exact), 1e-14);
  }
}

}  // namespace
