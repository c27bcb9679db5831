// AutoClip (Seetharaman et al. 2020, pseeth/autoclip): the threshold is a quantile of recent norms.
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

/// AutoClip's parameters, with the reference's defaults.
struct autoclip_config {
  double quantile = 0.9;       ///< which quantile of the history, in [0, 1]
  std::size_t history = 1000;  ///< how many recent norms, >= 1
};

/// AutoClip as a threshold controller: the threshold is the `quantile` of the last `history` finite
/// pre-clip norms, interpolated linearly between order statistics as torch.quantile does
/// (position quantile * (n - 1)), taken before the current norm is added. The first step is not clipped.
/// decide() is O(1): the history is also kept sorted, at O(history) moves per update.
///
///     gradclip::autoclip controller;   // 90th percentile of the last 1000 norms
///     auto result = gradclip::clip_by_global_norm(grads, controller);
class autoclip {
 public:
  autoclip() : autoclip(autoclip_config{}) {}

  explicit autoclip(const autoclip_config& config) : config_(config) {
    if (const char* what = invalid_field(config))
      throw std::invalid_argument(std::string("gradclip::autoclip_config: ") + what);
  }

  threshold_decision decide(double) const noexcept { return {threshold(), false}; }

  void update(const clip_result& step) {
    if (!step.finite) return;
    if (recent_.size() < config_.history) {
      recent_.push_back(step.norm);
    } else {
      double& oldest = recent_[next_];
      sorted_.erase(std::lower_bound(sorted_.begin(), sorted_.end(), oldest));
      oldest = step.norm;
      next_ = (next_ + 1) % config_.history;
    }
    sorted_.insert(std::upper_bound(sorted_.begin(), sorted_.end(), step.norm), step.norm);
  }

  /// The threshold the next step gets: the quantile of the history, +inf while it is empty.
  double threshold() const noexcept {
    if (sorted_.empty()) return std::numeric_limits<double>::infinity();
    const double position = config_.quantile * static_cast<double>(sorted_.size() - 1);
    const std::size_t below = static_cast<std::size_t>(std::floor(position));
    const std::size_t above = std::min(below + 1, sorted_.size() - 1);
    const double weight = position - static_cast<double>(below);
    const double a = sorted_[below], b = sorted_[above];
    // torch.lerp's two-sided form: exact at both ends.
    return weight < 0.5 ? a + weight * (b - a) : b - (b - a) * (1 - weight);
  }

  /// The current threshold: the quantile does not depend on this step's (non-finite) norm.
  double fallback_threshold() const noexcept { return threshold(); }

  const autoclip_config& config() const noexcept { return config_; }
  /// How many norms the history holds (at most config().history).
  std::size_t size() const noexcept { return recent_.size(); }

  friend bool operator==(const autoclip& a, const autoclip& b) {
    return a.config_.quantile == b.config_.quantile && a.config_.history == b.config_.history &&
           a.in_order() == b.in_order();
  }
  friend bool operator!=(const autoclip& a, const autoclip& b) { return !(a == b); }

  /// Writes the configuration and the history, oldest first, exactly.
  friend std::ostream& operator<<(std::ostream& out, const autoclip& c) {
    detail::write_tag(out, "gradclip::autoclip");
    detail::write_exact(out, c.config_.quantile);
    detail::write_exact(out, c.config_.history);
    detail::write_exact(out, c.in_order());
    return out;
  }

  /// Reads a state written by operator<<; on malformed input sets failbit and leaves c unchanged.
  friend std::istream& operator>>(std::istream& in, autoclip& c) {
    autoclip_config config;
    std::vector<double> norms;
    if (detail::read_tag(in, "gradclip::autoclip") && detail::read_exact(in, config.quantile) &&
        detail::read_exact(in, config.history) && detail::read_exact(in, norms, config.history)) {
      if (invalid_field(config) != nullptr ||
          !std::all_of(norms.begin(), norms.end(), [](double x) { return std::isfinite(x) && x >= 0; })) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      autoclip loaded(config);
      for (double x : norms) loaded.update({x, 1.0, false, true});
      c = std::move(loaded);
    }
    return in;
  }

 private:
  static const char* invalid_field(const autoclip_config& c) noexcept {
    if (!(c.quantile >= 0 && c.quantile <= 1)) return "quantile must be in [0, 1]";
    if (c.history < 1) return "history must be >= 1";
    return nullptr;
  }

  std::vector<double> in_order() const {
    std::vector<double> norms(recent_.begin() + static_cast<std::ptrdiff_t>(next_), recent_.end());
    norms.insert(norms.end(), recent_.begin(), recent_.begin() + static_cast<std::ptrdiff_t>(next_));
    return norms;
  }

  autoclip_config config_;
  std::vector<double> recent_;  // a ring once full: recent_[next_] is the oldest
  std::size_t next_ = 0;
  std::vector<double> sorted_;  // the same norms in ascending order
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
