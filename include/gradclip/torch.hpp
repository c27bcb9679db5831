// libtorch adapter: clip_grad_norm_ and clip_grad_value_ are source-compatible drop-ins for
// torch::nn::utils's (libtorch 1.13), right in every precision; clip_grad_norm_with and clip_grads_ take
// gradclip::options and return the whole clip_result. The migration table is docs/libtorch.md.
// Not included by gradclip.hpp; include it where libtorch is available.
#pragma once

#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/policies.hpp>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace libtorch {

namespace detail {

// The adapter hands libtorch's storage to gradclip's kernels, which read FP16/BF16 as raw bits.
static_assert(sizeof(c10::Half) == sizeof(Eigen::half) && sizeof(c10::BFloat16) == sizeof(Eigen::bfloat16),
              "c10::Half and c10::BFloat16 must have the same 16 bits as Eigen::half and Eigen::bfloat16.");

/// Throws std::invalid_argument, before anything is modified, for a tensor the kernels cannot read.
/// `name` says which tensor it is in the caller's terms ("gradient 2", "the gradient of parameter 2").
inline void check_supported(const char* function, const torch::Tensor& t, const std::string& name) {
  const auto reject = [&](const std::string& what) {
    throw std::invalid_argument(std::string(function) + ": " + name + " " + what);
  };
  if (t.layout() != torch::kStrided)
    reject("has layout " + c10::str(t.layout()) + "; only dense (strided) tensors are supported, not sparse ones");
  if (!t.device().is_cpu()) reject("is on device " + t.device().str() + "; only CPU tensors are supported");
  const auto type = t.scalar_type();
  if (type != torch::kHalf && type != torch::kBFloat16 && type != torch::kFloat && type != torch::kDouble)
    reject("has dtype " + std::string(c10::toString(type)) + "; only Half, BFloat16, Float and Double are supported");
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
    reject("has elements that share memory (as made by expand()), so it cannot be clipped in place");
}

/// A view of a tensor whose elements fill one block of memory in some order (contiguous, transposed,
/// permuted): clipping is elementwise, so the order does not matter.
inline grad_view flat_view(const torch::Tensor& t) {
  const auto n = static_cast<std::size_t>(t.numel());
  switch (t.scalar_type()) {
    case torch::kHalf:
      return grad_view(reinterpret_cast<Eigen::half*>(t.data_ptr<c10::Half>()), n);
    case torch::kBFloat16:
      return grad_view(reinterpret_cast<Eigen::bfloat16*>(t.data_ptr<c10::BFloat16>()), n);
    case torch::kFloat:
      return grad_view(t.data_ptr<float>(), n);
    default:
      return grad_view(t.data_ptr<double>(), n);
  }
}

/// A contiguous tensor cut into AGC units as PyTorch lays weights out: slices along the first dimension
/// ([out, in, kh, kw]: one unit per output), or one unit for a tensor with at most one dimension above 1.
template <class T>
gradclip::detail::unit_split<T> torch_units(const torch::Tensor& t) {
  gradclip::detail::unit_split<T> split;
  split.whole = {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
  for (const auto d : t.sizes()) split.shape.push_back(static_cast<std::ptrdiff_t>(d));
  if (t.numel() != 0 && !gradclip::detail::is_vector_shape(split.shape)) {
    split.units = static_cast<std::size_t>(t.size(0));
    split.unit_size = static_cast<std::size_t>(t.numel() / t.size(0));
    split.unit_stride = static_cast<std::ptrdiff_t>(split.unit_size);
  }
  return split;
}

/// Calls f(T*) with a null pointer of the tensor's element type, to dispatch on its dtype.
template <class F>
decltype(auto) with_element_type(const torch::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case torch::kHalf:
      return f(static_cast<Eigen::half*>(nullptr));
    case torch::kBFloat16:
      return f(static_cast<Eigen::bfloat16*>(nullptr));
    case torch::kFloat:
      return f(static_cast<float*>(nullptr));
    default:
      return f(static_cast<double*>(nullptr));
  }
}

/// Clips `grads` (defined, already checked) under one global norm. Gradients with gaps between their
/// elements (slices) are clipped through a contiguous copy that is written back only if clipping
/// changed it, so the caller's tensor is modified in place either way.
// The threshold controllers of issue 14 will enter here: an overload taking the controller in place of
// max_norm, forwarding to clip_by_global_norm<Policy>(views, controller, opt) with the same copies.
template <class Policy>
clip_result clip_tensors(const char* function, const std::vector<torch::Tensor>& grads, double max_norm,
                         const options& opt) {
  gradclip::detail::check_clip_arguments(function, max_norm, opt);
  std::vector<grad_view> views;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (caller's tensor, contiguous copy)
  views.reserve(grads.size());
  for (const auto& g : grads) {
    if (g.is_non_overlapping_and_dense()) {
      views.push_back(flat_view(g));
    } else {
      copies.emplace_back(g, g.contiguous());
      views.push_back(flat_view(copies.back().second));
    }
  }
  const clip_result result = [&] {
    try {
      return clip_by_global_norm<Policy>(views, max_norm, opt);
    } catch (const nonfinite_error& e) {
      throw nonfinite_error(function, e.norm);  // name the function the caller called
    }
  }();
  if (result.clipped) {
    const at::NoGradGuard no_grad;  // a gradient that itself requires grad may still be written
    for (auto& [original, copy] : copies) original.copy_(copy);
  }
  return result;
}

/// The defined gradients of `tensors` (their .grad() when `take_grad`), each checked before any is used.
inline std::vector<torch::Tensor> defined_gradients(const char* function, const std::vector<torch::Tensor>& tensors,
                                                    bool take_grad) {
  std::vector<torch::Tensor> grads;
  grads.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    const torch::Tensor& g = take_grad ? tensors[i].grad() : tensors[i];
    if (!g.defined()) continue;
    check_supported(function, g, (take_grad ? "the gradient of parameter " : "gradient ") + std::to_string(i));
    grads.push_back(g);
  }
  return grads;
}

/// Clamps one checked gradient to [-clip_value, clip_value] with libtorch's own clamp_, which rounds the
/// bound to the element type. FP16, which libtorch 1.13 cannot clamp on the CPU, is clamped in FP32: every
/// half and the bound rounded to half as libtorch rounds it (through float) are exact there.
inline void clamp_gradient(const torch::Tensor& grad, double clip_value) {
  const double largest = with_element_type(grad, [](auto* p) {
    return static_cast<double>(std::numeric_limits<std::remove_pointer_t<decltype(p)>>::max());
  });
  if (clip_value > largest) return;  // every finite element is within; libtorch throws instead
  torch::Tensor data = grad.data();  // as libtorch: no autograd history, the caller's storage
  if (grad.scalar_type() != torch::kHalf) {
    data.clamp_(-clip_value, clip_value);
  } else {
    const double bound = static_cast<float>(c10::Half(static_cast<float>(clip_value)));
    data.copy_(data.to(torch::kFloat).clamp_(-bound, bound));
  }
}

}  // namespace detail

/// Drop-in for torch::nn::utils::clip_grad_norm_ with the same overloads, arguments and result: clips
/// the .grad() of every parameter in place under one global norm of order `norm_type` (p > 0, or
/// infinity for the max norm), g <- g * c with c = max_norm / (norm + 1e-6) when c < 1, and returns the
/// norm. Parameters without a gradient are ignored (no gradient at all: returns 0). A NaN or infinite
/// norm propagates as in libtorch (every element times NaN, or times 0) unless error_if_nonfinite is
/// set: then gradclip::nonfinite_error is thrown and nothing is modified. Runs on at::get_num_threads()
/// threads, with the same bits for any count.
///
/// Unlike libtorch 1.13 it clips FP16 (libtorch throws), rounds BF16 once (libtorch turns [300] into
/// 0.996) and keeps FP32 [1e20, 1e20] finite (libtorch's norm is inf and it zeroes the gradient).
/// Gradients may mix Half, BFloat16, Float and Double (CPU, dense, any strides). Throws
/// std::invalid_argument, before anything is modified, for a negative or NaN max_norm, a norm_type that
/// is not > 0 (libtorch computes something for those), and CUDA, sparse or other-dtype gradients.
///
///     double norm = gradclip::libtorch::clip_grad_norm_(model->parameters(), 1.0);
inline double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false) {
  constexpr const char* function = "gradclip::libtorch::clip_grad_norm_";
  const options opt{error_if_nonfinite ? on_nonfinite::error : on_nonfinite::propagate, 1e-6,
                    gradclip::norm_type{norm_type}, static_cast<unsigned>(at::get_num_threads())};
  return detail::clip_tensors<robust>(function, detail::defined_gradients(function, parameters, true), max_norm, opt)
      .norm;
}

/// The same for a braced list of parameters: clip_grad_norm_({w, b}, 1.0).
inline double clip_grad_norm_(std::initializer_list<torch::Tensor> parameters, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false) {
  return clip_grad_norm_(std::vector<torch::Tensor>(parameters), max_norm, norm_type, error_if_nonfinite);
}

/// The same for one parameter.
inline double clip_grad_norm_(const torch::Tensor& parameter, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false) {
  return clip_grad_norm_(std::vector<torch::Tensor>{parameter}, max_norm, norm_type, error_if_nonfinite);
}

/// Drop-in for torch::nn::utils::clip_grad_value_: clamps the .grad() of every parameter to
/// [-clip_value, clip_value] in place, bit for bit as libtorch (NaN stays NaN). Unlike libtorch 1.13 it
/// also clamps FP16 on the CPU, and leaves a gradient unchanged when clip_value exceeds its dtype's
/// largest finite value (libtorch throws). Throws std::invalid_argument, before anything is modified, for
/// a negative or NaN clip_value (libtorch clamps every element to it) and for unsupported gradients.
///
///     gradclip::libtorch::clip_grad_value_(model->parameters(), 0.5);
inline void clip_grad_value_(const std::vector<torch::Tensor>& parameters, double clip_value) {
  constexpr const char* function = "gradclip::libtorch::clip_grad_value_";
  if (!(clip_value >= 0)) throw std::invalid_argument(std::string(function) + ": clip_value must be >= 0 and not NaN");
  for (const auto& grad : detail::defined_gradients(function, parameters, true))
    detail::clamp_gradient(grad, clip_value);
}

/// The same for a braced list of parameters.
inline void clip_grad_value_(std::initializer_list<torch::Tensor> parameters, double clip_value) {
  clip_grad_value_(std::vector<torch::Tensor>(parameters), clip_value);
}

/// The same for one parameter.
inline void clip_grad_value_(const torch::Tensor& parameter, double clip_value) {
  clip_grad_value_(std::vector<torch::Tensor>{parameter}, clip_value);
}

/// clip_grad_norm_ with gradclip's options and policy, returning the whole clip_result: clips the .grad()
/// of every parameter in place by g <- g * c, c = max_norm / (norm + opt.epsilon) when c < 1, the norm
/// being opt.norm over all of them, on opt.threads threads. The defaults are gradclip's (epsilon 0, a
/// non-finite norm skipped: nothing is modified and `finite` is false); {on_nonfinite::propagate, 1e-6}
/// is libtorch's arithmetic. Same tensors and exceptions as clip_grad_norm_.
///
///     auto result = gradclip::libtorch::clip_grad_norm_with(model->parameters(), 1.0);
///     if (result.finite) optimizer.step();
template <class Policy = robust>
clip_result clip_grad_norm_with(const std::vector<torch::Tensor>& parameters, double max_norm,
                                const options& opt = {}) {
  constexpr const char* function = "gradclip::libtorch::clip_grad_norm_with";
  return detail::clip_tensors<Policy>(function, detail::defined_gradients(function, parameters, true), max_norm, opt);
}

/// The same on the gradient tensors themselves (undefined tensors are ignored).
///
///     auto result = gradclip::libtorch::clip_grads_({w.grad(), b.grad()}, 1.0);
template <class Policy = robust>
clip_result clip_grads_(const std::vector<torch::Tensor>& grads, double max_norm, const options& opt = {}) {
  constexpr const char* function = "gradclip::libtorch::clip_grads_";
  return detail::clip_tensors<Policy>(function, detail::defined_gradients(function, grads, false), max_norm, opt);
}

/// Adaptive gradient clipping (gradclip::adaptive_clip, Optax's semantics) of one parameter's .grad()
/// against the parameter itself: each unit, a slice along the first dimension (a row of an [out, in]
/// weight, an output channel of a convolution kernel), is clipped to clipping * max(||w_u||, eps). The
/// gradient and the parameter may have different dtypes (Half, BFloat16, Float, Double; CPU, dense) but
/// the same shape. A parameter without a gradient is left alone (units = 0). Non-contiguous tensors are
/// read through contiguous copies; the gradient is written back in place.
///
///     for (auto& p : model->parameters()) (void)gradclip::libtorch::adaptive_clip_(p, 0.01);
inline adaptive_clip_result adaptive_clip_(const torch::Tensor& parameter, double clipping, double eps = 1e-3,
                                           on_nonfinite nonfinite = on_nonfinite::skip) {
  constexpr const char* function = "gradclip::libtorch::adaptive_clip_";
  if (!parameter.defined() || !parameter.grad().defined()) return {0, 0, 1.0, true};
  const torch::Tensor& grad = parameter.grad();
  detail::check_supported(function, grad, "the gradient");
  detail::check_supported(function, parameter, "the parameter");
  gradclip::detail::check_adaptive_clip_arguments(function, clipping, eps, options{nonfinite});
  const torch::Tensor weights = parameter.detach().contiguous();
  const bool in_place = grad.is_contiguous();
  const torch::Tensor work = in_place ? grad : grad.contiguous();
  const adaptive_clip_result result = detail::with_element_type(work, [&](auto* g) {
    return detail::with_element_type(weights, [&](auto* w) {
      using G = std::remove_pointer_t<decltype(g)>;
      using W = std::remove_pointer_t<decltype(w)>;
      return gradclip::detail::adaptive_clip_units(function, detail::torch_units<G>(work),
                                                   detail::torch_units<const W>(weights), clipping, eps,
                                                   options{nonfinite});
    });
  });
  if (!in_place && result.clipped != 0) {
    const at::NoGradGuard no_grad;
    torch::Tensor target = grad;  // a handle to the caller's gradient
    target.copy_(work);
  }
  return result;
}

}  // namespace libtorch
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
