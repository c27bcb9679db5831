// libtorch adapter: a drop-in for torch::nn::utils::clip_grad_norm_ that is right in every precision.
// Not included by gradclip.hpp; include it where libtorch is available.
#pragma once

#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/policies.hpp>

#include <ATen/MemoryOverlap.h>
#include <torch/types.h>

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gradclip::libtorch {

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

template <class Policy>
clip_result clip_defined(const char* function, const std::vector<torch::Tensor>& tensors, bool take_grad,
                         double max_norm, const options& opt) {
  std::vector<torch::Tensor> grads;
  grads.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    const torch::Tensor& g = take_grad ? tensors[i].grad() : tensors[i];
    if (!g.defined()) continue;
    check_supported(function, g, (take_grad ? "the gradient of parameter " : "gradient ") + std::to_string(i));
    grads.push_back(g);
  }
  return clip_tensors<Policy>(function, grads, max_norm, opt);
}

}  // namespace detail

/// Drop-in for torch::nn::utils::clip_grad_norm_: clips the .grad() of every parameter in place under
/// one global L2 norm, g <- g * min(1, max_norm / (norm + epsilon)); parameters without a gradient are
/// ignored. Gradients may mix Half, BFloat16, Float and Double (CPU, dense, any strides).
///
/// Unlike libtorch 1.13 it clips FP16 (libtorch throws), rounds BF16 once (libtorch turns [300] into
/// 0.996), and keeps FP32 [1e20, 1e20] finite (libtorch's norm is inf and it zeroes the gradient).
/// The defaults are gradclip's: epsilon 0 and non-finite norms skipped; {on_nonfinite::propagate, 1e-6}
/// reproduces libtorch. Throws std::invalid_argument, before anything is modified, for CUDA, sparse or
/// other-dtype gradients and for the bad arguments clip_by_norm rejects.
///
///     auto result = gradclip::libtorch::clip_grad_norm_(model->parameters(), 1.0);
template <class Policy = robust>
clip_result clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, options opt = {}) {
  return detail::clip_defined<Policy>("gradclip::libtorch::clip_grad_norm_", parameters, true, max_norm, opt);
}

/// The same on the gradient tensors themselves (undefined tensors are ignored).
///
///     auto result = gradclip::libtorch::clip_grads_({w.grad(), b.grad()}, 1.0);
template <class Policy = robust>
clip_result clip_grads_(const std::vector<torch::Tensor>& grads, double max_norm, options opt = {}) {
  return detail::clip_defined<Policy>("gradclip::libtorch::clip_grads_", grads, false, max_norm, opt);
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
  gradclip::detail::check_adaptive_clip_arguments(function, clipping, eps, nonfinite);
  const torch::Tensor weights = parameter.detach().contiguous();
  const bool in_place = grad.is_contiguous();
  const torch::Tensor work = in_place ? grad : grad.contiguous();
  const adaptive_clip_result result = detail::with_element_type(work, [&](auto* g) {
    return detail::with_element_type(weights, [&](auto* w) {
      using G = std::remove_pointer_t<decltype(g)>;
      using W = std::remove_pointer_t<decltype(w)>;
      return gradclip::detail::adaptive_clip_units(function, detail::torch_units<G>(work),
                                                   detail::torch_units<const W>(weights), clipping, eps, nonfinite);
    });
  });
  if (!in_place && result.clipped != 0) {
    const at::NoGradGuard no_grad;
    torch::Tensor target = grad;  // a handle to the caller's gradient
    target.copy_(work);
  }
  return result;
}

}  // namespace gradclip::libtorch
