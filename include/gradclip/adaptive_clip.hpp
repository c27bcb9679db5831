// Adaptive gradient clipping (AGC, Brock et al. 2021): each unit's gradient clipped relative to the norm
// of its weights, with Optax's adaptive_grad_clip semantics.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/pipeline.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

/// A gradient cut into units: unit i is `unit_size` elements `element_stride` apart, starting
/// `unit_stride * i` after `whole.data`; a single unit is `whole` itself (any strides).
template <class T>
struct unit_split {
  strided_view<T> whole;
  std::vector<std::ptrdiff_t> shape;
  std::size_t units = 1;
  std::size_t unit_size = 0;
  std::ptrdiff_t unit_stride = 0;
  std::ptrdiff_t element_stride = 1;

  strided_view<T> unit(std::size_t i) const {
    if (units == 1) return whole;
    return {whole.data + static_cast<std::ptrdiff_t>(i) * unit_stride, unit_size, element_stride};
  }
};

template <class G, class = void>
struct is_eigen_tensor : std::false_type {};
template <class G>
struct is_eigen_tensor<G, std::void_t<decltype(G::NumIndices), decltype(std::declval<G&>().dimensions()),
                                      decltype(std::declval<G&>().data())>> : std::true_type {};

/// Optax's rule: a tensor with at most one dimension above 1 (a scalar or a vector) is one unit.
inline bool is_vector_shape(const std::vector<std::ptrdiff_t>& shape) {
  return std::count_if(shape.begin(), shape.end(), [](std::ptrdiff_t d) { return d > 1; }) <= 1;
}

/// Units along the first dimension: rows of a matrix, slices t(i, ...) of a tensor.
template <class G>
auto split_units(G& g) {
  using raw = std::remove_cv_t<G>;
  if constexpr (is_eigen_dense_v<raw>) {
    static_assert(is_element_v<typename raw::Scalar>,
                  "adaptive_clip takes Eigen objects of Eigen::half, Eigen::bfloat16, float or double.");
    using T = std::remove_pointer_t<decltype(g.data())>;
    unit_split<T> split;
    split.whole = visit_gradient(g, [](auto view) { return view; });
    split.shape = {static_cast<std::ptrdiff_t>(g.rows()), static_cast<std::ptrdiff_t>(g.cols())};
    if (!is_vector_shape(split.shape)) {
      split.units = static_cast<std::size_t>(g.rows());
      split.unit_size = static_cast<std::size_t>(g.cols());
      // A row runs along the outer dimension of a column-major object, the inner one of a row-major one.
      split.unit_stride = raw::IsRowMajor ? g.outerStride() : g.innerStride();
      split.element_stride = raw::IsRowMajor ? g.innerStride() : g.outerStride();
    }
    return split;
  } else if constexpr (is_eigen_tensor<raw>::value) {
    using T = std::remove_pointer_t<decltype(g.data())>;
    static_assert(is_element_v<T>,
                  "adaptive_clip takes Eigen tensors of Eigen::half, Eigen::bfloat16, float or double.");
    unit_split<T> split;
    const std::size_t size = static_cast<std::size_t>(g.size());
    split.whole = {g.data(), size};
    for (std::size_t d = 0; d < static_cast<std::size_t>(raw::NumIndices); ++d)
      split.shape.push_back(static_cast<std::ptrdiff_t>(g.dimensions()[d]));
    if (size != 0 && !is_vector_shape(split.shape)) {
      const std::size_t first = static_cast<std::size_t>(split.shape[0]);
      split.units = first;
      split.unit_size = size / first;
      // Column-major: the first index varies fastest, so t(i, ...) is strided; row-major: contiguous.
      const bool row_major = static_cast<int>(raw::Layout) == static_cast<int>(Eigen::RowMajor);
      split.unit_stride = row_major ? static_cast<std::ptrdiff_t>(split.unit_size) : 1;
      split.element_stride = row_major ? 1 : static_cast<std::ptrdiff_t>(first);
    }
    return split;
  } else {
    static_assert(has_data_and_size<G>::value,
                  "adaptive_clip takes Eigen tensors, tensor maps and dense objects of Eigen::half, "
                  "Eigen::bfloat16, float or double, or a container with data() and size() (one unit).");
    using T = std::remove_pointer_t<decltype(g.data())>;
    unit_split<T> split;
    split.whole = {g.data(), static_cast<std::size_t>(g.size())};
    split.shape = {static_cast<std::ptrdiff_t>(g.size())};
    return split;
  }
}

inline std::string shape_string(const std::vector<std::ptrdiff_t>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

// Optax's guard in the coefficient's denominator, max(||g_u||, 1e-6).
inline constexpr double agc_div_eps = 1e-6;

/// True when units interleave in memory (rows of a column-major object): visiting one unit at a time
/// would touch a cache line per element, so their norms sweep all units column by column instead.
template <class T>
bool interleaved(const unit_split<T>& split) {
  return split.units > 1 && split.element_stride != 1;
}

// Columns per chunk of the sweep: unit sums are totalled once per chunk, so each unit's sum of squares
// rounds like a two-level sum (error ~ (32 + size / 32) * 2^-53 instead of size * 2^-53).
inline constexpr std::size_t sweep_chunk = 32;

/// The L2 norm of every unit as a partial_norm, as the robust policy computes it.
template <class T>
std::vector<partial_norm> unit_norms(const unit_split<T>& split, std::size_t units) {
  std::vector<partial_norm> norms(units);
  if (units == 0 || !interleaved(split)) {
    for (std::size_t i = 0; i < units; ++i) norms[i] = reduce_piece<robust>(split.unit(i), 2.0);
    return norms;
  }
  // FP64 squares of FP16/BF16/FP32 values neither overflow nor underflow; FP64 units whose maximum
  // leaves [2^-450, 2^450] (or that hold an Inf or NaN) are recomputed by the robust kernel.
  constexpr bool may_need_scaling = std::is_same_v<std::remove_const_t<T>, double>;
  std::vector<double> total(units, 0.0), chunk(units), top(units, 0.0);
  for (std::size_t k0 = 0; k0 < split.unit_size; k0 += sweep_chunk) {
    std::fill(chunk.begin(), chunk.end(), 0.0);
    for (std::size_t k = k0; k < std::min(split.unit_size, k0 + sweep_chunk); ++k) {
      const T* column = split.whole.data + static_cast<std::ptrdiff_t>(k) * split.element_stride;
      for (std::size_t i = 0; i < units; ++i) {
        const double x = widen<double>(column[static_cast<std::ptrdiff_t>(i) * split.unit_stride]);
        chunk[i] += x * x;
        if constexpr (may_need_scaling) top[i] = std::abs(x) > top[i] ? std::abs(x) : top[i];
      }
    }
    for (std::size_t i = 0; i < units; ++i) total[i] += chunk[i];
  }
  for (std::size_t i = 0; i < units; ++i) {
    const bool in_range = top[i] == 0.0 || (top[i] >= 0x1p-450 && top[i] <= 0x1p450);
    if (may_need_scaling && (!in_range || !std::isfinite(total[i])))
      norms[i] = reduce_piece<robust>(split.unit(i), 2.0);
    else
      norms[i] = {0, total[i], static_cast<bool>(std::isfinite(total[i]))};
  }
  return norms;
}

/// Multiplies each unit that clips by its coefficient with the robust policy's scale kernel (strided
/// units through a gathered buffer); units that do not clip are neither read nor written.
template <class T>
void apply_unit_factors(const unit_split<T>& split, const std::vector<std::pair<bool, scaled>>& plans) {
  for (std::size_t i = 0; i < plans.size(); ++i)
    if (plans[i].first)
      split.unit(i).for_each_run([&](T* p, std::size_t n) { scale_run<robust>(p, n, plans[i].second); }, true);
}

inline void check_adaptive_clip_arguments(const char* function, double clipping, double eps, on_nonfinite nonfinite) {
  if (!(clipping >= 0) || !std::isfinite(clipping))
    throw std::invalid_argument(std::string(function) + ": clipping must be finite and >= 0");
  if (!(eps >= 0) || !std::isfinite(eps))
    throw std::invalid_argument(std::string(function) + ": eps must be finite and >= 0");
  if (nonfinite != on_nonfinite::skip && nonfinite != on_nonfinite::error && nonfinite != on_nonfinite::propagate)
    throw std::invalid_argument(std::string(function) + ": nonfinite is not an on_nonfinite value");
}

template <class T, class U>
adaptive_clip_result adaptive_clip_units(const char* function, const unit_split<T>& grad, const unit_split<U>& weights,
                                         double clipping, double eps, on_nonfinite nonfinite) {
  static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
  if (grad.shape != weights.shape)
    throw std::invalid_argument(std::string(function) + ": the weights' shape " + shape_string(weights.shape) +
                                " differs from the gradient's " + shape_string(grad.shape));
  adaptive_clip_result result;
  result.units = grad.whole.size() == 0 ? 0 : grad.units;
  // Every decision is taken before any gradient is written, so `skip` and `error` modify nothing.
  std::vector<std::pair<bool, scaled>> plans(result.units, {false, scaled{1.0, 0}});
  double first_nonfinite = 0.0;
  const std::vector<partial_norm> grad_norms = unit_norms(grad, result.units);
  const std::vector<partial_norm> weight_norms = unit_norms(weights, result.units);
  for (std::size_t i = 0; i < result.units; ++i) {
    const partial_norm& g = grad_norms[i];
    const partial_norm& w = weight_norms[i];
    if (g.finite && w.finite) {
      const scaled g_norm = g.norm_scaled();
      const scaled max_norm = scaled::of(clipping) * std::max(w.norm_scaled(), scaled::of(eps));
      if (g_norm < max_norm) continue;  // Optax: where(g_norm < max_norm, g, clipped)
      plans[i] = {true, max_norm / std::max(g_norm, scaled::of(agc_div_eps))};
      continue;
    }
    if (result.finite) first_nonfinite = g.finite ? w.norm() : g.norm();
    result.finite = false;
    // Optax's arithmetic as is, NaN and inf included (max and maximum both propagate NaN).
    const double g_norm = g.norm(), w_norm = w.norm();
    const double max_norm = clipping * (std::isnan(w_norm) ? w_norm : std::max(w_norm, eps));
    if (g_norm < max_norm) continue;
    const double denominator = std::isnan(g_norm) ? g_norm : std::max(g_norm, agc_div_eps);
    plans[i] = {true, scaled{max_norm / denominator, 0}};
  }
  if (!result.finite) {
    if (nonfinite == on_nonfinite::error) throw nonfinite_error(function, first_nonfinite);
    if (nonfinite == on_nonfinite::skip) return result;
  }
  for (std::size_t i = 0; i < result.units; ++i) {
    if (!plans[i].first) continue;
    ++result.clipped;
    const double value = plans[i].second.value();
    if (!std::isnan(result.min_coefficient) && !(value >= result.min_coefficient)) result.min_coefficient = value;
  }
  if (result.clipped != 0) apply_unit_factors(grad, plans);
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
/// std::invalid_argument). A NaN or Inf in a gradient or weight unit follows `nonfinite`: `skip`
/// (default) modifies nothing and returns finite = false, `error` throws nonfinite_error, `propagate` is
/// Optax's arithmetic as is. Throws std::invalid_argument for a negative or non-finite clipping or eps.
///
///     auto r = gradclip::adaptive_clip(grad, weight, 0.01);   // Eigen::MatrixXf grad, weight
template <class Grad, class Weights>
adaptive_clip_result adaptive_clip(Grad&& grad, const Weights& weights, double clipping, double eps = 1e-3,
                                   on_nonfinite nonfinite = on_nonfinite::skip) {
  constexpr const char* function = "gradclip::adaptive_clip";
  detail::check_adaptive_clip_arguments(function, clipping, eps, nonfinite);
  return detail::adaptive_clip_units(function, detail::split_units(grad), detail::split_units(weights), clipping, eps,
                                     nonfinite);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
