// An adaptive per-example clipping bound for private training (Andrew et al. 2021, "Differentially
// Private Learning with Adaptive Clipping"; Opacus AdaClip, TF Privacy's quantile estimator): C tracks a
// quantile of the per-example norms by a geometric update from the fraction of examples it did not clip.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/exact_io.hpp>

#include <cmath>
#include <cstddef>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// The bound's parameters, with Andrew et al.'s defaults.
struct adaptive_bound_config {
  double initial = 1.0;           ///< C before the first update, in [min_bound, max_bound]
  double target_unclipped = 0.5;  ///< gamma: the fraction of examples C should leave unclipped, in [0, 1]
  double learning_rate = 0.2;     ///< eta: the geometric step, finite and >= 0
  double min_bound = std::numeric_limits<double>::min();       ///< C never falls below it (> 0: a zero C never grows)
  double max_bound = std::numeric_limits<double>::infinity();  ///< C never rises above it (>= min_bound)
};

/// C <- clamp(C * exp(-eta * (b - gamma)), min_bound, max_bound) after each step, where b is the fraction
/// of the batch whose norm was within C: C shrinks while more than gamma of the examples pass unclipped
/// and grows while fewer do, so it tracks the gamma-quantile of the per-example norms.
///
/// The count is private data: in private training add the noise to it before update (Andrew et al.:
/// b = (unclipped + N(0, sigma_b^2)) / expected batch size, and the gradient's noise multiplier becomes
/// (z^-2 - (2 sigma_b)^-2)^(-1/2) so that the pair spends the budget of z alone). gradclip adds no noise.
/// Throws std::invalid_argument naming the field for a bad configuration.
///
///     gradclip::adaptive_bound bound;                        // C = 1, gamma = 0.5, eta = 0.2
///     auto r = gradclip::clip_per_example(grads, sums, bound.value());
///     bound.update(r.unclipped() + noise(rng), batch_size);
class adaptive_bound {
 public:
  adaptive_bound() : adaptive_bound(adaptive_bound_config{}) {}

  explicit adaptive_bound(const adaptive_bound_config& config) : config_(config), value_(config.initial) {
    if (const char* what = invalid_field(config))
      throw std::invalid_argument(std::string("gradclip::adaptive_bound_config: ") + what);
  }

  /// The current bound C: pass it as max_norm.
  double value() const noexcept { return value_; }
  /// Updates made since construction.
  std::size_t steps() const noexcept { return steps_; }
  const adaptive_bound_config& config() const noexcept { return config_; }

  /// One geometric step with b = unclipped / expected_batch. `unclipped` is the (noisy) count of examples
  /// whose norm was within C, e.g. per_example_result::unclipped() plus the caller's noise; it may be
  /// negative or exceed the batch after noise. `expected_batch` is the batch size (with Poisson sampling,
  /// its expectation). Throws std::invalid_argument for a non-finite count or a batch that is not > 0.
  void update(double unclipped, double expected_batch) {
    if (!std::isfinite(unclipped))
      throw std::invalid_argument("gradclip::adaptive_bound::update: unclipped must be finite");
    if (!(expected_batch > 0) || !std::isfinite(expected_batch))
      throw std::invalid_argument("gradclip::adaptive_bound::update: expected_batch must be finite and > 0");
    const double b = unclipped / expected_batch;
    const double next = value_ * std::exp(-config_.learning_rate * (b - config_.target_unclipped));
    value_ = std::fmin(std::fmax(next, config_.min_bound), config_.max_bound);
    ++steps_;
  }

  /// Writes the whole state, configuration included, exactly (doubles as bit patterns).
  friend std::ostream& operator<<(std::ostream& out, const adaptive_bound& a) {
    const adaptive_bound_config& c = a.config_;
    detail::write_tag(out, "gradclip::adaptive_bound");
    for (double x : {c.initial, c.target_unclipped, c.learning_rate, c.min_bound, c.max_bound, a.value_})
      detail::write_exact(out, x);
    detail::write_exact(out, a.steps_);
    return out;
  }

  /// Reads a state written by operator<<. On malformed input or an invalid state sets failbit and leaves
  /// `a` unchanged.
  friend std::istream& operator>>(std::istream& in, adaptive_bound& a) {
    adaptive_bound_config c;
    double value = 0;
    std::size_t steps = 0;
    if (detail::read_tag(in, "gradclip::adaptive_bound") && detail::read_exact(in, c.initial) &&
        detail::read_exact(in, c.target_unclipped) && detail::read_exact(in, c.learning_rate) &&
        detail::read_exact(in, c.min_bound) && detail::read_exact(in, c.max_bound) && detail::read_exact(in, value) &&
        detail::read_exact(in, steps)) {
      if (invalid_field(c) || !(value >= c.min_bound && value <= c.max_bound)) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      a.config_ = c;
      a.value_ = value;
      a.steps_ = steps;
    }
    return in;
  }

 private:
  static const char* invalid_field(const adaptive_bound_config& c) noexcept {
    if (!(c.target_unclipped >= 0 && c.target_unclipped <= 1)) return "target_unclipped must be in [0, 1]";
    if (!(c.learning_rate >= 0) || !std::isfinite(c.learning_rate)) return "learning_rate must be finite and >= 0";
    if (!(c.min_bound > 0) || !std::isfinite(c.min_bound)) return "min_bound must be finite and > 0";
    if (!(c.max_bound >= c.min_bound)) return "max_bound must be >= min_bound (+inf: no cap)";
    if (!(c.initial >= c.min_bound && c.initial <= c.max_bound) || !std::isfinite(c.initial))
      return "initial must be finite and in [min_bound, max_bound]";
    return nullptr;
  }

  adaptive_bound_config config_;
  double value_;
  std::size_t steps_ = 0;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
