// strided_view: every gradient front-end (Eigen tensors and dense objects, containers, raw buffers)
// reduced to segments of contiguous elements, so the kernels only ever see a pointer and a length.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/numerics.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// `outer_size` segments of `inner_size` elements; segment j starts at data + j * outer_stride and
/// holds its elements inner_stride apart. Contiguous buffers are one segment with inner_stride 1.
template <class T>
struct strided_view {
  T* data = nullptr;
  std::size_t inner_size = 0;
  std::ptrdiff_t inner_stride = 1;
  std::size_t outer_size = 1;
  std::ptrdiff_t outer_stride = 0;

  using element_type = T;

  std::size_t size() const noexcept { return inner_size * outer_size; }

  /// Calls f(pointer, length) on contiguous runs covering every element once. Runs with a non-unit
  /// inner stride are gathered into a buffer first and, when `write_back`, scattered back after f.
  template <class F>
  void for_each_run(F&& f, bool write_back = false) const {
    // A contiguous view (most gradients) is one call here, small enough to inline into callers that
    // visit many small gradients; the strided walk, with its buffer, is a call of its own.
    if (inner_stride == 1 && outer_size == 1) {
      if (inner_size != 0) f(data, inner_size);
      return;
    }
    for_each_strided_run(f, write_back);
  }

 private:
  template <class F>
  void for_each_strided_run(F& f, bool write_back) const {
    for (std::size_t j = 0; j < outer_size; ++j) {
      T* segment = data + static_cast<std::ptrdiff_t>(j) * outer_stride;
      if (inner_stride == 1) {
        if (inner_size != 0) f(segment, inner_size);
        continue;
      }
      std::remove_const_t<T> buffer[block_size];
      for (std::size_t start = 0; start < inner_size; start += block_size) {
        const std::size_t m = std::min(block_size, inner_size - start);
        T* first = segment + static_cast<std::ptrdiff_t>(start) * inner_stride;
        for (std::size_t i = 0; i < m; ++i) buffer[i] = first[static_cast<std::ptrdiff_t>(i) * inner_stride];
        f(static_cast<T*>(buffer), m);
        if constexpr (!std::is_const_v<T>)
          if (write_back)
            for (std::size_t i = 0; i < m; ++i) first[static_cast<std::ptrdiff_t>(i) * inner_stride] = buffer[i];
      }
    }
  }
};

/// Merges segments that follow each other in memory into one run.
template <class T>
strided_view<T> normalized(strided_view<T> v) noexcept {
  if (v.size() == 0) return {v.data, 0, 1, 1, 0};
  if (v.inner_size == 1 && v.outer_size > 1) {  // a strided vector seen as single-element segments
    v.inner_size = v.outer_size;
    v.inner_stride = v.outer_stride;
    v.outer_size = 1;
  }
  if (v.inner_stride == 1 && v.outer_size > 1 && v.outer_stride == static_cast<std::ptrdiff_t>(v.inner_size)) {
    v.inner_size *= v.outer_size;
    v.outer_size = 1;
  }
  if (v.outer_size == 1) v.outer_stride = 0;
  return v;
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
