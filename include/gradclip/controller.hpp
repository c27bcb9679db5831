// Threshold controllers: objects that set the clipping threshold of each step from the history of
// gradient norms (gradclip::zclip, autoclip, spike_skip), and the clipping calls that consult them.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <array>
#include <functional>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

namespace gradclip {

/// What a controller decides for one step: the threshold to clip to (+inf: no clipping), or to skip it.
struct threshold_decision {
  double threshold = std::numeric_limits<double>::infinity();
  bool skip = false;
};

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

namespace detail {

// One read pass for the norm, the controller's decision, then a write pass only if the step clips.
template <class Policy, class Grads, class Controller>
clip_result clip_with_controller(const char* function, Grads& grads, Controller& controller, const options& opt) {
  check_options(function, opt);
  const partial_norm part = partial_global_norm<Policy>(grads, opt);
  const double norm = part.norm();
  threshold_decision decision;
  if (part.finite) {
    decision = controller.decide(norm);
  } else if (opt.nonfinite == on_nonfinite::propagate) {
    decision.threshold = controller.fallback_threshold();
  }
  clip_result result{norm, 1.0, false, part.finite, decision.threshold, true};
  if (!decision.skip) {
    // Non-finite norms follow opt.nonfinite here: an error throws before the controller hears of it.
    result = clip_by_global_norm<Policy>(grads, part, decision.threshold, opt);
    result.threshold = part.finite || opt.nonfinite == on_nonfinite::propagate
                           ? decision.threshold
                           : std::numeric_limits<double>::infinity();
  }
  controller.update(result);
  return result;
}

}  // namespace detail

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
          class = std::enable_if_t<is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(Grads& grads, Controller& controller, options opt = {}) {
  return detail::clip_with_controller<Policy>("gradclip::clip_by_global_norm", grads, controller, opt);
}

/// The same for a temporary group, e.g. a vector of maps made for the call.
template <class Policy = robust, class Grads, class Controller,
          class = std::enable_if_t<!std::is_reference_v<Grads> && is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(Grads&& grads, Controller& controller, options opt = {}) {
  return detail::clip_with_controller<Policy>("gradclip::clip_by_global_norm", grads, controller, opt);
}

/// The same for a braced list of gradients of any element types: clip_by_global_norm({w, b}, controller).
template <class Policy = robust, class Controller, class = std::enable_if_t<is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(std::initializer_list<grad_view> grads, Controller& controller, options opt = {}) {
  return detail::clip_with_controller<Policy>("gradclip::clip_by_global_norm", grads, controller, opt);
}

/// Clips one gradient by its norm to the threshold a controller sets; see clip_by_global_norm above.
///
///     auto result = gradclip::clip_by_norm(grad, controller);
template <class Policy = robust, class Grad, class Controller,
          class = std::enable_if_t<detail::is_gradient_v<Grad> && is_threshold_controller_v<Controller>>>
clip_result clip_by_norm(Grad&& g, Controller& controller, options opt = {}) {
  std::array<std::reference_wrapper<std::remove_reference_t<Grad>>, 1> group{std::ref(g)};
  return detail::clip_with_controller<Policy>("gradclip::clip_by_norm", group, controller, opt);
}

}  // namespace gradclip
