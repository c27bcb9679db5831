// The p-norm kernels (detail/p_norm_kernels.hpp): every vector version against the scalar one bit for
// bit (the table terms too), the 16-bit elements' plain table loads against the gathered table terms
// for every magnitude, and the partial norms of both paths for general p (series, tables) against
// binary128 sums of |x|^p, including scale changes, the ends of each type's range, NaN and Inf
// anywhere, and small and large p.
#include <gradclip/detail/p_norm_kernels.hpp>
#include <gradclip/partial_norm.hpp>

#include "reference.hpp"
#include "vector_targets.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::partial_norm;
using gradclip::detail::isa;
namespace pnorm = gradclip::detail::pnorm;
using gradclip::detail::portable;
using gradclip::detail::with_isa;

constexpr double inf = std::numeric_limits<double>::infinity();
constexpr std::size_t lengths[] = {0, 1, 3, 8, 15, 16, 17, 33, 255, 1023, 1024, 1025, 2047, 3001};

template <class T>
class PNormKernels : public ::testing::Test {};
using ElementTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(PNormKernels, ElementTypes);
template <class T>
class PNormVectorKernels : public gradclip_test::vector_kernels_test {};
TYPED_TEST_SUITE(PNormVectorKernels, ElementTypes);

// check(target) for every vector target, then for AVX-512 once more without VBMI where this CPU has it:
// the L1 sums of 16-bit elements take add_field_lines with it and add_fields' loop without.
template <class Check>
void for_each_vector_loop(Check&& check) {
  for (isa target : vector_isas()) {
    SCOPED_TRACE("isa " + std::to_string(static_cast<int>(target)));
    check(target);
  }
#if GRADCLIP_X86_DISPATCH
  bool& lines = gradclip::detail::use_avx512_vbmi;
  if (!lines) return;
  lines = false;
  SCOPED_TRACE("AVX-512 without VBMI");
  check(isa::avx512);
  lines = true;
#endif
}

std::uint64_t bits_of(double x) {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// Values spread over `binades` binades below 1 (and zeros, one in 16), random signs.
template <class T>
std::vector<T> spread_values(std::size_t n, std::mt19937_64& rng, int binades) {
  std::uniform_real_distribution<double> u(1.0, 2.0);
  std::uniform_int_distribution<int> e(-binades, 0), coin(0, 15);
  std::vector<T> v(n);
  for (auto& x : v) {
    const int c = coin(rng);
    if (c == 0) {
      x = T(0.0f);
      continue;
    }
    const int exponent = e(rng);  // the draws sequenced, as g++ made them, so that every compiler makes the same
    x = static_cast<T>(std::ldexp(c % 2 ? u(rng) : -u(rng), exponent));
  }
  return v;
}

/// 2^e in binary128, exactly.
quad quad_power_of_two(int e) {
  quad result = 1, base = e < 0 ? quad(0.5) : quad(2);
  for (unsigned k = static_cast<unsigned>(e < 0 ? -e : e); k != 0; k >>= 1, base *= base)
    if (k & 1u) result *= base;
  return result;
}

/// a^p in binary128 for p a multiple of 1/4: products and square roots.
quad quad_power(quad a, double p) {
  const double quarters = 4 * (p - std::floor(p));
  EXPECT_EQ(quarters, std::floor(quarters)) << "p = " << p;
  quad result = quarters == 0 ? quad(1) : quarters == 1 ? quad_sqrt(quad_sqrt(a)) : quad_sqrt(a);
  if (quarters == 3) result *= quad_sqrt(quad_sqrt(a));
  for (int k = 0; k < static_cast<int>(p); ++k) result *= a;
  return result;
}
// 7.75 and 8: the tables' series is least accurate near its largest order.
const std::vector<double> orders{0.5, 0.75, 1.0, 1.25, 1.5, 2.5, 3.0, 4.0, 7.0, 7.75, 8.0};

/// The partial norm by power_sum_kernel (path < 0) or by general_kernel on the given path.
template <class T>
partial_norm power_sum(const std::vector<T>& g, double p, int path) {
  if (path < 0 || p == 1.0 || std::isinf(p)) return gradclip::detail::power_sum_kernel(g.data(), g.size(), p);
  return with_isa(gradclip::detail::best_isa(), [&](auto k) {
    return pnorm::general_kernel<decltype(k)>(g.data(), g.size(), p, static_cast<pnorm::general_path>(path));
  });
}

/// Every way of computing the partial norm of g: power_sum_kernel's choice, then each general path.
template <class T>
std::vector<int> all_paths(double p) {
  std::vector<int> paths{-1};
  if (p != 1.0 && !std::isinf(p) && p <= pnorm::power_tables<T>::max_order)
    for (auto path : {pnorm::general_path::series, pnorm::general_path::tables})
      paths.push_back(static_cast<int>(path));
  return paths;
}

/// The kernel's part against sum (|x| 2^-E)^p in binary128, E its exponent: the sum is within 1e-13
/// (so the norm within 2e-13 for p >= 0.5, under the documented 1e-12).
template <class T>
void expect_sum_within_bound(const std::vector<T>& g, double p, const std::string& what) {
  int exponent = 0;
  quad exact = -1;
  for (int path : all_paths<T>(p)) {
    const partial_norm part = power_sum(g, p, path);
    ASSERT_TRUE(part.finite) << what;
    EXPECT_EQ(part.p, p);
    if (exact < 0 || part.exponent != exponent) {  // every path picks the same scale, as a rule
      exponent = part.exponent;
      const quad unit = quad_power_of_two(-exponent);
      exact = 0;
      for (const T& x : g) exact += quad_power(quad_abs(to_quad(x)) * unit, p);
    }
    EXPECT_LE(relative_error(part.sum, exact), 1e-13) << what << " " << type_name<T>() << " p = " << p << " path "
                                                      << path << " n = " << g.size() << " exponent " << part.exponent;
  }
}

// The L1 sums of 16-bit elements on each vector target (AVX2 and AVX-512 add them as FP64 bit fields)
// against the portable kernel's widening, bit for bit: every bit pattern of the type in random order,
// blocks of only subnormals, of maxima (sums far above the type's range) and of values whose sums round,
// and an Inf or NaN in a block's vectors or in its tail.
template <class T>
void expect_16_bit_sums_match_portable() {
  std::mt19937_64 rng(seed + 3);
  std::vector<T> every(65536);
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) every[b] = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(b));
  std::vector<T> finite;
  for (T x : every)
    if (std::isfinite(static_cast<float>(x))) finite.push_back(x);
  std::shuffle(finite.begin(), finite.end(), rng);
  std::vector<T> subnormals(3000), maxima(1030, std::numeric_limits<T>::max());
  for (auto& x : subnormals)
    x = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(rng() % 0x80 | (rng() % 2) << 15));
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  std::vector<T> rounding(2500);  // 1, 2^-8 and 2^-16 scales in one lane: sums that round
  for (std::size_t i = 0; i < rounding.size(); ++i) rounding[i] = T(std::ldexp(u(rng), -8 * static_cast<int>(i % 3)));
  std::vector<std::vector<T>> cases{every, finite, subnormals, maxima, rounding};
  for (std::size_t at : {5, 40, 1023, 1030}) {  // in a vector, in a block's tail (m = 1030: 6 past 1024)
    for (T special : {std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()}) {
      std::vector<T> with(rounding.begin(), rounding.begin() + 1030 + 40);
      with[at] = special;
      cases.push_back(with);
    }
  }
  for_each_vector_loop([&](isa target) {
    for (std::size_t c = 0; c < cases.size(); ++c)
      for (std::size_t n : {cases[c].size(), std::min<std::size_t>(cases[c].size(), 1030), std::size_t{47}}) {
        const T* p = cases[c].data();
        const auto sum_abs = [&](auto k) { return decltype(k)::sum_abs(p, n); };
        const double sum = with_isa(target, sum_abs), expected = sum_abs(portable{});
        if (std::isnan(expected))  // NaN's payload is the target's
          EXPECT_TRUE(std::isnan(sum)) << "case " << c << " n " << n;
        else
          EXPECT_EQ(bits_of(sum), bits_of(expected)) << "case " << c << " n " << n;
      }
  });
}

using PNormVectorKernels16 = gradclip_test::vector_kernels_test;

TEST_F(PNormVectorKernels16, SumsOfMagnitudesMatchPortableOnEveryBitPattern) {
  expect_16_bit_sums_match_portable<Eigen::half>();
  expect_16_bit_sums_match_portable<Eigen::bfloat16>();
}

TYPED_TEST(PNormVectorKernels, VectorLoopsMatchScalarBitForBit) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto data = spread_values<T>(3100, rng, std::is_same_v<T, double> ? 1060 : 30);
  for (isa target : vector_isas())
    for (std::size_t n : lengths)
      for (std::size_t offset : {0, 1, 3}) {
        SCOPED_TRACE("isa " + std::to_string(static_cast<int>(target)) + " n " + std::to_string(n) + " offset " +
                     std::to_string(offset));
        const T* p = data.data() + offset;
        const auto sum_abs = [&](auto k) { return decltype(k)::sum_abs(p, n); };
        const auto max_abs = [&](auto k) { return pnorm::max_abs<decltype(k)>(p, n); };
        EXPECT_EQ(bits_of(with_isa(target, sum_abs)), bits_of(sum_abs(portable{})));
        EXPECT_EQ(bits_of(with_isa(target, max_abs)), bits_of(max_abs(portable{})));
        for (double order : {0.01, 0.5, 1.5, 3.0, 4.0, 7.3})
          for (bool tabled : {false, true}) {  // each instruction set builds its own tables
            const double scale_top = std::is_same_v<T, double> ? 0.75 : 1.5;
            pnorm::power_tables<T> tables, tables_ref;
            pnorm::power_run<T> run{order}, run_ref{order};
            const auto kernels =
                with_isa(target, [](auto k) { return pnorm::general_kernels<T>::template of<decltype(k)>(); });
            const auto kernels_ref = pnorm::general_kernels<T>::template of<portable>();
            if (tabled) {
              tables.set_order(order, kernels.map);
              tables_ref.set_order(order, kernels_ref.map);
              run.tables = &tables;
              run_ref.tables = &tables_ref;
            }
            run.set_scale(scale_top, kernels);
            run_ref.set_scale(scale_top, kernels_ref);
            const std::size_t m = std::min(n, gradclip::detail::block_size);
            double top = 0, top_ref = 0;
            const double sum = run.block(p, m, top, kernels);
            const double ref = run_ref.block(p, m, top_ref, kernels_ref);
            EXPECT_EQ(bits_of(sum), bits_of(ref)) << "p = " << order << " tables " << tabled;
            EXPECT_EQ(top, top_ref);
          }
      }
}

TEST(PNormRawTables, MatchTableTermsForEveryMagnitude) {
  // 16-bit elements look their tables up with plain loads (raw_sum), the others with gathers
  // (table_term): for every finite 15-bit magnitude, both give the same term, and blocks of them (with
  // both signs) the same sums.
  const auto check = [](auto zero) {
    using T = decltype(zero);
    const auto finite = Eigen::numext::bit_cast<std::uint16_t>(std::numeric_limits<T>::infinity());
    std::vector<T> all(finite);
    for (std::size_t k = 0; k < all.size(); ++k) all[k] = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(k));
    for (double order : {0.01, 0.5, 1.5, 7.75}) {
      const auto kernels = pnorm::general_kernels<T>::template of<portable>();
      pnorm::power_tables<T> tables;
      tables.set_order(order, kernels.map);
      pnorm::power_run<T> run{order, &tables};
      run.set_scale(0.75, kernels);
      for (std::size_t start = 0; start < all.size(); start += 1000) {
        const std::size_t m = std::min<std::size_t>(1000, all.size() - start);
        std::vector<T> block(all.begin() + static_cast<std::ptrdiff_t>(start),
                             all.begin() + static_cast<std::ptrdiff_t>(start + m));
        for (std::size_t i = 0; i < m; ++i) {
          double top = 0, top_ref = 0;
          const double term = run.block(&block[i], 1, top, kernels);
          const double ref = portable::table_block<false, false>(&block[i], 1, tables, top_ref);
          ASSERT_EQ(bits_of(term), bits_of(ref)) << type_name<T>() << " p = " << order << " bits " << start + i;
        }
        for (std::size_t i = 0; i < m; i += 3) block[i] = -block[i];
        double top = 0, top_ref = 0;
        const double sum = run.block(block.data(), m, top, kernels);
        const double ref = portable::table_block<false, false>(block.data(), m, tables, top_ref);
        EXPECT_EQ(bits_of(sum), bits_of(ref)) << type_name<T>() << " p = " << order << " from " << start;
        EXPECT_EQ(top, top_ref);
      }
    }
  };
  check(Eigen::half(0.0f));
  check(Eigen::bfloat16(0.0f));
}

TYPED_TEST(PNormKernels, SumsWithinBoundOfBinary128) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (std::size_t n : {1u, 17u, 1024u, 3001u, 100000u}) {
    const auto g = random_gradient<T>(n, rng, 0.01);
    for (double p : orders) expect_sum_within_bound(g, p, "normal");
    const auto wide = spread_values<T>(n, rng, std::is_same_v<T, double> ? 1060 : 35);
    for (double p : orders) expect_sum_within_bound(wide, p, "spread");
  }
}

TYPED_TEST(PNormKernels, ScaleChangesAndRangeEnds) {
  using T = TypeParam;
  const T max = std::numeric_limits<T>::max(), tiny = std::numeric_limits<T>::denorm_min();
  const T min_normal = std::numeric_limits<T>::min();
  std::vector<T> rising(5000);  // each block's maximum above the last: the run changes scale
  for (std::size_t i = 0; i < rising.size(); ++i)
    rising[i] = static_cast<T>(std::ldexp(1.0 + static_cast<double>(i % 7) / 8, static_cast<int>(i / 1024) * 3 - 8));
  std::vector<T> falling(rising.rbegin(), rising.rend());
  std::vector<T> tiny_then_max(3000, tiny);
  tiny_then_max.back() = max;
  const std::vector<std::vector<T>> cases{{max, max},
                                          {max, -max, max, T(1)},
                                          {tiny},
                                          {tiny, tiny, min_normal},
                                          {max, tiny},
                                          {T(-0.0f), tiny},
                                          std::vector<T>(3000, max),
                                          std::vector<T>(3000, tiny),
                                          rising,
                                          falling,
                                          tiny_then_max};
  for (const auto& g : cases)
    for (double p : orders) expect_sum_within_bound(g, p, "case");
}

TYPED_TEST(PNormKernels, MaximumIsExact) {
  using T = TypeParam;
  std::mt19937_64 rng(seed);
  for (std::size_t n : lengths) {
    const auto g = spread_values<T>(n, rng, 20);
    double top = 0;
    for (const T& x : g) top = std::max(top, std::abs(static_cast<double>(x)));
    const partial_norm part = gradclip::detail::power_sum_kernel(g.data(), g.size(), inf);
    EXPECT_TRUE(part.finite);
    EXPECT_EQ(part.p, inf);
    EXPECT_EQ(part.norm(), top) << "n = " << n;
  }
}

TYPED_TEST(PNormKernels, NanWinsOverInfAnywhere) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN(), infinity = std::numeric_limits<T>::infinity();
  std::mt19937_64 rng(seed);
  for (std::size_t n : {1u, 17u, 1024u, 3001u})
    for (std::size_t at : {std::size_t{0}, n / 2, n - 1})
      for (double p : {0.5, 1.0, 1.5, 3.0, 4.0, inf})
        for (int path : all_paths<T>(p)) {
          auto g = random_gradient<T>(n, rng, 1.0);
          g[at] = infinity;
          partial_norm part = power_sum(g, p, path);
          EXPECT_FALSE(part.finite);
          EXPECT_EQ(part.sum, inf) << "p = " << p << " path " << path << " n = " << n << " at " << at;
          EXPECT_EQ(part.p, p);
          g[n - 1 - at] = -nan;
          part = power_sum(g, p, path);
          EXPECT_FALSE(part.finite);
          EXPECT_TRUE(std::isnan(part.sum)) << "p = " << p << " path " << path << " n = " << n << " at " << at;
        }
}

TEST(PNormKernelOrders, SmallAndLargeP) {
  // (1 + 1)^(1/0.01) = 2^100, on every path.
  const std::vector<double> ones(2, 1.0);
  for (int path : all_paths<double>(0.01)) {
    const partial_norm small = power_sum(ones, 0.01, path);
    EXPECT_NEAR(small.norm() / 0x1p100, 1.0, 1e-13) << "path " << path;
  }
  const std::vector<Eigen::half> half_ones(2, Eigen::half(1.0f));
  for (int path : all_paths<Eigen::half>(0.01)) {
    const partial_norm small = power_sum(half_ones, 0.01, path);
    EXPECT_NEAR(small.norm() / 0x1p100, 1.0, 1e-13) << "path " << path;
  }
  // Large integer p against binary128, with maxima whose mantissa makes the largest term near 2^p.
  std::mt19937_64 rng(seed);
  auto g = random_gradient<double>(3000, rng, 1e300);
  g[5] = 1.99e300;
  for (double p : {64.0, 100.0, 1000.0, 1500.0}) {
    const partial_norm part = gradclip::detail::power_sum_kernel(g.data(), g.size(), p);
    const quad unit = quad_power_of_two(-part.exponent);
    quad exact = 0;
    for (double x : g) exact += quad_power(quad_abs(to_quad(x)) * unit, p);
    EXPECT_LE(relative_error(part.sum, exact), 1e-13) << "p = " << p;
  }
}

TEST(PNormKernelOrders, Fp64L1BeyondDoubleRange) {
  // 3000 values near the maximum: the L1 norm exceeds double's range, the partial norm does not.
  const std::vector<double> g(3000, 1.5e308);
  const partial_norm part = gradclip::detail::power_sum_kernel(g.data(), g.size(), 1.0);
  ASSERT_TRUE(part.finite);
  const gradclip::detail::scaled norm = gradclip::detail::norm_scaled(part);
  EXPECT_NEAR(std::ldexp(norm.mantissa, norm.exponent - 1100) / (3000 * std::ldexp(1.5e308, -1100)), 1.0, 1e-13);
}

/// Bit patterns of T in a fixed shuffled order: every one for 16-bit types, 65536 random ones for
/// FP32 and FP64; finite ones (all signs, zeros, subnormals, the largest) or, with `nonfinite`, only
/// Inf and NaN (every payload and sign for 16-bit types).
template <class T>
std::vector<T> bit_patterns(std::mt19937_64& rng, bool nonfinite) {
  using bits_t = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                    std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  constexpr int exponent_bits = sizeof(T) == 2 ? (std::is_same_v<T, Eigen::half> ? 5 : 8) : sizeof(T) == 4 ? 8 : 11;
  constexpr int significand_bits = 8 * sizeof(T) - 1 - exponent_bits;
  constexpr bits_t exponent_mask = static_cast<bits_t>(((bits_t{1} << exponent_bits) - 1) << significand_bits);
  std::vector<T> v;
  for (std::uint64_t k = 0; k < 65536; ++k) {
    bits_t b = sizeof(T) == 2 ? static_cast<bits_t>(k) : static_cast<bits_t>(rng());
    if (nonfinite && sizeof(T) > 2) b |= exponent_mask;
    if (((b & exponent_mask) == exponent_mask) != nonfinite) continue;
    T x;
    std::memcpy(static_cast<void*>(&x), &b, sizeof x);
    v.push_back(x);
  }
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// sum |x| (sum_abs) of every vector target against the scalar one, bit for bit, over every 16-bit
// pattern: signs, zeros, subnormals and the largest values in the vector steps and in the tails, then
// each Inf and NaN at positions inside a vector step and in the tail (NaN, whatever its payload).
TYPED_TEST(PNormVectorKernels, SumAbsOfEveryBitPatternMatchesScalar) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto finite = bit_patterns<T>(rng, false);
  const auto special = bit_patterns<T>(rng, true);
  const auto sum_abs = [](auto k, const T* p, std::size_t n) { return decltype(k)::sum_abs(p, n); };
  for_each_vector_loop([&](isa target) {
    for (std::size_t start = 0; start + 3001 < finite.size(); start += 1999)
      for (std::size_t n : {std::size_t{7}, std::size_t{31}, std::size_t{33}, std::size_t{1025}, std::size_t{3001}}) {
        const T* p = finite.data() + start;
        EXPECT_EQ(bits_of(with_isa(target, [&](auto k) { return sum_abs(k, p, n); })),
                  bits_of(sum_abs(portable{}, p, n)))
            << "start " << start << " n " << n;
      }
    const std::size_t all = finite.size() - 5;  // whole blocks, then a tail
    EXPECT_EQ(bits_of(with_isa(target, [&](auto k) { return sum_abs(k, finite.data(), all); })),
              bits_of(sum_abs(portable{}, finite.data(), all)));
    std::vector<T> g(finite.begin(), finite.begin() + 53);  // 32 elements, 16, then a tail of 5
    for (std::size_t s = 0; s < special.size(); ++s)
      for (std::size_t at : {std::size_t{0}, std::size_t{9}, std::size_t{31}, std::size_t{40}, std::size_t{51}}) {
        g[at] = special[s];
        g[(at + 20) % g.size()] = special[(s * 7 + 1) % special.size()];  // a second one in another lane
        const double vector_sum = with_isa(target, [&](auto k) { return sum_abs(k, g.data(), g.size()); });
        const double scalar_sum = sum_abs(portable{}, g.data(), g.size());
        if (std::isnan(scalar_sum))  // which of two NaNs wins an addition is the compiler's choice
          ASSERT_TRUE(std::isnan(vector_sum)) << "pattern " << s << " at " << at;
        else
          ASSERT_EQ(bits_of(vector_sum), bits_of(scalar_sum)) << "pattern " << s << " at " << at;
        std::copy(finite.begin(), finite.begin() + 53, g.begin());
      }
  });
}

}  // namespace
