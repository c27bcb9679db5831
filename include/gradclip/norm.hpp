// Norms of one gradient or of a group, under a policy and options::norm.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <cstddef>
#include <initializer_list>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// The norm (options::norm: L2 by default, L1, max or any p > 0) of one gradient, in double: +inf only
/// when a finite FP64 gradient's norm exceeds double's range or the policy overflows (naive, promote);
/// NaN if an element is NaN, else +inf if one is infinite. Throws std::invalid_argument for a norm p that
/// is not > 0 and for bad options.
///
///     double n = gradclip::norm(grad);                                   // robust L2
///     double m = gradclip::norm(grad, {gradclip::on_nonfinite::skip, 0.0, gradclip::inf_norm});
template <class Policy = robust, class Grad, class = std::enable_if_t<detail::is_gradient_v<const Grad&>>>
double norm(const Grad& g, const options& opt = {}) {
  detail::check_options("gradclip::norm", opt);
  return detail::with_single(g, [&](const auto& one) { return detail::reduce_and_report<Policy>(one, opt).norm(); });
}

/// The norm of a raw buffer of `size` elements.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
double norm(const T* data, std::size_t size, const options& opt = {}) {
  return norm<Policy>(detail::strided_view<const T>{data, size}, opt);
}

/// The mergeable part of a group's norm: what one rank of a distributed job contributes.
template <class Policy = robust, class Grads>
partial_norm partial_global_norm(const Grads& grads, const options& opt = {}) {
  detail::check_options("gradclip::partial_global_norm", opt);
  return detail::reduce_and_report<Policy>(grads, opt);
}

/// The norm of the concatenation of every gradient in the group (a range of gradients, which may mix
/// element types through grad_view or const_grad_view). For the max norm, the largest magnitude of all.
template <class Policy = robust, class Grads, class = std::enable_if_t<detail::is_gradient_range_v<const Grads&>>>
double global_norm(const Grads& grads, const options& opt = {}) {
  detail::check_options("gradclip::global_norm", opt);
  return detail::reduce_and_report<Policy>(grads, opt).norm();
}

/// The same for a braced list of gradients of any element types: global_norm({w, b}).
template <class Policy = robust>
double global_norm(std::initializer_list<const_grad_view> grads, const options& opt = {}) {
  detail::check_options("gradclip::global_norm", opt);
  return detail::reduce_and_report<Policy>(grads, opt).norm();
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
