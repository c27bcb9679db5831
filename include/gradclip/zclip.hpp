// ZClip (Kumar et al. 2025, bluorion-com/ZClip): an EMA of the norm's mean and variance, and a z-score
// test that lowers the threshold of outlying steps.
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

/// How zclip tests a norm against its running statistics.
enum class zclip_mode {
  zscore,      ///< z = (norm - mean) / (std + eps); clip when z > z_threshold
  percentile,  ///< clip to mean + z_threshold * std when the norm exceeds it
};

/// What zscore mode clips an outlier (z > z_threshold) to.
enum class zclip_option {
  adaptive_scaling,  ///< (mean + z_threshold * std / (z / z_threshold)) * clip_factor: larger outliers, lower threshold
  mean,              ///< the EMA mean
};

/// ZClip's parameters, with the reference's defaults.
struct zclip_config {
  double alpha = 0.97;            ///< EMA smoothing factor, in (0, 1)
  double z_threshold = 2.5;       ///< z-score above which a step is an outlier (> 0)
  std::size_t warmup_steps = 25;  ///< finite steps whose norms initialize the statistics (>= 1)
  double eps = 1e-6;              ///< added to the standard deviation in the z-score (>= 0)
  zclip_mode mode = zclip_mode::zscore;
  zclip_option clip_option = zclip_option::adaptive_scaling;
  double clip_factor = 1.0;           ///< multiplies the adaptive_scaling threshold (> 0)
  double max_norm = 1.0;              ///< fixed cap, also during warm-up (> 0; +inf: none)
  bool skip_update_on_spike = false;  ///< leave the statistics unchanged on outlying steps
};

/// ZClip as a threshold controller. During the first `warmup_steps` finite steps only the cap applies;
/// then the EMA starts from the mean and population variance of those norms. Each later step whose
/// norm is an outlier is clipped to the adaptive threshold (zclip_option), and every step to at most
/// max_norm. The EMA then absorbs the adaptive threshold of an outlying step and the norm of any other
/// (as the reference does, even when the cap clipped it):
///     mean <- alpha * mean + (1 - alpha) * x,   var <- alpha * var + (1 - alpha) * (x - mean)^2 (new mean).
/// Throws std::invalid_argument naming the field for a bad configuration.
///
///     gradclip::zclip_config config;                   // ZClip's defaults, cap 1.0
///     config.max_norm = INFINITY;                      // no cap
///     gradclip::zclip controller(config);
///     auto result = gradclip::clip_by_global_norm(grads, controller);
class zclip {
 public:
  zclip() : zclip(zclip_config{}) {}

  explicit zclip(const zclip_config& config) : config_(config) { validate(config); }

  threshold_decision decide(double norm) const noexcept {
    return {std::min(adaptive_threshold(norm), config_.max_norm), false};
  }

  void update(const clip_result& step) {
    if (!step.finite) return;
    if (!initialized_) {
      warmup_norms_.push_back(step.norm);
      if (warmup_norms_.size() >= config_.warmup_steps) initialize();
      return;
    }
    const double adaptive = adaptive_threshold(step.norm);
    const bool outlier = adaptive < std::numeric_limits<double>::infinity();
    if (outlier && config_.skip_update_on_spike) return;
    const double x = outlier ? adaptive : step.norm;
    mean_ = config_.alpha * mean_ + (1 - config_.alpha) * x;
    var_ = config_.alpha * var_ + (1 - config_.alpha) * (x - mean_) * (x - mean_);
  }

  /// The cap: what applies to a non-finite step under on_nonfinite::propagate.
  double fallback_threshold() const noexcept { return config_.max_norm; }

  const zclip_config& config() const noexcept { return config_; }
  /// True once the warm-up is over and the EMA statistics exist.
  bool initialized() const noexcept { return initialized_; }
  /// The EMA mean and variance of the norm (NaN during warm-up).
  double mean() const noexcept { return initialized_ ? mean_ : std::numeric_limits<double>::quiet_NaN(); }
  double variance() const noexcept { return initialized_ ? var_ : std::numeric_limits<double>::quiet_NaN(); }

  friend bool operator==(const zclip& a, const zclip& b) noexcept {
    const zclip_config &x = a.config_, &y = b.config_;
    return same_bits(x.alpha, y.alpha) && same_bits(x.z_threshold, y.z_threshold) && x.warmup_steps == y.warmup_steps &&
           same_bits(x.eps, y.eps) && x.mode == y.mode && x.clip_option == y.clip_option &&
           same_bits(x.clip_factor, y.clip_factor) && same_bits(x.max_norm, y.max_norm) &&
           x.skip_update_on_spike == y.skip_update_on_spike && a.initialized_ == b.initialized_ &&
           same_bits(a.mean_, b.mean_) && same_bits(a.var_, b.var_) &&
           a.warmup_norms_.size() == b.warmup_norms_.size() &&
           std::equal(a.warmup_norms_.begin(), a.warmup_norms_.end(), b.warmup_norms_.begin(), same_bits);
  }
  friend bool operator!=(const zclip& a, const zclip& b) noexcept { return !(a == b); }

  /// Writes the whole state, configuration included, exactly (doubles as bit patterns).
  friend std::ostream& operator<<(std::ostream& out, const zclip& z) {
    const zclip_config& c = z.config_;
    detail::write_tag(out, "gradclip::zclip");
    for (double x : {c.alpha, c.z_threshold}) detail::write_exact(out, x);
    detail::write_exact(out, c.warmup_steps);
    detail::write_exact(out, c.eps);
    detail::write_exact(out, static_cast<std::size_t>(c.mode));
    detail::write_exact(out, static_cast<std::size_t>(c.clip_option));
    for (double x : {c.clip_factor, c.max_norm}) detail::write_exact(out, x);
    detail::write_exact(out, c.skip_update_on_spike);
    detail::write_exact(out, z.initialized_);
    detail::write_exact(out, z.mean_);
    detail::write_exact(out, z.var_);
    detail::write_exact(out, z.warmup_norms_);
    return out;
  }

  /// Reads a state written by operator<<. On malformed input or an invalid configuration sets failbit
  /// and leaves z unchanged.
  friend std::istream& operator>>(std::istream& in, zclip& z) {
    zclip_config c;
    std::size_t mode = 0, option = 0;
    bool initialized = false;
    double mean = 0, var = 0;
    std::vector<double> norms;
    if (detail::read_tag(in, "gradclip::zclip") && detail::read_exact(in, c.alpha) &&
        detail::read_exact(in, c.z_threshold) && detail::read_exact(in, c.warmup_steps) &&
        detail::read_exact(in, c.eps) && detail::read_exact(in, mode) && detail::read_exact(in, option) &&
        detail::read_exact(in, c.clip_factor) && detail::read_exact(in, c.max_norm) &&
        detail::read_exact(in, c.skip_update_on_spike) && detail::read_exact(in, initialized) &&
        detail::read_exact(in, mean) && detail::read_exact(in, var) && detail::read_exact(in, norms, c.warmup_steps)) {
      c.mode = static_cast<zclip_mode>(mode);
      c.clip_option = static_cast<zclip_option>(option);
      if (mode > 1 || option > 1 || !valid(c) || (initialized && !norms.empty()) ||
          (!initialized && norms.size() >= c.warmup_steps)) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      zclip loaded(c);
      loaded.initialized_ = initialized;
      loaded.mean_ = mean;
      loaded.var_ = var;
      loaded.warmup_norms_.assign(norms.begin(), norms.end());
      z = std::move(loaded);
    }
    return in;
  }

 private:
  static bool same_bits(double a, double b) noexcept {
    return a == b ? std::signbit(a) == std::signbit(b) : a != a && b != b;
  }

  static const char* invalid_field(const zclip_config& c) noexcept {
    if (!(c.alpha > 0 && c.alpha < 1)) return "alpha must be in (0, 1)";
    if (!(c.z_threshold > 0) || !std::isfinite(c.z_threshold)) return "z_threshold must be finite and > 0";
    if (c.warmup_steps < 1) return "warmup_steps must be >= 1";
    if (!(c.eps >= 0) || !std::isfinite(c.eps)) return "eps must be finite and >= 0";
    if (c.mode != zclip_mode::zscore && c.mode != zclip_mode::percentile) return "mode is not a zclip_mode value";
    if (c.clip_option != zclip_option::adaptive_scaling && c.clip_option != zclip_option::mean)
      return "clip_option is not a zclip_option value";
    if (!(c.clip_factor > 0) || !std::isfinite(c.clip_factor)) return "clip_factor must be finite and > 0";
    if (!(c.max_norm > 0)) return "max_norm must be > 0 (+inf: no cap)";
    return nullptr;
  }
  static bool valid(const zclip_config& c) noexcept { return invalid_field(c) == nullptr; }
  static void validate(const zclip_config& c) {
    if (const char* what = invalid_field(c))
      throw std::invalid_argument(std::string("gradclip::zclip_config: ") + what);
  }

  void initialize() noexcept {
    const double n = static_cast<double>(warmup_norms_.size());
    double sum = 0;
    for (double x : warmup_norms_) sum += x;
    mean_ = sum / n;
    double squares = 0;
    for (double x : warmup_norms_) squares += (x - mean_) * (x - mean_);
    var_ = squares / n;
    initialized_ = true;
    warmup_norms_.clear();
  }

  // The threshold an outlier is clipped to, +inf when the norm is not one (or during warm-up).
  double adaptive_threshold(double norm) const noexcept {
    constexpr double none = std::numeric_limits<double>::infinity();
    if (!initialized_) return none;
    const double std_dev = std::sqrt(var_);
    if (config_.mode == zclip_mode::percentile) {
      const double bound = mean_ + config_.z_threshold * std_dev;
      return norm > bound ? bound : none;
    }
    const double z = (norm - mean_) / (std_dev + config_.eps);
    if (!(z > config_.z_threshold)) return none;
    if (config_.clip_option == zclip_option::mean) return mean_;
    const double eta = z / config_.z_threshold;  // larger outliers get a lower threshold
    return (mean_ + config_.z_threshold * std_dev / eta) * config_.clip_factor;
  }

  zclip_config config_;
  bool initialized_ = false;
  double mean_ = 0;
  double var_ = 0;
  std::vector<double> warmup_norms_;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
