// The protocol of policies: the traits a policy's row declares (how squares are accumulated, how the
// coefficient is applied), read by the kernels. The rows themselves, one per policy tag, are in
// policies.hpp, so adding a policy touches that file only.
#pragma once

#include <gradclip/detail/config.hpp>

#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// How the coefficient is applied: rounded to the element type and multiplied in its arithmetic
/// (`element`), rounded to FP32, or FP64 for FP64 input (`promoted`), or kept in FP64 so that the rounding
/// to the element type is the only one that matters (`exact`).
enum class scaling { element, promoted, exact };

// FP64 for FP64 input, FP32 otherwise: the "promote" rule.
template <class T>
using promoted_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// FP32 squares of FP16 and BF16 elements are exact; FP32 and FP64 elements square in FP64.
template <class T>
using robust_t = std::conditional_t<sizeof(T) == 2, float, double>;

/// The traits table: one row per policy. `accumulator<T>` is the type squares are summed in;
/// `sequential` sums one element after the other in it (no lanes, no FP64 carry); `max_scales` rescales
/// blocks whose range needs it; `compensated` sums FP64 squares compensated (compensated_squares).
/// Declared only, so a type without a row is not a policy.
template <class Policy>
struct policy_traits;

template <class Policy, class = void>
struct is_policy : std::false_type {};
template <class Policy>
struct is_policy<Policy, std::void_t<decltype(policy_traits<Policy>::max_scales)>> : std::true_type {};
template <class Policy>
inline constexpr bool is_policy_v = is_policy<Policy>::value;

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
