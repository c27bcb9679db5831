// Dynamic loss scaling fused with clipping: one read pass over the scaled gradients finds the norm and any
// overflow, one write pass unscales and clips, rounded once to the element type.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/detail/scale.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace gradclip {

/// How the loss scale S moves: PyTorch GradScaler's parameters and defaults.
struct loss_scaler_config {
  double init_scale = 65536.0;  ///< the first S; finite, in [loss_scaler::smallest_scale, largest_scale]
  double growth_factor = 2.0;   ///< S *= growth_factor after growth_interval finite steps in a row; > 1
  double backoff_factor = 0.5;  ///< S *= backoff_factor after a non-finite step; in (0, 1)
  int growth_interval = 2000;   ///< finite steps in a row before S grows; >= 1
};

// Internals of the loss scaler, in their own namespace so that they cannot clash with the core's.
namespace detail::loss_scaling {

/// S = mantissa * 2^exponent with mantissa in [1, 2): the power of two divides out exactly.
struct split_scale {
  double mantissa;
  int exponent;
};

inline split_scale split(double s) noexcept {
  int e = 0;
  const double m = std::frexp(s, &e);  // m in [0.5, 1)
  return {2 * m, e - 1};
}

/// The sum of squares of g / S from that of g: exact when S is a power of two, two roundings of the
/// double sum otherwise (negligible next to the element type's). Never overflows: only the exponent moves.
inline partial_norm unscaled(partial_norm part, const split_scale& s) noexcept {
  if (!part.finite || part.sum == 0.0) return part;
  part.exponent -= s.exponent;
  if (s.mantissa != 1.0) part.sum = part.sum / s.mantissa / s.mantissa;
  return part;
}

/// x / m rounded to odd: when inexact, the neighbour of the exact quotient whose last bit is 1. A later
/// round-to-nearest to a type with at least two digits fewer is then the correct rounding of x / m.
inline double quotient_rounded_to_odd(double x, double m) noexcept {
  const double q = x / m;
  const double remainder = std::fma(-q, m, x);  // exact: x - q * m
  std::uint64_t bits;
  std::memcpy(&bits, &q, sizeof bits);
  if (remainder == 0 || (bits & 1u) != 0) return q;
  const double toward =
      remainder > 0 ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  return std::nextafter(q, toward);
}

/// Rounds to T once: FP16 and BF16 go through FP32 rounded to odd, so the two steps round like one.
template <class T>
T narrow_from_odd(double y) noexcept {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return static_cast<T>(y);
  } else {
    float f = static_cast<float>(y);
    if (static_cast<double>(f) != y && (bits_of(f) & 1u) == 0)
      f = std::nextafter(f, y > static_cast<double>(f) ? std::numeric_limits<float>::infinity()
                                                       : -std::numeric_limits<float>::infinity());
    return T(f);
  }
}

/// p[i] <- p[i] * c / m for a scale S = m * 2^k that is not a power of two (c carries the 2^-k).
/// Unclipped (c a power of two), each element is x / S correctly rounded to T: one rounding. Clipped, the
/// factor c / m is rounded to FP64 first: negligible for FP32 and narrower, half an ulp more for FP64.
template <class T>
void divide_and_multiply(T* p, std::size_t n, double mantissa, const factor& c) noexcept {
  // 2^exponent as two normal doubles, applied last so that no intermediate over- or underflows.
  const double first = std::ldexp(1.0, c.exponent / 2);
  const double second = std::ldexp(1.0, c.exponent - c.exponent / 2);
  if (c.mantissa == 1.0) {
    for (std::size_t i = 0; i < n; ++i) {
      const double x = widen<double>(p[i]);
      const double q = std::is_same_v<T, double> ? x / mantissa : quotient_rounded_to_odd(x, mantissa);
      p[i] = narrow_from_odd<T>(q * first * second);
    }
  } else {
    const double ratio = c.mantissa / mantissa;
    for (std::size_t i = 0; i < n; ++i) p[i] = narrow<T>(widen<double>(p[i]) * ratio * first * second);
  }
}

/// Calls f(strided_view<T>) for one gradient, or for each gradient of a group.
template <class Grads, class F>
void for_each_view(Grads& grads, F&& f) {
  if constexpr (is_gradient_v<Grads>) {
    visit_gradient(grads, f);
  } else {
    for (auto& g : grads) visit_gradient(g, f);
  }
}

/// The partial norm of one gradient or of a group.
template <class Policy, class Grads>
partial_norm partial_norm_of_any(const Grads& grads) {
  if constexpr (is_gradient_v<Grads>)
    return partial_norm_of<Policy>(grads);
  else
    return partial_norm_of_group<Policy>(grads);
}

}  // namespace detail::loss_scaling

/// Dynamic loss scaling (as PyTorch's GradScaler) whose unscale is fused with global-norm clipping.
///
/// The loss is multiplied by scale() before the backward pass; unscale_and_clip() then reads the scaled
/// gradients once (norm and overflow check) and writes them once, unscaled and clipped; update() lowers S
/// after an overflow and raises it after growth_interval finite steps in a row. S stays a finite, normal
/// FP32 number in [smallest_scale, largest_scale] however long training runs. S falls below 1 only when the
/// true gradients overflow their type; an unscaled (and unclipped) element beyond the type's range then
/// becomes +-inf, its correct rounding.
///
///     gradclip::loss_scaler scaler;
///     backward(loss * scaler.scale());                       // gradients now hold g * S
///     auto step = scaler.unscale_and_clip(grads, 1.0);      // g, clipped to norm 1; untouched on overflow
///     if (step.finite) optimizer.step();
///     scaler.update(step);
class loss_scaler {
 public:
  /// Bounds of the scale: the smallest normal and the largest power of two of FP32.
  static constexpr double smallest_scale = 0x1p-126;
  static constexpr double largest_scale = 0x1p127;

  loss_scaler() : loss_scaler(loss_scaler_config{}) {}

  /// Throws std::invalid_argument (naming gradclip::loss_scaler) for an init_scale that is not finite or
  /// outside [smallest_scale, largest_scale], a growth_factor that is not finite and > 1, a backoff_factor
  /// outside (0, 1), or a growth_interval < 1.
  explicit loss_scaler(loss_scaler_config config) : config_(config), scale_(config.init_scale) {
    const std::string function = "gradclip::loss_scaler: ";
    if (!(config.init_scale >= smallest_scale && config.init_scale <= largest_scale))
      throw std::invalid_argument(function + "init_scale must be in [2^-126, 2^127]");
    if (!(config.growth_factor > 1.0) || !std::isfinite(config.growth_factor))
      throw std::invalid_argument(function + "growth_factor must be finite and > 1");
    if (!(config.backoff_factor > 0.0 && config.backoff_factor < 1.0))
      throw std::invalid_argument(function + "backoff_factor must be in (0, 1)");
    if (config.growth_interval < 1) throw std::invalid_argument(function + "growth_interval must be >= 1");
  }

  /// The current loss scale S: multiply the loss by it before the backward pass.
  double scale() const noexcept { return scale_; }

  /// Finite steps in a row since S last changed (PyTorch's growth tracker).
  int growth_tracker() const noexcept { return growth_tracker_; }

  const loss_scaler_config& config() const noexcept { return config_; }

  /// Unscales and clips scaled gradients in place: g <- g * min(1, max_norm / (||g / S|| + epsilon)) / S.
  ///
  /// One read pass (the policy's norm of the scaled gradients, which also detects NaN and Inf) and one
  /// write pass, each element rounded once to its type. `result.norm` is ||g / S||, computed without
  /// overflow (only the power-of-two exponent of the scaled sum of squares moves); `result.coefficient`
  /// is the clip factor alone, without 1/S. Non-finite gradients follow opt.nonfinite (skip: every gradient
  /// untouched, `finite = false`, so the caller skips the step and update() backs off). Takes one gradient
  /// or a group (any range of gradients, e.g. std::vector<grad_view> mixing element types).
  /// Throws std::invalid_argument for a negative or NaN max_norm or a bad epsilon.
  ///
  ///     auto step = scaler.unscale_and_clip(grads, 1.0);
  template <class Policy = robust, class Grads>
  clip_result unscale_and_clip(Grads&& grads, double max_norm, options opt = {}) {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale_and_clip", grads, max_norm, opt);
  }

  /// The same for a braced list of gradients of any element types: unscale_and_clip({w, b}, 1.0).
  template <class Policy = robust>
  clip_result unscale_and_clip(std::initializer_list<grad_view> grads, double max_norm, options opt = {}) {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale_and_clip", grads, max_norm, opt);
  }

  /// Unscales in place, g <- g / S, in the same two passes (the read pass detects non-finite values and
  /// gives `result.norm` = ||g / S||); never clips. With a scale that is not a power of two each element is
  /// still x / S correctly rounded.
  template <class Policy = robust, class Grads>
  clip_result unscale(Grads&& grads, options opt = {}) {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale", grads,
                                         std::numeric_limits<double>::infinity(), opt);
  }

  /// The same for a braced list of gradients of any element types.
  template <class Policy = robust>
  clip_result unscale(std::initializer_list<grad_view> grads, options opt = {}) {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale", grads,
                                         std::numeric_limits<double>::infinity(), opt);
  }

  /// Moves S after a step: times backoff_factor (and the count of finite steps reset) when !step.finite,
  /// times growth_factor after growth_interval finite steps in a row; clamped to the bounds.
  void update(const clip_result& step) noexcept {
    if (!step.finite) {
      scale_ = std::max(scale_ * config_.backoff_factor, smallest_scale);
      growth_tracker_ = 0;
    } else if (++growth_tracker_ >= config_.growth_interval) {
      scale_ = std::min(scale_ * config_.growth_factor, largest_scale);
      growth_tracker_ = 0;
    }
  }

 private:
  template <class Policy, class Grads>
  clip_result unscale_and_clip_impl(const char* function, Grads& grads, double max_norm, const options& opt) {
    using group = std::remove_cv_t<Grads>;
    static_assert(detail::is_gradient_v<group> || detail::is_gradient_range_v<group>,
                  "The loss scaler takes one gradient or a range (std::vector, std::array, ...) of gradients.");
    detail::check_clip_arguments(function, max_norm, opt);
    const detail::loss_scaling::split_scale s = detail::loss_scaling::split(scale_);
    const partial_norm part =
        detail::loss_scaling::unscaled(detail::loss_scaling::partial_norm_of_any<Policy>(grads), s);
    const detail::clip_plan plan = detail::plan_clip(function, part, max_norm, opt);
    if (!plan.result.finite && opt.nonfinite == on_nonfinite::skip) return plan.result;
    if (!plan.result.clipped && scale_ == 1.0) return plan.result;  // nothing to change: no write pass
    // c / S = mantissa_c * 2^(exponent_c - k) / m; for a power-of-two S (m = 1) the core's kernel does it.
    const detail::factor combined{plan.coefficient.mantissa, plan.coefficient.exponent - s.exponent};
    detail::loss_scaling::for_each_view(grads, [&](const auto& view) {
      using T = typename std::decay_t<decltype(view)>::element_type;
      static_assert(!std::is_const_v<T>, "Unscaling modifies the gradient in place, so it cannot be const.");
      if (s.mantissa == 1.0)
        detail::apply_coefficient<Policy>(view, combined);
      else
        view.for_each_run(
            [&](T* p, std::size_t n) { detail::loss_scaling::divide_and_multiply(p, n, s.mantissa, combined); }, true);
    });
    return plan.result;
  }

  loss_scaler_config config_;
  double scale_;
  int growth_tracker_ = 0;
};

}  // namespace gradclip
