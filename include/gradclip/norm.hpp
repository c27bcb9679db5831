// L2 norms of one gradient or of a group, under a policy.
#pragma once

#include <gradclip/detail/reduce.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <cstddef>
#include <initializer_list>

namespace gradclip {

namespace detail {

template <class Policy, class T>
partial_norm partial_norm_of_view(const strided_view<T>& view) {
  static_assert(is_policy_v<Policy>, "The policy must be gradclip::naive, promote, max_scale or robust.");
  partial_norm part;
  view.for_each_run([&](const auto* p, std::size_t n) { part.merge(reduce_kernel<Policy>::run(p, n)); });
  return part;
}

template <class Policy, class G>
partial_norm partial_norm_of(const G& g) {
  return visit_gradient(g, [](const auto& view) { return partial_norm_of_view<Policy>(view); });
}

template <class Policy, class Grads>
partial_norm partial_norm_of_group(const Grads& grads) {
  static_assert(is_gradient_range_v<const Grads&>,
                "A group of gradients is a range (a std::vector, std::array, ...) whose elements are gradients.");
  partial_norm total;
  for (const auto& g : grads) total.merge(partial_norm_of<Policy>(g));
  return total;
}

}  // namespace detail

/// The L2 norm of one gradient, in double: +inf only when a finite FP64 gradient's norm exceeds
/// double's range (robust, max_scale) or the policy overflows (naive, promote); NaN if an element is NaN.
///
///     double n = gradclip::norm(grad);                    // robust
///     double m = gradclip::norm<gradclip::promote>(grad);
template <class Policy = robust, class Grad>
double norm(const Grad& g) {
  return detail::partial_norm_of<Policy>(g).norm();
}

/// The L2 norm of a raw buffer of `size` elements.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
double norm(const T* data, std::size_t size) {
  return detail::partial_norm_of_view<Policy>(detail::strided_view<const T>{data, size}).norm();
}

/// The mergeable sum of squares of a group: what one rank of a distributed job contributes.
template <class Policy = robust, class Grads>
partial_norm partial_global_norm(const Grads& grads) {
  return detail::partial_norm_of_group<Policy>(grads);
}

/// The L2 norm of the concatenation of every gradient in the group (a range of gradients, which may
/// mix element types through grad_view).
template <class Policy = robust, class Grads>
double global_norm(const Grads& grads) {
  return partial_global_norm<Policy>(grads).norm();
}

/// The same for a braced list of gradients of any element types: global_norm({w, b}).
template <class Policy = robust>
double global_norm(std::initializer_list<grad_view> grads) {
  return detail::partial_norm_of_group<Policy>(grads).norm();
}

}  // namespace gradclip
