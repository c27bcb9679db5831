// What the compiler's flags mean for gradclip: the floating-point modes and -fno-exceptions, which it refuses, the
// products it keeps from being fused into FMAs, and the inline namespace that names the instruction sets a
// translation unit was compiled for. Every gradclip header includes this one.
#pragma once

#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__) || defined(__ASSOCIATIVE_MATH__)
#error \
    "gradclip: -ffast-math, -ffinite-math-only and -fassociative-math are not supported. Under them the compiler may assume no NaN or Inf exists (so a non-finite gradient would be clipped as if it were finite) and may reorder the compensated sums (so the documented error bounds would not hold). Compile the translation units that include gradclip without these flags (e.g. add -fno-fast-math after them)."
#endif

// g++ names -fno-signed-zeros (clang does not). Under it, built by g++ 12, test_kernels' weighted sums lost the
// sign of their -0 starts, and test_p_norm_kernels found gradients holding an Inf finite at p = 0.5.
#if defined(__NO_SIGNED_ZEROS__)
#error \
    "gradclip: -fno-signed-zeros is not supported. Built with it by g++ 12, the kernels gave a finite p = 0.5 norm for a gradient that holds an Inf, and weighted sums of -0 products lost their sign. Compile the translation units that include gradclip without it (e.g. add -fsigned-zeros after it)."
#endif

// x87 arithmetic (g++ -mfpmath=387, 32-bit x86 without SSE2) keeps doubles in 80-bit registers and rounds
// them when it spills: the scalar code's bits then differ from the vector targets', and the compensated
// sums' error terms come out wrong. Built so, test_kernels failed 26 of its 64 tests.
#if defined(__FLT_EVAL_METHOD__) && __FLT_EVAL_METHOD__ != 0
#error \
    "gradclip: excess floating-point precision (FLT_EVAL_METHOD != 0: x87 arithmetic, from -mfpmath=387 or a 32-bit x86 target without SSE2) is not supported. It rounds each operation to whatever width the compiler keeps it in, so the compensated sums lose their error terms and the results depend on register allocation. Compile with SSE2 arithmetic (-msse2 -mfpmath=sse; the default on x86-64)."
#endif

#if !defined(__cpp_exceptions)
#error \
    "gradclip: -fno-exceptions is not supported. gradclip reports bad input by throwing (std::invalid_argument, gradclip::nonfinite_error), and its thread pool hands a job's exception to the caller. Compile the translation units that include gradclip with exceptions (-fexceptions)."
#endif

// Every gradclip function is inline, so each translation unit that uses one emits a copy, and the linker
// keeps any one of them. A copy compiled with -mavx512f (or -march=native) would then run where a unit
// built for the baseline calls it, and fault on a CPU without AVX-512. So everything gradclip defines
// lives in an inline namespace named after the instruction-set extensions the compiler may use: units
// built with different flags get different symbols and never replace each other's code. Each name part
// is one extension the compiler's macros report (x86-64 and arm64); GRADCLIP_NO_SIMD and GRADCLIP_COMPILED
// change the name too.
#define GRADCLIP_ABI_PASTE(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q) \
  abi##a##b##c##d##e##f##g##h##i##j##k##l##m##n##o##p##q
#define GRADCLIP_ABI_NAME(...) GRADCLIP_ABI_PASTE(__VA_ARGS__)

#if defined(__SSE4_2__)
#define GRADCLIP_ABI_SSE _sse42
#elif defined(__SSE4_1__)
#define GRADCLIP_ABI_SSE _sse41
#elif defined(__SSSE3__)
#define GRADCLIP_ABI_SSE _ssse3
#elif defined(__SSE3__)
#define GRADCLIP_ABI_SSE _sse3
#else
#define GRADCLIP_ABI_SSE
#endif
#if defined(__POPCNT__)
#define GRADCLIP_ABI_POPCNT _popcnt
#else
#define GRADCLIP_ABI_POPCNT
#endif
#if defined(__AVX2__)
#define GRADCLIP_ABI_AVX _avx2
#elif defined(__AVX__)
#define GRADCLIP_ABI_AVX _avx
#else
#define GRADCLIP_ABI_AVX
#endif
#if defined(__FMA__)
#define GRADCLIP_ABI_FMA _fma
#else
#define GRADCLIP_ABI_FMA
#endif
#if defined(__F16C__)
#define GRADCLIP_ABI_F16C _f16c
#else
#define GRADCLIP_ABI_F16C
#endif
#if defined(__BMI2__)
#define GRADCLIP_ABI_BMI _bmi2
#elif defined(__BMI__)
#define GRADCLIP_ABI_BMI _bmi
#else
#define GRADCLIP_ABI_BMI
#endif
#if defined(__LZCNT__)
#define GRADCLIP_ABI_LZCNT _lzcnt
#else
#define GRADCLIP_ABI_LZCNT
#endif
#if defined(__AVX512F__)
#define GRADCLIP_ABI_AVX512F _avx512f
#else
#define GRADCLIP_ABI_AVX512F
#endif
#if defined(__AVX512BW__)
#define GRADCLIP_ABI_AVX512BW _bw
#else
#define GRADCLIP_ABI_AVX512BW
#endif
#if defined(__AVX512DQ__)
#define GRADCLIP_ABI_AVX512DQ _dq
#else
#define GRADCLIP_ABI_AVX512DQ
#endif
#if defined(__AVX512VL__)
#define GRADCLIP_ABI_AVX512VL _vl
#else
#define GRADCLIP_ABI_AVX512VL
#endif
#if defined(__AVX512CD__)
#define GRADCLIP_ABI_AVX512CD _cd
#else
#define GRADCLIP_ABI_AVX512CD
#endif
#if defined(__AVX512FP16__)
#define GRADCLIP_ABI_AVX512FP16 _fp16
#else
#define GRADCLIP_ABI_AVX512FP16
#endif
#if defined(__AVX512BF16__)
#define GRADCLIP_ABI_AVX512BF16 _bf16
#else
#define GRADCLIP_ABI_AVX512BF16
#endif
// arm64: the scalable vectors and the half-precision arithmetic the compiler may use.
#if defined(__ARM_FEATURE_SVE)
#define GRADCLIP_ABI_ARM _sve
#elif defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC)
#define GRADCLIP_ABI_ARM _fp16arith
#else
#define GRADCLIP_ABI_ARM
#endif
#if defined(GRADCLIP_NO_SIMD)
#define GRADCLIP_ABI_SIMD _nosimd
#else
#define GRADCLIP_ABI_SIMD
#endif
// Compiled mode: the inline functions that call the library's kernels differ from the header-only ones
// of the same name, so the two modes may meet in one program (and in the library itself).
#if defined(GRADCLIP_COMPILED)
#define GRADCLIP_ABI_COMPILED _compiled
#else
#define GRADCLIP_ABI_COMPILED
#endif

/// The inline namespace around everything gradclip defines: `abi` followed by the extensions, e.g.
/// gradclip::abi for the x86-64 baseline, gradclip::abi_sse42_popcnt_avx2_fma_f16c_bmi2_lzcnt for
/// -march=x86-64-v3. Code names gradclip::clip_by_norm and never needs it.
#define GRADCLIP_ABI                                                                                              \
  GRADCLIP_ABI_NAME(GRADCLIP_ABI_SSE, GRADCLIP_ABI_POPCNT, GRADCLIP_ABI_AVX, GRADCLIP_ABI_FMA, GRADCLIP_ABI_F16C, \
                    GRADCLIP_ABI_BMI, GRADCLIP_ABI_LZCNT, GRADCLIP_ABI_AVX512F, GRADCLIP_ABI_AVX512BW,            \
                    GRADCLIP_ABI_AVX512DQ, GRADCLIP_ABI_AVX512VL, GRADCLIP_ABI_AVX512CD, GRADCLIP_ABI_AVX512FP16, \
                    GRADCLIP_ABI_AVX512BF16, GRADCLIP_ABI_ARM, GRADCLIP_ABI_SIMD, GRADCLIP_ABI_COMPILED)

// Products rounded before they are added, whatever the user's -ffp-contract: GRADCLIP_FP_CONTRACT_OFF_BEGIN
// and _END bracket code whose bits would change if the compiler fused a multiply and an add. clang 14 ignores
// float_control on arm64, with a warning in every unit, and the user's mode could not be restored after a
// bare `clang fp contract(off)`: nothing is set there. arm64 has one target, so its bits cannot differ
// between targets, and rounded (below) still keeps the kernels' products rounded.
#if defined(__clang__) && defined(__aarch64__)
#define GRADCLIP_FP_CONTRACT_OFF_BEGIN
#define GRADCLIP_FP_CONTRACT_OFF_END
#elif defined(__clang__)
#define GRADCLIP_FP_CONTRACT_OFF_BEGIN _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define GRADCLIP_FP_CONTRACT_OFF_END _Pragma("float_control(pop)")
#elif defined(__GNUC__)
#define GRADCLIP_FP_CONTRACT_OFF_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define GRADCLIP_FP_CONTRACT_OFF_END _Pragma("GCC pop_options")
#else
#define GRADCLIP_FP_CONTRACT_OFF_BEGIN
#define GRADCLIP_FP_CONTRACT_OFF_END
#endif

// Under -ffp-contract=fast, clang fuses products into FMAs across its pragma, so a product that must be
// rounded also passes through GRADCLIP_OPAQUE(x): an empty asm that holds x in a register, which no
// optimization sees into (detail::rounded). GCC honours its pragma and needs none.
#if defined(__clang__) && defined(__x86_64__)
#define GRADCLIP_OPAQUE(x) __asm__("" : "+v"(x))
#elif defined(__clang__) && defined(__aarch64__)
#define GRADCLIP_OPAQUE(x) __asm__("" : "+w"(x))
#else
#define GRADCLIP_OPAQUE(x) static_cast<void>(x)
#endif
// clang's inliner counts each of those asm statements as a call, and would leave kernels.inc's unrolled,
// whose calls must inline for their vectors to stay in registers, out of line: it is flattened there.
#if defined(__clang__)
#define GRADCLIP_UNROLLED [[gnu::always_inline, gnu::flatten]]
#else
#define GRADCLIP_UNROLLED
#endif
// Whether short_squares (reduce.hpp) unrolls the pairs of a short FP32 run completely (at most 16). GCC
// leaves that loop a loop, with its setup, spills and tail, once it also tracks the magnitudes (a report of
// small gradients), and then runs 244 instructions per gradient of 4 where 227 do; clang's unrolled code is
// longer than its loop (306 instructions without a report instead of 280), so clang keeps its own choice.
#if defined(__GNUC__) && !defined(__clang__)
#define GRADCLIP_UNROLLS_SHORT_RUNS 1
#else
#define GRADCLIP_UNROLLS_SHORT_RUNS 0
#endif
// A lambda always inlined into its caller (pipeline.hpp's per-piece sink). GCC and clang take the attribute
// after the parameters in this spelling; [[gnu::always_inline]] there would name the type and be ignored.
#if defined(__GNUC__) || defined(__clang__)
#define GRADCLIP_INLINE_LAMBDA __attribute__((always_inline))
#else
#define GRADCLIP_INLINE_LAMBDA
#endif

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {
/// x as it is, but rounded before anything adds it: a product passed through it is never fused into an
/// FMA, whatever the compiler's -ffp-contract (GRADCLIP_OPAQUE). The vector targets have their own, for
/// their registers (simd.hpp).
template <class V>
inline V rounded(V x) noexcept {
  GRADCLIP_OPAQUE(x);
  return x;
}
}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
