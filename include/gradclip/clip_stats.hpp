// Clip statistics over a logging interval: how often clipping binds, how often steps overflow or are
// skipped, how large the norms and thresholds are. The clip fraction per interval tells which regime
// training is in.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/exact_io.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <istream>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>

namespace gradclip {
inline namespace GRADCLIP_ABI {

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

/// Counts, norm and threshold statistics of clip_results since the last reset(). Its whole state
/// round-trips exactly through operator<< / operator>> (for checkpoints); log_line() is for people.
///
///     gradclip::clip_stats stats(gradclip::element_count(grads));
///     stats.record(scaler.unscale_and_clip(grads, 1.0));    // every step
///     if (step % 100 == 0) { std::cout << stats.log_line() << '\n'; stats.reset(); }
class clip_stats {
 public:
  clip_stats() = default;

  /// With the element count of the clipped group, the statistics also report the norm per sqrt(n).
  explicit clip_stats(std::size_t element_count) noexcept : element_count_(element_count) {}

  /// Adds one step. Non-finite steps are counted but enter neither the norms, the thresholds nor the clip
  /// fraction. Finite thresholds (a fixed max_norm or a controller's) enter the threshold statistics.
  void record(const clip_result& step) noexcept {
    ++steps_;
    if (!step.finite) {
      ++nonfinite_steps_;
      return;
    }
    clipped_steps_ += step.clipped ? 1 : 0;
    skipped_steps_ += step.skip ? 1 : 0;
    norm_sum_ += step.norm;
    max_norm_ = std::max(max_norm_, step.norm);
    if (std::isfinite(step.threshold)) {
      ++threshold_steps_;
      threshold_sum_ += step.threshold;
      last_threshold_ = step.threshold;
    }
  }

  std::size_t steps() const noexcept { return steps_; }
  /// Finite steps at which clipping bound.
  std::size_t clipped_steps() const noexcept { return clipped_steps_; }
  /// Steps whose gradient was not finite (skipped, with a loss scaler).
  std::size_t nonfinite_steps() const noexcept { return nonfinite_steps_; }
  std::size_t finite_steps() const noexcept { return steps_ - nonfinite_steps_; }
  /// Finite steps that a threshold controller said to skip (gradient untouched).
  std::size_t skipped_steps() const noexcept { return skipped_steps_; }

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

  /// The mean of the finite thresholds of the finite steps; NaN when there was none.
  double mean_threshold() const noexcept {
    return threshold_steps_ == 0 ? std::numeric_limits<double>::quiet_NaN()
                                 : threshold_sum_ / static_cast<double>(threshold_steps_);
  }

  /// The finite threshold of the latest finite step that had one (a controller's current threshold);
  /// NaN when there was none.
  double last_threshold() const noexcept {
    return threshold_steps_ == 0 ? std::numeric_limits<double>::quiet_NaN() : last_threshold_;
  }

  std::size_t element_count() const noexcept { return element_count_; }

  /// Starts a new logging interval; the element count is kept.
  void reset() noexcept { *this = clip_stats(element_count_); }

  /// One log line: `steps=100 clipped=23 clip_fraction=0.23 nonfinite=1 mean_norm=1.5 max_norm=4
  /// norm_per_sqrt_n=0.002 skipped=2 mean_threshold=1.2 last_threshold=1.1`; norm_per_sqrt_n only when the
  /// element count is known, skipped only when a step was, the thresholds only when a step had one.
  std::string log_line() const {
    std::ostringstream out;
    out << "steps=" << steps() << " clipped=" << clipped_steps() << " clip_fraction=" << clip_fraction()
        << " nonfinite=" << nonfinite_steps() << " mean_norm=" << mean_norm() << " max_norm=" << max_norm();
    if (element_count_ != 0) out << " norm_per_sqrt_n=" << mean_norm_per_sqrt_n();
    if (skipped_steps_ != 0) out << " skipped=" << skipped_steps_;
    if (threshold_steps_ != 0) out << " mean_threshold=" << mean_threshold() << " last_threshold=" << last_threshold();
    return out.str();
  }

  friend bool operator==(const clip_stats& a, const clip_stats& b) noexcept {
    return a.element_count_ == b.element_count_ && a.steps_ == b.steps_ && a.clipped_steps_ == b.clipped_steps_ &&
           a.nonfinite_steps_ == b.nonfinite_steps_ && a.skipped_steps_ == b.skipped_steps_ &&
           a.threshold_steps_ == b.threshold_steps_ && a.norm_sum_ == b.norm_sum_ && a.max_norm_ == b.max_norm_ &&
           a.threshold_sum_ == b.threshold_sum_ && a.last_threshold_ == b.last_threshold_;
  }
  friend bool operator!=(const clip_stats& a, const clip_stats& b) noexcept { return !(a == b); }

  /// Writes the whole state exactly (doubles as bit patterns), for checkpoints; see log_line() for people.
  friend std::ostream& operator<<(std::ostream& out, const clip_stats& s) {
    detail::write_tag(out, "gradclip::clip_stats");
    for (std::size_t n :
         {s.element_count_, s.steps_, s.clipped_steps_, s.nonfinite_steps_, s.skipped_steps_, s.threshold_steps_})
      detail::write_exact(out, n);
    for (double x : {s.norm_sum_, s.max_norm_, s.threshold_sum_, s.last_threshold_}) detail::write_exact(out, x);
    return out;
  }

  /// Reads a state written by operator<<; on malformed or inconsistent input sets failbit and leaves s
  /// unchanged.
  friend std::istream& operator>>(std::istream& in, clip_stats& s) {
    clip_stats r;
    if (detail::read_tag(in, "gradclip::clip_stats") && detail::read_exact(in, r.element_count_) &&
        detail::read_exact(in, r.steps_) && detail::read_exact(in, r.clipped_steps_) &&
        detail::read_exact(in, r.nonfinite_steps_) && detail::read_exact(in, r.skipped_steps_) &&
        detail::read_exact(in, r.threshold_steps_) && detail::read_exact(in, r.norm_sum_) &&
        detail::read_exact(in, r.max_norm_) && detail::read_exact(in, r.threshold_sum_) &&
        detail::read_exact(in, r.last_threshold_)) {
      if (r.nonfinite_steps_ > r.steps_ || r.clipped_steps_ > r.finite_steps() || r.skipped_steps_ > r.finite_steps() ||
          r.threshold_steps_ > r.finite_steps()) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      s = r;
    }
    return in;
  }

 private:
  std::size_t element_count_ = 0;
  std::size_t steps_ = 0;
  std::size_t clipped_steps_ = 0;
  std::size_t nonfinite_steps_ = 0;
  std::size_t skipped_steps_ = 0;
  std::size_t threshold_steps_ = 0;
  double norm_sum_ = 0.0;
  double max_norm_ = 0.0;
  double threshold_sum_ = 0.0;
  double last_threshold_ = 0.0;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
