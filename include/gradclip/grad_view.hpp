// What counts as a gradient, and grad_view / const_grad_view: non-owning, type-erased gradients for
// groups that mix element types (FP16 weights with FP32 biases) under one global norm.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/strided_view.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <functional>
#include <iterator>
#include <type_traits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {

class grad_view;
class const_grad_view;

namespace detail {

template <class G>
inline constexpr bool is_eigen_dense_v = std::is_base_of_v<Eigen::DenseBase<G>, G>;

template <class G, class = void>
struct has_data_and_size : std::false_type {};
template <class G>
struct has_data_and_size<G, std::void_t<decltype(std::declval<G&>().data()), decltype(std::declval<G&>().size())>>
    : std::bool_constant<std::is_pointer_v<decltype(std::declval<G&>().data())> &&
                         is_element_v<std::remove_pointer_t<decltype(std::declval<G&>().data())>>> {};

template <class G>
struct is_reference_wrapper : std::false_type {};
template <class G>
struct is_reference_wrapper<std::reference_wrapper<G>> : std::true_type {};

template <class G>
struct is_strided_view : std::false_type {};
template <class T>
struct is_strided_view<strided_view<T>> : std::true_type {};

template <class G>
inline constexpr bool is_erased_view_v =
    std::is_same_v<std::remove_cv_t<G>, grad_view> || std::is_same_v<std::remove_cv_t<G>, const_grad_view>;

template <class G>
struct view_traits {
  using raw = std::remove_cv_t<G>;
  static constexpr bool dense = is_eigen_dense_v<raw>;
  static constexpr bool contiguous = !dense && has_data_and_size<G>::value;
  static constexpr bool erased = is_erased_view_v<G>;
  static constexpr bool typed = is_strided_view<raw>::value;
  static constexpr bool indirect = std::is_pointer_v<raw> || is_reference_wrapper<raw>::value;
};

/// True for the types gradclip accepts as one gradient: Eigen dense objects with direct access,
/// Eigen tensors and tensor maps (or any container with data() and size()) of a supported element
/// type, grad_view, and pointers or reference_wrappers to any of these.
template <class G>
constexpr bool is_gradient() {
  using traits = view_traits<G>;
  if constexpr (traits::indirect) {
    if constexpr (std::is_pointer_v<typename traits::raw>)
      return is_gradient<std::remove_pointer_t<typename traits::raw>>();
    else
      return is_gradient<typename traits::raw::type>();
  } else if constexpr (traits::dense) {
    return is_element_v<typename traits::raw::Scalar>;
  } else {
    return traits::contiguous || traits::erased || traits::typed;
  }
}
template <class G>
inline constexpr bool is_gradient_v = is_gradient<std::remove_reference_t<G>>();

template <class Grads, class = void>
struct is_gradient_range : std::false_type {};
template <class Grads>
struct is_gradient_range<
    Grads, std::void_t<decltype(std::begin(std::declval<Grads&>())), decltype(std::end(std::declval<Grads&>()))>>
    : std::bool_constant<is_gradient_v<decltype(*std::begin(std::declval<Grads&>()))>> {};
template <class Grads>
inline constexpr bool is_gradient_range_v = is_gradient_range<std::remove_reference_t<Grads>>::value;

/// Calls f(strided_view<T>) for a gradient, T const when the gradient is.
template <class G, class F>
decltype(auto) visit_gradient(G& g, F&& f);

}  // namespace detail

namespace detail {

/// What grad_view and const_grad_view share: the address, the runtime element type and the strides.
class erased_view {
 public:
  dtype type() const noexcept { return type_; }
  std::size_t size() const noexcept { return inner_size_ * outer_size_; }

 protected:
  template <class T>
  explicit erased_view(strided_view<T> v) noexcept
      : data_(const_cast<std::remove_const_t<T>*>(v.data)),
        type_(element_traits<std::remove_const_t<T>>::tag),
        inner_size_(v.inner_size),
        inner_stride_(v.inner_stride),
        outer_size_(v.outer_size),
        outer_stride_(v.outer_stride) {}
  /// A view of `type` elements from a strided_view's fields (the compiled library's plain view).
  erased_view(void* data, dtype type, std::size_t inner_size, std::ptrdiff_t inner_stride, std::size_t outer_size,
              std::ptrdiff_t outer_stride) noexcept
      : data_(data),
        type_(type),
        inner_size_(inner_size),
        inner_stride_(inner_stride),
        outer_size_(outer_size),
        outer_stride_(outer_stride) {}

  /// Calls f(strided_view<T>) with the element type restored, const when Const.
  template <bool Const, class F>
  decltype(auto) visit_as(F&& f) const {
    switch (type_) {
      case dtype::float16:
        return f(typed<Const, Eigen::half>());
      case dtype::bfloat16:
        return f(typed<Const, Eigen::bfloat16>());
      case dtype::float32:
        return f(typed<Const, float>());
      case dtype::float64:
        break;
    }
    return f(typed<Const, double>());
  }

 private:
  template <bool Const, class T>
  auto typed() const noexcept {
    using element = std::conditional_t<Const, const T, T>;
    return strided_view<element>{static_cast<element*>(data_), inner_size_, inner_stride_, outer_size_, outer_stride_};
  }

  void* data_;
  dtype type_;
  std::size_t inner_size_;
  std::ptrdiff_t inner_stride_;
  std::size_t outer_size_;
  std::ptrdiff_t outer_stride_;
};

}  // namespace detail

/// A non-owning view of one gradient of any supported element type, with its type as a runtime tag; it
/// can be clipped. A std::vector<grad_view> is a group that mixes element types under one global norm:
/// each gradient is reduced with the policy's rules for its own type and the parts merge with one
/// rounding per merge. Gradients of const data need const_grad_view.
///
///     std::vector<gradclip::grad_view> group{weights_fp16, bias_fp32};
///     auto result = gradclip::clip_by_global_norm(group, 1.0);
class grad_view : public detail::erased_view {
 public:
  /// A contiguous buffer of `size` elements.
  template <class T, class = std::enable_if_t<detail::is_element_v<T> && !std::is_const_v<T>>>
  grad_view(T* data, std::size_t size) noexcept : grad_view(detail::strided_view<T>{data, size}) {}

  /// Any gradient (Eigen tensor, tensor map, dense object, container) whose elements can be written. It
  /// must outlive the view.
  template <class G, class = std::enable_if_t<detail::is_gradient_v<G> && !detail::is_erased_view_v<G>>>
  grad_view(G& gradient) : grad_view(detail::visit_gradient(gradient, [](auto v) { return grad_view(v); })) {
    static_assert(!std::is_const_v<G>, "A grad_view can modify its gradient, so it cannot view a const one.");
  }

  template <class T>
  explicit grad_view(detail::strided_view<T> v) noexcept : erased_view(v) {
    static_assert(!std::is_const_v<T>,
                  "A grad_view can modify its gradient, so it cannot view const data; use const_grad_view.");
  }

  /// Calls f(detail::strided_view<T>) with the element type restored.
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_as<false>(std::forward<F>(f));
  }
};

/// A read-only, non-owning view of one gradient of any supported element type. Every norm function takes
/// groups of it; clipping through it does not compile.
///
///     std::vector<gradclip::const_grad_view> group{const_weights, bias};
///     double n = gradclip::global_norm(group);
class const_grad_view : public detail::erased_view {
 public:
  /// A contiguous buffer of `size` elements.
  template <class T, class = std::enable_if_t<detail::is_element_v<T>>>
  const_grad_view(const T* data, std::size_t size) noexcept
      : const_grad_view(detail::strided_view<const T>{data, size}) {}

  /// Any gradient, const or not, and any grad_view. It must outlive the view.
  template <class G, class = std::enable_if_t<detail::is_gradient_v<const G&> &&
                                              !std::is_same_v<std::remove_cv_t<G>, const_grad_view>>>
  const_grad_view(const G& gradient)
      : const_grad_view(detail::visit_gradient(gradient, [](auto v) { return const_grad_view(v); })) {}

  template <class T>
  explicit const_grad_view(detail::strided_view<T> v) noexcept : erased_view(v) {}

  /// Calls f(detail::strided_view<const T>) with the element type restored.
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_as<true>(std::forward<F>(f));
  }
};

namespace detail {

template <class G, class F>
decltype(auto) visit_gradient(G& g, F&& f) {
  using traits = view_traits<G>;
  static_assert(is_gradient<G>(),
                "gradclip accepts Eigen tensors, tensor maps and dense objects of Eigen::half, Eigen::bfloat16, "
                "float or double, containers with data() and size() of those types, and grad_view.");
  if constexpr (traits::indirect) {
    if constexpr (std::is_pointer_v<typename traits::raw>)
      return visit_gradient(*g, std::forward<F>(f));
    else
      return visit_gradient(g.get(), std::forward<F>(f));
  } else if constexpr (traits::erased) {
    return g.visit(std::forward<F>(f));
  } else if constexpr (traits::typed) {
    return f(g);
  } else if constexpr (traits::dense) {
    static_assert(static_cast<bool>(traits::raw::Flags & Eigen::DirectAccessBit),
                  "gradclip needs an Eigen object with direct access to its memory (a Matrix, Array, Map, Ref "
                  "or block of one); evaluate expressions into one first.");
    using T = std::remove_pointer_t<decltype(g.data())>;
    strided_view<T> v{g.data(), static_cast<std::size_t>(g.innerSize()), g.innerStride(),
                      static_cast<std::size_t>(g.outerSize()), g.outerStride()};
    return f(normalized(v));
  } else {
    using T = std::remove_pointer_t<decltype(g.data())>;
    return f(strided_view<T>{g.data(), static_cast<std::size_t>(g.size())});
  }
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
