// Policies: how the L2 norm's sum of squares is accumulated and how the coefficient is applied. Empty tag
// types, passed as the first template argument; each is one row of the traits table below (what each trait
// means: detail/policy_traits.hpp), so adding a policy touches this file only.
//
// The policy applies to the L2 norm. The L1, max and other p-norms (options::norm) are computed the same
// way under every policy: |x| or |x|^p of each element in FP64 per block of 1024, each block scaled by a
// power of two near its largest magnitude, so they never overflow or underflow; the coefficient is then
// applied with the policy's scaling.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/policy_traits.hpp>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// Squares and sums in the gradient's own type, as `g.square().sum().sqrt()` does.
/// Reproduces the FP16 overflow bug on purpose; for tests and benchmarks only.
struct naive {};

/// FP16/BF16 promoted to FP32 before squaring (PyTorch's approach): FP32 squares in chains of 32 per lane
/// (8 for FP32 input) carried into FP64 (FP64 throughout for FP64 input); the coefficient rounded to FP32 (FP64) and
/// applied in that type. Overflows once a square or a chain exceeds FP32's range (e.g. FP32 `[1e20, 1e20]`).
struct promote {};

/// Max scaling: as promote, but a block of 1024 elements (4096 FP16 or BF16) whose sum of squares
/// overflows, or is so small (below 2^-100 in FP32, 2^-900 in FP64) that a square may have underflowed,
/// is summed again divided by a power of two near its largest magnitude, and the scaled sums are merged.
/// Never overflows or underflows for finite input. FP64 sums are plain (80 * 2^-53 relative); the
/// coefficient is applied as robust applies it, so FP64 elements are within one ulp plus that error.
struct max_scale {};

/// The default. FP16/BF16: exact FP32 squares in chains of 32, carried into FP64, BF16 blocks max-scaled
/// where FP32's range needs it (relative error at most 16 * 2^-24). FP32: squares and sums in FP64 (at most
/// 36 * 2^-53, about 4e-15, relative). FP64: the squares' and additions' errors kept exactly by FMA and
/// summed compensated, blocks max-scaled where FP64's range needs it, kept with its tail through every
/// merge: within 2^-53 on the sum of squares and 1.5 * 2^-53 on the norm, for any length and any number of
/// tensors.
/// Overflow- and underflow-free for every finite input. The coefficient is computed in double-double:
/// FP16, BF16 and FP32 elements get it rounded to FP64 and one rounding to their type, FP64 elements
/// x * (high + low) with one rounding, so every element is within one ulp of the exact projection.
struct robust {};

namespace detail {

template <>
struct policy_traits<naive> {
  template <class T>
  using accumulator = T;
  static constexpr bool sequential = true;
  static constexpr bool max_scales = false;
  static constexpr bool compensated = false;
  static constexpr scaling scale = scaling::element;
};

template <>
struct policy_traits<promote> {
  template <class T>
  using accumulator = promoted_t<T>;
  static constexpr bool sequential = false;
  static constexpr bool max_scales = false;
  static constexpr bool compensated = false;
  static constexpr scaling scale = scaling::promoted;
};

template <>
struct policy_traits<max_scale> {
  template <class T>
  using accumulator = promoted_t<T>;
  static constexpr bool sequential = false;
  static constexpr bool max_scales = true;
  static constexpr bool compensated = false;
  static constexpr scaling scale = scaling::exact;
};

template <>
struct policy_traits<robust> {
  template <class T>
  using accumulator = robust_t<T>;
  static constexpr bool sequential = false;
  static constexpr bool max_scales = true;
  static constexpr bool compensated = true;
  static constexpr scaling scale = scaling::exact;
};

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
