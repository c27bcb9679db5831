// Robust FP64 clipping to one ulp: the compensated sum of squares, the double-double coefficient
// and the one-rounding FP64 scale kernel, against binary128; and the vector kernels against the portable
// ones, bit for bit.
#include <gradclip/clip.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/norm.hpp>

#include "reference.hpp"
#include "vector_targets.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::detail::isa;
using gradclip::detail::portable;
using gradclip::detail::scaled;
using gradclip::detail::with_isa;

constexpr double u = 0x1p-53;  // double's unit roundoff

using model = std::vector<std::vector<double>>;

quad exact_norm_of(const model& m) {
  quad sum = 0;
  for (const auto& g : m)
    for (const double x : g) sum += to_quad(x) * to_quad(x);
  return quad_sqrt(sum);
}

// A threshold that is a generic fraction of the norm: a coefficient with a short binary expansion (a power
// of two, or the double 0.3) makes many products exact or near-exact and hides rounding errors.
double generic_threshold(quad norm, std::mt19937_64& rng) {
  return static_cast<double>(norm * static_cast<quad>(0.1 + 0.8 * std::uniform_real_distribution<double>()(rng)));
}

// The largest distance, in ulps, of a clipped model from the exact projection m * max_norm / ||m||.
double worst_ulps(const model& original, const model& clipped, double max_norm, quad norm) {
  const quad c = static_cast<quad>(max_norm) / norm;
  double worst = 0;
  for (std::size_t k = 0; k < original.size(); ++k)
    for (std::size_t i = 0; i < original[k].size(); ++i)
      worst = std::max(worst, ulps(clipped[k][i], to_quad(original[k][i]) * c));
  return worst;
}

// Clips the model (whose exact norm is `norm`) with robust and returns the worst ulps; the norm is checked
// against `norm_bound`.
double clip_and_measure(model m, double max_norm, quad norm, double norm_bound = 1.5 * u) {
  const model original = m;
  const auto result = gradclip::clip_by_global_norm(m, max_norm);
  EXPECT_TRUE(result.clipped);
  EXPECT_LE(relative_error(result.norm, norm), norm_bound) << "the FP64 norm";
  return worst_ulps(original, m, max_norm, norm);
}

// clip_and_measure at a generic threshold.
double clip_generic(const model& m, std::mt19937_64& rng, double norm_bound = 1.5 * u) {
  const quad norm = exact_norm_of(m);
  return clip_and_measure(m, generic_threshold(norm, rng), norm, norm_bound);
}

model one(std::vector<double> g) { return model{std::move(g)}; }

// Normal values times 2^(a random exponent in [low, high]), random signs. The draws are sequenced (the
// order of a call's arguments is unspecified, and g++ and clang++ differ), so every compiler builds the same
// values from a seed.
std::vector<double> spread(std::size_t n, int low, int high, std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(low, high);
  std::vector<double> v(n);
  for (auto& x : v) {
    const int e = exponent(rng);
    x = std::ldexp(normal(rng), e);
  }
  return v;
}

TEST(Fp64Ulp, EveryShortLengthIsWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 40);
  std::vector<std::size_t> lengths;
  for (std::size_t n = 1; n <= 80; ++n) lengths.push_back(n);
  for (std::size_t n : {1023u, 1024u, 1025u, 4095u, 4097u, 33333u}) lengths.push_back(n);
  for (const std::size_t n : lengths) {
    const model m = one(random_gradient<double>(n, rng));
    EXPECT_LE(clip_generic(m, rng), 1.0) << "n = " << n;
  }
}

TEST(Fp64Ulp, ExtremeMagnitudesAreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 41);
  for (const double scale : {1e-300, 1e-160, 1.0, 1e160, 1e300, 1e303})
    for (const std::size_t n : {3u, 1000u, 70000u}) {
      const model m = one(random_gradient<double>(n, rng, scale));
      EXPECT_LE(clip_generic(m, rng), 1.0) << "magnitude " << scale << ", n = " << n;
    }
}

// Without the compensated sum this case was 2.5 ulp off (its blocks are all max-scaled, and plain sums of
// 2048 scaled block sums carried their roundings into the coefficient). Two pieces of 2^20 elements, each
// summed compensated, then merged with their tails.
TEST(Fp64Ulp, TwoMillionElementsOfMagnitude1e300AreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 42);
  const model m = one(random_gradient<double>(std::size_t{2} << 20, rng, 1e300));
  EXPECT_LE(clip_generic(m, rng), 1.0);
}

TEST(Fp64Ulp, MixedMagnitudesWithinOneGradientAreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 43);
  for (const auto& range : {std::pair{-1070, 1020}, std::pair{-1074, -990}, std::pair{-40, 40}, std::pair{900, 1020}}) {
    const model m = one(spread(30000, range.first, range.second, rng));
    EXPECT_LE(clip_generic(m, rng), 1.0) << "exponents in [" << range.first << ", " << range.second << "]";
  }
}

// Products near the smallest normal double, where the fast kernel's addend x * low would itself be
// rounded to the subnormal grid: multiply_exactly takes over there.
TEST(Fp64Ulp, ResultsNearTheSmallestNormalAreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 44);
  std::vector<double> g = spread(20000, -1030, -995, rng);
  g[0] = 1.0;  // the norm, about 1, so results land in [2^-1031, 2^-995]
  const model m = one(g);
  EXPECT_LE(clip_generic(m, rng), 1.0);
}

// A coefficient below double's normal range: mantissa and tail no longer scale to normal doubles, and
// each element is rounded by multiply_exactly.
TEST(Fp64Ulp, CoefficientsBelowTheNormalRangeAreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 45);
  const model m = one(random_gradient<double>(5000, rng, 1e300));
  const quad norm = exact_norm_of(m);
  // Coefficients 1.37 * 2^k: the fast kernel's limit (-968) on either side, below the normal range, and
  // far below it (max_norm about 2^-996 and 2^-1066, itself subnormal).
  for (const int k : {-964, -970, -1000, -1030, -2000, -2070}) {
    quad fraction = 1.37;
    for (int e = k; e != 0; e -= std::max(e, -1000)) fraction *= static_cast<quad>(std::ldexp(1.0, std::max(e, -1000)));
    const double max_norm = static_cast<double>(norm * fraction);
    EXPECT_LE(clip_and_measure(m, max_norm, norm), 1.0) << "max_norm " << max_norm;
  }
}

// Models of 40 tensors of 1 to 3000 elements, each at its own scale.
TEST(Fp64Ulp, RandomModelsAreWithinOneUlp) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 46);
  for (int trial = 0; trial < 6; ++trial) {
    model m;
    for (int k = 0; k < 40; ++k) {
      const auto n = static_cast<std::size_t>(std::exp(std::uniform_real_distribution<double>(0, 8)(rng)));
      m.push_back(random_gradient<double>(n, rng, std::pow(10.0, std::uniform_real_distribution<double>(-6, 6)(rng))));
    }
    EXPECT_LE(clip_generic(m, rng), 1.0) << "trial " << trial;
  }
}

// multiply_exactly is x * (mantissa + low) * 2^exponent rounded once, subnormal results included:
// binary128 holds the exact product to 113 bits, and its conversion to double rounds once.
TEST(Fp64Kernels, MultiplyExactlyRoundsOnceEverywhere) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 47);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-2100, -1);
  for (int trial = 0; trial < 20000; ++trial) {
    const double m = mantissa(rng);
    const scaled c{m, exponent(rng), std::ldexp(mantissa(rng) - 1.5, -53)};
    const double x = spread(1, -1074, 1023, rng)[0];
    // The exact product, scaled into binary128's range: 2^e in quad by repeated factors.
    quad exact = to_quad(x) * (to_quad(c.mantissa) + to_quad(c.low));
    for (int e = c.exponent; e != 0;) {
      const int step = std::max(e, -1000);
      exact *= static_cast<quad>(std::ldexp(1.0, step));
      e -= step;
    }
    const double expected = static_cast<double>(exact);
    const double got = gradclip::detail::multiply_exactly(x, c);
    ASSERT_EQ(got, expected) << "x = " << x << ", c = (" << c.mantissa << " + " << c.low << ") 2^" << c.exponent;
  }
}

// compensated_squares' bound on the relative error of its sum of n squares before the rounding.
double compensated_bound(std::size_t n) { return (4400 * static_cast<double>(n) + 0x1p21) * u * u; }

// The relative error of a compensated sum (hi + lo) against `exact`.
template <class Sum>
double sum_error(const Sum& s, quad exact) {
  return static_cast<double>(quad_abs(to_quad(s.hi) + to_quad(s.lo) - exact) / exact);
}

// compensated_squares<Ranged> of all of g on `target` (Ranged: over [2^-451, 2^450), which holds every g
// here), before its rounding: its relative error against `exact`. Every element must be taken.
template <bool Ranged>
double compensated_error(isa target, const std::vector<double>& g, quad exact) {
  std::size_t done = 0;
  const auto s = with_isa(target, [&](auto k) {
    return decltype(k)::template compensated_squares<Ranged>(g.data(), g.size(), 0x1p-451, 0x1p450, done);
  });
  EXPECT_EQ(done, g.size());
  return sum_error(s, exact);
}

// The compensated sum before its rounding: within compensated_bound(n) of the exact sum.
TEST(Fp64Kernels, CompensatedSquaresAreAccurateToDoubleDouble) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 48);
  for (const std::size_t n : {1u, 17u, 1000u, 5000u, 100000u}) {
    const std::vector<double> g = spread(n, -20, 20, rng);
    const double bound = compensated_bound(n);
    EXPECT_LE(compensated_error<false>(gradclip::detail::best_isa(), g, exact_norm(g) * exact_norm(g)), bound)
        << "n = " << n;
  }
}

// Runs whose blocks grow: nearly every block makes the lanes grow past their offset, which must grow before
// the block is summed again (kept at the old offset, this case is 2^-58 off at 3000 and 70 000 elements), on
// every target alike. The bound is CompensatedSquaresAreAccurateToDoubleDouble's.
TEST(Fp64Kernels, CompensatedSquaresOfGrowingBlocksAreAccurateToDoubleDouble) {
  for (const std::size_t n : {3000u, 70000u}) {
    std::vector<double> g(n);
    for (std::size_t i = 0; i < n; ++i)
      g[i] = std::ldexp(1.0 + static_cast<double>(i % 7) * 0x1p-40, static_cast<int>(i * 800 / n) - 400);
    const quad exact = exact_norm(g) * exact_norm(g);
    const double bound = compensated_bound(n);
    for (const isa target : {isa::portable, isa::avx2, isa::avx512}) {
      if (!gradclip::detail::isa_supported(target)) continue;
      EXPECT_LE(compensated_error<true>(target, g, exact), bound)
          << "n = " << n << ", target " << static_cast<int>(target);
    }
  }
}

// Many equal elements: every lane adds the same square to a sum in the same binade, so each addition loses
// the same amount, and the compensation that collects those errors is rounded the same way each time it
// grows. Before each block each lane's compensation moves into its sum (Fast2Sum, exact), which keeps it
// below 65 u s (s the lane's sum: the move leaves u s, a block adds 32 errors below 2 u s), so its n / 32
// roundings per lane stay below (65 / 32) n u^2 of the total: the bound here, tighter than the general one
// because the offset never moves. Left to grow, the compensation is 7 to 22 times that bound off at 2^22
// elements (1/3, 0.1, pi/4).
TEST(Fp64Kernels, CompensatedSquaresOfEqualElementsKeepTheCompensationSmall) {
  const std::size_t n = std::size_t{1} << 22;
  const double x = 1.0 / 3.0;
  const std::vector<double> g(n, x);
  const quad exact = to_quad(x) * to_quad(x) * static_cast<quad>(n);  // exact in binary128
  const double bound = (65.0 / 32 * static_cast<double>(n) + 0x1p12) * u * u;
  for (const isa target : {isa::portable, isa::avx2, isa::avx512}) {
    if (!gradclip::detail::isa_supported(target)) continue;
    EXPECT_LE(compensated_error<false>(target, g, exact), bound) << "target " << static_cast<int>(target);
  }
}

using Fp64VectorKernels = vector_kernels_test;

bool same_double(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST_F(Fp64VectorKernels, CompensatedSquaresMatchPortableBitForBit) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 49);
  const double lo = 0x1p-451, hi = 0x1p450;
  for (const isa target : vector_isas())
    for (const std::size_t n : {0u, 1u, 15u, 16u, 17u, 70u, 1024u, 1041u, 5000u}) {
      std::vector<double> g = spread(n, -300, 300, rng);
      if (n > 3000) g[2500] = 1e300;  // out of range: the ranged sums stop before that block
      std::size_t done_vector = 0, done_portable = 0;
      const auto v = with_isa(target, [&](auto k) {
        return decltype(k)::template compensated_squares<true>(g.data(), n, lo, hi, done_vector);
      });
      const auto p = portable::compensated_squares<true>(g.data(), n, lo, hi, done_portable);
      EXPECT_EQ(done_vector, done_portable) << "n = " << n;
      EXPECT_TRUE(same_double(v.hi, p.hi) && same_double(v.lo, p.lo)) << "n = " << n;
      if (n > 3000) g[2500] = 1.0;  // unranged sums take finite squares only (their NaN bits may differ)
      const auto vf = with_isa(target, [&](auto k) {
        return decltype(k)::template compensated_squares<false>(g.data(), n, lo, hi, done_vector);
      });
      const auto pf = portable::compensated_squares<false>(g.data(), n, lo, hi, done_portable);
      EXPECT_TRUE(same_double(vf.hi, pf.hi) && same_double(vf.lo, pf.lo)) << "n = " << n;
    }
}

// Ranged sums stop before the first block whose lanes would not stay finite, whichever lane and block that
// is: an element whose square is not finite (Inf, NaN, 1e300) or too large for the lanes' offset (2^460,
// whose square passes hi^2 = 2^900), in the first block or a later one. What comes before it is summed
// within the bound, to the same bits on every target. (Not to the bits of that part summed alone: each lane's
// compensation moves into its sum before the block that stops, which keeps their sum but not its split.)
TEST(Fp64Kernels, RangedCompensatedSquaresStopBeforeABlockTheyCannotSum) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 51);
  const double lo = 0x1p-451, hi = 0x1p450;
  const std::size_t n = 5000;
  const std::vector<double> clean = spread(n, -300, 300, rng);
  for (const double bad :
       {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 1e300, 0x1p460})
    for (const std::size_t at : {std::size_t{100}, std::size_t{2500}, std::size_t{4999}}) {
      std::vector<double> g = clean;
      g[at] = bad;
      const std::size_t before = at / gradclip::detail::block_size * gradclip::detail::block_size;
      const std::vector<double> summed(clean.begin(), clean.begin() + static_cast<std::ptrdiff_t>(before));
      const quad exact = exact_norm(summed) * exact_norm(summed);
      const double bound = compensated_bound(before);
      std::size_t portable_done = 0;
      const auto expected = portable::compensated_squares<true>(g.data(), n, lo, hi, portable_done);
      for (const isa target : {isa::portable, isa::avx2, isa::avx512}) {
        if (!gradclip::detail::isa_supported(target)) continue;
        SCOPED_TRACE(std::to_string(bad) + " at " + std::to_string(at) + ", target " +
                     std::to_string(static_cast<int>(target)));
        std::size_t done = 0;
        const auto s = with_isa(
            target, [&](auto k) { return decltype(k)::template compensated_squares<true>(g.data(), n, lo, hi, done); });
        EXPECT_EQ(done, before);
        EXPECT_TRUE(same_double(s.hi, expected.hi) && same_double(s.lo, expected.lo));
        if (before == 0)
          EXPECT_TRUE(s.hi == 0 && s.lo == 0);
        else
          EXPECT_LE(sum_error(s, exact), bound);
      }
    }
}

TEST_F(Fp64VectorKernels, MultiplyCompensatedMatchesPortableBitForBit) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 50);
  for (const isa target : vector_isas())
    for (const int exponent : {-1, -30, -600, -968})
      for (const std::size_t n : {0u, 1u, 7u, 16u, 33u, 3000u}) {
        // Elements from the subnormals up, so products fall below, into and above the exact band.
        const std::vector<double> g = spread(n, -1074 - exponent, 60, rng);
        const scaled c{1.0 + std::uniform_real_distribution<double>()(rng), exponent, 0x1.3p-54};
        auto vector = g, portable_result = g;
        with_isa(target, [&](auto k) { decltype(k)::multiply_compensated(vector.data(), n, c); });
        portable::multiply_compensated(portable_result.data(), n, c);
        EXPECT_TRUE(same_bits(vector, portable_result)) << "n = " << n << ", exponent " << exponent;
      }
}

}  // namespace
