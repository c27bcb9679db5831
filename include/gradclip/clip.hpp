// Clipping by norm (one gradient or a group under one global norm) and by value.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {

namespace detail {

/// limit (>= 0) rounded to nearest T, ties to even, beyond T's range to +inf (IEEE conversion, as
/// PyTorch, TensorFlow and Optax round a bound): exact, where converting through float would round twice.
template <class T>
T nearest_bound(double limit) noexcept {
  if constexpr (std::is_same_v<T, double>) {
    return limit;
  } else {
    using bits = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint16_t>;
    const auto step = [](T x, int by) {  // the next T up or down (positive x; +inf follows the largest)
      return Eigen::numext::bit_cast<T>(static_cast<bits>(Eigen::numext::bit_cast<bits>(x) + by));
    };
    T low = narrow<T>(limit);  // within one step of the answer
    while (static_cast<double>(low) > limit) low = step(low, -1);
    if (std::isinf(static_cast<double>(low))) return low;
    const T high = step(low, 1);
    // The midpoint is exact in double; above the largest T it is half a step past it.
    const double l = static_cast<double>(low), h = static_cast<double>(high);
    const double middle = std::isinf(h) ? l + (l - static_cast<double>(step(low, -1))) / 2 : l + (h - l) / 2;
    if (limit != middle) return limit < middle ? low : high;
    return (Eigen::numext::bit_cast<bits>(low) & 1) == 0 ? low : high;
  }
}

}  // namespace detail

/// Clips one gradient in place: g <- g * c with c = max_norm / (||g|| + epsilon) when c < 1 (PyTorch's
/// rule), the norm being options::norm (L2 by default).
///
/// When c >= 1 the gradient is left bit-for-bit untouched and the coefficient is exactly 1. Non-finite
/// norms follow opt.nonfinite (skip by default: untouched, `finite = false`). With the robust policy each
/// clipped FP16, BF16 or FP32 or FP64 element is within one unit in the last place of the exact g * c
/// (FP64: compensated sum of squares, double-double coefficient, one rounding). Runs on up to
/// opt.threads threads with results identical for every thread count. Throws std::invalid_argument for a
/// negative or NaN max_norm and for bad options.
///
///     auto result = gradclip::clip_by_norm(grad, 1.0);   // grad: Eigen::Tensor<Eigen::half, 2>, ...
template <class Policy = robust, class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
clip_result clip_by_norm(Grad&& g, double max_norm, const options& opt = {}) {
  return detail::with_single(g, [&](auto& group) {
    return detail::clip<Policy>("gradclip::clip_by_norm", group, detail::fixed_threshold{max_norm}, opt);
  });
}

/// Clips a raw buffer of `size` elements in place; see the overload above.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_by_norm(T* data, std::size_t size, double max_norm, const options& opt = {}) {
  return clip_by_norm<Policy>(detail::strided_view<T>{data, size}, max_norm, opt);
}

/// Clips every gradient of a group by one coefficient computed from the global norm (the norm of their
/// concatenation), so the direction of the whole update is kept. Same semantics as clip_by_norm; with
/// on_nonfinite::error nothing in the group is modified when it throws.
///
///     std::vector<Eigen::Tensor<float, 2>> grads = ...;
///     auto result = gradclip::clip_by_global_norm(grads, 1.0);
template <class Policy = robust, class Grads, class = std::enable_if_t<detail::is_gradient_range_v<Grads&>>>
clip_result clip_by_global_norm(Grads&& grads, double max_norm, const options& opt = {}) {
  return detail::clip<Policy>("gradclip::clip_by_global_norm", grads, detail::fixed_threshold{max_norm}, opt);
}

/// The same for a braced list of gradients of any element types: clip_by_global_norm({w, b}, 1.0).
template <class Policy = robust>
clip_result clip_by_global_norm(std::initializer_list<grad_view> grads, double max_norm, const options& opt = {}) {
  return detail::clip<Policy>("gradclip::clip_by_global_norm", grads, detail::fixed_threshold{max_norm}, opt);
}

/// Clips this process's gradients by a norm reduced elsewhere (e.g. with NCCL or Gloo from every rank's
/// partial_global_norm; see partial_norm.hpp), without reading them again. Every rank passing the same
/// `global` applies the same coefficient, bit for bit. `global` must be a part of options::norm.
///
///     auto result = gradclip::clip_by_global_norm(local_grads, reduced_partial, 1.0);
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(Grads&& local_grads, const partial_norm& global, double max_norm,
                                const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_by_global_norm";
  detail::check_group<Grads&>();
  if (!(global.p == opt.norm.p()))
    throw std::invalid_argument(std::string(function) + ": the partial norm is of p = " + std::to_string(global.p) +
                                ", options::norm of p = " + std::to_string(opt.norm.p()));
  return detail::clip<Policy>(function, local_grads, detail::fixed_threshold{max_norm}, opt, [&] { return global; });
}

/// The clip_result clip_by_norm / clip_by_global_norm would return, bit for bit, with nothing written: for
/// an optimizer that applies `coefficient` in its own pass over the gradients (llm.c's fused AdamW), which
/// saves the clipping write pass. Apply it only when `clipped`; when the norm is not finite, options::
/// nonfinite decides as it would (skip: the step should be skipped, error: throws, propagate: the
/// coefficient the clip would have applied). Same arguments, checks and options::report as the clip.
///
///     auto plan = gradclip::clip_coefficient(grads, 1.0);
///     sgd_step(weights, grads, learning_rate * (plan.clipped ? plan.coefficient : 1.0));
template <class Policy = robust, class Grads>
clip_result clip_coefficient(const Grads& grads, double max_norm, const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_coefficient";
  if constexpr (detail::is_gradient_v<const Grads&>) {
    return detail::with_single(grads, [&](const auto& one) {
      return detail::plan_only<Policy>(function, one, detail::fixed_threshold{max_norm}, opt);
    });
  } else {
    return detail::plan_only<Policy>(function, grads, detail::fixed_threshold{max_norm}, opt);
  }
}

/// The same for a braced list of gradients of any element types: clip_coefficient({w, b}, 1.0).
template <class Policy = robust>
clip_result clip_coefficient(std::initializer_list<const_grad_view> grads, double max_norm, const options& opt = {}) {
  return detail::plan_only<Policy>("gradclip::clip_coefficient", grads, detail::fixed_threshold{max_norm}, opt);
}

/// The same for a raw buffer of `size` elements.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_coefficient(const T* data, std::size_t size, double max_norm, const options& opt = {}) {
  return clip_coefficient<Policy>(detail::strided_view<const T>{data, size}, max_norm, opt);
}

/// Clips this process's gradients by a total norm the caller reduced elsewhere, as a double (PyTorch 2.x's
/// clip_grads_with_norm_): c = max_norm / (total_norm + epsilon) when c < 1, the gradients not read again.
/// A NaN or +inf total_norm follows opt.nonfinite. Throws std::invalid_argument for a negative total_norm,
/// a negative or NaN max_norm and bad options.
///
///     auto result = gradclip::clip_by_global_norm(local_grads, total_norm, 1.0);
template <class Policy = robust, class Grads, class = std::enable_if_t<detail::is_gradient_range_v<Grads&>>>
clip_result clip_by_global_norm(Grads&& local_grads, double total_norm, double max_norm, const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_by_global_norm";
  detail::check_group<Grads&>();
  if (total_norm < 0)
    throw std::invalid_argument(std::string(function) + ": total_norm must be >= 0, NaN or +inf, not " +
                                std::to_string(total_norm));
  // A norm is the part of one element of its magnitude; as a maximum it is held exactly.
  const partial_norm total = std::isfinite(total_norm)
                                 ? partial_norm{0, total_norm, true, std::numeric_limits<double>::infinity()}
                                 : partial_norm::nonfinite(total_norm);
  return detail::clip<Policy>(function, local_grads, detail::fixed_threshold{max_norm}, opt, [&] { return total; });
}

/// Clamps every element to [-b, b] in place, b being limit rounded to nearest in the element type (ties
/// to even; +inf beyond its range), as PyTorch, TensorFlow and Optax round a bound: clip_by_value(x, 4.4)
/// on FP32 clamps to 4.4000001f. NaN elements stay NaN. Throws std::invalid_argument for a negative or NaN
/// limit.
template <class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
void clip_by_value(Grad&& g, double limit) {
  if (!(limit >= 0)) throw std::invalid_argument("gradclip::clip_by_value: limit must be >= 0 and not NaN");
  detail::visit_gradient(g, [&](const auto& view) {
    using T = typename std::decay_t<decltype(view)>::element_type;
    static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
    // abs: a limit of -0.0 is valid and must clamp positive elements to +0, not -0.
    const T upper = detail::nearest_bound<T>(std::abs(limit));
    const T lower = -upper;
    const double bound = static_cast<double>(upper);
    view.for_each_run(
        [&](T* p, std::size_t n) {
          for (std::size_t i = 0; i < n; ++i) {
            const double x = static_cast<double>(p[i]);
            if (x > bound) p[i] = upper;
            if (x < -bound) p[i] = lower;
          }
        },
        true);
  });
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
