// Ghost norms for dense layers (Goodfellow 2015; Li et al. 2022, "ghost clipping"): each example's
// weight-gradient norm from the layer's inputs and output gradients, and the clipped sum as one matrix
// product, without ever forming a per-example weight gradient.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/per_example.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/tensor_units.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// How add_ghost_norms forms ||grad W_i||^2 = ||B_i^T A_i||_F^2 for T > 1 steps per example.
enum class ghost_form {
  automatic,  ///< the cheaper of the two by operation count: gram when T (d_in + d_out) < d_in d_out
  gram,       ///< <A_i A_i^T, B_i B_i^T>: two T x T Gram matrices, ~T^2 (d_in + d_out) per example
  direct,     ///< B_i^T A_i formed (d_out x d_in, one example at a time), ~T d_in d_out per example
};

namespace detail {

struct dense_shape {
  std::size_t examples, steps, inputs, outputs;
};

template <class In, class Out>
dense_shape check_dense_layer(const char* function, const Eigen::MatrixBase<In>& inputs,
                              const Eigen::MatrixBase<Out>& output_grads, std::size_t steps) {
  static_assert(is_element_v<typename In::Scalar> && is_element_v<typename Out::Scalar>,
                "Dense-layer inputs and output gradients are Eigen matrices of Eigen::half, Eigen::bfloat16, float "
                "or double.");
  const std::string where(function);
  if (steps == 0) throw std::invalid_argument(where + ": steps must be >= 1");
  if (inputs.rows() != output_grads.rows())
    throw std::invalid_argument(where + ": inputs have " + std::to_string(inputs.rows()) + " rows, output gradients " +
                                std::to_string(output_grads.rows()));
  const std::size_t rows = static_cast<std::size_t>(inputs.rows());
  if (rows % steps != 0)
    throw std::invalid_argument(where + ": " + std::to_string(rows) + " rows are not a whole number of examples of " +
                                std::to_string(steps) + " steps");
  return {rows / steps, steps, static_cast<std::size_t>(inputs.cols()), static_cast<std::size_t>(output_grads.cols())};
}

/// ||a||^2 ||b||^2 from the two parts, as a part: normalized sums multiply without overflow. Element
/// products of an Inf with zeros are NaN, as the materialized gradient would hold.
inline partial_norm product_of_parts(const partial_norm& a, const partial_norm& b) noexcept {
  if (!a.finite || !b.finite) {
    const bool nan = std::isnan(a.sum) || std::isnan(b.sum) || (a.finite && a.sum == 0) || (b.finite && b.sum == 0);
    return partial_norm::nonfinite(nan ? std::numeric_limits<double>::quiet_NaN() : a.sum * b.sum);
  }
  const partial_norm x = a.normalized(), y = b.normalized();
  return {x.exponent + y.exponent, x.sum * y.sum, true};
}

/// Example rows widened to FP64 and divided by 2^e, a power of two near their largest magnitude (e = 0
/// for zero rows), so that every product and sum formed from them stays inside double's range.
/// `witness` is NaN or Inf when the rows are not finite.
struct scaled_rows {
  Eigen::MatrixXd values;
  int exponent = 0;
  double witness = 0;
};

template <class M>
scaled_rows scale_rows(const M& rows) {
  scaled_rows r;
  r.values = rows.unaryExpr([](typename M::Scalar x) { return widen<double>(x); });
  if (!r.values.allFinite()) {
    r.witness = r.values.hasNaN() ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    return r;
  }
  const double top = r.values.size() == 0 ? 0.0 : r.values.cwiseAbs().maxCoeff();
  if (top == 0) return r;
  r.exponent = std::ilogb(top) + 1;  // top * 2^-e in [0.5, 1)
  const auto [first, second] = power_of_two_factors(-r.exponent);
  r.values = (r.values * first) * second;
  return r;
}

/// One example's ||B^T A||_F^2 as a part, from rows scaled by scale_rows. A template (Rows is scaled_rows),
/// so that only the units that call it instantiate Eigen's matrix products: 1.5 s of every unit's build.
template <class Rows>
partial_norm ghost_weight_part(const Rows& a, const Rows& b, ghost_form form) {
  if (a.witness != 0 || b.witness != 0)
    return product_of_parts(a.witness != 0 ? partial_norm::nonfinite(a.witness) : partial_norm{0, 1.0, true},
                            b.witness != 0 ? partial_norm::nonfinite(b.witness) : partial_norm{0, 1.0, true});
  double sum = 0;
  if (form == ghost_form::gram) {
    const Eigen::MatrixXd gram_a = a.values * a.values.transpose();
    const Eigen::MatrixXd gram_b = b.values * b.values.transpose();
    sum = gram_a.cwiseProduct(gram_b).sum();
  } else {
    sum = (b.values.transpose() * a.values).squaredNorm();
  }
  // The Gram form sums products of both signs: rounding may leave a tiny negative for a zero gradient.
  return {a.exponent + b.exponent, sum > 0 ? sum : 0.0, true};
}

/// One example's ||sum_t b_t||^2 (the bias gradient's) as a part (a template as ghost_weight_part is).
template <class Rows>
partial_norm ghost_bias_part(const Rows& b) {
  if (b.witness != 0) return partial_norm::nonfinite(b.witness);
  return {b.exponent, b.values.colwise().sum().squaredNorm(), true};
}

inline ghost_form choose_form(const dense_shape& s, ghost_form form) {
  if (form != ghost_form::automatic) return form;
  return s.steps * (s.inputs + s.outputs) < s.inputs * s.outputs ? ghost_form::gram : ghost_form::direct;
}

}  // namespace detail

/// Adds each example's squared gradient norm of a dense layer y_t = W x_t (+ b) to parts[i], without
/// forming any per-example gradient: ||grad W_i||_F^2 = ||B_i^T A_i||_F^2 = <A_i A_i^T, B_i B_i^T>, and
/// with `bias` also ||grad b_i||^2 = ||sum_t b_t||^2.
///
/// `inputs` (A, B*T x d_in) and `output_grads` (B, B*T x d_out) hold example i's T steps (sequence
/// positions, or 1) in rows i*T to i*T + T - 1; any storage order, element type and direct-access Eigen
/// matrix, map or block. `parts` is empty (it is then sized B) or holds B parts, e.g. from
/// per_example_partial_norms of the other layers, so that the merged parts are each example's norm over
/// the whole model. T = 1 multiplies the two row norms (robust numerics: FP16/BF16 within 16 * 2^-24);
/// T > 1 uses `form` (the cheaper by default) in FP64 on rows divided by a power of two near their
/// maximum, so nothing overflows for any finite input; the error is that of an FP64 matrix product,
/// about (T + d) 2^-53 relative to the sums of absolute products. A NaN or Inf makes the example's part
/// non-finite. Returns the form used. Throws std::invalid_argument for mismatched rows, rows that are not
/// a multiple of T, or parts of another size.
///
///     std::vector<gradclip::partial_norm> parts = gradclip::per_example_partial_norms(std::tie(d_embedding));
///     gradclip::add_ghost_norms(parts, x, dy, 1);    // x: B x d_in, dy: B x d_out
template <class In, class Out>
ghost_form add_ghost_norms(std::vector<partial_norm>& parts, const Eigen::MatrixBase<In>& inputs,
                           const Eigen::MatrixBase<Out>& output_grads, std::size_t steps, bool bias = true,
                           ghost_form form = ghost_form::automatic) {
  constexpr const char* function = "gradclip::add_ghost_norms";
  const detail::dense_shape s = detail::check_dense_layer(function, inputs, output_grads, steps);
  if (parts.empty()) parts.resize(s.examples);
  if (parts.size() != s.examples)
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(parts.size()) + " parts for " +
                                std::to_string(s.examples) + " examples");
  if (steps == 1) {
    const auto a =
        detail::reduce_units<robust>(detail::consecutive_units(detail::batch_of(inputs.derived()).split), {});
    const auto b =
        detail::reduce_units<robust>(detail::consecutive_units(detail::batch_of(output_grads.derived()).split), {});
    for (std::size_t i = 0; i < s.examples; ++i) {
      parts[i].merge(detail::product_of_parts(a[i], b[i]));
      if (bias) parts[i].merge(b[i]);
    }
    return ghost_form::gram;
  }
  form = detail::choose_form(s, form);
  const Eigen::Index t = static_cast<Eigen::Index>(steps);
  for (std::size_t i = 0; i < s.examples; ++i) {
    const Eigen::Index first = static_cast<Eigen::Index>(i) * t;
    const detail::scaled_rows a = detail::scale_rows(inputs.middleRows(first, t));
    const detail::scaled_rows b = detail::scale_rows(output_grads.middleRows(first, t));
    parts[i].merge(detail::ghost_weight_part(a, b, form));
    if (bias) parts[i].merge(detail::ghost_bias_part(b));
  }
  return form;
}

namespace detail {

/// Rounds acc * 2^exponent once into out (an Eigen matrix of any element type).
template <class Acc, class OutMatrix>
void write_scaled(const Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic>& acc, int exponent,
                  const Eigen::MatrixBase<OutMatrix>& out) {
  using U = typename OutMatrix::Scalar;
  static_assert(is_element_v<U>, "The sums are Eigen matrices of Eigen::half, Eigen::bfloat16, float or double.");
  auto& target = const_cast<Eigen::MatrixBase<OutMatrix>&>(out);  // Eigen's idiom for writable temporaries
  const auto [first, second] = power_of_two_factors(exponent);
  for (Eigen::Index k = 0; k < acc.cols(); ++k)
    for (Eigen::Index j = 0; j < acc.rows(); ++j)
      target(j, k) = exponent == 0 ? narrow<U>(acc(j, k)) : narrow<U>(static_cast<double>(acc(j, k)) * first * second);
}

/// Divides m by a power of two when its largest magnitude leaves Acc's safe range; returns the exponent.
template <class Acc>
int scale_into_range(Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic>& m) {
  const Acc top = m.size() == 0 ? Acc(0) : m.cwiseAbs().maxCoeff();
  const Acc lo = std::ldexp(Acc(1), -safe_exponent_range<Acc>), hi = std::ldexp(Acc(1), safe_exponent_range<Acc>);
  if (top == Acc(0) || !std::isfinite(top) || (top >= lo && top <= hi)) return 0;
  const int e = std::ilogb(top) + 1;
  const auto [first, second] = power_of_two_factors<Acc>(-e);
  m = (m * first) * second;
  return e;
}

template <class In, class Out, class WeightSum, class BiasSum>
void ghost_sum(const per_example_plan& plan, const Eigen::MatrixBase<In>& inputs,
               const Eigen::MatrixBase<Out>& output_grads, std::size_t steps,
               const Eigen::MatrixBase<WeightSum>& weight_sum, const Eigen::MatrixBase<BiasSum>* bias_sum) {
  constexpr const char* function = "gradclip::ghost_weighted_sum";
  const dense_shape s = check_dense_layer(function, inputs, output_grads, steps);
  const std::string where(function);
  if (plan.size() != s.examples || plan.included.size() != s.examples)
    throw std::invalid_argument(where + ": the plan has " + std::to_string(plan.size()) + " examples, the layer " +
                                std::to_string(s.examples));
  if (static_cast<std::size_t>(weight_sum.rows()) != s.outputs ||
      static_cast<std::size_t>(weight_sum.cols()) != s.inputs)
    throw std::invalid_argument(
        where + ": weight_sum is " + std::to_string(weight_sum.rows()) + " x " + std::to_string(weight_sum.cols()) +
        ", expected d_out x d_in = " + std::to_string(s.outputs) + " x " + std::to_string(s.inputs));
  if (bias_sum && static_cast<std::size_t>(bias_sum->size()) != s.outputs)
    throw std::invalid_argument(where + ": bias_sum has " + std::to_string(bias_sum->size()) + " elements, expected " +
                                std::to_string(s.outputs));
  using TIn = typename In::Scalar;
  using TOut = typename Out::Scalar;
  using Acc = std::conditional_t<std::is_same_v<TIn, double> || std::is_same_v<TOut, double>, double, float>;
  using matrix = Eigen::Matrix<Acc, Eigen::Dynamic, Eigen::Dynamic>;
  // A and f_i B_i in Acc, rows of left-out examples zero (they may hold NaN, which 0 * NaN would spread).
  matrix a = matrix::Zero(inputs.rows(), inputs.cols()), b = matrix::Zero(output_grads.rows(), output_grads.cols());
  const Eigen::Index t = static_cast<Eigen::Index>(steps);
  with_weights<TOut>(plan_factors::of(plan), plan.included, [&](const auto& w) {
    for (std::size_t i = 0; i < s.examples; ++i) {
      if (!plan.included[i]) continue;
      const Eigen::Index first = static_cast<Eigen::Index>(i) * t;
      a.middleRows(first, t) = inputs.middleRows(first, t).unaryExpr([](TIn x) { return widen<Acc>(x); });
      b.middleRows(first, t) = output_grads.middleRows(first, t).unaryExpr([&](TOut x) { return Acc(w[i](x)); });
    }
  });
  const int ea = scale_into_range(a), eb = scale_into_range(b);
  const matrix sum = b.transpose() * a;  // sum_i f_i B_i^T A_i: one GEMM over all B*T rows
  write_scaled(sum, ea + eb, weight_sum);
  if (bias_sum) write_scaled(matrix(b.colwise().sum().transpose()), eb, *bias_sum);
}

}  // namespace detail

/// The clipped sum of a dense layer's per-example weight gradients, sum_i f_i B_i^T A_i (d_out x d_in,
/// PyTorch's [out, in] weight layout), with the factors of `plan` (plan_per_example on parts that include
/// add_ghost_norms), formed as one matrix product (Eigen's GEMM) of the B*T rows of f_i B_i and A:
/// no per-example gradient is formed. Accumulates in FP32 (FP64 when A or B is FP64), on rows divided by a
/// power of two when their range needs it, and rounds once into weight_sum (any element type). Examples
/// the plan leaves out are left out. Throws std::invalid_argument for shapes that do not match.
///
///     gradclip::ghost_weighted_sum(plan, x, dy, 1, sum_w);
template <class In, class Out, class WeightSum>
void ghost_weighted_sum(const per_example_plan& plan, const Eigen::MatrixBase<In>& inputs,
                        const Eigen::MatrixBase<Out>& output_grads, std::size_t steps,
                        const Eigen::MatrixBase<WeightSum>& weight_sum) {
  detail::ghost_sum(plan, inputs, output_grads, steps, weight_sum,
                    static_cast<const Eigen::MatrixBase<WeightSum>*>(nullptr));
}

/// The same, with the bias gradient's clipped sum, sum_i f_i sum_t b_t, into bias_sum (d_out elements).
template <class In, class Out, class WeightSum, class BiasSum>
void ghost_weighted_sum(const per_example_plan& plan, const Eigen::MatrixBase<In>& inputs,
                        const Eigen::MatrixBase<Out>& output_grads, std::size_t steps,
                        const Eigen::MatrixBase<WeightSum>& weight_sum, const Eigen::MatrixBase<BiasSum>& bias_sum) {
  detail::ghost_sum(plan, inputs, output_grads, steps, weight_sum, &bias_sum);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
