// Clip statistics over a logging interval: how often clipping binds, how often steps overflow, how large
// the norms are. The clip fraction per interval tells which regime training is in.
#pragma once

#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <ostream>

namespace gradclip {

/// The number of elements of one gradient or of a group (any range of gradients): the n in the
/// threshold's natural sqrt(n) growth.
template <class Grads>
std::size_t element_count(const Grads& grads) {
  const auto size = [](const auto& view) { return view.size(); };
  if constexpr (detail::is_gradient_v<Grads>) {
    return detail::visit_gradient(grads, size);
  } else {
    static_assert(detail::is_gradient_range_v<const Grads&>,
                  "element_count takes one gradient or a range (std::vector, std::array, ...) of gradients.");
    std::size_t total = 0;
    for (const auto& g : grads) total += detail::visit_gradient(g, size);
    return total;
  }
}

/// Counts and norm statistics of clip_results since the last reset().
///
///     gradclip::clip_stats stats(gradclip::element_count(grads));
///     stats.record(scaler.unscale_and_clip(grads, 1.0));    // every step
///     if (step % 100 == 0) { std::cout << stats << '\n'; stats.reset(); }
class clip_stats {
 public:
  clip_stats() = default;

  /// With the element count of the clipped group, the statistics also report the norm per sqrt(n).
  explicit clip_stats(std::size_t element_count) noexcept : element_count_(element_count) {}

  /// Adds one step. Non-finite steps are counted but enter neither the norms nor the clip fraction.
  void record(const clip_result& step) noexcept {
    ++steps_;
    if (!step.finite) {
      ++nonfinite_steps_;
      return;
    }
    clipped_steps_ += step.clipped ? 1 : 0;
    norm_sum_ += step.norm;
    max_norm_ = std::max(max_norm_, step.norm);
  }

  std::size_t steps() const noexcept { return steps_; }
  /// Finite steps at which clipping bound.
  std::size_t clipped_steps() const noexcept { return clipped_steps_; }
  /// Steps whose gradient was not finite (skipped, with a loss scaler).
  std::size_t nonfinite_steps() const noexcept { return nonfinite_steps_; }
  std::size_t finite_steps() const noexcept { return steps_ - nonfinite_steps_; }

  /// clipped_steps() / finite_steps(); 0 when there was no finite step.
  double clip_fraction() const noexcept {
    return finite_steps() == 0 ? 0.0 : static_cast<double>(clipped_steps_) / static_cast<double>(finite_steps());
  }

  /// The mean norm (before clipping) over the finite steps; NaN when there was none.
  double mean_norm() const noexcept {
    return finite_steps() == 0 ? std::numeric_limits<double>::quiet_NaN()
                               : norm_sum_ / static_cast<double>(finite_steps());
  }

  /// The largest norm over the finite steps; NaN when there was none.
  double max_norm() const noexcept {
    return finite_steps() == 0 ? std::numeric_limits<double>::quiet_NaN() : max_norm_;
  }

  /// mean_norm() / sqrt(element count): the root-mean-square gradient element, comparable across model
  /// sizes, so a threshold can be carried over as max_norm = this * sqrt(n). NaN when the count is unknown.
  double mean_norm_per_sqrt_n() const noexcept {
    return element_count_ == 0 ? std::numeric_limits<double>::quiet_NaN()
                               : mean_norm() / std::sqrt(static_cast<double>(element_count_));
  }

  std::size_t element_count() const noexcept { return element_count_; }

  /// Starts a new logging interval; the element count is kept.
  void reset() noexcept { *this = clip_stats(element_count_); }

  /// One log line: `steps=100 clipped=23 clip_fraction=0.23 nonfinite=1 mean_norm=1.5 max_norm=4
  /// norm_per_sqrt_n=0.002` (the last field only when the element count is known).
  friend std::ostream& operator<<(std::ostream& out, const clip_stats& s) {
    out << "steps=" << s.steps() << " clipped=" << s.clipped_steps() << " clip_fraction=" << s.clip_fraction()
        << " nonfinite=" << s.nonfinite_steps() << " mean_norm=" << s.mean_norm() << " max_norm=" << s.max_norm();
    if (s.element_count_ != 0) out << " norm_per_sqrt_n=" << s.mean_norm_per_sqrt_n();
    return out;
  }

 private:
  std::size_t element_count_ = 0;
  std::size_t steps_ = 0;
  std::size_t clipped_steps_ = 0;
  std::size_t nonfinite_steps_ = 0;
  double norm_sum_ = 0.0;
  double max_norm_ = 0.0;
};

}  // namespace gradclip
