// Skip-on-spike (OLMo-core's SkipStepOptimizer): a step whose norm lies far above the recent norms is
// skipped, its gradient left untouched.
#pragma once

#include <gradclip/controller.hpp>  // IWYU pragma: export
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/exact_io.hpp>
#include <gradclip/options.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// spike_skip's parameters, with OLMo-core's defaults.
struct spike_skip_config {
  std::size_t window = 128;  ///< how many previous norms the mean and deviation are taken over (>= 2)
  double sigma_factor = 6;   ///< skip when norm - mean > sigma_factor * std (finite, > 0)
  /// No decision until this many norms, the current one included, have been seen: OLMo-core's
  /// max(20, window / 2). In [3, window + 1].
  std::size_t min_norms = 64;
  double max_norm = std::numeric_limits<double>::infinity();  ///< cap for the steps not skipped (> 0; +inf: none)
};

/// OLMo-core's skip-step rule as a threshold controller. Once min_norms finite norms (this one included)
/// have been seen, a step is skipped when norm - mean > sigma_factor * std, with the mean and the
/// standard deviation (Bessel-corrected, as torch.std_mean) of the previous `window` finite norms;
/// `result.threshold` then reports mean + sigma_factor * std and the gradient is left untouched. Every
/// finite norm enters the window, skipped ones too (as in OLMo-core; llm.c's detector leaves outliers
/// out). Steps not skipped are clipped to max_norm, which by default is +inf (no clipping).
///
///     gradclip::spike_skip controller;
///     auto result = gradclip::clip_by_global_norm(grads, controller);
///     if (!result.skip) optimizer.step();
class spike_skip {
 public:
  spike_skip() : spike_skip(spike_skip_config{}) {}

  explicit spike_skip(const spike_skip_config& config) : config_(config) {
    if (const char* what = invalid_field(config))
      throw std::invalid_argument(std::string("gradclip::spike_skip_config: ") + what);
  }

  threshold_decision decide(double norm) const noexcept {
    if (recent_.size() + 1 < config_.min_norms) return {config_.max_norm, false};
    if (norm - mean_ <= config_.sigma_factor * std_) return {config_.max_norm, false};
    return {bound(), true};
  }

  void update(const clip_result& step) {
    if (!step.finite) return;
    if (recent_.size() < config_.window) {
      recent_.push_back(step.norm);
    } else {
      recent_[next_] = step.norm;
      next_ = (next_ + 1) % config_.window;
    }
    refresh();
  }

  /// mean + sigma_factor * std of the window: norms above it are skipped. +inf before any decision.
  double bound() const noexcept {
    if (recent_.size() + 1 < config_.min_norms) return std::numeric_limits<double>::infinity();
    return mean_ + config_.sigma_factor * std_;
  }

  double fallback_threshold() const noexcept { return config_.max_norm; }

  const spike_skip_config& config() const noexcept { return config_; }
  /// How many norms the window holds (at most config().window).
  std::size_t size() const noexcept { return recent_.size(); }

  friend bool operator==(const spike_skip& a, const spike_skip& b) {
    return a.config_.window == b.config_.window && a.config_.sigma_factor == b.config_.sigma_factor &&
           a.config_.min_norms == b.config_.min_norms && a.config_.max_norm == b.config_.max_norm &&
           a.in_order() == b.in_order();
  }
  friend bool operator!=(const spike_skip& a, const spike_skip& b) { return !(a == b); }

  /// Writes the configuration and the window, oldest first, exactly.
  friend std::ostream& operator<<(std::ostream& out, const spike_skip& s) {
    detail::write_tag(out, "gradclip::spike_skip");
    detail::write_exact(out, s.config_.window);
    detail::write_exact(out, s.config_.sigma_factor);
    detail::write_exact(out, s.config_.min_norms);
    detail::write_exact(out, s.config_.max_norm);
    detail::write_exact(out, s.in_order());
    return out;
  }

  /// Reads a state written by operator<<; on malformed input sets failbit and leaves s unchanged.
  friend std::istream& operator>>(std::istream& in, spike_skip& s) {
    spike_skip_config config;
    std::vector<double> norms;
    if (detail::read_tag(in, "gradclip::spike_skip") && detail::read_exact(in, config.window) &&
        detail::read_exact(in, config.sigma_factor) && detail::read_exact(in, config.min_norms) &&
        detail::read_exact(in, config.max_norm) && detail::read_exact(in, norms, config.window)) {
      if (invalid_field(config) != nullptr ||
          !std::all_of(norms.begin(), norms.end(), [](double x) { return std::isfinite(x) && x >= 0; })) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      spike_skip loaded(config);
      loaded.recent_ = std::move(norms);
      loaded.refresh();
      s = std::move(loaded);
    }
    return in;
  }

 private:
  static const char* invalid_field(const spike_skip_config& c) noexcept {
    if (c.window < 2) return "window must be >= 2";
    if (!(c.sigma_factor > 0) || !std::isfinite(c.sigma_factor)) return "sigma_factor must be finite and > 0";
    if (c.min_norms < 3 || c.min_norms > c.window + 1) return "min_norms must be in [3, window + 1]";
    if (!(c.max_norm > 0)) return "max_norm must be > 0 (+inf: no cap)";
    return nullptr;
  }

  // Two passes over the window, oldest norm first, so that a restored window (stored from its start)
  // gives the same bits.
  void refresh() noexcept {
    const std::size_t n = recent_.size();
    if (n < 2) return;
    const auto oldest_first = [&](auto&& f) {
      for (std::size_t i = next_; i < n; ++i) f(recent_[i]);
      for (std::size_t i = 0; i < next_; ++i) f(recent_[i]);
    };
    double sum = 0;
    oldest_first([&](double x) { sum += x; });
    mean_ = sum / static_cast<double>(n);
    double squares = 0;
    oldest_first([&](double x) { squares += (x - mean_) * (x - mean_); });
    std_ = std::sqrt(squares / static_cast<double>(n - 1));
  }

  std::vector<double> in_order() const {
    std::vector<double> norms(recent_.begin() + static_cast<std::ptrdiff_t>(next_), recent_.end());
    norms.insert(norms.end(), recent_.begin(), recent_.begin() + static_cast<std::ptrdiff_t>(next_));
    return norms;
  }

  spike_skip_config config_;
  std::vector<double> recent_;  // a ring once full: recent_[next_] is the oldest
  std::size_t next_ = 0;
  double mean_ = 0;
  double std_ = 0;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
