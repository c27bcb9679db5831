// Adaptive gradient clipping (AGC, Brock et al. 2021): each unit's gradient clipped relative to the norm
// of its weights, with Optax's adaptive_grad_clip semantics.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/tensor_units.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// What adaptive_clip did.
struct [[nodiscard]] adaptive_clip_result {
  std::size_t units = 0;         ///< how many units the gradient was split into
  std::size_t clipped = 0;       ///< units whose gradient norm reached max_norm_u and were rescaled
  double min_coefficient = 1.0;  ///< the smallest factor applied to a unit (1 when none was clipped)
  bool finite = true;            ///< false when a gradient or weight unit norm was NaN or Inf
};

namespace detail {

inline void check_adaptive_clip_arguments(const char* function, double clipping, double eps, const options& opt) {
  if (!(clipping >= 0) || !std::isfinite(clipping))
    throw std::invalid_argument(std::string(function) + ": clipping must be finite and >= 0");
  if (!(eps >= 0) || !std::isfinite(eps))
    throw std::invalid_argument(std::string(function) + ": eps must be finite and >= 0");
  if (opt.epsilon != 0.0)
    throw std::invalid_argument(std::string(function) +
                                ": options::epsilon has no meaning here (the floor of the weights' norm is eps)");
}

/// AGC's source: unit u's threshold is clipping * max(||w_u||, eps), from the weights' part (unit
/// `units + u` of the same reduction), and its plan Optax's rule (plan_relative).
struct relative_to_weights {
  std::size_t units;
  double clipping, eps;

  void check(const char*) const noexcept {}
  template <class Parts>
  clip_plan plan(const char* function, std::size_t u, const Parts& parts, const options& opt) const {
    const partial_norm& w = parts[units + u];
    if (!w.finite) {  // the threshold itself is NaN or Inf: Optax's arithmetic on it
      const double w_norm = w.norm();
      const double threshold = clipping * (std::isnan(w_norm) ? w_norm : std::max(w_norm, eps));
      return plan_relative(function, parts[u], scaled{threshold, 0}, opt);
    }
    return plan_relative(function, parts[u], scaled::of(clipping) * std::max(norm_scaled(w), scaled::of(eps)), opt);
  }
  void update(std::size_t, const clip_result&) const noexcept {}
  std::string where(const char* function, std::size_t) const { return function; }
};

template <class T, class U>
adaptive_clip_result adaptive_clip_units(const char* function, const unit_split<T>& grad, const unit_split<U>& weights,
                                         double clipping, double eps, const options& opt) {
  static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
  check_adaptive_clip_arguments(function, clipping, eps, opt);
  if (grad.shape != weights.shape)
    throw std::invalid_argument(std::string(function) + ": the weights' shape " + shape_string(weights.shape) +
                                " differs from the gradient's " + shape_string(grad.shape));
  const auto read = consecutive_units(grad, weights);  // the gradient's units, then the weights'
  const auto write = consecutive_units(grad);
  const relative_to_weights source{write.units(), clipping, eps};
  const auto plans = run_units(
      function, write, source, opt, [&] { return reduce_units<robust>(read, opt); },
      [&](const auto& unit_plans) { apply_units<robust>(write, unit_plans, opt); });
  adaptive_clip_result result;
  result.units = write.units();
  for (const clip_plan& plan : plans) {
    result.finite = result.finite && plan.result.finite;
    if (!plan.result.clipped) continue;
    ++result.clipped;
    const double value = plan.result.coefficient;
    if (!std::isnan(result.min_coefficient) && !(value >= result.min_coefficient)) result.min_coefficient = value;
  }
  return result;
}

}  // namespace detail

/// Adaptive gradient clipping (AGC; Brock et al. 2021), Optax's `adaptive_grad_clip(clipping, eps)`:
/// for each unit u,
///
///     max_norm_u = clipping * max(||w_u||, eps)
///     g_u <- g_u                                        if ||g_u|| <  max_norm_u
///     g_u <- g_u * max_norm_u / max(||g_u||, 1e-6)      otherwise
///
/// with L2 norms. A unit whose gradient is zero is left alone (0 < max_norm_u) unless clipping or eps is
/// 0, when it is "clipped" by 0 and stays zero; zero weights clip the unit to norm clipping * eps.
///
/// Units are slices along the first dimension, reduced over every other one:
/// - an Eigen matrix (column- or row-major, maps and blocks too): each row, the weights feeding one
///   output of y = W x (a row of a PyTorch [out, in] weight);
/// - an Eigen tensor or tensor map of rank >= 2: each slice t(i, ...), whatever the storage order, so
///   give the tensor PyTorch's dimension order ([out, in, kh, kw]); a column-major TensorMap over a
///   PyTorch (row-major) buffer reverses the dimensions, so map such buffers as RowMajor tensors;
/// - anything with at most one dimension above 1 (vectors, scalars, std::vector) is one unit.
/// Optax's layouts put the output last (IO, HWIO), so this is its rank-2 and rank-4 rule transposed
/// into PyTorch's order; for rank 3 Optax reduces over axis 0 only, which gradclip does not replicate.
///
/// Norms are the robust policy's (overflow-free for every finite input) and max_norm_u and the
/// coefficient are formed as mantissa and power of two, so neither overflows either. Weights may have a
/// different element type and storage order than the gradient, but the same shape (else
/// std::invalid_argument). A NaN or Inf in a gradient or weight unit follows `nonfinite`, per unit:
/// `skip` (default) leaves that unit's bits alone (the finite units still clip) and returns finite =
/// false, `error` throws nonfinite_error before anything is written, `propagate` is Optax's arithmetic.
/// Throws std::invalid_argument for a negative or non-finite clipping or eps.
///
///     auto r = gradclip::adaptive_clip(grad, weight, 0.01);   // Eigen::MatrixXf grad, weight
template <class Grad, class Weights>
adaptive_clip_result adaptive_clip(Grad&& grad, const Weights& weights, double clipping, double eps = 1e-3,
                                   on_nonfinite nonfinite = on_nonfinite::skip) {
  return adaptive_clip(std::forward<Grad>(grad), weights, clipping, eps, options{nonfinite});
}

/// The same with options: opt.threads and opt.pool run the passes on threads (same bits for any count),
/// opt.norm is the unit norm of both the gradient and the weights (Optax's is L2, the default),
/// opt.nonfinite as above; opt.epsilon must be 0 (eps is the weights' floor).
///
///     auto r = gradclip::adaptive_clip(grad, weight, 0.01, 1e-3, {gradclip::on_nonfinite::skip, 0.0,
///     gradclip::l2_norm, 4});
template <class Grad, class Weights>
adaptive_clip_result adaptive_clip(Grad&& grad, const Weights& weights, double clipping, double eps,
                                   const options& opt) {
  return detail::adaptive_clip_units("gradclip::adaptive_clip", detail::split_units(grad), detail::split_units(weights),
                                     clipping, eps, opt);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
