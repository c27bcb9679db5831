// libtorch adapter: clip_grad_norm_ and clip_grad_value_ are source-compatible drop-ins for
// torch::nn::utils's (libtorch 1.13), right in every precision; clip_grad_norm_with and clip_grads_ take
// gradclip::options and return the whole clip_result; get_total_norm and clip_grads_with_norm_ are PyTorch
// 2.x's split of clip_grad_norm_. CPU tensors go through gradclip's kernels, tensors on any other device
// (CUDA, ...) through libtorch's own operations on that device, with the same robust arithmetic
// (GRADCLIP_TORCH_FORCE_OPS sends CPU tensors there too). The migration table is docs/libtorch.md.
// Not included by gradclip.hpp; include it where libtorch is available.
#pragma once

#include <gradclip/adaptive_clip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/report.hpp>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_foreach_mul.h>
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

// 1: every tensor goes through the libtorch-ops path, CPU ones too (to test that path without a GPU).
#ifndef GRADCLIP_TORCH_FORCE_OPS
#define GRADCLIP_TORCH_FORCE_OPS 0
#endif

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace libtorch {

namespace detail {

// The adapter hands libtorch's storage to gradclip's kernels, which read FP16/BF16 as raw bits.
static_assert(sizeof(c10::Half) == sizeof(Eigen::half) && sizeof(c10::BFloat16) == sizeof(Eigen::bfloat16),
              "c10::Half and c10::BFloat16 must have the same 16 bits as Eigen::half and Eigen::bfloat16.");

/// Throws std::invalid_argument, before anything is modified, for a tensor neither path can read.
/// `name` says which tensor it is in the caller's terms ("gradient 2", "the gradient of parameter 2").
inline void check_supported(const char* function, const torch::Tensor& t, const std::string& name) {
  const auto reject = [&](const std::string& what) {
    throw std::invalid_argument(std::string(function) + ": " + name + " " + what);
  };
  if (t.layout() != torch::kStrided)
    reject("has layout " + c10::str(t.layout()) + "; only dense (strided) tensors are supported, not sparse ones");
  if (t.device().is_meta()) reject("is on device meta, which holds no data");
  const auto type = t.scalar_type();
  if (type != torch::kHalf && type != torch::kBFloat16 && type != torch::kFloat && type != torch::kDouble)
    reject("has dtype " + std::string(c10::toString(type)) + "; only Half, BFloat16, Float and Double are supported");
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
    reject("has elements that share memory (as made by expand()), so it cannot be clipped in place");
}

/// Throws std::invalid_argument for a tensor the native kernels cannot read (adaptive_clip_ has no op path).
inline void check_cpu(const char* function, const torch::Tensor& t, const std::string& name) {
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string(function) + ": " + name + " is on device " + t.device().str() +
                                "; only CPU tensors are supported");
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

/// True when a call's tensors (on one device, checked) go through libtorch's operations.
inline bool use_ops(const std::vector<torch::Tensor>& grads) {
  return GRADCLIP_TORCH_FORCE_OPS || (!grads.empty() && !grads.front().device().is_cpu());
}

/// The smallest positive normal value of a gradient's own dtype (below it, a nonzero element is subnormal).
inline double smallest_normal(const torch::Tensor& g) {
  switch (g.scalar_type()) {
    case torch::kHalf:
      return std::ldexp(1.0, -14);
    case torch::kDouble:
      return std::numeric_limits<double>::min();
    default:  // Float and BFloat16
      return std::numeric_limits<float>::min();
  }
}

/// The group's part of the p-norm from libtorch operations on the tensors' device, robust as the native
/// path: per tensor m = max|g| and the sum of |g / m|^p in FP64 (no element or sum over- or underflows),
/// ||g|| = m * ||g / m||; the parts merged on the host as partial_norms (a mantissa and a power of two),
/// which no group overflows. With `report`, also one tensor_stats per gradient (options::report), counted
/// on the device. One host sync, whatever the number of tensors.
inline partial_norm op_reduce(const std::vector<torch::Tensor>& grads, double p,
                              std::vector<tensor_stats>* report = nullptr) {
  const at::NoGradGuard no_grad;
  // stats: every nonempty tensor's maximum, then its scaled norm or sum, then (reporting) every tensor's
  // counts of NaN, Inf, zero and subnormal elements, exact in FP64 below 2^53 elements.
  std::vector<torch::Tensor> stats, scaled, counts;
  for (const auto& g : grads) {
    torch::Tensor a = g.to(torch::kDouble).abs();  // exact for every dtype, and every CPU op takes FP64
    if (report) {
      for (const torch::Tensor& c : {a.isnan(), a.isinf(), a.eq(0), a.gt(0).logical_and_(a.lt(smallest_normal(g)))})
        counts.push_back(c.sum().to(torch::kDouble));
    }
    if (g.numel() == 0) continue;
    stats.push_back(a.amax());
    // A zero maximum divides zeros by the smallest double; a NaN or inf maximum is decided on the host.
    if (!std::isinf(p)) scaled.push_back(a.div_(stats.back().clamp_min(std::numeric_limits<double>::denorm_min())));
  }
  const std::size_t n = stats.size();
  // Sums by at::sum (a cascade on the CPU, a tree on CUDA): _foreach_norm's CPU path sums serially, 1e-14
  // off on 3 M elements, beyond the policy's bound.
  for (auto& y : scaled) stats.push_back((p == 1 ? y : p == 2 ? y.mul_(y) : y.pow_(p)).sum());
  stats.insert(stats.end(), counts.begin(), counts.end());
  const torch::Tensor host = stats.empty() ? torch::Tensor() : torch::stack(stats).to(torch::kCPU);  // the one sync
  const double* v = stats.empty() ? nullptr : host.data_ptr<double>();
  const double* count = v ? v + (std::isinf(p) ? n : 2 * n) : nullptr;
  partial_norm total{0, 0.0, true, p};
  if (report) report->assign(grads.size(), tensor_stats{});
  for (std::size_t t = 0, i = 0; t < grads.size(); ++t) {
    partial_norm part{0, 0.0, true, p};
    const double m = grads[t].numel() == 0 ? 0.0 : v[i];
    if (!std::isfinite(m)) {
      part = partial_norm::nonfinite(m, p);
    } else if (m != 0) {
      int k = 0;
      const double f = std::frexp(m, &k);  // m = f * 2^k exactly
      double sum = f;                      // the maximum
      if (p == 2) {
        sum = f * f * v[n + i];
      } else if (p == 1) {
        sum = f * v[n + i];
      } else if (!std::isinf(p)) {
        sum = std::pow(f, p) * v[n + i];
      }
      part = {k, sum, true, p};
    }
    if (grads[t].numel() != 0) ++i;
    total.merge(part);
    if (!report) continue;
    const double* c = count + 4 * t;  // NaN, Inf, zero, subnormal
    const auto as_size = [](double x) { return static_cast<std::size_t>(x); };
    (*report)[t] = {
        part.norm(),  m, static_cast<std::size_t>(grads[t].numel()), as_size(c[0]), as_size(c[1]), as_size(c[2]),
        as_size(c[3])};
  }
  return total;
}

/// g <- g * c for every tensor with libtorch operations, one multiply each, rounded once from a wider
/// product: FP64 by foreach, FP32 through FP64, FP16 and BF16 through FP32 (FP64 where c is below FP32's
/// normal range). An FP64 coefficient below double's normal range is applied in two exact steps.
inline void op_scale(const std::vector<torch::Tensor>& grads, const gradclip::detail::scaled& c) {
  const at::NoGradGuard no_grad;
  const double factor = c.value();
  std::vector<torch::Tensor> doubles;
  for (const auto& g : grads) {
    if (g.scalar_type() == torch::kDouble) {
      doubles.push_back(g);
    } else {
      const bool narrow = g.element_size() == 2 && !(std::abs(factor) < std::numeric_limits<float>::min());
      g.copy_(g.to(narrow ? torch::kFloat : torch::kDouble).mul_(factor));
    }
  }
  if (doubles.empty()) return;
  if (factor != 0 && std::isfinite(factor) && std::abs(factor) < std::numeric_limits<double>::min()) {
    at::_foreach_mul_(doubles, std::ldexp(c.mantissa, c.exponent + 512));
    at::_foreach_mul_(doubles, std::ldexp(1.0, -512));
  } else {
    at::_foreach_mul_(doubles, factor);
  }
}

/// A call's gradients (defined, checked, on one device), reduced and clipped through the native kernels
/// or libtorch's operations (use_ops). Native: gradients with gaps between their elements (slices) go
/// through contiguous copies, written back only if clipping changed them, so the caller's tensors are
/// modified in place either way.
template <class Policy>
class tensor_group {
 public:
  tensor_group(const char* function, std::vector<torch::Tensor> grads)
      : function_(function), grads_(std::move(grads)), ops_(use_ops(grads_)) {
    if (ops_) {
      if (!std::is_same_v<Policy, robust>)
        throw std::invalid_argument(std::string(function) + ": tensors on device " + grads_.front().device().str() +
                                    " go through libtorch's operations, which compute the robust policy only");
      return;
    }
    views_.reserve(grads_.size());
    for (const auto& g : grads_) {
      if (g.is_non_overlapping_and_dense()) {
        views_.push_back(flat_view(g));
      } else {
        copies_.emplace_back(g, g.contiguous());
        views_.push_back(flat_view(copies_.back().second));
      }
    }
  }

  /// The part of the norm of kind opt.norm (options checked by the caller), filling opt.report.
  partial_norm reduce(const options& opt) const {
    if (!ops_) return partial_global_norm<Policy>(views_, opt);
    if (!gradclip::detail::norm_kind{opt.norm.p()}.p_norm())
      throw std::invalid_argument(
          std::string(function_) + ": tensors on device " + grads_.front().device().str() +
          " go through libtorch's operations, which compute p-norms only, not options::norm = " +
          std::to_string(opt.norm.p()));
    if (!opt.report) return op_reduce(grads_, opt.norm.p());
    std::vector<tensor_stats> stats;
    const partial_norm total = op_reduce(grads_, opt.norm.p(), &stats);
    opt.report->assign(std::move(stats));
    return total;
  }

  /// Clips by a reduced part (a partial_norm) or a total norm (a double), PyTorch's rule.
  template <class Total>
  clip_result clip(const Total& total, double max_norm, const options& opt) {
    try {
      if (ops_) return clip_ops(total, max_norm, opt);
      const clip_result result = clip_by_global_norm<Policy>(views_, total, max_norm, opt);
      if (result.clipped) {
        const at::NoGradGuard no_grad;  // a gradient that itself requires grad may still be written
        for (auto& [original, copy] : copies_) original.copy_(copy);
      }
      return result;
    } catch (const nonfinite_error& e) {
      throw nonfinite_error(function_, e.norm);  // name the function the caller called
    }
  }

 private:
  clip_result clip_ops(const partial_norm& total, double max_norm, const options& opt) {
    const auto plan = gradclip::detail::plan_clip(function_, total, max_norm, opt);
    if (plan.result.clipped) op_scale(grads_, plan.coefficient);
    return plan.result;
  }
  clip_result clip_ops(double total_norm, double max_norm, const options& opt) {
    // As the core's clip_by_global_norm(grads, total_norm, max_norm, opt) reads a double.
    return clip_ops(std::isfinite(total_norm)
                        ? partial_norm{0, total_norm, true, std::numeric_limits<double>::infinity()}
                        : partial_norm::nonfinite(total_norm),
                    max_norm, opt);
  }

  const char* function_;
  std::vector<torch::Tensor> grads_;
  bool ops_;
  std::vector<grad_view> views_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies_;  // (caller's tensor, contiguous copy)
};

/// Clips `grads` (defined, already checked) under one global norm.
// The threshold controllers of issue 14 will enter here: an overload taking the controller in place of
// max_norm, forwarding to clip_by_global_norm<Policy>(views, controller, opt) with the same copies.
template <class Policy>
clip_result clip_tensors(const char* function, const std::vector<torch::Tensor>& grads, double max_norm,
                         const options& opt) {
  gradclip::detail::check_clip_arguments(function, max_norm, opt);
  tensor_group<Policy> group(function, grads);
  if (!opt.report) return group.clip(group.reduce(opt), max_norm, opt);
  // The report is read into a copy and published once the write is done: a call that throws leaves it.
  tensor_report read;
  options reading = opt, writing = opt;
  reading.report = &read;
  writing.report = nullptr;
  const clip_result result = group.clip(group.reduce(reading), max_norm, writing);
  *opt.report = std::move(read);
  return result;
}

/// The defined gradients of `tensors` (their .grad() when `take_grad`), each checked before any is used,
/// all on one device.
inline std::vector<torch::Tensor> defined_gradients(const char* function, const std::vector<torch::Tensor>& tensors,
                                                    bool take_grad) {
  std::vector<torch::Tensor> grads;
  std::string first;  // the first gradient's name
  grads.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    const torch::Tensor& g = take_grad ? tensors[i].grad() : tensors[i];
    if (!g.defined()) continue;
    const std::string name = (take_grad ? "the gradient of parameter " : "gradient ") + std::to_string(i);
    if (grads.empty()) {
      first = name;
    } else if (g.device() != grads.front().device()) {
      throw std::invalid_argument(std::string(function) + ": " + first + " is on device " +
                                  grads.front().device().str() + " and " + name + " on device " + g.device().str() +
                                  "; the tensors of one call must be on one device");
    }
    check_supported(function, g, name);
    grads.push_back(g);
  }
  return grads;
}

/// The options of the drop-ins: libtorch's epsilon and NaN/Inf arithmetic, its thread count. norm_type is
/// libtorch's p: the keys of gradclip's other kinds (rms_norm) are refused.
inline options drop_in_options(const char* function, double norm_type, bool error_if_nonfinite) {
  if (!gradclip::detail::norm_kind{norm_type}.p_norm())
    throw std::invalid_argument(std::string(function) + ": norm_type must be > 0 or inf, not " +
                                std::to_string(norm_type));
  return {error_if_nonfinite ? on_nonfinite::error : on_nonfinite::propagate, 1e-6, gradclip::norm_type{norm_type},
          static_cast<unsigned>(at::get_num_threads())};
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
/// set: then gradclip::nonfinite_error is thrown and nothing is modified. CPU tensors run on
/// at::get_num_threads() threads, with the same bits for any count; tensors on another device (CUDA)
/// through libtorch's operations there, one host sync per call. The same bits as get_total_norm followed
/// by clip_grads_with_norm_, except where a finite group's norm exceeds double's range (FP64 only): the
/// norm returned is +inf and the gradients are still clipped right.
///
/// Unlike libtorch 1.13 it clips FP16 (libtorch throws), rounds BF16 once (libtorch turns [300] into
/// 0.996) and keeps FP32 [1e20, 1e20] finite (libtorch's norm is inf and it zeroes the gradient).
/// Gradients may mix Half, BFloat16, Float and Double (dense, any strides), on one device. Throws
/// std::invalid_argument, before anything is modified, for a negative or NaN max_norm, a norm_type that
/// is not > 0 (libtorch computes something for those), tensors on two devices, and sparse, meta or
/// other-dtype gradients.
///
///     double norm = gradclip::libtorch::clip_grad_norm_(model->parameters(), 1.0);
inline double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false) {
  constexpr const char* function = "gradclip::libtorch::clip_grad_norm_";
  const options opt = detail::drop_in_options(function, norm_type, error_if_nonfinite);
  gradclip::detail::check_clip_arguments(function, max_norm, opt);
  detail::tensor_group<robust> group(function, detail::defined_gradients(function, parameters, true));
  const partial_norm total = group.reduce(opt);
  const double norm = total.norm();
  if (total.finite && std::isinf(norm)) return group.clip(total, max_norm, opt).norm;
  return group.clip(norm, max_norm, opt).norm;  // the split API's arithmetic
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

/// PyTorch 2.x's torch.nn.utils.get_total_norm: the norm of order `norm_type` of the gradient tensors
/// themselves (undefined ones are ignored), computed as clip_grad_norm_ computes it; NaN or +inf for
/// non-finite gradients, or gradclip::nonfinite_error when error_if_nonfinite is set. Reads only.
///
///     const double total = gradclip::libtorch::get_total_norm(grads);
///     gradclip::libtorch::clip_grads_with_norm_(model->parameters(), 1.0, total);
inline double get_total_norm(const std::vector<torch::Tensor>& tensors, double norm_type = 2.0,
                             bool error_if_nonfinite = false) {
  constexpr const char* function = "gradclip::libtorch::get_total_norm";
  const options opt = detail::drop_in_options(function, norm_type, error_if_nonfinite);
  gradclip::detail::check_options(function, opt);
  const detail::tensor_group<robust> group(function, detail::defined_gradients(function, tensors, false));
  const partial_norm total = group.reduce(opt);
  if (!total.finite && error_if_nonfinite) throw nonfinite_error(function, total.norm());
  return total.norm();
}

/// PyTorch 2.x's torch.nn.utils.clip_grads_with_norm_: scales the .grad() of every parameter in place by
/// c = max_norm / (total_norm + 1e-6) when c < 1, total_norm being reduced elsewhere (get_total_norm, or
/// across ranks). A NaN or +inf total_norm propagates as in PyTorch. With get_total_norm's result it
/// gives clip_grad_norm_'s bits. Throws std::invalid_argument, before anything is modified, for a negative
/// or NaN max_norm, a negative total_norm and unsupported gradients.
inline void clip_grads_with_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double total_norm) {
  constexpr const char* function = "gradclip::libtorch::clip_grads_with_norm_";
  const options opt = detail::drop_in_options(function, 2.0, false);
  gradclip::detail::check_clip_arguments(function, max_norm, opt);
  if (total_norm < 0) throw std::invalid_argument(std::string(function) + ": total_norm must be >= 0, NaN or +inf");
  detail::tensor_group<robust> group(function, detail::defined_gradients(function, parameters, true));
  (void)group.clip(total_norm, max_norm, opt);
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
  detail::check_cpu(function, grad, "the gradient");
  detail::check_cpu(function, parameter, "the parameter");
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
