// AdaGC (Wang et al. 2025; pytorch_optimizer's adagc.py): one adaptive threshold per tensor, an EMA of the
// tensor's clipped gradient norm, after a warm-up clipped by the global norm; and clip_per_tensor, which
// applies it to a group with one read pass and one write pass.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/exact_io.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// AdaGC's parameters, with the reference's defaults.
struct adagc_config {
  double lambda_rel = 1.05;        ///< after warm-up, tensor i is clipped to lambda_rel * gamma_i (finite, > 0)
  double beta = 0.98;              ///< the EMA factor of gamma_i, in [0, 1)
  std::size_t warmup_steps = 100;  ///< finite steps clipped by the global norm (>= 1)
  double lambda_abs = 1.0;         ///< the warm-up's threshold on the global norm (> 0; +inf: none)
};

/// AdaGC as a per-tensor threshold controller. With t the count of finite steps (this one included) and
/// ||g_hat_i|| the norm of tensor i after clipping:
/// - t <= warmup_steps: every tensor is clipped by the global norm to lambda_abs, as clip_by_global_norm
///   clips; gamma_i = ||g_hat_i|| at t = 1, min(gamma_i, ||g_hat_i||) after;
/// - later: tensor i is clipped by its own norm to lambda_rel * gamma_i (a zero norm never clips), then
///   gamma_i <- beta * gamma_i + (1 - beta) * ||g_hat_i||: the EMA tracks the clipped norm.
/// The coefficient follows gradclip's rule, c = threshold / (norm + options::epsilon) when c < 1, which is
/// the reference's min(1, threshold / norm) with epsilon 0. The tensor count is fixed by the first
/// non-empty call. Differences from pytorch_optimizer's port, on purpose: its warm-up divides by the
/// *squared* global norm (its get_global_gradient_norm never takes the root) and lasts warmup_steps - 1
/// steps (step < warmup_steps); gradclip divides by the norm, as the paper does, for warmup_steps steps.
/// Like the reference, a tensor whose gradient is zero on a warm-up step has gamma_i = 0 and is zeroed on
/// every later step: leave frozen tensors out of the group. Throws std::invalid_argument naming the
/// field for a bad configuration.
///
///     gradclip::adagc controller;                                  // the reference's defaults
///     auto results = gradclip::clip_per_tensor(grads, controller); // one clip_result per tensor
class adagc {
 public:
  adagc() : adagc(adagc_config{}) {}
  explicit adagc(const adagc_config& config) : config_(config) { validate(config); }

  const adagc_config& config() const noexcept { return config_; }
  /// Finite steps counted so far.
  std::size_t steps() const noexcept { return steps_; }
  /// The tensor count fixed by the first call (0 before it).
  std::size_t tensors() const noexcept { return gamma_.size(); }
  /// True when the next finite step is a warm-up step, clipped by the global norm.
  bool warming_up() const noexcept { return steps_ < config_.warmup_steps; }
  /// gamma_i of every tensor (zeros before the first finite step).
  const std::vector<double>& gamma() const noexcept { return gamma_; }

  /// Fixes the tensor count on the first call; throws std::invalid_argument (naming `function`) when a
  /// later call has another count.
  void bind(const char* function, std::size_t count) {
    if (gamma_.empty()) {
      gamma_.assign(count, 0.0);
    } else if (count != gamma_.size()) {
      throw std::invalid_argument(std::string(function) + ": adagc tracks " + std::to_string(gamma_.size()) +
                                  " tensors, this group has " + std::to_string(count));
    }
  }
  /// The threshold of tensor i's own norm after warm-up: lambda_rel * gamma_i.
  double threshold(std::size_t i) const noexcept { return config_.lambda_rel * gamma_[i]; }
  /// Counts a finite step whose clipped tensors have the norms `clipped_norms` (one per tensor).
  void update(const std::vector<double>& clipped_norms) {
    if (clipped_norms.size() != gamma_.size())
      throw std::invalid_argument("gradclip::adagc::update: " + std::to_string(clipped_norms.size()) + " norms for " +
                                  std::to_string(gamma_.size()) + " tensors");
    const bool warm = warming_up();
    ++steps_;
    for (std::size_t i = 0; i < gamma_.size(); ++i) {
      const double hat = clipped_norms[i];
      if (warm)
        gamma_[i] = steps_ == 1 ? hat : std::min(gamma_[i], hat);
      else
        gamma_[i] = config_.beta * gamma_[i] + (1 - config_.beta) * hat;
    }
  }

  friend bool operator==(const adagc& a, const adagc& b) noexcept {
    const adagc_config &x = a.config_, &y = b.config_;
    return same_bits(x.lambda_rel, y.lambda_rel) && same_bits(x.beta, y.beta) && x.warmup_steps == y.warmup_steps &&
           same_bits(x.lambda_abs, y.lambda_abs) && a.steps_ == b.steps_ && a.gamma_.size() == b.gamma_.size() &&
           std::equal(a.gamma_.begin(), a.gamma_.end(), b.gamma_.begin(), same_bits);
  }
  friend bool operator!=(const adagc& a, const adagc& b) noexcept { return !(a == b); }

  /// Writes the whole state, configuration included, exactly (doubles as bit patterns).
  friend std::ostream& operator<<(std::ostream& out, const adagc& c) {
    detail::write_tag(out, "gradclip::adagc");
    detail::write_exact(out, c.config_.lambda_rel);
    detail::write_exact(out, c.config_.beta);
    detail::write_exact(out, c.config_.warmup_steps);
    detail::write_exact(out, c.config_.lambda_abs);
    detail::write_exact(out, c.steps_);
    detail::write_exact(out, c.gamma_);
    return out;
  }

  /// Reads a state written by operator<<. On malformed input or an invalid state sets failbit and
  /// leaves c unchanged.
  friend std::istream& operator>>(std::istream& in, adagc& c) {
    adagc_config config;
    std::size_t steps = 0;
    std::vector<double> gamma;
    if (detail::read_tag(in, "gradclip::adagc") && detail::read_exact(in, config.lambda_rel) &&
        detail::read_exact(in, config.beta) && detail::read_exact(in, config.warmup_steps) &&
        detail::read_exact(in, config.lambda_abs) && detail::read_exact(in, steps) &&
        detail::read_exact(in, gamma, max_tensors)) {
      const bool gammas_valid = std::all_of(gamma.begin(), gamma.end(), [](double g) { return g >= 0; });
      if (invalid_field(config) != nullptr || !gammas_valid || (gamma.empty() && steps != 0)) {
        in.setstate(std::ios_base::failbit);
        return in;
      }
      adagc loaded(config);
      loaded.steps_ = steps;
      loaded.gamma_ = std::move(gamma);
      c = std::move(loaded);
    }
    return in;
  }

 private:
  static constexpr std::size_t max_tensors = std::size_t{1} << 24;  // what a stream may claim

  static bool same_bits(double a, double b) noexcept {
    return a == b ? std::signbit(a) == std::signbit(b) : a != a && b != b;
  }
  static const char* invalid_field(const adagc_config& c) noexcept {
    if (!(c.lambda_rel > 0) || !std::isfinite(c.lambda_rel)) return "lambda_rel must be finite and > 0";
    if (!(c.beta >= 0 && c.beta < 1)) return "beta must be in [0, 1)";
    if (c.warmup_steps < 1) return "warmup_steps must be >= 1";
    if (!(c.lambda_abs > 0)) return "lambda_abs must be > 0 (+inf: no warm-up clipping)";
    return nullptr;
  }
  static void validate(const adagc_config& c) {
    if (const char* what = invalid_field(c))
      throw std::invalid_argument(std::string("gradclip::adagc_config: ") + what);
  }

  adagc_config config_;
  std::size_t steps_ = 0;
  std::vector<double> gamma_;
};

namespace detail {

template <class Policy, class Grads, class Reduce>
std::vector<clip_result> clip_per_tensor(const char* function, Grads& grads, adagc& controller, const options& opt,
                                         Reduce&& reduce_global) {
  check_group<Grads&>();
  check_options(function, opt);
  // One read pass: every tensor's part and the group's (the bits clip_by_global_norm reduces).
  const whole_group<Grads> group{grads};
  const per_gradient<Grads> tensors{grads};
  std::vector<partial_norm> parts;
  partial_norm global = reduce_units<Policy>(group, opt, &parts)[0];
  parts.resize(tensors.units(), partial_norm{0, 0.0, true, opt.norm.p()});
  const std::size_t count = parts.size();
  if (count == 0 && controller.tensors() == 0) return {};
  controller.bind(function, count);
  bool finite = std::all_of(parts.begin(), parts.end(), [](const partial_norm& p) { return p.finite; });
  std::vector<clip_result> results;
  results.reserve(count);
  std::vector<scaled> coefficients(count, scaled{1.0, 0});
  if (controller.warming_up()) {
    global = reduce_global(static_cast<const partial_norm&>(global));
    if (!(global.p == opt.norm.p()))
      throw std::invalid_argument(std::string(function) + ": the reduced global norm is of p = " +
                                  std::to_string(global.p) + ", options::norm of p = " + std::to_string(opt.norm.p()));
    finite = finite && global.finite;
    const std::array<clip_plan, 1> plan_of_group{plan_clip(function, global, controller.config().lambda_abs, opt)};
    const clip_plan& plan = plan_of_group[0];
    apply_units<Policy>(group, plan_of_group, opt);
    for (std::size_t i = 0; i < count; ++i) {
      results.push_back(plan.result);
      results[i].norm = parts[i].norm();
      results[i].finite = parts[i].finite;
      if (plan.result.clipped) coefficients[i] = plan.coefficient;
    }
  } else {
    const auto bad = std::find_if(parts.begin(), parts.end(), [](const partial_norm& p) { return !p.finite; });
    if (bad != parts.end() && opt.nonfinite == on_nonfinite::error) throw nonfinite_error(function, bad->norm());
    const bool skip_all = bad != parts.end() && opt.nonfinite == on_nonfinite::skip;
    std::vector<clip_plan> plans;
    plans.reserve(count);
    for (std::size_t i = 0; i < count; ++i)
      plans.push_back(
          skip_all ? clip_plan{{parts[i].norm(), 1.0, false, parts[i].finite, std::numeric_limits<double>::infinity()},
                               scaled{1.0, 0}}
                   : plan_clip(function, parts[i], controller.threshold(i), opt));
    apply_units<Policy>(tensors, plans, opt);
    for (std::size_t i = 0; i < count; ++i) {
      if (plans[i].result.clipped) coefficients[i] = plans[i].coefficient;
      results.push_back(plans[i].result);
    }
  }
  if (finite) {  // a step with any non-finite norm never enters the statistics
    std::vector<double> clipped_norms(count);
    for (std::size_t i = 0; i < count; ++i)
      clipped_norms[i] = (coefficients[i] * detail::norm_scaled(parts[i])).value();
    controller.update(clipped_norms);
  }
  return results;
}

}  // namespace detail

/// Clips each tensor of a group by the threshold `controller` sets for it (see adagc) and returns one
/// clip_result per tensor, in order: its own norm (options::norm), the coefficient applied, the threshold
/// (during warm-up lambda_abs, which the *global* norm, the root of the sum of the squared norms, was
/// compared with). One read pass computes every tensor's norm and the global one (threaded as
/// clip_by_global_norm; a warm-up step gives its bits exactly), then one write pass scales the tensors
/// that clip. A step where any norm is NaN or Inf is not counted and leaves the controller unchanged;
/// its gradients follow opt.nonfinite: `skip` leaves every tensor untouched, `error` throws
/// nonfinite_error before writing, `propagate` multiplies each tensor by PyTorch's arithmetic (the
/// global coefficient during warm-up). A group whose tensor count differs from the first call's throws
/// std::invalid_argument.
///
///     gradclip::adagc controller;
///     auto results = gradclip::clip_per_tensor(grads, controller);   // std::vector<clip_result>
template <class Policy = robust, class Grads, class = std::enable_if_t<detail::is_gradient_range_v<Grads&>>>
std::vector<clip_result> clip_per_tensor(Grads&& grads, adagc& controller, const options& opt = {}) {
  return detail::clip_per_tensor<Policy>("gradclip::clip_per_tensor", grads, controller, opt,
                                         [](const partial_norm& local) { return local; });
}

/// The same for tensors spread over the ranks of a distributed job, each rank clipping the tensors it
/// holds whole: `reduce_global(local)` turns this rank's part of the global norm into the job's (e.g.
/// with the two all-reduces of partial_norm.hpp) and is called on warm-up steps only, from the same read
/// pass. After the warm-up each tensor's threshold is its own, so no step communicates. Every rank must
/// count the same steps: skip a step on every rank when any rank's gradients are not finite.
///
///     auto results = gradclip::clip_per_tensor(my_tensors, controller, [&](const gradclip::partial_norm& local) {
///       return allreduce_partial_norm(local);   // e.g. MPI_MAX of the exponent, then MPI_SUM of the sums
///     });
template <class Policy = robust, class Grads, class Reduce,
          class = std::enable_if_t<detail::is_gradient_range_v<Grads&> &&
                                   std::is_invocable_r_v<partial_norm, Reduce&, const partial_norm&>>>
std::vector<clip_result> clip_per_tensor(Grads&& grads, adagc& controller, Reduce&& reduce_global,
                                         const options& opt = {}) {
  return detail::clip_per_tensor<Policy>("gradclip::clip_per_tensor", grads, controller, opt, reduce_global);
}

/// The same for a braced list of gradients of any element types: clip_per_tensor({w, b}, controller).
template <class Policy = robust>
std::vector<clip_result> clip_per_tensor(std::initializer_list<grad_view> grads, adagc& controller,
                                         const options& opt = {}) {
  std::vector<grad_view> group(grads);
  return clip_per_tensor<Policy>(group, controller, opt);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
