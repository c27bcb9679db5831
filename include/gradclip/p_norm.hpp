// Norms other than L2: L1, L-infinity (max abs) and any p > 0, for one gradient or a group, and clipping
// by them. Overloads of norm, global_norm, clip_by_norm and clip_by_global_norm taking a norm_type.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/detail/p_norm_kernels.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <cstddef>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace gradclip {

namespace detail {

inline void check_norm_type(const char* function, norm_type type) {
  if (!(type.p() > 0))
    throw std::invalid_argument(std::string(function) + ": norm_type p must be > 0 (inf for the max norm), not " +
                                std::to_string(type.p()));
}

template <class T>
power_sum power_sum_of_view(const strided_view<T>& view, double p) {
  power_sum total;
  view.for_each_run([&](const auto* data, std::size_t n) { total.merge(power_sum_kernel(data, n, p), p); });
  return total;
}

/// The p-norm of a group as 2^e * r (a partial_norm that plan_clip accepts). p = 2 takes the robust L2
/// path itself, so it costs exactly what norm() and clip_by_norm() cost.
template <class Grads>
partial_norm p_norm_of_group(const Grads& grads, double p) {
  static_assert(is_gradient_range_v<const Grads&>,
                "A group of gradients is a range (a std::vector, std::array, ...) whose elements are gradients.");
  if (p == 2.0) return partial_norm_of_group<robust>(grads);
  power_sum total;
  for (const auto& g : grads)
    total.merge(visit_gradient(g, [&](const auto& view) { return power_sum_of_view(view, p); }), p);
  return as_partial_norm(total, p);
}

template <class T>
partial_norm p_norm_of_view(const strided_view<T>& view, double p) {
  if (p == 2.0) return partial_norm_of_view<robust>(view);
  return as_partial_norm(power_sum_of_view(view, p), p);
}

template <class Grads>
clip_result clip_group_by_p_norm(Grads& grads, double max_norm, norm_type type, const options& opt) {
  constexpr const char* function = "gradclip::clip_by_global_norm";
  check_norm_type(function, type);
  if (type.p() == 2.0) return clip_group<robust>(grads, max_norm, opt);
  check_clip_arguments(function, max_norm, opt);
  const clip_plan plan = plan_clip(function, p_norm_of_group(grads, type.p()), max_norm, opt);
  if (plan.result.clipped)
    for (auto& g : grads)
      visit_gradient(g, [&](const auto& view) { apply_coefficient<robust>(view, plan.coefficient); });
  return plan.result;
}

}  // namespace detail

/// The p-norm of one gradient, in double: (sum |g_i|^p)^(1/p), or max |g_i| for inf_norm. Computed with
/// the robust policy's numerics for every p (FP64 sums of power-of-two-scaled blocks): never overflows or
/// underflows for finite input (+inf only when a finite FP64 gradient's norm exceeds double's range), NaN
/// if an element is NaN, +inf if one is infinite. p = 2 is norm(g) itself. Throws std::invalid_argument
/// for p <= 0 or NaN.
///
///     double m = gradclip::norm(grad, gradclip::inf_norm);
///     double q = gradclip::norm(grad, gradclip::norm_type{1.5});
template <class Grad, class = std::enable_if_t<detail::is_gradient_v<const Grad&>>>
double norm(const Grad& g, norm_type type) {
  detail::check_norm_type("gradclip::norm", type);
  return detail::visit_gradient(g, [&](const auto& view) { return detail::p_norm_of_view(view, type.p()); }).norm();
}

/// The p-norm of a raw buffer of `size` elements.
template <class T, class = std::enable_if_t<detail::is_element_v<T>>>
double norm(const T* data, std::size_t size, norm_type type) {
  detail::check_norm_type("gradclip::norm", type);
  return detail::p_norm_of_view(detail::strided_view<const T>{data, size}, type.p()).norm();
}

/// The p-norm of the concatenation of a group: (sum over gradients of ||g||_p^p)^(1/p), which for
/// inf_norm is the largest of the gradients' max norms (the MAX reduction of Megatron and DeepSpeed).
template <class Grads>
double global_norm(const Grads& grads, norm_type type) {
  detail::check_norm_type("gradclip::global_norm", type);
  return detail::p_norm_of_group(grads, type.p()).norm();
}

/// The same for a braced list of gradients of any element types: global_norm({w, b}, l1_norm).
inline double global_norm(std::initializer_list<grad_view> grads, norm_type type) {
  detail::check_norm_type("gradclip::global_norm", type);
  return detail::p_norm_of_group(grads, type.p()).norm();
}

/// Clips one gradient in place to p-norm at most max_norm, with clip_by_norm's semantics: when
/// ||g||_p > max_norm every element is multiplied by max_norm / (||g||_p + epsilon), else the gradient is
/// untouched and the coefficient exactly 1; non-finite norms follow opt.nonfinite. `result.norm` is the
/// p-norm. Each clipped element is within about one unit in the last place of the exact value (the
/// scaling is the robust policy's). Throws std::invalid_argument for p <= 0 or NaN and for the arguments
/// clip_by_norm rejects.
///
///     auto result = gradclip::clip_by_norm(grad, 1.0, gradclip::inf_norm);
template <class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
clip_result clip_by_norm(Grad&& g, double max_norm, norm_type type, options opt = {}) {
  constexpr const char* function = "gradclip::clip_by_norm";
  detail::check_norm_type(function, type);
  if (type.p() == 2.0) return clip_by_norm<robust>(std::forward<Grad>(g), max_norm, opt);
  detail::check_clip_arguments(function, max_norm, opt);
  return detail::visit_gradient(g, [&](const auto& view) {
    const detail::clip_plan plan = detail::plan_clip(function, detail::p_norm_of_view(view, type.p()), max_norm, opt);
    if (plan.result.clipped) detail::apply_coefficient<robust>(view, plan.coefficient);
    return plan.result;
  });
}

/// Clips a raw buffer of `size` elements in place by its p-norm; see the overload above.
template <class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_by_norm(T* data, std::size_t size, double max_norm, norm_type type, options opt = {}) {
  return clip_by_norm(detail::strided_view<T>{data, size}, max_norm, type, opt);
}

/// Clips every gradient of a group by one coefficient computed from the global p-norm (for inf_norm the
/// largest magnitude in the group). Same semantics as clip_by_global_norm.
///
///     auto result = gradclip::clip_by_global_norm(grads, 1.0, gradclip::l1_norm);
template <class Grads>
clip_result clip_by_global_norm(Grads& grads, double max_norm, norm_type type, options opt = {}) {
  return detail::clip_group_by_p_norm(grads, max_norm, type, opt);
}

/// The same for a temporary group, e.g. a vector of maps made for the call.
template <class Grads, class = std::enable_if_t<!std::is_reference_v<Grads>>>
clip_result clip_by_global_norm(Grads&& grads, double max_norm, norm_type type, options opt = {}) {
  return detail::clip_group_by_p_norm(grads, max_norm, type, opt);
}

/// The same for a braced list of gradients of any element types.
inline clip_result clip_by_global_norm(std::initializer_list<grad_view> grads, double max_norm, norm_type type,
                                       options opt = {}) {
  return detail::clip_group_by_p_norm(grads, max_norm, type, opt);
}

}  // namespace gradclip
