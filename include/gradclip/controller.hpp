// Threshold controllers: objects that set the clipping threshold of each step from the history of
// gradient norms (gradclip::zclip, autoclip, spike_skip), and the clipping calls that consult them.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <initializer_list>
#include <type_traits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {

namespace detail {

template <class C, class = void>
struct is_threshold_controller : std::false_type {};
template <class C>
struct is_threshold_controller<C, std::void_t<decltype(std::declval<const C&>().decide(0.0)),
                                              decltype(std::declval<C&>().update(std::declval<const clip_result&>())),
                                              decltype(std::declval<const C&>().fallback_threshold())>>
    : std::bool_constant<std::is_same_v<decltype(std::declval<const C&>().decide(0.0)), threshold_decision> &&
                         std::is_convertible_v<decltype(std::declval<const C&>().fallback_threshold()), double> &&
                         std::is_copy_constructible_v<C>> {};

}  // namespace detail

/// True for a threshold controller C, a copyable type with
///   - `threshold_decision decide(double norm) const`: pure; called with the step's finite norm;
///   - `void update(const clip_result& step)`: told the outcome; ignores steps with `finite == false`;
///   - `double fallback_threshold() const`: the threshold for a non-finite norm under on_nonfinite::propagate;
/// and whose whole state (configuration included) round-trips exactly through operator<< / operator>>.
template <class C>
inline constexpr bool is_threshold_controller_v =
    detail::is_threshold_controller<std::remove_cv_t<std::remove_reference_t<C>>>::value;

/// Clips a group by its global norm to the threshold a controller sets from the history of norms:
/// one read pass for the norm, `controller.decide(norm)`, one write pass only if the step clips, then
/// `controller.update(result)`. `result.threshold` is the threshold applied (+inf when none);
/// `result.skip` is true when the controller said to skip the step, and the gradients are then untouched.
/// A non-finite norm follows opt.nonfinite and never enters the controller's statistics; with
/// on_nonfinite::propagate the gradients are multiplied as by a fixed threshold equal to
/// `controller.fallback_threshold()` (for zclip its max_norm cap).
///
///     gradclip::zclip controller;   // ZClip's defaults
///     auto result = gradclip::clip_by_global_norm(grads, controller);
template <class Policy = robust, class Grads, class Controller,
          class = std::enable_if_t<detail::is_gradient_range_v<Grads&> && is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(Grads&& grads, Controller& controller, const options& opt = {}) {
  return detail::clip<Policy>("gradclip::clip_by_global_norm", grads, detail::controlled<Controller>{controller}, opt);
}

/// The same for a braced list of gradients of any element types: clip_by_global_norm({w, b}, controller).
template <class Policy = robust, class Controller, class = std::enable_if_t<is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(std::initializer_list<grad_view> grads, Controller& controller,
                                const options& opt = {}) {
  return detail::clip<Policy>("gradclip::clip_by_global_norm", grads, detail::controlled<Controller>{controller}, opt);
}

/// Clips one gradient by its norm to the threshold a controller sets; see clip_by_global_norm above.
///
///     auto result = gradclip::clip_by_norm(grad, controller);
template <class Policy = robust, class Grad, class Controller,
          class = std::enable_if_t<detail::is_gradient_v<Grad> && is_threshold_controller_v<Controller>>>
clip_result clip_by_norm(Grad&& g, Controller& controller, const options& opt = {}) {
  return detail::with_single(g, [&](auto& group) {
    return detail::clip<Policy>("gradclip::clip_by_norm", group, detail::controlled<Controller>{controller}, opt);
  });
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
