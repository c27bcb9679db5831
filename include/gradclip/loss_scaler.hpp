// Dynamic loss scaling fused with clipping: one read pass over the scaled gradients finds the norm and any
// overflow, one write pass unscales and clips, rounded once to the element type.
#pragma once

#include <gradclip/controller.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/dispatch.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/report.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// How the loss scale S moves: PyTorch GradScaler's parameters and defaults.
struct loss_scaler_config {
  double init_scale = 65536.0;  ///< the first S; finite, in [loss_scaler::smallest_scale, largest_scale]
  double growth_factor = 2.0;   ///< S *= growth_factor after growth_interval finite steps in a row; > 1
  double backoff_factor = 0.5;  ///< S *= backoff_factor after a non-finite step; in (0, 1)
  int growth_interval = 2000;   ///< finite steps in a row before S grows; >= 1
};

/// The loss scaler's whole state, field for field GradScaler's state_dict: a run moving between PyTorch
/// and gradclip keeps its scale by copying these five numbers.
struct loss_scaler_state {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
  int growth_tracker = 0;  ///< GradScaler's `_growth_tracker`
};

namespace detail {

/// The part of g / S from the part of g: only the exponent moves when S is a power of two; otherwise
/// one more rounding of the sum (negligible next to the element type's). Never overflows.
inline partial_norm unscaled(partial_norm part, double s) noexcept {
  if (!part.finite || part.sum == 0.0) return part;
  const scaled split = scaled::of(s);  // S = m * 2^k, m in [1, 2)
  part.exponent -= split.exponent;
  if (split.mantissa != 1.0) part.sum = norm_kind{part.p}.unscaled_sum(part.sum, split.mantissa);
  return part;
}

}  // namespace detail

/// Dynamic loss scaling (as PyTorch's GradScaler) whose unscale is fused with global-norm clipping.
///
/// The loss is multiplied by scale() before the backward pass; unscale_and_clip() then reads the scaled
/// gradients once (norm and overflow check) and writes them once, unscaled and clipped; update() lowers S
/// after an overflow and raises it after growth_interval finite steps in a row. S is always an FP32
/// number (each update is rounded to FP32) in [smallest_scale, largest_scale], however long training runs.
/// S falls below 1 only when the true gradients overflow their type; an unscaled (and unclipped) element
/// beyond the type's range then becomes +-inf, its correct rounding.
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
  /// outside (0, 1), or a growth_interval < 1. init_scale is rounded to FP32.
  explicit loss_scaler(const loss_scaler_config& config) {
    assign({config.init_scale, config.growth_factor, config.backoff_factor, config.growth_interval, 0}, "init_scale");
  }

  /// Resumes from a saved state (state_dict(), or PyTorch GradScaler's state_dict fields). Throws
  /// std::invalid_argument as the config constructor does, and for a growth_tracker outside
  /// [0, growth_interval).
  explicit loss_scaler(const loss_scaler_state& state) { load_state_dict(state); }

  /// The current loss scale S: multiply the loss by it before the backward pass.
  double scale() const noexcept { return scale_; }

  /// Finite steps in a row since S last changed (PyTorch's growth tracker).
  int growth_tracker() const noexcept { return growth_tracker_; }

  loss_scaler_config config() const noexcept { return {scale_, growth_factor_, backoff_factor_, growth_interval_}; }

  /// The whole state, GradScaler's state_dict fields.
  loss_scaler_state state_dict() const noexcept {
    return {scale_, growth_factor_, backoff_factor_, growth_interval_, growth_tracker_};
  }

  /// Replaces the whole state; validated first, so a bad state changes nothing.
  void load_state_dict(const loss_scaler_state& state) { assign(state, "scale"); }

  /// Unscales and clips scaled gradients in place: g <- g * c / S with c = max_norm / (||g / S|| +
  /// epsilon) when c < 1, else 1; the norm is options::norm.
  ///
  /// One read pass (the policy's norm of the scaled gradients, which also detects NaN and Inf) and one
  /// write pass, each element rounded once to its type from an FP64 product by c / S (rounded to FP64
  /// first when S is not a power of two). `result.norm` is ||g / S||, computed without overflow;
  /// `result.coefficient` is the clip factor alone, without 1/S. Non-finite gradients follow
  /// opt.nonfinite (skip: every gradient untouched, `finite = false`, so the caller skips the step and
  /// update() backs off). Takes one gradient or a group (any range of gradients, e.g.
  /// std::vector<grad_view> mixing element types); runs on up to opt.threads threads. Throws
  /// std::invalid_argument for a negative or NaN max_norm and for bad options.
  ///
  ///     auto step = scaler.unscale_and_clip(grads, 1.0);
  template <class Policy = robust, class Grads>
  clip_result unscale_and_clip(Grads&& grads, double max_norm, const options& opt = {}) const {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale_and_clip", grads,
                                         detail::fixed_threshold{max_norm}, opt);
  }

  /// The same for a braced list of gradients of any element types: unscale_and_clip({w, b}, 1.0).
  template <class Policy = robust>
  clip_result unscale_and_clip(std::initializer_list<grad_view> grads, double max_norm, const options& opt = {}) const {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale_and_clip", grads,
                                         detail::fixed_threshold{max_norm}, opt);
  }

  /// Unscales and clips to the threshold a controller (controller.hpp) sets from ||g / S||, in the same
  /// two passes; a step the controller skips is left untouched (still scaled).
  ///
  ///     auto step = scaler.unscale_and_clip(grads, controller);
  template <class Policy = robust, class Grads, class Controller,
            class = std::enable_if_t<is_threshold_controller_v<Controller>>>
  clip_result unscale_and_clip(Grads&& grads, Controller& controller, const options& opt = {}) const {
    return unscale_and_clip_impl<Policy>("gradclip::loss_scaler::unscale_and_clip", grads,
                                         detail::controlled<Controller>{controller}, opt);
  }

  /// Unscales in place, g <- g / S, in the same two passes (the read pass detects non-finite values and
  /// gives `result.norm` = ||g / S||); never clips: `clipped` is false and `coefficient` 1 on every input.
  /// Each element is x / S correctly rounded to its type, subnormal results included. Non-finite
  /// gradients are unscaled too (NaN and Inf elements stay what they are) and reported with `finite =
  /// false`, under skip as under propagate, as PyTorch's unscale_ does; with on_nonfinite::error the call
  /// throws nonfinite_error before writing.
  template <class Policy = robust, class Grads>
  clip_result unscale(Grads&& grads, const options& opt = {}) const {
    return unscale_impl<Policy>("gradclip::loss_scaler::unscale", grads, opt);
  }

  /// The same for a braced list of gradients of any element types.
  template <class Policy = robust>
  clip_result unscale(std::initializer_list<grad_view> grads, const options& opt = {}) const {
    return unscale_impl<Policy>("gradclip::loss_scaler::unscale", grads, opt);
  }

  /// Moves S after a step: times backoff_factor (and the count of finite steps reset) when !step.finite,
  /// times growth_factor after growth_interval finite steps in a row; clamped to the bounds and rounded to
  /// FP32.
  void update(const clip_result& step) noexcept {
    if (!step.finite) {
      scale_ = to_fp32(std::max(scale_ * backoff_factor_, smallest_scale));
      growth_tracker_ = 0;
    } else if (++growth_tracker_ >= growth_interval_) {
      scale_ = to_fp32(std::min(scale_ * growth_factor_, largest_scale));
      growth_tracker_ = 0;
    }
  }

  /// Writes the whole state as five numbers, each exactly (17 significant digits), as the standard
  /// random engines do: `operator>>` restores a scaler that makes the same decisions bit for bit.
  friend std::ostream& operator<<(std::ostream& out, const loss_scaler& s) {
    const auto flags = out.flags();
    const auto precision = out.precision(17);
    out.unsetf(std::ios_base::floatfield);
    out << s.scale_ << ' ' << s.growth_factor_ << ' ' << s.backoff_factor_ << ' ' << s.growth_interval_ << ' '
        << s.growth_tracker_;
    out.precision(precision);
    out.flags(flags);
    return out;
  }

  /// Reads what operator<< wrote. On malformed or invalid input the stream's failbit is set and the
  /// scaler is unchanged.
  friend std::istream& operator>>(std::istream& in, loss_scaler& s) {
    loss_scaler_state state;
    if (!(in >> state.scale >> state.growth_factor >> state.backoff_factor >> state.growth_interval >>
          state.growth_tracker))
      return in;
    try {
      s.load_state_dict(state);
    } catch (const std::invalid_argument&) {
      in.setstate(std::ios_base::failbit);
    }
    return in;
  }

 private:
  // Validates every field before changing any; `scale_field` names the scale as the caller knows it.
  void assign(const loss_scaler_state& state, const char* scale_field) {
    const std::string function = "gradclip::loss_scaler: ";
    if (!(state.scale >= smallest_scale && state.scale <= largest_scale))
      throw std::invalid_argument(function + scale_field + " must be in [2^-126, 2^127]");
    if (!(state.growth_factor > 1.0) || !std::isfinite(state.growth_factor))
      throw std::invalid_argument(function + "growth_factor must be finite and > 1");
    if (!(state.backoff_factor > 0.0 && state.backoff_factor < 1.0))
      throw std::invalid_argument(function + "backoff_factor must be in (0, 1)");
    if (state.growth_interval < 1) throw std::invalid_argument(function + "growth_interval must be >= 1");
    if (state.growth_tracker < 0 || state.growth_tracker >= state.growth_interval)
      throw std::invalid_argument(function + "growth_tracker must be in [0, growth_interval)");
    scale_ = to_fp32(state.scale);
    growth_factor_ = state.growth_factor;
    backoff_factor_ = state.backoff_factor;
    growth_interval_ = state.growth_interval;
    growth_tracker_ = state.growth_tracker;
  }

  static constexpr detail::fixed_threshold never_clips{std::numeric_limits<double>::infinity()};

  static double to_fp32(double x) noexcept { return static_cast<double>(static_cast<float>(x)); }

  // The pipeline on the scaled gradients: the part of g / S, the threshold from `source`, and a write
  // pass that unscales and clips together (or only unscales).
  template <class Policy, class Grads, class Source>
  clip_result unscale_and_clip_impl(const char* function, Grads& grads, const Source& source,
                                    const options& opt) const {
    return on_group(grads, [&](auto& group) {
      const detail::whole_group<std::remove_reference_t<decltype(group)>> layout{group};
      return detail::run_units(function, layout, source, opt, unscaled_norm<Policy>(group, opt),
                               [&](const auto& plans) {
                                 if (plans[0].result.skip) return;  // a controller's skip: still scaled
                                 if (!plans[0].result.finite && opt.nonfinite == on_nonfinite::skip) return;
                                 if (!plans[0].result.clipped) return divide(layout, opt);
                                 auto unscaling = plans;  // the clip factor and 1 / S, applied together
                                 unscaling[0].coefficient = plans[0].coefficient / detail::scaled::of(scale_);
                                 detail::apply_units<Policy>(layout, unscaling, opt);
                               })[0]
          .result;
    });
  }

  // The same pipeline with no threshold: every element is unscaled, whatever the norm (error aside, which
  // throws before writing).
  template <class Policy, class Grads>
  clip_result unscale_impl(const char* function, Grads& grads, const options& opt) const {
    return on_group(grads, [&](auto& group) {
      const detail::whole_group<std::remove_reference_t<decltype(group)>> layout{group};
      const clip_result r = detail::run_units(function, layout, never_clips, opt, unscaled_norm<Policy>(group, opt),
                                              [&](const auto&) { divide(layout, opt); })[0]
                                .result;
      return clip_result{r.norm, 1.0, false, r.finite, r.threshold};
    });
  }

  // Calls f(group): the gradients themselves, or one gradient as a group of one.
  template <class Grads, class F>
  static clip_result on_group(Grads& grads, F&& f) {
    using group = std::remove_cv_t<Grads>;
    static_assert(detail::is_gradient_v<group> || detail::is_gradient_range_v<group&>,
                  "The loss scaler takes one gradient or a range (std::vector, std::array, ...) of gradients.");
    if constexpr (detail::is_gradient_v<group>) {
      return detail::with_single(grads, f);
    } else {
      return f(grads);
    }
  }

  template <class Policy, class Group>
  auto unscaled_norm(const Group& group, const options& opt) const {
    return [&group, &opt, s = scale_] {
      if (opt.report) detail::report_staging::keep_parts(*opt.report);  // for unscale
      const partial_norm scaled = detail::reduce<Policy>(group, opt);
      if (opt.report)
        detail::report_staging::unscale(
            *opt.report, [s](const partial_norm& part) { return detail::unscaled(part, s); }, s);
      return detail::unit_parts<true>(detail::unscaled(scaled, s));
    };
  }

  // x / S in one FP64 division: correctly rounded to every element type, subnormals included.
  template <class Layout>
  void divide(const Layout& layout, const options& opt) const {
    if (scale_ == 1.0) return;
    detail::write_pieces(layout, opt, [s = scale_](const auto& piece) {
      piece.view.for_each_run(
          [&](auto* p, std::size_t n) {
            detail::with_isa(detail::best_isa(), [&](auto k) { decltype(k)::divide(p, n, s); });
          },
          true);
    });
  }

  double scale_ = 65536.0;
  double growth_factor_ = 2.0;
  double backoff_factor_ = 0.5;
  int growth_interval_ = 2000;
  int growth_tracker_ = 0;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
