// Clipping by norm (one gradient or a group under one global norm) and by value.
#pragma once

#include <gradclip/detail/scale.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace gradclip {

namespace detail {

inline void check_clip_arguments(const char* function, double max_norm, const options& opt) {
  if (!(max_norm >= 0)) throw std::invalid_argument(std::string(function) + ": max_norm must be >= 0 and not NaN");
  if (!(opt.epsilon >= 0) || !std::isfinite(opt.epsilon))
    throw std::invalid_argument(std::string(function) + ": options::epsilon must be finite and >= 0");
  if (opt.nonfinite != on_nonfinite::skip && opt.nonfinite != on_nonfinite::error &&
      opt.nonfinite != on_nonfinite::propagate)
    throw std::invalid_argument(std::string(function) + ": options::nonfinite is not an on_nonfinite value");
}

struct clip_plan {
  clip_result result;
  factor coefficient;
};

/// Decides from the sum of squares whether and by how much to clip, without touching any gradient.
/// Works on the scaled form (norm = 2^e * r), so the coefficient is right even when the norm overflows.
inline clip_plan plan_clip(const char* function, const partial_norm& part, double max_norm, const options& opt) {
  const double norm = part.norm();
  if (!part.finite) {
    if (opt.nonfinite == on_nonfinite::error) throw nonfinite_error(function, norm);
    if (opt.nonfinite == on_nonfinite::skip) return {{norm, 1.0, false, false}, {}};
    double c = max_norm / (norm + opt.epsilon);  // PyTorch: clamp(max=1), NaN stays NaN
    if (c > 1.0) c = 1.0;
    return {{norm, c, !(c == 1.0), false}, {c, 0}};
  }
  const double r = std::sqrt(part.sum);
  if (!(r > std::ldexp(max_norm, -part.exponent))) return {{norm, 1.0, false, true}, {}};
  // max_norm = m * 2^k with m in [0.5, 1), so the mantissa stays normal even when max_norm is subnormal.
  int k = 0;
  const double m = std::frexp(max_norm, &k);
  const factor c{m / (r + std::ldexp(opt.epsilon, -part.exponent)), k - part.exponent};
  return {{norm, c.value(), true, true}, c};
}

template <class Policy, class T>
void apply_coefficient(const strided_view<T>& view, const factor& c) {
  static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
  view.for_each_run([&](T* p, std::size_t n) { scale_kernel<Policy>::run(p, n, c); }, true);
}

/// The largest T not above limit (>= 0), so that clipped values never exceed it after rounding.
template <class T>
T largest_not_above(double limit) noexcept {
  T bound = narrow<T>(limit);
  while (static_cast<double>(bound) > limit) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      bound = std::nextafter(bound, T(0));
    } else {
      bound = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(Eigen::numext::bit_cast<std::uint16_t>(bound) - 1));
    }
  }
  return bound;
}

}  // namespace detail

/// Clips one gradient in place to L2 norm at most max_norm: g <- g * min(1, max_norm / (||g|| + epsilon)).
///
/// When ||g|| <= max_norm the gradient is left bit-for-bit untouched and the coefficient is exactly 1.
/// Non-finite norms follow opt.nonfinite (skip by default: untouched, `finite = false`). With the robust
/// policy each clipped FP16, BF16 or FP32 element is within one unit in the last place of the exact
/// g * max_norm / ||g||; an FP64 element within one ulp plus the FP64 norm's rounding error (README).
/// Throws std::invalid_argument for a negative or NaN max_norm or a negative or non-finite epsilon.
///
///     auto result = gradclip::clip_by_norm(grad, 1.0);   // grad: Eigen::Tensor<Eigen::half, 2>, ...
template <class Policy = robust, class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
clip_result clip_by_norm(Grad&& g, double max_norm, options opt = {}) {
  constexpr const char* function = "gradclip::clip_by_norm";
  detail::check_clip_arguments(function, max_norm, opt);
  return detail::visit_gradient(g, [&](const auto& view) {
    const detail::clip_plan plan =
        detail::plan_clip(function, detail::partial_norm_of_view<Policy>(view), max_norm, opt);
    if (plan.result.clipped) detail::apply_coefficient<Policy>(view, plan.coefficient);
    return plan.result;
  });
}

/// Clips a raw buffer of `size` elements in place; see the overload above.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_by_norm(T* data, std::size_t size, double max_norm, options opt = {}) {
  return clip_by_norm<Policy>(detail::strided_view<T>{data, size}, max_norm, opt);
}

namespace detail {

// Clips a group by the norm `global` (its own, or one reduced across processes), which the caller
// computes only after the arguments have been checked.
template <class Policy, class Grads, class GlobalNorm>
clip_result clip_group(Grads& grads, double max_norm, const options& opt, GlobalNorm&& global,
                       const char* function = "gradclip::clip_by_global_norm") {
  check_clip_arguments(function, max_norm, opt);
  const clip_plan plan = plan_clip(function, global(), max_norm, opt);
  if (plan.result.clipped)
    for (auto& g : grads)
      visit_gradient(g, [&](const auto& view) { apply_coefficient<Policy>(view, plan.coefficient); });
  return plan.result;
}

template <class Policy, class Grads>
clip_result clip_group(Grads& grads, double max_norm, const options& opt) {
  return clip_group<Policy>(grads, max_norm, opt, [&] { return partial_norm_of_group<Policy>(grads); });
}

}  // namespace detail

/// Clips every gradient of a group by one coefficient computed from the global norm (the norm of their
/// concatenation), so the direction of the whole update is kept. Same semantics as clip_by_norm; with
/// on_nonfinite::error nothing in the group is modified when it throws.
///
///     std::vector<Eigen::Tensor<float, 2>> grads = ...;
///     auto result = gradclip::clip_by_global_norm(grads, 1.0);
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(Grads& grads, double max_norm, options opt = {}) {
  return detail::clip_group<Policy>(grads, max_norm, opt);
}

/// The same for a temporary group, e.g. a vector of maps made for the call.
template <class Policy = robust, class Grads, class = std::enable_if_t<!std::is_reference_v<Grads>>>
clip_result clip_by_global_norm(Grads&& grads, double max_norm, options opt = {}) {
  return detail::clip_group<Policy>(grads, max_norm, opt);
}

/// The same for a braced list of gradients of any element types: clip_by_global_norm({w, b}, 1.0).
template <class Policy = robust>
clip_result clip_by_global_norm(std::initializer_list<grad_view> grads, double max_norm, options opt = {}) {
  return detail::clip_group<Policy>(grads, max_norm, opt);
}

/// Clips this process's gradients by a global norm reduced elsewhere (e.g. with NCCL or Gloo from every
/// rank's partial_global_norm; see partial_norm.hpp). Every rank passing the same `global` applies the
/// same coefficient, bit for bit.
///
///     auto result = gradclip::clip_by_global_norm(local_grads, reduced_partial, 1.0);
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(Grads& local_grads, const partial_norm& global, double max_norm, options opt = {}) {
  return detail::clip_group<Policy>(local_grads, max_norm, opt, [&] { return global; });
}

/// Clamps every element to [-limit, limit] in place (limit rounded down to the element type, so no
/// result exceeds it). NaN elements stay NaN. Throws std::invalid_argument for a negative or NaN limit.
template <class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
void clip_by_value(Grad&& g, double limit) {
  if (!(limit >= 0)) throw std::invalid_argument("gradclip::clip_by_value: limit must be >= 0 and not NaN");
  detail::visit_gradient(g, [&](const auto& view) {
    using T = typename std::decay_t<decltype(view)>::element_type;
    static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
    // abs: a limit of -0.0 is valid and must clamp positive elements to +0, not -0.
    const T upper = detail::largest_not_above<T>(std::abs(limit));
    const T lower = -upper;
    view.for_each_run(
        [&](T* p, std::size_t n) {
          for (std::size_t i = 0; i < n; ++i) {
            const double x = static_cast<double>(p[i]);
            if (x > limit) p[i] = upper;
            if (x < -limit) p[i] = lower;
          }
        },
        true);
  });
}

}  // namespace gradclip
