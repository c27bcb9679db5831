// Every kernel against an independent binary128 reference (long double on AArch64), the portable ones
// included, so these tests check the arithmetic wherever they run (arm64 and x86 CPUs without AVX2 have
// no vector kernel); and every vector kernel (AVX2, AVX-512, whichever this CPU runs) against the
// portable one, bit for bit: lengths around the vector and block widths, misaligned starts,
// out-of-range blocks, NaN and Inf, and every 16-bit pattern through the scaling kernel.
#include <gradclip/detail/simd.hpp>
#include <gradclip/detail/update_kernels.hpp>

#include "reference.hpp"
#include "vector_targets.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using gradclip::detail::isa;
using gradclip::detail::portable;
using gradclip::detail::with_isa;
using gradclip_test::vector_isas;

constexpr std::uint64_t seed = 20261202;
constexpr std::size_t lengths[] = {0,    1,    3,    7,    8,    15,   16,   17,   31,  32,  33,
                                   63,   64,   65,   127,  129,  255,  256,  257,  511, 512, 513,
                                   1023, 1024, 1025, 2047, 3001, 4095, 4096, 4097, 8193};

constexpr std::size_t longest = *std::max_element(std::begin(lengths), std::end(lengths));

/// The portable kernels and every vector kernel this CPU runs.
std::vector<isa> all_isas() {
  std::vector<isa> result{isa::portable};
  for (isa target : vector_isas()) result.push_back(target);
  return result;
}

std::string name_of(isa target) { return target == isa::avx512 ? "avx512" : target == isa::avx2 ? "avx2" : "portable"; }

template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(static_cast<float>(u(rng) * scale));
  return v;
}

template <class T>
std::uint64_t bits(T x) {
  std::uint64_t b = 0;
  std::memcpy(&b, &x, sizeof x);
  return b;
}

template <class T>
bool is_nan(T x) {
  return std::isnan(static_cast<double>(x));
}

template <class T>
class Kernels : public ::testing::Test {};
using ElementTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(Kernels, ElementTypes);
template <class T>
class VectorKernels : public gradclip_test::vector_kernels_test {};
TYPED_TEST_SUITE(VectorKernels, ElementTypes);

TEST(Dispatch, BestIsaIsSupported) {
  EXPECT_TRUE(gradclip::detail::isa_supported(gradclip::detail::best_isa()));
  EXPECT_TRUE(gradclip::detail::isa_supported(isa::portable));
}

// Sums of exact squares (16-bit and FP32 elements in FP64, 16-bit in FP32) match the reference bit for
// bit; FP32 and FP64 squares rounded in their own type may differ by the FMA's missing rounding.
template <class Acc, class T>
void check_block_sums(const std::vector<T>& data, std::size_t offset, std::size_t n, const char* what) {
  constexpr bool exact = !std::is_same_v<T, double> && !(std::is_same_v<Acc, float> && std::is_same_v<T, float>);
  const double min_sum = 0x1p-40;
  for (isa target : vector_isas()) {
    SCOPED_TRACE(name_of(target) + " " + what + " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
    std::size_t done_ref = 0, done = 0;
    const double ref = portable::block_sums<Acc, false>(data.data() + offset, n, min_sum, done_ref);
    const double got = with_isa(target, [&](auto k) {
      return decltype(k)::template block_sums<Acc, false>(data.data() + offset, n, min_sum, done);
    });
    EXPECT_EQ(done, n);
    EXPECT_EQ(done_ref, n);
    const double ref_ranged = portable::block_sums<Acc, true>(data.data() + offset, n, min_sum, done_ref);
    const double got_ranged = with_isa(target, [&](auto k) {
      return decltype(k)::template block_sums<Acc, true>(data.data() + offset, n, min_sum, done);
    });
    EXPECT_EQ(done, done_ref);
    for (auto [r, g] : {std::pair{ref, got}, std::pair{ref_ranged, got_ranged}}) {
      if (std::isnan(r)) {
        EXPECT_TRUE(std::isnan(g));
      } else if (exact || std::isinf(r)) {
        EXPECT_EQ(g, r);
      } else {
        EXPECT_NEAR(g, r, std::abs(r) * 4 * std::numeric_limits<Acc>::epsilon());
      }
    }
  }
}

/// gamma(k) = k u / (1 - k u): the relative error of k roundings to nearest of nonnegative terms.
double gamma_of(double k, double unit) { return k * unit / (1 - k * unit); }

/// The relative error bound of block_sums<Acc> over elements of T (all terms are nonnegative), from the
/// kernels' structure (simd.hpp): in a lane, a chain of `chain` squares (each rounded unless exact) and
/// chain - 1 additions in Acc; the chains carried into FP64 lanes (block / chunk carries per block), the
/// lanes summed pairwise (log2 lanes additions) and the block sums totalled compensated (one rounding,
/// and one more for the compensation's second-order terms).
template <class T, class Acc>
double block_sums_bound() {
  namespace d = gradclip::detail;
  constexpr bool exact = d::exact_squares<T, Acc>;
  const double acc_unit = std::ldexp(1.0, -std::numeric_limits<Acc>::digits), fp64_unit = 0x1p-53;
  const double in_chain = static_cast<double>(d::chain<T, Acc>) - 1 + (exact ? 0 : 1);
  const double carries = static_cast<double>(d::block_for<T> / d::chunk<T, Acc>) - 1;
  const double in_fp64 = carries + std::log2(static_cast<double>(d::lanes<Acc>)) + 2;
  if (std::is_same_v<Acc, double>) return gamma_of(in_chain + in_fp64, fp64_unit);
  return (1 + gamma_of(in_chain, acc_unit)) * (1 + gamma_of(in_fp64, fp64_unit)) - 1;
}

/// Every kernel's sum of squares, portable included, against the exact sum in binary128, within
/// block_sums_bound (for data whose squares neither overflow nor underflow Acc).
template <class Acc, class T>
void check_block_sums_accuracy(const std::vector<T>& data, std::size_t offset, std::size_t n) {
  gradclip_test::quad exact = 0;
  for (std::size_t i = offset; i < offset + n; ++i)
    exact += gradclip_test::to_quad(data[i]) * gradclip_test::to_quad(data[i]);
  const double bound = block_sums_bound<T, Acc>();
  for (isa target : all_isas()) {
    SCOPED_TRACE(name_of(target) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
    std::size_t done = 0;
    const double sum = with_isa(target, [&](auto k) {
      return decltype(k)::template block_sums<Acc, false>(data.data() + offset, n, 0.0, done);
    });
    EXPECT_EQ(done, n);
    EXPECT_LE(gradclip_test::relative_error(sum, exact), bound);
    const double ranged = with_isa(target, [&](auto k) {
      return decltype(k)::template block_sums<Acc, true>(data.data() + offset, n, 0x1p-40, done);
    });
    EXPECT_EQ(done, n);  // random values in [-1, 1]: every block is summed unscaled
    EXPECT_LE(gradclip_test::relative_error(ranged, exact), bound);
  }
}

template <class T, class F>
void for_each_accumulator(F&& f) {
  f(double{});
  if constexpr (!std::is_same_v<T, double>) f(float{});
}

TYPED_TEST(VectorKernels, BlockSumsMatchPortableForEveryLengthAndAlignment) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto data = random_values<T>(longest + 4, rng);
  for_each_accumulator<T>([&](auto acc) {
    for (std::size_t n : lengths)
      for (std::size_t offset = 0; offset < 4; ++offset) check_block_sums<decltype(acc)>(data, offset, n, "random");
  });
}

TYPED_TEST(Kernels, BlockSumsAreWithinTheirBoundOfTheExactSum) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto data = random_values<T>(longest + 4, rng);
  for_each_accumulator<T>([&](auto acc) {
    SCOPED_TRACE(sizeof(acc) == 4 ? "FP32 chains" : "FP64");
    for (std::size_t n : lengths)
      for (std::size_t offset = 0; offset < 4; ++offset) check_block_sums_accuracy<decltype(acc)>(data, offset, n);
  });
}

template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, double>)
    return x;
  else
    return static_cast<T>(static_cast<float>(x));
}

/// Where the Ranged portable kernel stops on `data` (and the vector kernels stop alike).
template <class Acc, class T>
std::size_t ranged_stop(const std::vector<T>& data) {
  check_block_sums<Acc>(data, 0, data.size(), "ranged");
  std::size_t done = 0;
  portable::block_sums<Acc, true>(data.data(), data.size(), 0x1p-40, done);
  return done;
}

// A block whose squares overflow Acc, or whose sum is so small that squares may have underflowed, stops
// the Ranged kernels there (for the caller to rescale it); a block of zeros, of either sign, does not.
TYPED_TEST(Kernels, BlockSumsStopAtBlocksTheirSumCannotHold) {
  using T = TypeParam;
  constexpr std::size_t block = gradclip::detail::block_for<T>;
  std::mt19937_64 rng(seed + 1);
  for_each_accumulator<T>([&](auto acc) {
    using Acc = decltype(acc);
    const int big = std::numeric_limits<Acc>::max_exponent / 2 + 2,
              small = std::numeric_limits<Acc>::min_exponent / 2 - 30;
    for (int e : {big, small}) {
      if (e >= std::numeric_limits<T>::max_exponent || e < std::numeric_limits<T>::min_exponent) continue;
      auto data = random_values<T>(3 * block + 1, rng);
      const T outlier = from_double<T>(std::ldexp(1.0, e));
      std::fill(data.begin() + block, data.begin() + 2 * block, outlier);
      data[block + 476] = -outlier;
      EXPECT_EQ(ranged_stop<Acc>(data), block) << "outlier 2^" << e;
    }
    auto data = random_values<T>(3 * block + 1, rng);
    std::fill(data.begin() + block, data.begin() + 2 * block, T(0));
    data[block + 476] = T(-0.0f);
    EXPECT_EQ(ranged_stop<Acc>(data), data.size()) << "a block of zeros";
    data[block + 476] = std::numeric_limits<T>::denorm_min();
    if (std::ldexp(1.0, 2 * std::numeric_limits<T>::min_exponent) < 0x1p-40) {
      EXPECT_EQ(ranged_stop<Acc>(data), block) << "zeros and one subnormal";
    }
  });
}

// A NaN's block stops the Ranged kernels, vector and portable alike (the rescan reports the NaN).
TYPED_TEST(Kernels, BlockSumsStopAtANanBlock) {
  using T = TypeParam;
  constexpr std::size_t block = gradclip::detail::block_for<T>;
  std::mt19937_64 rng(seed + 3);
  for_each_accumulator<T>([&](auto acc) {
    auto data = random_values<T>(3 * block + 1, rng);
    data[block + 6] = std::numeric_limits<T>::quiet_NaN();
    EXPECT_EQ(ranged_stop<decltype(acc)>(data), block);
  });
}

TYPED_TEST(Kernels, BlockSumsPropagateNanAndInf) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 2);
  for_each_accumulator<T>([&](auto acc) {
    using Acc = decltype(acc);
    for (std::size_t position : {std::size_t{0}, std::size_t{17}, std::size_t{1030}, std::size_t{2999}}) {
      for (T special : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                        T(-std::numeric_limits<T>::infinity())}) {
        auto data = random_values<T>(3000, rng);
        data[position] = special;
        check_block_sums<Acc>(data, 0, data.size(), "special");
        std::size_t done = 0;
        const double sum = with_isa(gradclip::detail::best_isa(), [&](auto k) {
          return decltype(k)::template block_sums<Acc, false>(data.data(), data.size(), 0.0, done);
        });
        EXPECT_EQ(std::isnan(sum), is_nan(special));
        EXPECT_EQ(std::isinf(sum), !is_nan(special));
      }
    }
  });
}

// Block sums each a little under half an ulp of the running total: summed plainly every one of them is
// rounded away (about 31 ulp in all here); compensated, the total stays within an ulp of the exact sum.
TEST(Kernels, BlockTotalsAreCompensated) {
  const double tiny = 0.7 * 0x1p-26;  // 1024 tiny^2 = 0.49 * 2^-42, and ulp(1024) = 2^-42
  std::vector<double> data(65 * 1024, tiny);
  std::fill(data.begin(), data.begin() + 1024, 1.0);
  gradclip_test::quad exact = 0;
  for (double x : data) exact += gradclip_test::to_quad(x) * gradclip_test::to_quad(x);
  for (isa target : {isa::portable, isa::avx2, isa::avx512}) {
    if (!gradclip::detail::isa_supported(target)) continue;
    std::size_t done = 0;
    const double sum = with_isa(target, [&](auto k) {
      return decltype(k)::template block_sums<double, false>(data.data(), data.size(), 0.0, done);
    });
    EXPECT_LE(gradclip_test::relative_error(sum, exact), 0x1p-52) << static_cast<int>(target);
  }
}

using gradclip_test::quad;
using gradclip_test::to_quad;
using gradclip_test::type_name;

/// q rounded to T's precision and range, to nearest even, computed in binary128 (an independent
/// reference for the division kernel).
template <class T>
double round_to(quad q) {
  if (q == 0) return static_cast<double>(q);  // its sign kept
  const bool negative = q < 0;
  const quad a = negative ? -q : q;
  const int digits = std::numeric_limits<T>::digits, emin = std::numeric_limits<T>::min_exponent - 1;
  const quad overflow = quad(static_cast<double>(std::numeric_limits<T>::max())) +
                        quad(std::ldexp(1.0, std::numeric_limits<T>::max_exponent - digits - 1));
  if (a >= overflow) return negative ? -INFINITY : INFINITY;
  int e = std::ilogb(static_cast<double>(a));
  if (quad(std::ldexp(1.0, e)) > a) --e;
  if (quad(std::ldexp(1.0, e + 1)) <= a) ++e;
  e = std::max(e, emin);
  const quad ulp = quad(std::ldexp(1.0, e - digits + 1));
  const quad k = a / ulp;
  auto whole = static_cast<std::int64_t>(k);  // floor: k >= 0 and below 2^(digits + 1)
  const quad rest = k - quad(whole);
  if (rest > quad(0.5) || (rest == quad(0.5) && whole % 2 != 0)) ++whole;
  const double result = static_cast<double>(quad(whole) * ulp);
  return negative ? -result : result;
}

/// x * c as the multiply kernels compute it: the exact product (binary128 holds it) rounded to Compute,
/// then to T; NaN for a NaN product, a zero with the product's sign for a zero.
template <class T, class Compute>
double multiplied(T x, Compute c) {
  const double a = static_cast<double>(x), b = static_cast<double>(c);
  if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b) || a == 0 || b == 0) return a * b;
  return round_to<T>(to_quad(round_to<Compute>(to_quad(a) * to_quad(b))));
}

/// got against expected, element by element: the same bits, or a NaN of the same sign where expected holds
/// a NaN (its payload may differ between targets). Stops at the first element that differs.
template <class T>
void expect_same_bits_but_nan_payloads(const std::vector<T>& got, const std::vector<T>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (is_nan(expected[i])) {
      ASSERT_TRUE(is_nan(got[i])) << "element " << i;
      ASSERT_EQ(std::signbit(static_cast<double>(got[i])), std::signbit(static_cast<double>(expected[i])))
          << "element " << i;
    } else {
      ASSERT_EQ(bits(got[i]), bits(expected[i])) << "element " << i << " of " << expected.size();
    }
  }
}

template <class Compute, class T>
void check_multiply(const std::vector<T>& data, Compute c, std::size_t offset, std::size_t n, bool reference = true) {
  if (reference) {  // the portable kernel against the binary128 reference
    SCOPED_TRACE("portable c=" + std::to_string(static_cast<double>(c)) + " n=" + std::to_string(n) +
                 " offset=" + std::to_string(offset));
    auto got = data;
    portable::multiply<Compute>(got.data() + offset, n, c);
    for (std::size_t i = 0; i < data.size(); ++i) {
      const bool inside = i >= offset && i < offset + n;
      const double want = inside ? multiplied(data[i], c) : static_cast<double>(data[i]);
      const double value = static_cast<double>(got[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(value)) << "element " << i;
      } else {
        ASSERT_EQ(value, want) << "element " << i << ": " << static_cast<double>(data[i]) << " * " << c;
        ASSERT_EQ(std::signbit(value), std::signbit(want)) << "element " << i;
      }
    }
  }
  for (isa target : vector_isas()) {
    SCOPED_TRACE(name_of(target) + " c=" + std::to_string(static_cast<double>(c)) + " n=" + std::to_string(n) +
                 " offset=" + std::to_string(offset));
    auto expected = data;
    auto got = data;
    portable::multiply<Compute>(expected.data() + offset, n, c);
    with_isa(target, [&](auto k) { decltype(k)::template multiply<Compute>(got.data() + offset, n, c); });
    expect_same_bits_but_nan_payloads(got, expected);
  }
}

template <class T, class F>
void for_each_compute(F&& f) {
  if constexpr (!std::is_same_v<T, double>) f(float{});
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) f(double{});
}

TYPED_TEST(Kernels, MultiplyMatchesPortableBitForBit) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 3);
  const auto data = random_values<T>(longest + 4, rng, 100.0);
  for_each_compute<T>([&](auto compute) {
    using Compute = decltype(compute);
    for (Compute c : {Compute(0.3), Compute(1.0) / Compute(3), Compute(1e-3), Compute(0)})
      for (std::size_t n : lengths)
        for (std::size_t offset = 0; offset < 4; ++offset)  // the reference once per c: element by element
          check_multiply<Compute>(data, c, offset, n, n == longest && offset == 0);
  });
}

template <class T>
class SixteenBitKernels : public ::testing::Test {};
using SixteenBitTypes = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(SixteenBitKernels, SixteenBitTypes);

TYPED_TEST(SixteenBitKernels, MultiplyRoundsEveryBitPatternLikeEigen) {
  using T = TypeParam;
  std::vector<T> all(65536);
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) all[b] = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(b));
  // Ties, overflow to inf, results in the subnormal range, products below FP32's (zeros of their sign),
  // and exact values.
  for (float c : {0.75f, 1.0f / 3.0f, 1.00048828125f, 3e4f, 1e-5f, 0x1p-140f, 1.0f, -1.0f})
    check_multiply<float>(all, c, 0, all.size());
}

TYPED_TEST(Kernels, MultiplyKeepsNanInfAndSubnormals) {
  using T = TypeParam;
  std::vector<T> data(100, T(1.5f));
  data[3] = std::numeric_limits<T>::quiet_NaN();
  data[20] = std::numeric_limits<T>::infinity();
  data[33] = std::numeric_limits<T>::denorm_min();
  data[34] = std::numeric_limits<T>::max();
  data[85] = std::numeric_limits<T>::denorm_min();  // in the second 16 of 32 elements, the first 16 plain
  data[99] = std::numeric_limits<T>::quiet_NaN();
  for_each_compute<T>([&](auto compute) {
    using Compute = decltype(compute);
    for (Compute c : {Compute(0.5), Compute(0), std::numeric_limits<Compute>::quiet_NaN(), Compute(3)})
      check_multiply<Compute>(data, c, 0, data.size());
  });
}

// Only speed depends on how the streaming loops read (`streaming`, chosen by CPU): AMD Zen 4's and Zen 5's
// choices, everyone else's, and neither prefetches nor BF16 pairs give this CPU's bits, on every target.
TYPED_TEST(Kernels, EveryStreamingChoiceGivesTheSameBits) {
  using T = TypeParam;
  using gradclip::detail::stream_tuning;
  std::mt19937_64 rng(seed + 11);
  const auto data = random_values<T>(3 * 8192 + 5, rng, 100.0);
  const auto results = [&] {
    std::vector<std::uint64_t> out;
    for (isa target : all_isas()) {
      with_isa(target, [&](auto k) {
        using K = decltype(k);
        std::size_t done = 0;
        for_each_accumulator<T>([&](auto acc) {
          out.push_back(
              bits(K::template block_sums<decltype(acc), false>(data.data() + 1, data.size() - 1, 0x1p-40, done)));
        });
        if constexpr (std::is_same_v<T, double>) {
          const auto compensated =
              K::template compensated_squares<false>(data.data() + 1, data.size() - 1, 0.0, 0.0, done);
          out.push_back(bits(compensated.hi));
          out.push_back(bits(compensated.lo));
        }
        out.push_back(bits(K::sum_abs(data.data() + 1, data.size() - 1)));
        for_each_compute<T>([&](auto compute) {
          using Compute = decltype(compute);
          auto scaled = data;
          K::template multiply<Compute>(scaled.data() + 1, scaled.size() - 1, Compute(0.3));
          for (T x : scaled) out.push_back(bits(x));
        });
      });
    }
    return out;
  };
  stream_tuning& tuning = gradclip::detail::streaming;
  const stream_tuning own = tuning;
  const auto expected = results();
  const std::pair<stream_tuning, const char*> choices[] = {{stream_tuning::for_cpu(true, 25), "AMD Zen 4's"},
                                                           {stream_tuning::for_cpu(true, 26), "AMD Zen 5's"},
                                                           {stream_tuning::for_cpu(false, 6), "Intel's"}};
  for (const auto& [choice, name] : choices) {
    tuning = choice;
    EXPECT_EQ(results(), expected) << name << " choices";
  }
  tuning = {false, 0, false, false};
  EXPECT_EQ(results(), expected) << "no prefetch, no pairs";
  tuning = own;
}

// ---- Update clipping (update_kernels.inc): StableAdamW's quotient lanes and SPAM's test

bool same_double(double a, double b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0; }

// Every vector kernel this CPU runs (AVX2, AVX-512) against the portable one: StableAdamW's lane sum bit
// for bit and SPAM's count (never below the elements it clips), for every g type with FP32 and FP64 v, on lengths
// around the vector and lane widths, misaligned starts, random values, extremes (maxima, subnormals, zero and negative
// v, squares that overflow) and NaN or Inf in g or v.
template <class T, class V>
void expect_update_kernels_agree(std::mt19937_64& rng) {
  constexpr std::size_t n = 1024 + 3;
  const std::size_t update_lengths[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 1023, 1024};
  std::normal_distribution<double> normal(0.0, 1.0);
  const T specials[] = {std::numeric_limits<T>::max(),        -std::numeric_limits<T>::max(),
                        std::numeric_limits<T>::denorm_min(), T(0.0f),
                        std::numeric_limits<T>::infinity(),   std::numeric_limits<T>::quiet_NaN()};
  const V moments[] = {std::numeric_limits<V>::denorm_min(),
                       V(0),
                       V(-1),
                       std::numeric_limits<V>::max(),
                       std::numeric_limits<V>::infinity(),
                       std::numeric_limits<V>::quiet_NaN(),
                       -std::numeric_limits<V>::infinity()};
  for (int pattern = 0; pattern < 4; ++pattern) {
    std::vector<T> g(n);
    std::vector<V> v(n);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = static_cast<T>(static_cast<float>(normal(rng) * (pattern == 0 ? 1.0 : 100.0)));
      v[i] = static_cast<V>(std::abs(normal(rng)) * (pattern == 0 ? 1.0 : 1e-6));
    }
    if (pattern >= 2) {  // extremes (finite only in pattern 2), at irregular positions
      const std::size_t specials_used = pattern == 2 ? 4 : std::size(specials);
      const std::size_t moments_used = pattern == 2 ? 4 : std::size(moments);
      for (std::size_t i = 5; i < n; i += 11) g[i] = specials[(i / 11) % specials_used];
      for (std::size_t i = 2; i < n; i += 13) v[i] = moments[(i / 13) % moments_used];
    }
    for (std::size_t offset : {0u, 1u, 3u})
      for (std::size_t m : update_lengths) {
        const T* gp = g.data() + offset;
        const V* vp = v.data() + offset;
        for (double eps_squared : {1e-16, 1.0, 1e-300, 0x1p-1074}) {
          const double expected = portable::quotient_lanes(gp, vp, m, eps_squared);
          for (auto target : vector_isas()) {
            const double got =
                with_isa(target, [&](auto k) { return decltype(k)::quotient_lanes(gp, vp, m, eps_squared); });
            ASSERT_TRUE(same_double(got, expected))
                << type_name<T>() << " g, " << type_name<V>() << " v, pattern " << pattern << ", m " << m << ", offset "
                << offset << ": " << got << " != " << expected;
          }
        }
        for (double theta : {5000.0, 1.0, 1e-3, 1e300, 1e-300}) {
          // The fast test never rules out an element that SPAM clips (propagate clips the most).
          std::size_t clips = 0;
          for (std::size_t i = 0; i < m; ++i) {
            T x = gp[i];
            clips += gradclip::detail::spam_element(x, static_cast<double>(vp[i]), theta, /*clip_infinite=*/true);
          }
          const std::size_t expected = portable::spam_unclear(gp, vp, m, theta);
          EXPECT_GE(expected, clips);
          for (auto target : vector_isas())
            ASSERT_EQ(with_isa(target, [&](auto k) { return decltype(k)::spam_unclear(gp, vp, m, theta); }), expected)
                << type_name<T>() << " g, " << type_name<V>() << " v, pattern " << pattern << ", m " << m;
        }
      }
  }
}

TYPED_TEST(Kernels, UpdateKernelsGiveThePortableBits) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed + 250);
  expect_update_kernels_agree<TypeParam, float>(rng);
  expect_update_kernels_agree<TypeParam, double>(rng);
}

}  // namespace

TYPED_TEST(Kernels, DivideMatchesPortableBitForBitAndRoundsCorrectly) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(1.0, 2.0);
  std::uniform_int_distribution<int> e(-30, 30);
  std::vector<T> data(longest + 2);
  for (auto& x : data) {  // the draws sequenced, as g++ made them, so that every compiler makes the same
    const int exponent = e(rng);
    const double magnitude = std::ldexp(u(rng), exponent);
    x = static_cast<T>(static_cast<float>(u(rng) < 1.5 ? -magnitude : magnitude));
  }
  data[7] = std::numeric_limits<T>::denorm_min();
  data[8] = std::numeric_limits<T>::max();
  data[9] = std::numeric_limits<T>::quiet_NaN();
  data[10] = -std::numeric_limits<T>::infinity();
  // Divisors representable in T (where the quotient is documented as correctly rounded) and one that is not;
  // then powers of two, whose quotients are exact before the one rounding: 16-bit elements take the FP32
  // multiply by 1 / s where that reciprocal is an FP32 number (s from 2^-127 to 2^149, both here), the
  // division beyond (2^-128, 2^150).
  const std::vector<double> divisors{3.0,
                                     static_cast<double>(static_cast<T>(0.1f)),
                                     static_cast<double>(static_cast<T>(1.7e-3f)),
                                     static_cast<double>(static_cast<T>(777.0f)),
                                     0.1,
                                     65536.0,
                                     0x1p-128,
                                     0x1p-127,
                                     0x1p-126,
                                     0x1p100,
                                     0x1p149,
                                     0x1p150};
  for (double s : divisors)
    for (std::size_t n : lengths)
      for (std::size_t offset : {0, 1}) {
        auto ref = data;
        portable::divide(ref.data() + offset, n, s);
        for (isa target : vector_isas()) {
          SCOPED_TRACE(name_of(target) + " s=" + std::to_string(s) + " n=" + std::to_string(n));
          auto got = data;
          with_isa(target, [&](auto k) { decltype(k)::divide(got.data() + offset, n, s); });
          EXPECT_TRUE(gradclip_test::same_bits(got, ref));
        }
        if (s == 0.1) continue;
        for (std::size_t i = offset; i < offset + n; ++i) {
          const double x = static_cast<double>(data[i]);
          if (!std::isfinite(x)) {  // NaN stays NaN, infinities keep their sign (s > 0)
            if (std::isnan(x))
              EXPECT_TRUE(is_nan(ref[i]));
            else
              EXPECT_EQ(static_cast<double>(ref[i]), x);
            continue;
          }
          ASSERT_EQ(static_cast<double>(ref[i]), round_to<T>(to_quad(x) / to_quad(s)))
              << type_name<T>() << " " << x << " / " << s;
        }
      }
}

// Every FP16 and BF16 bit pattern divided by scales that are not powers of two (the vector targets' own
// loop, round to odd FP32 and then to T): each target gives the portable loop's bits (a NaN's payload
// aside), and the quotients are correctly rounded where that is documented (s representable in T) and for
// 2/3 (1 -+ 2^-30), whose quotients 1.5 x (1 +- 2^-30) lie just off T's midpoints, far nearer than FP32's
// precision but far from them in FP64's: rounding to FP32 to nearest or toward zero, not to odd, rounds
// them wrongly. Overflow to Inf, results below T's subnormals and quotients that round to FP32's largest
// number or its smallest subnormal are among them.
TYPED_TEST(SixteenBitKernels, DivideRoundsEveryBitPatternCorrectly) {
  using T = TypeParam;
  std::vector<T> all(65536 + 3);  // and three more, so that the loops end in a partial vector
  for (std::size_t b = 0; b < all.size(); ++b)
    all[b] = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(b * 40503u));
  // (s, whether the quotients are checked against binary128)
  const std::pair<double, bool> divisors[] = {{3.0, true},
                                              {static_cast<double>(static_cast<T>(0.1f)), true},
                                              {static_cast<double>(static_cast<T>(777.0f)), true},
                                              {static_cast<double>(std::numeric_limits<T>::max()), true},
                                              {static_cast<double>(std::numeric_limits<T>::denorm_min()), true},
                                              {static_cast<double>(static_cast<T>(-1.7e-3f)), true},
                                              {2.0 / 3.0 * (1 - 0x1p-30), true},
                                              {2.0 / 3.0 * (1 + 0x1p-30), true},
                                              {0.1, false},
                                              {1.0 / 3.0, false},
                                              {1e-30, false},
                                              {1e30, false},
                                              {1e-300, false}};
  for (const auto& [s, checked] : divisors) {
    SCOPED_TRACE(type_name<T>() + " s=" + std::to_string(s));
    auto ref = all;
    portable::divide(ref.data(), ref.size(), s);
    for (isa target : vector_isas()) {
      auto got = all;
      with_isa(target, [&, s = s](auto kernels) { decltype(kernels)::divide(got.data(), got.size(), s); });
      SCOPED_TRACE(name_of(target));
      expect_same_bits_but_nan_payloads(got, ref);
    }
    if (!checked) continue;
    for (std::size_t i = 0; i < all.size(); ++i) {
      const double x = static_cast<double>(all[i]);
      if (std::isnan(x)) {
        ASSERT_TRUE(is_nan(ref[i]));
      } else if (std::isinf(x)) {
        ASSERT_EQ(static_cast<double>(ref[i]), s > 0 ? x : -x);
      } else {
        const double want = round_to<T>(to_quad(x) / to_quad(s));
        ASSERT_EQ(static_cast<double>(ref[i]), want) << x << " / " << s;
        ASSERT_EQ(std::signbit(static_cast<double>(ref[i])), std::signbit(want)) << x << " / " << s;
      }
    }
  }
}

// ---- The kernels of interleaved units (unit u's element c at base[c * stride + u]): unit and column
// counts around the vector width, the tile and the fold width, a stride with padding, and masked units
// holding NaN and Inf.

namespace {

constexpr std::size_t unit_counts[] = {1, 3, 8, 15, 16, 17, 31, 32, 33, 64, 65, 100, 128, 130, 160};
constexpr std::size_t column_counts[] = {0, 1, 2, 7, 15, 16, 17, 31, 32, 33, 40, 65};

/// The accumulator of the interleaved kernels for elements of type T.
template <class T>
using column_acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// column_dot's documented sum, written out: products rounded to Acc, unit u added to lane u % (128 bytes
/// of Acc lanes, each starting at -0), the lanes summed halves first, then added to out[c].
template <class Acc, class T>
Acc column_dot_reference(const T* column, std::size_t units, const std::vector<Acc>& factor,
                         const std::vector<unsigned char>& keep, Acc out) {
  constexpr std::size_t L = 128 / sizeof(Acc);
  Acc lane[L];
  std::fill(lane, lane + L, Acc(-0.0));
  for (std::size_t u = 0; u < units; ++u) {
    if (!keep[u]) continue;
    volatile Acc product = static_cast<Acc>(static_cast<Acc>(column[u]) * factor[u]);  // rounded to Acc
    lane[u % L] += product;
  }
  for (std::size_t width = L / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) lane[j] += lane[j + width];
  return out + lane[0];
}

/// column_dot on `target`, masked (only units whose keep is set) or not, adding into out.
template <class Acc, class T>
void run_column_dot(isa target, bool masked, const std::vector<T>& data, std::size_t units, std::size_t columns,
                    std::size_t stride, const std::vector<Acc>& factor, const std::vector<unsigned char>& keep,
                    std::vector<Acc>& out) {
  with_isa(target, [&](auto k) {
    const auto s = static_cast<std::ptrdiff_t>(stride);
    if (masked)
      decltype(k)::template column_dot<Acc, true>(data.data(), units, columns, s, factor.data(), keep.data(),
                                                  out.data());
    else
      decltype(k)::template column_dot<Acc, false>(data.data(), units, columns, s, factor.data(), keep.data(),
                                                   out.data());
  });
}

}  // namespace

TYPED_TEST(Kernels, ColumnDotSumsEachColumnsLanesPairwiseOnEveryTarget) {
  using T = TypeParam;
  using Acc = column_acc<T>;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t units : unit_counts)
    for (std::size_t columns : column_counts)
      for (bool masked : {false, true}) {
        const std::size_t stride = units + (units % 3);
        auto data = random_values<T>(columns * stride + 1, rng);
        const auto factor = random_values<Acc>(units, rng, 4.0);
        std::vector<unsigned char> keep(units, 1);
        if (masked)
          for (std::size_t u = 0; u < units; u += 3) {
            keep[u] = 0;
            for (std::size_t c = 0; c < columns; ++c)  // what an excluded example may hold
              data[c * stride + u] = c % 2 ? std::numeric_limits<T>::quiet_NaN() : -std::numeric_limits<T>::infinity();
          }
        const auto start = random_values<Acc>(columns, rng);
        std::vector<Acc> expected(columns);
        for (std::size_t c = 0; c < columns; ++c)
          expected[c] = column_dot_reference(data.data() + c * stride, units, factor, keep, start[c]);
        for (isa target : all_isas()) {
          SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + " columns=" + std::to_string(columns) +
                       (masked ? " masked" : ""));
          auto got = start;
          run_column_dot(target, masked, data, units, columns, stride, factor, keep, got);
          ASSERT_TRUE(gradclip_test::same_bits(got, expected));
        }
        // The sum itself, against binary128: each product and each of the few additions rounds once.
        for (std::size_t c = 0; c < columns; ++c) {
          quad exact = to_quad(start[c]), magnitude = gradclip_test::quad_abs(to_quad(start[c]));
          for (std::size_t u = 0; u < units; ++u)
            if (keep[u]) {
              const quad term = to_quad(data[c * stride + u]) * to_quad(factor[u]);
              exact += term;
              magnitude += gradclip_test::quad_abs(term);
            }
          const double eps = std::numeric_limits<Acc>::epsilon();
          EXPECT_LE(std::abs(static_cast<double>(to_quad(expected[c]) - exact)),
                    static_cast<double>(units + 8) * eps * static_cast<double>(magnitude));
        }
      }
}

TYPED_TEST(Kernels, ColumnSquaresMatchPortableAndBinary128) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t units : unit_counts)
    for (std::size_t columns : column_counts) {
      const std::size_t stride = units + (units % 3);
      auto data = random_values<T>(columns * stride + 1, rng, 8.0);
      if (columns > 3 && units > 2) data[3 * stride + 2] = std::numeric_limits<T>::infinity();  // unit 2 only
      const auto exact_of = [&](std::size_t u) {
        quad s = 0;
        for (std::size_t c = 0; c < columns; ++c) s += to_quad(data[c * stride + u]) * to_quad(data[c * stride + u]);
        return s;
      };
      const auto s = static_cast<std::ptrdiff_t>(stride);
      if constexpr (std::is_same_v<T, double>) {
        std::vector<double> sum(units), compensation(units), top(units);
        portable::column_squares_compensated(data.data(), units, columns, s, sum.data(), compensation.data(),
                                             top.data());
        for (isa target : vector_isas()) {
          SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + " columns=" + std::to_string(columns));
          std::vector<double> got_sum(units, -1), got_compensation(units, -1), got_top(units, -1);
          with_isa(target, [&](auto k) {
            decltype(k)::column_squares_compensated(data.data(), units, columns, s, got_sum.data(),
                                                    got_compensation.data(), got_top.data());
          });
          ASSERT_TRUE(gradclip_test::same_bits(got_top, top));
          // A unit holding Inf is rescanned by the caller: its sum only has to say so (the compensation is a
          // NaN whose sign depends on the target's FMA).
          for (std::size_t u = 0; u < units; ++u)
            if (std::isfinite(top[u])) {
              ASSERT_EQ(bits(got_sum[u]), bits(sum[u])) << u;
              ASSERT_EQ(bits(got_compensation[u]), bits(compensation[u])) << u;
            } else {
              ASSERT_FALSE(std::isfinite(got_sum[u])) << u;
            }
        }
        for (std::size_t u = 0; u < units; ++u) {
          double largest = 0;
          for (std::size_t c = 0; c < columns; ++c) largest = std::max(largest, std::abs(data[c * stride + u]));
          EXPECT_EQ(top[u], largest);
          const quad exact = exact_of(u);
          if (std::isinf(largest)) {
            EXPECT_TRUE(std::isinf(sum[u]));
            continue;
          }
          // Dot2: the compensated total is within a few units of the last place of the exact sum.
          EXPECT_LE(std::abs(static_cast<double>(to_quad(sum[u]) + to_quad(compensation[u]) - exact)),
                    4 * std::numeric_limits<double>::epsilon() * static_cast<double>(exact));
        }
      } else {
        using Acc = std::conditional_t<sizeof(T) == 2, float, double>;
        std::vector<double> sums(units);
        portable::template column_squares<Acc>(data.data(), units, columns, s, sums.data());
        for (isa target : vector_isas()) {
          SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + " columns=" + std::to_string(columns));
          std::vector<double> got(units, -1);
          with_isa(target, [&](auto k) {
            decltype(k)::template column_squares<Acc>(data.data(), units, columns, s, got.data());
          });
          ASSERT_TRUE(gradclip_test::same_bits(got, sums));
        }
        for (std::size_t u = 0; u < units; ++u) {
          const quad exact = exact_of(u);
          if (!(exact < quad(1e300))) {
            EXPECT_TRUE(std::isinf(sums[u]));
            continue;
          }
          // Chains of at most 64 roundings in Acc, carried into FP64.
          EXPECT_LE(std::abs(static_cast<double>(to_quad(sums[u]) - exact)),
                    64 * std::numeric_limits<Acc>::epsilon() * static_cast<double>(exact));
        }
      }
    }
}

TYPED_TEST(Kernels, ColumnMultiplyRoundsEachElementOnce) {
  using T = TypeParam;
  if constexpr (!std::is_same_v<T, double>) {
    using Compute = std::conditional_t<sizeof(T) == 2, float, double>;
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    for (std::size_t units : unit_counts)
      for (std::size_t columns : column_counts) {
        const std::size_t stride = units + (units % 3);
        auto data = random_values<T>(columns * stride + 1, rng, 100.0);
        if (columns > 1 && units > 1) {
          data[stride] = std::numeric_limits<T>::quiet_NaN();
          data[stride + 1] = -std::numeric_limits<T>::infinity();
        }
        auto factor = random_values<Compute>(units, rng, 2.0);
        factor[0] = 1;  // a unit that does not clip keeps its bits, NaN and Inf included
        for (isa target : all_isas()) {
          SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + " columns=" + std::to_string(columns));
          auto got = data;
          with_isa(target, [&](auto k) {
            decltype(k)::template column_multiply<Compute>(got.data(), units, columns,
                                                           static_cast<std::ptrdiff_t>(stride), factor.data());
          });
          for (std::size_t i = 0; i < data.size(); ++i) {
            const std::size_t u = i % stride;
            const bool inside = i < columns * stride && u < units;
            const double want = inside ? multiplied(data[i], factor[u]) : static_cast<double>(data[i]);
            if (std::isnan(want)) {
              ASSERT_TRUE(is_nan(got[i])) << i;
            } else {
              ASSERT_EQ(static_cast<double>(got[i]), want) << i;
            }
            const bool finite = std::isfinite(static_cast<double>(data[i]));
            if (!inside || (u == 0 && finite)) {
              ASSERT_EQ(bits(got[i]), bits(data[i])) << i;
            }
          }
        }
      }
  }
}

TYPED_TEST(Kernels, AddScaledAddsEachRunInOrder) {
  using T = TypeParam;
  using Acc = column_acc<T>;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t count : {0, 1, 3, 4, 5, 8, 9})
    for (std::size_t n : {0, 1, 15, 16, 17, 31, 33, 64, 100}) {
      std::vector<std::vector<T>> runs;
      std::vector<const T*> rows;
      for (std::size_t i = 0; i < count; ++i) runs.push_back(random_values<T>(n + 1, rng, 10.0));
      for (auto& r : runs) rows.push_back(r.data() + 1);  // misaligned
      const auto factor = random_values<Acc>(count, rng, 3.0);
      const auto start = random_values<Acc>(n, rng);
      auto expected = start;
      for (std::size_t j = 0; j < n; ++j)
        for (std::size_t i = 0; i < count; ++i) {
          volatile Acc product = static_cast<Acc>(static_cast<Acc>(rows[i][j]) * factor[i]);
          expected[j] += product;
        }
      for (isa target : all_isas()) {
        SCOPED_TRACE(name_of(target) + " count=" + std::to_string(count) + " n=" + std::to_string(n));
        auto got = start;
        with_isa(target, [&](auto k) { decltype(k)::add_scaled(got.data(), rows.data(), factor.data(), count, n); });
        ASSERT_TRUE(gradclip_test::same_bits(got, expected));
      }
    }
}

// column_squares' documented order, written out: each unit's squares (rounded to Acc) added in Acc over
// runs of chain<T, Acc> columns from 0, each run's sum carried into FP64. Unit counts past a register tile
// (the swept path) and past its blocks of units, with strides that leave gaps between the columns.
TYPED_TEST(Kernels, ColumnSquaresAddEachUnitsChainsInOrderOnEveryTarget) {
  using T = TypeParam;
  if constexpr (!std::is_same_v<T, double>) {
    using Acc = std::conditional_t<sizeof(T) == 2, float, double>;
    constexpr std::size_t per = gradclip::detail::chain<T, Acc>;
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    for (std::size_t units : {1, 31, 64, 65, 96, 130, 2049, 4095, 4129, 8200})
      for (std::size_t columns : {0, 1, 31, 33, 70}) {
        const std::size_t stride = units + (units % 3);
        auto data = random_values<T>(columns * stride + 1, rng, 8.0);
        if (columns > 3 && units > 2) data[3 * stride + 2] = std::numeric_limits<T>::infinity();  // unit 2 only
        std::vector<double> expected(units, 0.0);
        for (std::size_t u = 0; u < units; ++u)
          for (std::size_t c0 = 0; c0 < columns; c0 += per) {
            Acc s = 0;
            for (std::size_t c = c0; c < std::min(columns, c0 + per); ++c) {
              const Acc v = static_cast<Acc>(data[c * stride + u]);
              volatile Acc square = v * v;  // rounded to Acc
              s += square;
            }
            expected[u] += static_cast<double>(s);
          }
        for (isa target : all_isas()) {
          SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + " columns=" + std::to_string(columns));
          std::vector<double> got(units, -1);
          with_isa(target, [&](auto k) {
            decltype(k)::template column_squares<Acc>(data.data(), units, columns, static_cast<std::ptrdiff_t>(stride),
                                                      got.data());
          });
          ASSERT_TRUE(gradclip_test::same_bits(got, expected));
        }
      }
  }
}

// column_dot's lanes start at -0, the identity of addition: a column whose every product is -0 adds -0,
// which leaves a sum of -0 as it is (lanes starting at +0 would turn it into +0).
TYPED_TEST(Kernels, ColumnDotOfNegativeZeroProductsLeavesTheSumsBits) {
  using T = TypeParam;
  using Acc = column_acc<T>;
  for (std::size_t units : {1, 5, 32, 64, 100, 128})
    for (bool masked : {false, true}) {
      const std::size_t columns = 17, stride = units + 1;
      std::vector<T> data(columns * stride, T(0));
      const std::vector<Acc> factor(units, Acc(-0.5));  // 0 * -0.5 = -0
      const std::vector<unsigned char> keep(units, 1);
      for (isa target : all_isas()) {
        SCOPED_TRACE(name_of(target) + " units=" + std::to_string(units) + (masked ? " masked" : ""));
        std::vector<Acc> got(columns, Acc(-0.0));
        run_column_dot(target, masked, data, units, columns, stride, factor, keep, got);
        for (Acc x : got) ASSERT_TRUE(std::signbit(static_cast<double>(x)) && x == Acc(0));
      }
    }
}
