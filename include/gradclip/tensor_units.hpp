// Tensors cut into units along their first dimension (rows of a matrix, slices t(i, ...) of a tensor,
// examples of a batch), as pieces of the pipeline: what adaptive clipping, per-example clipping and
// ghost norms share. Internal (namespace detail).
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/pipeline.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// A tensor cut into units: unit i is `unit_size` elements `element_stride` apart, starting
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

  /// True when units interleave in memory with unit i's element j at whole.data[j * element_stride + i]
  /// (rows of a column-major object, examples of a column-major batch): the pipeline then sweeps all units
  /// column by column instead of touching a cache line per element.
  bool interleaved() const noexcept { return units > 1 && unit_stride == 1 && element_stride != 1; }

  /// Calls f(piece<T>) for the pieces of the units, unit i being unit `first_unit + i` of the pipeline
  /// and `tensor` the tensor's index in the call.
  template <class F>
  void for_each_piece(std::size_t first_unit, std::size_t tensor, F&& f) const {
    if (whole.size() == 0) return;
    if (units == 1) return cut_into_pieces(whole, first_unit, tensor, f);
    if (interleaved()) return cut_columns(whole.data, units, unit_size, element_stride, first_unit, tensor, f);
    for (std::size_t i = 0; i < units; ++i) cut_into_pieces(unit(i), first_unit + i, tensor, f);
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

/// Units along the first dimension: rows of a matrix, slices t(i, ...) of a tensor; vectors and
/// containers are one unit.
template <class G>
auto split_units(G& g) {
  using raw = std::remove_cv_t<G>;
  if constexpr (is_eigen_dense_v<raw>) {
    static_assert(is_element_v<typename raw::Scalar>,
                  "Units are cut from Eigen objects of Eigen::half, Eigen::bfloat16, float or double.");
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
                  "Units are cut from Eigen tensors of Eigen::half, Eigen::bfloat16, float or double.");
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
                  "Units are cut from Eigen tensors, tensor maps and dense objects of Eigen::half, "
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

/// The units of several splits as one layout: split k's units numbered from firsts[k].
template <class... Splits>
struct split_layout {
  std::tuple<const Splits&...> splits;
  std::array<std::size_t, sizeof...(Splits)> firsts;
  std::size_t total;

  std::size_t units() const noexcept { return total; }
  template <class F>
  void for_each_piece(F&& f) const {
    std::apply(
        [&](const auto&... s) {
          std::size_t k = 0;
          ((s.for_each_piece(firsts[k], k, f), ++k), ...);
        },
        splits);
  }
};

/// The splits' units one after the other: split 0's, then split 1's, ...
template <class... Splits>
split_layout<Splits...> consecutive_units(const Splits&... splits) {
  split_layout<Splits...> layout{std::tie(splits...), {}, 0};
  std::size_t k = 0;
  ((layout.firsts[k++] = layout.total, layout.total += (splits.whole.size() == 0 ? 0 : splits.units)), ...);
  return layout;
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
