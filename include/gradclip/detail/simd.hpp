// The memory-bound kernels every norm and clip is built from, written once (kernels.inc) and compiled
// for each target: `portable`, on scalar operations with the translation unit's own flags, and on x86-64
// with GCC or Clang `avx2` (AVX2, F16C, FMA) and `avx512` (F, BW, VL, DQ), chosen once at run time by
// with_isa, so a build without -march still runs at memory speed. FMA appears only where it is asked for
// by name (exact squares, the FP64 compensated kernels), never by contraction.
#pragma once

#include <gradclip/detail/census.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/scaled.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if !defined(GRADCLIP_NO_SIMD) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GRADCLIP_X86_DISPATCH 1
#include <immintrin.h>
#else
#define GRADCLIP_X86_DISPATCH 0
#endif

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// The instruction sets gradclip has kernels for, each a superset of the one before.
enum class isa { portable, avx2, avx512 };

/// Whether this CPU (and OS) runs the kernels of `target`.
inline bool isa_supported(isa target) noexcept {
#if GRADCLIP_X86_DISPATCH
  __builtin_cpu_init();
  // Every CPU with AVX2 also has F16C and FMA (Haswell, Excavator and later).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (target) {
    case isa::avx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case isa::avx2:
      return avx2;
    case isa::portable:
      break;
  }
#endif
  return target == isa::portable;
}

/// The widest supported instruction set, detected once at start-up. A namespace-scope variable, so
/// reading it costs no guard; code that runs before it is initialized reads isa::portable, which is
/// always correct.
inline const isa detected_isa = isa_supported(isa::avx512) ? isa::avx512
                                : isa_supported(isa::avx2) ? isa::avx2
                                                           : isa::portable;

inline isa best_isa() noexcept { return detected_isa; }

/// The instruction set of the interleaved accumulation (column_dot): on AVX-512 CPUs the avx2 kernel,
/// whose 256-bit operations issue on three ports instead of two. The pass has as many multiplies, adds
/// and fold shuffles as loads; on the Intel Xeon (model 167) of docs/bench the 512-bit kernel ran it at
/// 0.73-0.75 of a plain read, the 256-bit one at 0.80-0.82. Every target gives the same bits.
inline isa column_dot_isa() noexcept { return best_isa() == isa::avx512 ? isa::avx2 : best_isa(); }

/// Whether the avx512 kernels may round FP32 to BF16 by AVX-512 BF16's instruction (avx512::multiply_bf16);
/// false before it is initialized, which is always correct.
#if GRADCLIP_X86_DISPATCH
inline const bool has_avx512_bf16 = isa_supported(isa::avx512) && __builtin_cpu_supports("avx512bf16");
#else
inline constexpr bool has_avx512_bf16 = false;
#endif

/// Whether the avx512 kernels add FP16 and BF16 magnitudes by AVX-512 VBMI's byte shifts
/// (avx512::add_field_lines); false before it is initialized, which is always correct. Only speed depends
/// on it: test_p_norm_kernels turns it off and compares the bits.
#if GRADCLIP_X86_DISPATCH
inline bool use_avx512_vbmi = isa_supported(isa::avx512) && __builtin_cpu_supports("avx512vbmi");
#else
inline constexpr bool use_avx512_vbmi = false;
#endif

// How far ahead of its loads a streaming kernel asks for lines. One core of an Intel server CPU reads
// from memory at the rate of the misses it keeps in flight; a plain read keeps enough, but a kernel that
// widens and multiplies between its loads keeps fewer, and the hardware prefetchers alone left the norms
// at about 0.65 of the read's speed there (issue 28). A few KiB ahead covers the latency at that rate.
inline constexpr std::size_t prefetch_distance = 2048;

/// How the streaming loops read, chosen by CPU at start-up (issue 28), where the fastest way differs.
/// Measured from memory (64 Mi elements) on one thread, paired against a plain read:
/// - Intel Xeon (family 6 model 167): asking ahead helped every element type, 16-bit loops that widen most
///   4 KiB ahead; BF16 squares summed as 32-bit pairs (block_squares' raw pairs) kept up with the read.
/// - AMD EPYC Zen 5 (family 26): its hardware prefetchers alone keep loops over 4- and 8-byte elements near
///   the read, and asking ahead cost the FP64 norms 10 to 20 % and the FP32 norm a few percent (though
///   128 Ki FP64 elements, 1 MiB, lost 10 % without it); 16-bit loops gain most 8 KiB ahead (binding BF16
///   clip 0.87 of the read at 4 KiB, 0.91 at 8 KiB, less at 16 KiB); and BF16 widened 16 at a time, not
///   as pairs, took the BF16 norm from 0.74 to 0.90 of the read (pairs stay faster in cache: 0.48
///   against 0.42).
/// - AMD EPYC Zen 4 (family 25 model 17): 4- and 8-byte loops as on Zen 5, but asking ahead slowed every
///   16-bit loop, at any distance (the FP16 norm 0.95 of the read without, 0.77 to 0.85 at 2 to 8 KiB; the
///   binding FP16 clip 1.04 of read and rewrite, against 0.91); BF16 pairs as fast as 16 at a time from
///   memory and faster in cache (0.47 of the read against 0.36).
/// Other vendors take Intel's choices, AMD CPUs before family 26 Zen 4's (Zen 3 and older unmeasured). Only
/// speed depends on them: test_kernels sets each and compares the bits.
struct stream_tuning {
  bool wide_prefetch;              ///< whether loops over 4- and 8-byte elements ask ahead
  std::ptrdiff_t narrow_distance;  ///< how far ahead loops that widen 16-bit elements ask, in bytes; 0: not at all
  bool bf16_pairs;                 ///< whether block_squares reads BF16 as 32-bit pairs (where ops allow)
  /// Whether compensated_squares reads a 512-bit vector in one load rather than as two 256-bit halves: in
  /// cache on AMD Zen 4, 0.73-0.76 of a plain read against 0.63-0.66, and as fast from DRAM. Other FP64
  /// loops keep the halves (one load cost the promote norm in cache 0.93 -> 0.86 there); Zen 5, whose
  /// streams ran 1.3x faster with halves (f32::load), is unmeasured.
  bool whole_compensated_loads;

  /// The choices for a CPU of this vendor and family (as CPUID numbers it: 25 for Zen 3 and 4, 26 for Zen 5).
  static constexpr stream_tuning for_cpu(bool amd, unsigned family) noexcept {
    constexpr auto distance = static_cast<std::ptrdiff_t>(prefetch_distance);
    if (!amd) return {true, 2 * distance, true, false};
    return family >= 26 ? stream_tuning{false, 4 * distance, false, false} : stream_tuning{false, 0, true, true};
  }
};

#if GRADCLIP_X86_DISPATCH
/// An AMD CPU's family as CPUID numbers it, for the families the compilers name (K10 to Zen 4), and 26 for
/// any other: Zen 5 and later, which GCC 12 does not name (the low-power families 14h and 16h have no AVX2,
/// so their loops are the portable ones, which no choice touches). Asked of the compilers' CPU model rather
/// than of CPUID itself, so that no gradclip header defines <cpuid.h>'s macros in the user's code.
inline unsigned amd_family() noexcept {
  __builtin_cpu_init();
  if (__builtin_cpu_is("amdfam19h")) return 25;
  if (__builtin_cpu_is("amdfam17h")) return 23;
  if (__builtin_cpu_is("amdfam15h")) return 21;
  if (__builtin_cpu_is("amdfam10h")) return 16;
  return 26;
}
#endif

/// This CPU's choices, set at start-up; code that runs before that reads {false, 0, false, false}, as correct.
#if GRADCLIP_X86_DISPATCH
inline stream_tuning streaming = [] {
  __builtin_cpu_init();
  const bool amd = __builtin_cpu_is("amd");
  return stream_tuning::for_cpu(amd, amd ? amd_family() : 0);
}();
#else
inline stream_tuning streaming = stream_tuning::for_cpu(false, 0);
#endif

/// Asks for the cache lines of [p, p + bytes) moved prefetch_distance ahead, in the vector targets' loops.
/// It changes no value, and the address is formed as an integer: past the buffer's end it is harmless
/// (prefetches never fault). The portable target's loops are left as they are: their steps are an element
/// or two in short runs, and on other architectures the compiler vectorizes them as it sees fit.
template <isa Target>
inline void prefetch_ahead([[maybe_unused]] const void* p, [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (Target != isa::portable) {
    const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) + prefetch_distance;
    for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(first + b));
  }
#endif
}

/// Asks for the cache lines of [p + offset, p + offset + bytes) in the vector targets' loops, the address
/// formed as an integer as in prefetch_ahead: where a sweep reads next is not always prefetch_distance
/// further on (interleaved units read a few lines of each column).
template <isa Target>
inline void prefetch_lines([[maybe_unused]] const void* p, [[maybe_unused]] std::ptrdiff_t offset,
                           [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (Target != isa::portable) {
    const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(offset);
    for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(first + b));
  }
#endif
}

/// fold<G>'s shuffle for output lane `o` of a W-lane vector: the source lane (W and above: the second
/// vector's) of the lower (High false) or upper half of the group that lane o halves.
template <std::size_t W, std::size_t G, bool High>
constexpr int fold_source(std::size_t o) noexcept {
  const std::size_t half = W / 2, r = o % half, g = G / 2;
  return static_cast<int>((o < half ? 0 : W) + (r / g) * G + r % g + (High ? g : 0));
}

/// fold_source's lanes as a table of I, for a vector permute.
template <class I, std::size_t W, std::size_t G, bool High, class Lanes = std::make_index_sequence<W>>
struct fold_sources;
template <class I, std::size_t W, std::size_t G, bool High, std::size_t... O>
struct fold_sources<I, W, G, High, std::index_sequence<O...>> {
  alignas(64) static constexpr I lanes[W] = {static_cast<I>(fold_source<W, G, High>(O))...};
};

// The portable target: scalar operations, never contracted into FMA, so that its squares are rounded
// before they are added as the vector targets' are.
GRADCLIP_FP_CONTRACT_OFF_BEGIN
struct portable {
  static constexpr isa target = isa::portable;

  struct f32 {
    using vec = float;
    static constexpr std::size_t width = 1;
    static constexpr bool bf16_pairs = false;
    static vec zero() noexcept { return 0.0f; }
    static vec set1(float x) noexcept { return x; }
    template <class T>
    static vec load(const T* p) noexcept {
      return widen<float>(*p);
    }
    template <class T>
    static void store(T* p, vec v) noexcept {
      *p = narrow<T>(v);
    }
    static vec add_square(vec acc, vec v) noexcept { return acc + rounded(v * v); }
    static vec add_exact_square(vec acc, vec v) noexcept { return acc + v * v; }  // v * v is exact
    static vec add(vec a, vec b) noexcept { return a + b; }
    static vec mul(vec a, vec b) noexcept { return rounded(a * b); }
    static double to_double(vec v) noexcept { return static_cast<double>(v); }
  };

  struct f64 {
    using vec = double;
    static constexpr bool bf16_pairs = false;
    static constexpr bool reads_fields = false;  ///< whether add_fields exists (see avx512::f64)
    using mask = bool;
    static constexpr std::size_t width = 1;
    static vec zero() noexcept { return 0.0; }
    static vec set1(double x) noexcept { return x; }
    static vec broadcast(double x) noexcept { return x; }
    static double lane(vec v) noexcept { return v; }
    /// The lanes summed pairwise, halves first (sum_lanes's order): the value itself here.
    static double pairwise_sum(vec v) noexcept { return v; }
    template <class T>
    static vec load(const T* p) noexcept {
      return widen<double>(*p);
    }
    static vec load_whole(const double* p) noexcept { return *p; }  // see avx512::f64
    template <class T>
    static void store(T* p, vec v) noexcept {
      *p = narrow<T>(v);
    }
    static vec add(vec a, vec b) noexcept { return a + b; }
    static vec sub(vec a, vec b) noexcept { return a - b; }
    static vec mul(vec a, vec b) noexcept { return rounded(a * b); }
    static vec div(vec a, vec b) noexcept { return a / b; }
    static vec add_square(vec acc, vec v) noexcept { return acc + rounded(v * v); }
    static vec add_exact_square(vec acc, vec v) noexcept { return acc + v * v; }  // v * v is exact
    static vec fmadd(vec a, vec b, vec c) noexcept { return std::fma(a, b, c); }
    static vec fmsub(vec a, vec b, vec c) noexcept { return std::fma(a, b, -c); }
    static vec abs(vec v) noexcept { return std::abs(v); }
    /// acc[k] += |p[k * width + j]| lane by lane, for the N vectors of the p-norm lanes (sum_abs).
    template <class T, std::size_t N>
    static void add_magnitudes(vec (&acc)[N], const T* p) noexcept {
      for (std::size_t k = 0; k < N; ++k) acc[k] = add(acc[k], abs(load(p + k * width)));
    }
    static vec max(vec a, vec b) noexcept { return a > b ? a : b; }  // b where a is NaN, like maxpd
    static double max_lane(vec v) noexcept { return v; }
    /// Bit 0 set where lo <= |v| < hi.
    static unsigned within(vec v, vec lo, vec hi) noexcept { return std::abs(v) >= lo && std::abs(v) < hi ? 1u : 0u; }
    static mask less(vec a, vec b) noexcept { return a < b; }
    static vec select(mask m, vec a, vec b) noexcept { return m ? b : a; }
    static vec keep(mask m, vec v) noexcept { return m ? v : 0.0; }
    static std::uint64_t bits(vec v) noexcept {
      std::uint64_t b;
      std::memcpy(&b, &v, sizeof b);
      return b;
    }
    static vec from_bits(std::uint64_t b) noexcept {
      vec v;
      std::memcpy(&v, &b, sizeof v);
      return v;
    }
    /// The biased exponent field of v >= 0, as a double.
    static vec exponent_field(vec v) noexcept { return static_cast<double>(bits(v) >> 52); }
    /// The significand of a positive normal v, in [1, 2).
    static vec significand(vec v) noexcept { return from_bits((bits(v) & 0x000fffffffffffffu) | 0x3ff0000000000000u); }
    /// 2^n for t = n + 1.5 * 2^52 (n an integer in [-1022, 1023], kept in t's low bits).
    static vec power_of_two(vec t) noexcept { return from_bits((bits(t) + 1023) << 52); }
  };

  struct ints {
    template <class Bits>
    static constexpr std::size_t width = 1;
    using vec = std::uint32_t;
    static vec zero() noexcept { return 0; }
    template <class T>
    static vec load(const T* p) noexcept {
      std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t> b;
      std::memcpy(&b, p, sizeof b);
      return b;
    }
    template <class Bits>
    static vec max_magnitude(vec top, vec b) noexcept {
      return std::max<vec>(top, b & (std::numeric_limits<Bits>::max() >> 1));
    }
    template <class Bits>
    static Bits max_lane(vec v) noexcept {
      return static_cast<Bits>(v);
    }
  };

  // 64-bit integer lanes beside `f64`, for the table terms: bit fields of FP64 values as table indices.
  struct i64 {
    using vec = std::int64_t;
    static vec set1(std::int64_t x) noexcept { return x; }
    static vec of(double v) noexcept { return static_cast<vec>(f64::bits(v)); }
    static double to_f64(vec v) noexcept { return f64::from_bits(static_cast<std::uint64_t>(v)); }
    template <int N>
    static vec shift_right(vec v) noexcept {  // of nonnegative values only
      return v >> N;
    }
    template <int N>
    static vec shift_left(vec v) noexcept {  // of small nonnegative values only
      return v << N;
    }
    static vec add(vec a, vec b) noexcept { return a + b; }
    static vec bit_and(vec a, vec b) noexcept { return a & b; }
    static vec bit_or(vec a, vec b) noexcept { return a | b; }
    static vec keep(bool m, vec v) noexcept { return m ? v : 0; }
    static double gather(const double* base, vec i) noexcept { return base[i]; }
  };

  struct i16 {  // 16-bit magnitudes one at a time
    using vec = std::uint16_t;
    static constexpr std::size_t width = 1;
    static vec zero() noexcept { return 0; }
    static vec set1(std::uint16_t x) noexcept { return x; }
    template <class T>
    static vec load(const T* p) noexcept {
      return Eigen::numext::bit_cast<std::uint16_t>(*p);
    }
    static vec magnitude(vec v) noexcept { return static_cast<vec>(v & 0x7fffu); }
    static vec minus_one(vec v) noexcept { return static_cast<vec>(v - 1u); }  // 0 wraps to 0xffff
    static vec max(vec a, vec b) noexcept { return std::max(a, b); }
    static vec min(vec a, vec b) noexcept { return std::min(a, b); }
    static std::uint16_t max_lane(vec v) noexcept { return v; }
    static std::uint16_t min_lane(vec v) noexcept { return v; }
  };

#include <gradclip/detail/kernels.inc>
#include <gradclip/detail/update_kernels.inc>
};
GRADCLIP_FP_CONTRACT_OFF_END

#if GRADCLIP_X86_DISPATCH

// Each target's struct compiles its functions for one instruction set; nothing in them runs unless
// with_isa chose it. No contraction into FMA: squares are rounded before they are added, as in the
// portable target, so a result does not depend on the instruction set.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")  // FMA (in AVX-512F too) would skip the rounding of squares
// GCC 12's intrinsics build their "undefined" vectors from themselves (bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
struct avx2 {
  /// config.hpp's rounded, compiled for this target: its vectors need the target's registers.
  template <class V>
  static V rounded(V x) noexcept {
    GRADCLIP_OPAQUE(x);
    return x;
  }

  static constexpr isa target = isa::avx2;

  struct f32 {
    using vec = __m256;
    static constexpr std::size_t width = 8;
    static vec zero() noexcept { return _mm256_setzero_ps(); }
    static vec set1(float x) noexcept { return _mm256_set1_ps(x); }
    static vec load(const float* p) noexcept { return _mm256_loadu_ps(p); }
    static vec load(const Eigen::half* p) noexcept {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static vec load(const Eigen::bfloat16* p) noexcept {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static void store(float* p, vec v) noexcept { _mm256_storeu_ps(p, v); }
    static void store(Eigen::half* p, vec v) noexcept {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    // Eigen's rounding: add 0x7fff plus the lowest kept bit, truncate; NaN becomes a signed quiet NaN.
    static void store(Eigen::bfloat16* p, vec v) noexcept {
      const __m256i bits = _mm256_castps_si256(v);
      const __m256i high = _mm256_srli_epi32(bits, 16);
      const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
      const __m256i nearest = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
      const __m256i quiet =
          _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256i result = _mm256_blendv_epi8(nearest, quiet, nan);
      // packus works per 128-bit half: gather the two low quadwords.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    }
    static vec add_square(vec acc, vec v) noexcept { return _mm256_add_ps(acc, rounded(_mm256_mul_ps(v, v))); }
    static vec add_exact_square(vec acc, vec v) noexcept { return _mm256_fmadd_ps(v, v, acc); }  // one rounding
    static constexpr bool bf16_pairs = true;
    // BF16 pairs in 32-bit lanes: the low and the high elements as FP32.
    static vec low_halves(__m256i pairs) noexcept { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
    static vec high_halves(__m256i pairs) noexcept {
      return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    /// Even and odd elements' lanes back to element order: a holds elements 0-7, b elements 8-15.
    static void interleave(vec& a, vec& b) noexcept {
      const vec low = _mm256_unpacklo_ps(a, b), high = _mm256_unpackhi_ps(a, b);
      a = _mm256_permute2f128_ps(low, high, 0x20);
      b = _mm256_permute2f128_ps(low, high, 0x31);
    }
    /// a and b as groups of G lanes, each one sum's lanes: the groups halved, a's then b's, lane k of a
    /// halved group being group[k] + group[k + G / 2] (the lower first), as sum_lanes adds them.
    template <std::size_t G>
    static vec fold(vec a, vec b) noexcept {
      static_assert(G == 2 || G == 4 || G == 8, "a group is 2, 4 or 8 lanes");
      if constexpr (G == 8) {
        return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
      } else {
        // Within each 128-bit half: a's lower halves of groups, b's, then the upper halves; the sums come
        // out as a0 b0 | a1 b1 (64 bits each) and the quadword shuffle puts a's first.
        constexpr int low = G == 4 ? 0x44 : 0x88, high = G == 4 ? 0xee : 0xdd;
        const vec s = _mm256_add_ps(_mm256_shuffle_ps(a, b, low), _mm256_shuffle_ps(a, b, high));
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xd8));
      }
    }
    static __m256d widen_low(vec v) noexcept { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
    static __m256d widen_high(vec v) noexcept { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
    /// The lanes of low, then of high, each rounded to FP32 to odd (round_to_odd_float's bits): rounded to
    /// nearest, stepped back one toward zero where that went away from zero (the truncation), and its last
    /// bit set where inexact. NaN stays as rounding left it.
    static vec round_to_odd(__m256d low, __m256d high) noexcept { return _mm256_set_m128(to_odd(high), to_odd(low)); }
    static __m128 to_odd(__m256d v) noexcept {
      const __m128 nearest = _mm256_cvtpd_ps(v);
      const __m256d back = _mm256_cvtps_pd(nearest), sign = _mm256_set1_pd(-0.0);
      const __m256d away = _mm256_cmp_pd(_mm256_andnot_pd(sign, back), _mm256_andnot_pd(sign, v), _CMP_GT_OQ);
      const __m256d inexact = _mm256_cmp_pd(back, v, _CMP_NEQ_OQ);
      const __m128i truncated = _mm_add_epi32(_mm_castps_si128(nearest), lane_masks(away));  // -1 where away
      return _mm_castsi128_ps(_mm_or_si128(truncated, _mm_and_si128(lane_masks(inexact), _mm_set1_epi32(1))));
    }
    /// Four 64-bit lane masks as four 32-bit ones.
    static __m128i lane_masks(__m256d m) noexcept {
      const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
      return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(m), low_halves));
    }
    static vec mul(vec a, vec b) noexcept { return rounded(_mm256_mul_ps(a, b)); }
    static vec add(vec a, vec b) noexcept { return _mm256_add_ps(a, b); }
  };

  struct f64 {
    using vec = __m256d;
    static constexpr bool bf16_pairs = false;
    static constexpr bool reads_fields = true;
    static constexpr std::size_t width = 4;
    static vec zero() noexcept { return _mm256_setzero_pd(); }
    static vec set1(double x) noexcept { return _mm256_set1_pd(x); }
    static vec load(const double* p) noexcept { return _mm256_loadu_pd(p); }
    static vec load_whole(const double* p) noexcept { return load(p); }  // see avx512::f64
    static vec load(const float* p) noexcept { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
    static vec load(const Eigen::half* p) noexcept {
      return _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static vec load(const Eigen::bfloat16* p) noexcept {
      const __m128i wide = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(wide, 16)));
    }
    static void store(double* p, vec v) noexcept { _mm256_storeu_pd(p, v); }
    static void store(float* p, vec v) noexcept { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
    static vec add_square(vec acc, vec v) noexcept { return _mm256_add_pd(acc, rounded(_mm256_mul_pd(v, v))); }
    static vec add(vec a, vec b) noexcept { return _mm256_add_pd(a, b); }
    template <std::size_t G>  // see f32::fold
    static vec fold(vec a, vec b) noexcept {
      static_assert(G == 2 || G == 4, "a group is 2 or 4 lanes");
      if constexpr (G == 4) {
        return _mm256_add_pd(_mm256_permute2f128_pd(a, b, 0x20), _mm256_permute2f128_pd(a, b, 0x31));
      } else {
        const vec s = _mm256_add_pd(_mm256_unpacklo_pd(a, b), _mm256_unpackhi_pd(a, b));
        return _mm256_permute4x64_pd(s, 0xd8);
      }
    }
    static vec mul(vec a, vec b) noexcept { return rounded(_mm256_mul_pd(a, b)); }
    static vec abs(vec v) noexcept { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), v); }
    template <class T, std::size_t N>  // see portable::f64
    static void add_magnitudes(vec (&acc)[N], const T* p) noexcept {
      for (std::size_t k = 0; k < N; ++k) acc[k] = add(acc[k], abs(load(p + k * width)));
    }
    /// 16 FP16 or BF16 magnitudes added as FP64 bit fields: see avx512::f64::add_fields.
    using field_bits = __m256i;
    template <class T>
    static void add_fields(vec (&acc)[4], const T* p, field_bits& top) noexcept {
      constexpr int shift = 53 - std::numeric_limits<T>::digits;
      const __m256i bits = i16::magnitude(i16::load(p));
      top = i16::max(top, bits);
      const __m128i low = _mm256_castsi256_si128(bits), high = _mm256_extracti128_si256(bits, 1);
      acc[0] = add(acc[0], fields<shift>(low));
      acc[1] = add(acc[1], fields<shift>(_mm_srli_si128(low, 8)));
      acc[2] = add(acc[2], fields<shift>(high));
      acc[3] = add(acc[3], fields<shift>(_mm_srli_si128(high, 8)));
    }
    template <int Shift>  // (not a lambda: GCC compiles lambdas without their region's target)
    static vec fields(__m128i four) noexcept {
      return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepu16_epi64(four), Shift));
    }
    static std::uint16_t top_field(field_bits top) noexcept { return i16::max_lane(top); }
    static vec max(vec a, vec b) noexcept { return _mm256_max_pd(a, b); }
    static vec fmadd(vec a, vec b, vec c) noexcept { return _mm256_fmadd_pd(a, b, c); }  // a b + c, one rounding
    static vec add_exact_square(vec acc, vec v) noexcept { return _mm256_fmadd_pd(v, v, acc); }
    static vec fmsub(vec a, vec b, vec c) noexcept { return _mm256_fmsub_pd(a, b, c); }  // a b - c, one rounding
    /// Bit j set where lo <= |v_j| < hi.
    static unsigned within(vec v, vec lo, vec hi) noexcept {
      const vec a = abs(v);
      return static_cast<unsigned>(
          _mm256_movemask_pd(_mm256_and_pd(_mm256_cmp_pd(a, lo, _CMP_GE_OQ), _mm256_cmp_pd(a, hi, _CMP_LT_OQ))));
    }
    static double max_lane(vec v) noexcept {
      const __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
      return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
    }
    // For the p-norm loops and divide (see scalar::f64).
    using mask = __m256d;
    static vec broadcast(double x) noexcept { return _mm256_set1_pd(x); }
    static double lane(vec v) noexcept { return _mm256_cvtsd_f64(v); }
    static double pairwise_sum(vec v) noexcept {  // see portable::f64
      const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
      return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    }
    static vec sub(vec a, vec b) noexcept { return _mm256_sub_pd(a, b); }
    static vec div(vec a, vec b) noexcept { return _mm256_div_pd(a, b); }
    static mask less(vec a, vec b) noexcept { return _mm256_cmp_pd(a, b, _CMP_LT_OQ); }
    static vec select(mask m, vec a, vec b) noexcept { return _mm256_blendv_pd(a, b, m); }
    static vec keep(mask m, vec v) noexcept { return _mm256_and_pd(m, v); }
    static vec exponent_field(vec v) noexcept {  // the field in the low bits of 2^52 + field, then 2^52 off
      const __m256i field = _mm256_srli_epi64(_mm256_castpd_si256(v), 52);
      const __m256i biased = _mm256_or_si256(field, _mm256_set1_epi64x(0x4330000000000000));
      return _mm256_sub_pd(_mm256_castsi256_pd(biased), _mm256_set1_pd(0x1p52));
    }
    static vec significand(vec v) noexcept {
      const __m256i bits = _mm256_and_si256(_mm256_castpd_si256(v), _mm256_set1_epi64x(0x000fffffffffffff));
      return _mm256_castsi256_pd(_mm256_or_si256(bits, _mm256_set1_epi64x(0x3ff0000000000000)));
    }
    static vec power_of_two(vec t) noexcept {
      const __m256i biased = _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023));
      return _mm256_castsi256_pd(_mm256_slli_epi64(biased, 52));
    }
  };

  struct ints {
    using vec = __m256i;
    template <class Bits>
    static constexpr std::size_t width = 32 / sizeof(Bits);
    static vec zero() noexcept { return _mm256_setzero_si256(); }
    static vec load(const void* p) noexcept { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
    // Magnitudes fit in 15 or 31 bits, so the signed maximum works.
    template <class Bits>
    static vec max_magnitude(vec top, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm256_max_epi16(top, _mm256_and_si256(b, _mm256_set1_epi16(0x7fff)));
      else
        return _mm256_max_epi32(top, _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)));
    }
    template <class Bits>
    static Bits max_lane(vec v) noexcept {
      Bits all[width<Bits>];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(all), v);
      return *std::max_element(all, all + width<Bits>);
    }
  };

  struct i64 {
    using vec = __m256i;
    static vec set1(std::int64_t x) noexcept { return _mm256_set1_epi64x(x); }
    static vec of(__m256d v) noexcept { return _mm256_castpd_si256(v); }
    static __m256d to_f64(vec v) noexcept { return _mm256_castsi256_pd(v); }
    template <int N>
    static vec shift_right(vec v) noexcept {
      return _mm256_srli_epi64(v, N);
    }
    template <int N>
    static vec shift_left(vec v) noexcept {
      return _mm256_slli_epi64(v, N);
    }
    static vec add(vec a, vec b) noexcept { return _mm256_add_epi64(a, b); }
    static vec bit_and(vec a, vec b) noexcept { return _mm256_and_si256(a, b); }
    static vec bit_or(vec a, vec b) noexcept { return _mm256_or_si256(a, b); }
    static vec keep(__m256d m, vec v) noexcept { return _mm256_and_si256(_mm256_castpd_si256(m), v); }
    static __m256d gather(const double* base, vec i) noexcept { return _mm256_i64gather_pd(base, i, 8); }
  };
  struct i16 {  // unsigned 16-bit lanes
    using vec = __m256i;
    static constexpr std::size_t width = 16;
    static vec zero() noexcept { return _mm256_setzero_si256(); }
    static vec set1(std::uint16_t x) noexcept { return _mm256_set1_epi16(static_cast<short>(x)); }
    static vec load(const void* p) noexcept { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
    static vec magnitude(vec v) noexcept { return _mm256_and_si256(v, _mm256_set1_epi16(0x7fff)); }
    static vec minus_one(vec v) noexcept { return _mm256_sub_epi16(v, _mm256_set1_epi16(1)); }
    static vec max(vec a, vec b) noexcept { return _mm256_max_epu16(a, b); }
    static vec min(vec a, vec b) noexcept { return _mm256_min_epu16(a, b); }
    static std::uint16_t max_lane(vec v) noexcept {
      return reduce(v, [](auto a, auto b) { return std::max(a, b); });
    }
    static std::uint16_t min_lane(vec v) noexcept {
      return reduce(v, [](auto a, auto b) { return std::min(a, b); });
    }
    template <class Op>
    static std::uint16_t reduce(vec v, Op op) noexcept {
      std::uint16_t all[width];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(all), v);
      std::uint16_t r = all[0];
      for (std::uint16_t x : all) r = op(r, x);
      return r;
    }
  };

  /// The census's lanes (options::report): T-wide signed integers holding an element's bits, counted
  /// where a compare holds. Magnitudes (bits & mask) are nonnegative, so signed compares order them.
  template <class Bits>
  struct tally {
    using vec = __m256i;
    static constexpr std::size_t width = 32 / sizeof(Bits);
    static vec zero() noexcept { return _mm256_setzero_si256(); }
    static vec set1(Bits x) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm256_set1_epi16(x);
      else if constexpr (sizeof(Bits) == 4)
        return _mm256_set1_epi32(x);
      else
        return _mm256_set1_epi64x(x);
    }
    static vec load(const void* p) noexcept { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
    static vec bit_and(vec a, vec b) noexcept { return _mm256_and_si256(a, b); }
    static vec equal(vec a, vec b) noexcept {  // all ones where a == b
      if constexpr (sizeof(Bits) == 2)
        return _mm256_cmpeq_epi16(a, b);
      else if constexpr (sizeof(Bits) == 4)
        return _mm256_cmpeq_epi32(a, b);
      else
        return _mm256_cmpeq_epi64(a, b);
    }
    static vec greater(vec a, vec b) noexcept {  // all ones where a > b
      if constexpr (sizeof(Bits) == 2)
        return _mm256_cmpgt_epi16(a, b);
      else if constexpr (sizeof(Bits) == 4)
        return _mm256_cmpgt_epi32(a, b);
      else
        return _mm256_cmpgt_epi64(a, b);
    }
    static vec minus(vec a, vec b) noexcept {  // a - b; all ones is -1
      if constexpr (sizeof(Bits) == 2)
        return _mm256_sub_epi16(a, b);
      else if constexpr (sizeof(Bits) == 4)
        return _mm256_sub_epi32(a, b);
      else
        return _mm256_sub_epi64(a, b);
    }
    static vec count_equal(vec counts, vec a, vec b) noexcept { return minus(counts, equal(a, b)); }
    static vec count_less(vec counts, vec a, vec b) noexcept { return minus(counts, greater(b, a)); }
    static vec max(vec a, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm256_max_epi16(a, b);
      else if constexpr (sizeof(Bits) == 4)
        return _mm256_max_epi32(a, b);
      else
        return _mm256_blendv_epi8(a, b, greater(b, a));
    }
    static std::size_t sum_lanes(vec v) noexcept {
      Bits all[width];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(all), v);
      std::size_t sum = 0;
      for (const Bits x : all) sum += static_cast<std::size_t>(x);
      return sum;
    }
    static Bits max_lane(vec v) noexcept {
      Bits all[width];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(all), v);
      return *std::max_element(all, all + width);
    }
  };

  /// The census's magnitudes in an accumulator's lanes (f32::vec or f64::vec; census_lanes in
  /// census_lanes.inc): the largest and least |v| of the values a sum of squares has just widened, so that
  /// counting loads nothing again.
  struct magnitudes {
    /// top = max(top, |v|), low = min(low, |v|), lane by lane.
    static void take(__m256& top, __m256& low, __m256 v) noexcept {
      const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
      top = _mm256_max_ps(top, a);
      low = _mm256_min_ps(low, a);
    }
    static void take(__m256d& top, __m256d& low, __m256d v) noexcept {
      const __m256d a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), v);
      top = _mm256_max_pd(top, a);
      low = _mm256_min_pd(low, a);
    }
    static bool any_below(__m256 v, __m256 x) noexcept {
      return _mm256_movemask_ps(_mm256_cmp_ps(v, x, _CMP_LT_OQ)) != 0;
    }
    static __m256 max(__m256 a, __m256 b) noexcept { return _mm256_max_ps(a, b); }
    static __m256d max(__m256d a, __m256d b) noexcept { return _mm256_max_pd(a, b); }
    static bool any_below(__m256d v, __m256d x) noexcept {
      return _mm256_movemask_pd(_mm256_cmp_pd(v, x, _CMP_LT_OQ)) != 0;
    }
    static double max_lane(__m256 v) noexcept {
      const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
      return static_cast<double>(_mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t))));
    }
    static double max_lane(__m256d v) noexcept { return f64::max_lane(v); }
  };

#include <gradclip/detail/kernels.inc>
#include <gradclip/detail/update_kernels.inc>

#include <gradclip/detail/census_lanes.inc>  // uses kernels.inc's functions
};
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")
#pragma GCC optimize("fp-contract=off")
#endif
// The masked (maskz) forms of the intrinsics: GCC 12's unmasked ones start from an "undefined" vector
// that -Wmaybe-uninitialized reports wherever they are inlined (GCC bug 105593).
struct avx512 {
  /// config.hpp's rounded, compiled for this target: its vectors need the target's registers.
  template <class V>
  static V rounded(V x) noexcept {
    GRADCLIP_OPAQUE(x);
    return x;
  }

  static constexpr isa target = isa::avx512;

  struct f32 {
    using vec = __m512;
    static constexpr std::size_t width = 16;
    static vec zero() noexcept { return _mm512_setzero_ps(); }
    static vec set1(float x) noexcept { return _mm512_set1_ps(x); }
    // Two 256-bit loads: streaming from DRAM they ran 1.3x faster than one 512-bit load on the AMD
    // EPYC (Zen 5) that the benchmarks come from, and no slower in cache.
    static vec load(const float* p) noexcept {
      return _mm512_insertf32x8(_mm512_zextps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 8), 1);
    }
    static vec load(const Eigen::half* p) noexcept {
      return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static vec load(const Eigen::bfloat16* p) noexcept {
      const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, wide, 16));
    }
    static void store(float* p, vec v) noexcept { _mm512_storeu_ps(p, v); }
    static void store(Eigen::half* p, vec v) noexcept {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT));
    }
    static void store(Eigen::bfloat16* p, vec v) noexcept {  // see avx2::f32
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i high = _mm512_maskz_srli_epi32(0xffff, bits, 16);
      const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
      const __m512i nearest = _mm512_maskz_srli_epi32(0xffff, _mm512_add_epi32(bits, bias), 16);
      const __m512i quiet =
          _mm512_or_si512(_mm512_and_si512(high, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
      const __m512i result = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nearest, quiet);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(0xffff, result));
    }
    static vec add_square(vec acc, vec v) noexcept { return _mm512_add_ps(acc, rounded(_mm512_mul_ps(v, v))); }
    static vec add_exact_square(vec acc, vec v) noexcept { return _mm512_fmadd_ps(v, v, acc); }  // one rounding
    static constexpr bool bf16_pairs = true;
    static vec low_halves(__m512i pairs) noexcept {  // see avx2::f32
      return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, pairs, 16));
    }
    static vec high_halves(__m512i pairs) noexcept {
      return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    static void interleave(vec& a, vec& b) noexcept {
      const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
      const vec first = _mm512_permutex2var_ps(a, low, b);
      b = _mm512_permutex2var_ps(a, high, b);
      a = first;
    }
    static __m512d widen_low(vec v) noexcept { return _mm512_maskz_cvtps_pd(0xff, _mm512_castps512_ps256(v)); }
    static __m512d widen_high(vec v) noexcept {
      return _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 1));
    }
    /// The lanes of low, then of high, each rounded to FP32 to odd: see avx2::f32::round_to_odd.
    static vec round_to_odd(__m512d low, __m512d high) noexcept {
      return _mm512_insertf32x8(_mm512_zextps256_ps512(to_odd(low)), to_odd(high), 1);
    }
    static __m256 to_odd(__m512d v) noexcept {
      const __m256 nearest = _mm512_maskz_cvtpd_ps(0xff, v);
      const __m512d back = _mm512_maskz_cvtps_pd(0xff, nearest);
      const __mmask8 away = _mm512_cmp_pd_mask(_mm512_abs_pd(back), _mm512_abs_pd(v), _CMP_GT_OQ);
      const __mmask8 inexact = _mm512_cmp_pd_mask(back, v, _CMP_NEQ_OQ);
      const __m256i one = _mm256_set1_epi32(1), bits = _mm256_castps_si256(nearest);
      const __m256i truncated = _mm256_mask_sub_epi32(bits, away, bits, one);
      return _mm256_castsi256_ps(_mm256_mask_or_epi32(truncated, inexact, truncated, one));
    }
    static vec mul(vec a, vec b) noexcept { return rounded(_mm512_mul_ps(a, b)); }
    static vec add(vec a, vec b) noexcept { return _mm512_add_ps(a, b); }
    template <std::size_t G>  // see avx2::f32::fold
    static vec fold(vec a, vec b) noexcept {
      static_assert(G == 2 || G == 4 || G == 8 || G == 16, "a group is 2, 4, 8 or 16 lanes");
      const __m512i low = _mm512_loadu_si512(fold_sources<std::int32_t, width, G, false>::lanes);
      const __m512i high = _mm512_loadu_si512(fold_sources<std::int32_t, width, G, true>::lanes);
      return _mm512_add_ps(_mm512_permutex2var_ps(a, low, b), _mm512_permutex2var_ps(a, high, b));
    }
  };

  struct f64 {
    using vec = __m512d;
    static constexpr bool bf16_pairs = false;
    static constexpr bool reads_fields = true;
    static constexpr std::size_t width = 8;
    static vec zero() noexcept { return _mm512_setzero_pd(); }
    static vec set1(double x) noexcept { return _mm512_set1_pd(x); }
    static vec load(const double* p) noexcept {  // see f32::load
      return _mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_loadu_pd(p)), _mm256_loadu_pd(p + 4), 1);
    }
    /// One 512-bit load, for the loop that stream_tuning::whole_compensated_loads names.
    static vec load_whole(const double* p) noexcept { return _mm512_loadu_pd(p); }
    static vec load(const float* p) noexcept { return _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(p)); }
    static vec load(const Eigen::half* p) noexcept {
      return _mm512_maskz_cvtps_pd(0xff, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static vec load(const Eigen::bfloat16* p) noexcept {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_maskz_cvtps_pd(0xff, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    static void store(double* p, vec v) noexcept { _mm512_storeu_pd(p, v); }
    static void store(float* p, vec v) noexcept { _mm256_storeu_ps(p, _mm512_maskz_cvtpd_ps(0xff, v)); }
    static vec add_square(vec acc, vec v) noexcept { return _mm512_add_pd(acc, rounded(_mm512_mul_pd(v, v))); }
    static vec add(vec a, vec b) noexcept { return _mm512_add_pd(a, b); }
    template <std::size_t G>  // see avx2::f32::fold
    static vec fold(vec a, vec b) noexcept {
      static_assert(G == 2 || G == 4 || G == 8, "a group is 2, 4 or 8 lanes");
      const __m512i low = _mm512_loadu_si512(fold_sources<std::int64_t, width, G, false>::lanes);
      const __m512i high = _mm512_loadu_si512(fold_sources<std::int64_t, width, G, true>::lanes);
      return _mm512_add_pd(_mm512_permutex2var_pd(a, low, b), _mm512_permutex2var_pd(a, high, b));
    }
    static vec mul(vec a, vec b) noexcept { return rounded(_mm512_mul_pd(a, b)); }
    static vec abs(vec v) noexcept { return _mm512_abs_pd(v); }
    template <class T, std::size_t N>  // see portable::f64
    static void add_magnitudes(vec (&acc)[N], const T* p) noexcept {
      for (std::size_t k = 0; k < N; ++k) acc[k] = add(acc[k], abs(load(p + k * width)));
    }
    /// 16 FP16 or BF16 magnitudes added as FP64 bit fields (field_sum in kernels.inc: each lane gets its
    /// element's value times a power of two): an integer widening and a shift per 8 elements instead of
    /// two conversions. `top` keeps the largest magnitude's bits, so that field_sum sees Inf and NaN.
    using field_bits = __m256i;
    template <class T>
    static void add_fields(vec (&acc)[2], const T* p, field_bits& top) noexcept {
      constexpr int shift = 53 - std::numeric_limits<T>::digits;  // T's significand's top bit to FP64's
      const __m256i bits = avx2::i16::magnitude(avx2::i16::load(p));
      top = avx2::i16::max(top, bits);
      acc[0] = add(acc[0], fields<shift>(_mm256_castsi256_si128(bits)));
      acc[1] = add(acc[1], fields<shift>(_mm256_extracti128_si256(bits, 1)));
    }
    template <int Shift>  // (not a lambda: GCC compiles lambdas without their region's target)
    static vec fields(__m128i eight) noexcept {
      return _mm512_castsi512_pd(_mm512_maskz_slli_epi64(0xff, _mm512_maskz_cvtepu16_epi64(0xff, eight), Shift));
    }
    static std::uint16_t top_field(field_bits top) noexcept { return avx2::i16::max_lane(top); }
    static vec max(vec a, vec b) noexcept { return _mm512_maskz_max_pd(0xff, a, b); }
    static vec fmadd(vec a, vec b, vec c) noexcept { return _mm512_fmadd_pd(a, b, c); }
    static vec add_exact_square(vec acc, vec v) noexcept { return _mm512_fmadd_pd(v, v, acc); }
    static vec fmsub(vec a, vec b, vec c) noexcept { return _mm512_fmsub_pd(a, b, c); }
    static unsigned within(vec v, vec lo, vec hi) noexcept {
      const vec a = abs(v);
      return _mm512_mask_cmp_pd_mask(_mm512_cmp_pd_mask(a, lo, _CMP_GE_OQ), a, hi, _CMP_LT_OQ);
    }
    static double max_lane(vec v) noexcept {  // the halves' maximum, then avx2's shuffles
      return avx2::f64::max_lane(_mm256_max_pd(_mm512_castpd512_pd256(v), _mm512_maskz_extractf64x4_pd(0xf, v, 1)));
    }
    // For the p-norm loops and divide (see scalar::f64).
    using mask = __mmask8;
    static vec broadcast(double x) noexcept { return _mm512_set1_pd(x); }
    static double lane(vec v) noexcept { return _mm512_cvtsd_f64(v); }
    static double pairwise_sum(vec v) noexcept {  // see portable::f64
      return avx2::f64::pairwise_sum(_mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_maskz_extractf64x4_pd(0xf, v, 1)));
    }
    static vec sub(vec a, vec b) noexcept { return _mm512_sub_pd(a, b); }
    static vec div(vec a, vec b) noexcept { return _mm512_div_pd(a, b); }
    static mask less(vec a, vec b) noexcept { return _mm512_cmp_pd_mask(a, b, _CMP_LT_OQ); }
    static vec select(mask m, vec a, vec b) noexcept { return _mm512_mask_blend_pd(m, a, b); }
    static vec keep(mask m, vec v) noexcept { return _mm512_maskz_mov_pd(m, v); }
    static vec exponent_field(vec v) noexcept {  // see avx2::f64
      const __m512i field = _mm512_maskz_srli_epi64(0xff, _mm512_castpd_si512(v), 52);
      const __m512i biased = _mm512_or_si512(field, _mm512_set1_epi64(0x4330000000000000));
      return _mm512_sub_pd(_mm512_castsi512_pd(biased), _mm512_set1_pd(0x1p52));
    }
    static vec significand(vec v) noexcept {
      const __m512i bits = _mm512_and_si512(_mm512_castpd_si512(v), _mm512_set1_epi64(0x000fffffffffffff));
      return _mm512_castsi512_pd(_mm512_or_si512(bits, _mm512_set1_epi64(0x3ff0000000000000)));
    }
    static vec power_of_two(vec t) noexcept {
      const __m512i biased = _mm512_add_epi64(_mm512_castpd_si512(t), _mm512_set1_epi64(1023));
      return _mm512_castsi512_pd(_mm512_maskz_slli_epi64(0xff, biased, 52));
    }
  };

  struct ints {
    using vec = __m512i;
    template <class Bits>
    static constexpr std::size_t width = 64 / sizeof(Bits);
    static vec zero() noexcept { return _mm512_setzero_si512(); }
    static vec load(const void* p) noexcept { return _mm512_loadu_si512(p); }
    template <class Bits>  // see avx2::ints
    static vec max_magnitude(vec top, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm512_max_epi16(top, _mm512_and_si512(b, _mm512_set1_epi16(0x7fff)));
      else
        return _mm512_max_epi32(top, _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)));
    }
    template <class Bits>
    static Bits max_lane(vec v) noexcept {
      Bits all[width<Bits>];
      _mm512_storeu_si512(all, v);
      return *std::max_element(all, all + width<Bits>);
    }
  };

  struct i64 {
    using vec = __m512i;
    static vec set1(std::int64_t x) noexcept { return _mm512_set1_epi64(x); }
    static vec of(__m512d v) noexcept { return _mm512_castpd_si512(v); }
    static __m512d to_f64(vec v) noexcept { return _mm512_castsi512_pd(v); }
    template <int N>  // the masked forms: see simd.hpp (GCC bug 105593)
    static vec shift_right(vec v) noexcept {
      return _mm512_maskz_srli_epi64(0xff, v, N);
    }
    template <int N>
    static vec shift_left(vec v) noexcept {
      return _mm512_maskz_slli_epi64(0xff, v, N);
    }
    static vec add(vec a, vec b) noexcept { return _mm512_add_epi64(a, b); }
    static vec bit_and(vec a, vec b) noexcept { return _mm512_and_si512(a, b); }
    static vec bit_or(vec a, vec b) noexcept { return _mm512_or_si512(a, b); }
    static vec keep(__mmask8 m, vec v) noexcept { return _mm512_maskz_mov_epi64(m, v); }
    // Without optimization GCC's gather is a macro that passes the mask on as a plain char, which
    // -Wsign-conversion reports at the user's call site.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif
    static __m512d gather(const double* base, vec i) noexcept {
      return _mm512_mask_i64gather_pd(_mm512_setzero_pd(), 0xff, i, base, 8);
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  };
  struct i16 {  // see avx2::i16
    using vec = __m512i;
    static constexpr std::size_t width = 32;
    static vec zero() noexcept { return _mm512_setzero_si512(); }
    static vec set1(std::uint16_t x) noexcept { return _mm512_set1_epi16(static_cast<short>(x)); }
    static vec load(const void* p) noexcept { return _mm512_loadu_si512(p); }
    static vec magnitude(vec v) noexcept { return _mm512_and_si512(v, _mm512_set1_epi16(0x7fff)); }
    static vec minus_one(vec v) noexcept { return _mm512_sub_epi16(v, _mm512_set1_epi16(1)); }
    static vec max(vec a, vec b) noexcept { return _mm512_max_epu16(a, b); }
    static vec min(vec a, vec b) noexcept { return _mm512_min_epu16(a, b); }
    static std::uint16_t max_lane(vec v) noexcept {
      return avx2::i16::max_lane(_mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
    }
    static std::uint16_t min_lane(vec v) noexcept {
      return avx2::i16::min_lane(_mm256_min_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
    }
  };

  template <class Bits>  // see avx2::tally; compares give masks, counts are masked adds
  struct tally {
    using vec = __m512i;
    static constexpr std::size_t width = 64 / sizeof(Bits);
    static vec zero() noexcept { return _mm512_setzero_si512(); }
    static vec set1(Bits x) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm512_set1_epi16(x);
      else if constexpr (sizeof(Bits) == 4)
        return _mm512_set1_epi32(x);
      else
        return _mm512_set1_epi64(x);
    }
    static vec load(const void* p) noexcept { return _mm512_loadu_si512(p); }
    static vec bit_and(vec a, vec b) noexcept { return _mm512_and_si512(a, b); }
    static vec count_equal(vec counts, vec a, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm512_mask_add_epi16(counts, _mm512_cmpeq_epi16_mask(a, b), counts, _mm512_set1_epi16(1));
      else if constexpr (sizeof(Bits) == 4)
        return _mm512_mask_add_epi32(counts, _mm512_cmpeq_epi32_mask(a, b), counts, _mm512_set1_epi32(1));
      else
        return _mm512_mask_add_epi64(counts, _mm512_cmpeq_epi64_mask(a, b), counts, _mm512_set1_epi64(1));
    }
    static vec count_less(vec counts, vec a, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm512_mask_add_epi16(counts, _mm512_cmplt_epi16_mask(a, b), counts, _mm512_set1_epi16(1));
      else if constexpr (sizeof(Bits) == 4)
        return _mm512_mask_add_epi32(counts, _mm512_cmplt_epi32_mask(a, b), counts, _mm512_set1_epi32(1));
      else
        return _mm512_mask_add_epi64(counts, _mm512_cmplt_epi64_mask(a, b), counts, _mm512_set1_epi64(1));
    }
    static vec max(vec a, vec b) noexcept {
      if constexpr (sizeof(Bits) == 2)
        return _mm512_maskz_max_epi16(0xffffffff, a, b);
      else if constexpr (sizeof(Bits) == 4)
        return _mm512_maskz_max_epi32(0xffff, a, b);
      else
        return _mm512_maskz_max_epi64(0xff, a, b);
    }
    static std::size_t sum_lanes(vec v) noexcept {
      Bits all[width];
      _mm512_storeu_si512(all, v);
      std::size_t sum = 0;
      for (const Bits x : all) sum += static_cast<std::size_t>(x);
      return sum;
    }
    static Bits max_lane(vec v) noexcept {
      Bits all[width];
      _mm512_storeu_si512(all, v);
      return *std::max_element(all, all + width);
    }
  };

  // vrangeps and vrangepd (AVX-512DQ) give max(|a|, |b|) or min(|a|, |b|) in one instruction: imm8 bits
  // 1:0 select the larger (11) or smaller (10) magnitude, bits 3:2 = 10 clear its sign.
  struct magnitudes {  // see avx2::magnitudes
    // Without optimization GCC's range intrinsics are macros that pass the mask on as a signed integer,
    // which -Wsign-conversion reports at the user's call site (as for i64::gather).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
#endif
    static void take(__m512& top, __m512& low, __m512 v) noexcept {
      top = _mm512_maskz_range_ps(0xffff, top, v, 0x0b);
      low = _mm512_maskz_range_ps(0xffff, low, v, 0x0a);
    }
    static void take(__m512d& top, __m512d& low, __m512d v) noexcept {
      top = _mm512_maskz_range_pd(0xff, top, v, 0x0b);
      low = _mm512_maskz_range_pd(0xff, low, v, 0x0a);
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
    static bool any_below(__m512 v, __m512 x) noexcept { return _mm512_cmp_ps_mask(v, x, _CMP_LT_OQ) != 0; }
    static bool any_below(__m512d v, __m512d x) noexcept { return _mm512_cmp_pd_mask(v, x, _CMP_LT_OQ) != 0; }
    static __m512 max(__m512 a, __m512 b) noexcept { return _mm512_maskz_max_ps(0xffff, a, b); }
    static __m512d max(__m512d a, __m512d b) noexcept { return _mm512_maskz_max_pd(0xff, a, b); }
    static double max_lane(__m512 v) noexcept {
      return avx2::magnitudes::max_lane(
          _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_maskz_extractf32x8_ps(0xff, v, 1)));
    }
    static double max_lane(__m512d v) noexcept { return f64::max_lane(v); }
  };

  /// multiply<float> of BF16 elements on a CPU with AVX-512 BF16 (has_avx512_bf16). That extension (Cooper
  /// Lake, Sapphire Rapids, Zen 4 and later) rounds FP32 to BF16 in one instruction, to nearest even as Eigen
  /// does, where f32::store takes eight: the binding BF16 clip's write pass ran at half its speed in cache
  /// (issue 28). The instruction flushes subnormals to zero and keeps NaN payloads, so a vector holding
  /// either takes f32::store; the bits are f32::store's either way.
  __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma"))) static void multiply_bf16(
      Eigen::bfloat16* p, std::size_t n, float c) noexcept {
    const __m512 k = _mm512_set1_ps(c);
    const bool ahead = streams_ahead<Eigen::bfloat16>();
    const std::ptrdiff_t distance = widening_prefetch_distance<Eigen::bfloat16>();
    constexpr std::size_t w = f32::width;
    constexpr int nan_or_subnormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, subnormal, signalling NaN
    std::size_t i = 0;
    // A line (two vectors) a step, one prefetch and one test for both: the write pass ran 10 to 20 % faster
    // in cache than a vector a step (AMD EPYC Zen 5).
    for (; i + 2 * w <= n; i += 2 * w) {
      if (ahead) prefetch_lines<target>(p + i, distance, 2 * w * sizeof(Eigen::bfloat16));
      const __m512 v = _mm512_mul_ps(f32::load(p + i), k), u = _mm512_mul_ps(f32::load(p + i + w), k);
      if ((_mm512_fpclass_ps_mask(v, nan_or_subnormal) | _mm512_fpclass_ps_mask(u, nan_or_subnormal)) != 0) {
        f32::store(p + i, v);
        f32::store(p + i + w, u);
      } else {
        const __m256bh low = _mm512_cvtneps_pbh(v), high = _mm512_cvtneps_pbh(u);
        std::memcpy(static_cast<void*>(p + i), &low, sizeof low);
        std::memcpy(static_cast<void*>(p + i + w), &high, sizeof high);
      }
    }
    if (i + w <= n) {
      f32::store(p + i, _mm512_mul_ps(f32::load(p + i), k));
      i += w;
    }
    for (; i < n; ++i) p[i] = narrow<Eigen::bfloat16>(widen<float>(p[i]) * c);
  }

  /// field_sum's whole lines of 32 FP16 or BF16 elements on a CPU with AVX-512 VBMI (use_avx512_vbmi): a word
  /// permutation gathers elements q, q + 8, q + 16 and q + 24 into 64-bit lane q, and a multishift a
  /// quarter moves each one's magnitude to add_fields' place with every other bit zero, so each lane gets
  /// the elements add_fields gives it, in the same order: the same bits, with 14 instructions per 32
  /// elements instead of 20 (the L1 norm in cache at 0.52 of the L2 norm's speed against 0.42, FP16 and BF16
  /// alike, on an AMD EPYC Zen 4, where it had kept up with memory only just). Returns how many elements it
  /// added and raises `top` to their largest magnitude's bits.
  template <class T>
  __attribute__((target("avx512vbmi,avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma"))) static std::size_t
  add_field_lines(f64::vec (&acc)[2], const T* p, std::size_t m, std::uint16_t& top) noexcept {
    constexpr int shift = 53 - std::numeric_limits<T>::digits;
    // Byte k of a lane takes the 8 bits from (element's bit + 8k - shift) mod 64; bytes 0 to 4 are zeroed.
    // A quarter's neighbours are zeroed first, so the bits below and above its 15 read as zero.
    constexpr auto control = [](int bit) {
      std::uint64_t c = 0;
      for (int k = 5; k < 8; ++k) c |= std::uint64_t((bit + 8 * k - shift) & 63) << (8 * k);
      return static_cast<long long>(c);
    };
    constexpr __mmask64 fields = 0xe0e0e0e0e0e0e0e0;
    const __m512i order = _mm512_loadu_si512(line_order);
    constexpr long long controls[4] = {control(0), control(16), control(32), control(48)};
    const __m512i quarter[4] = {_mm512_set1_epi64(controls[0]), _mm512_set1_epi64(controls[1]),
                                _mm512_set1_epi64(controls[2]), _mm512_set1_epi64(controls[3])};
    const __m512i even = _mm512_set1_epi64(0x00007fff00007fff), odd = _mm512_set1_epi64(0x7fff00007fff0000);
    const bool ahead = streams_ahead<T>();
    const std::ptrdiff_t distance = widening_prefetch_distance<T>();
    __m512i high = _mm512_setzero_si512();
    std::size_t i = 0;
    for (; i + 32 <= m; i += 32) {
      if (ahead) prefetch_lines<target>(p + i, distance, 64);
      const __m512i x = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(p + i));
      const __m512i a = _mm512_and_si512(x, even), b = _mm512_and_si512(x, odd);  // elements 0-7, 16-23; the rest
      high = _mm512_max_epu16(high, _mm512_or_si512(a, b));
      acc[0] = f64::add(acc[0], _mm512_castsi512_pd(_mm512_maskz_multishift_epi64_epi8(fields, quarter[0], a)));
      acc[1] = f64::add(acc[1], _mm512_castsi512_pd(_mm512_maskz_multishift_epi64_epi8(fields, quarter[1], b)));
      acc[0] = f64::add(acc[0], _mm512_castsi512_pd(_mm512_maskz_multishift_epi64_epi8(fields, quarter[2], a)));
      acc[1] = f64::add(acc[1], _mm512_castsi512_pd(_mm512_maskz_multishift_epi64_epi8(fields, quarter[3], b)));
    }
    const __m256i halves = _mm256_max_epu16(_mm512_castsi512_si256(high), _mm512_extracti64x4_epi64(high, 1));
    top = std::max(top, avx2::i16::max_lane(halves));
    return i;
  }
  /// Word 4q + j of a line gathered for add_field_lines: element 8j + q.
  static constexpr std::uint16_t line_order[32] = {0, 8,  16, 24, 1, 9,  17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                                                   4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31};

#include <gradclip/detail/kernels.inc>
#include <gradclip/detail/update_kernels.inc>

#include <gradclip/detail/census_lanes.inc>  // uses kernels.inc's functions
};
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // GRADCLIP_X86_DISPATCH

/// The one instruction-set dispatcher: calls f(target's kernels), the struct `portable`, `avx2` or
/// `avx512`, whose static members are the kernels of kernels.inc compiled for it. `target` must be
/// supported (best_isa() is).
///
///     const double s = with_isa(best_isa(), [&](auto k) { return decltype(k)::sum_abs(p, n); });
template <class F>
decltype(auto) with_isa([[maybe_unused]] isa target, F&& f) {
#if GRADCLIP_X86_DISPATCH
  if (target == isa::avx512) return f(avx512{});
  if (target == isa::avx2) return f(avx2{});
#endif
  return f(portable{});
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
