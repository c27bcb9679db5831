// Compiled mode (GRADCLIP_COMPILED, the gradclip::gradclip target of GRADCLIP_COMPILED_LIBRARY=ON): the
// kernels' entry points, declared here and defined once in the library (src/), which holds every
// instruction set's kernels and dispatches among them at run time. A translation unit then neither parses
// nor instantiates the kernels. The library is built for the baseline ISA and its users may be built with
// any -m flags, so these declarations live outside the ABI namespace (config.hpp) and take only types
// that are the same in every unit: pointers, sizes, numbers, and the plain structs below.
#pragma once

#include <gradclip/detail/census.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/partial_norm.hpp>
#include <gradclip/detail/scaled.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <memory>
#include <type_traits>

namespace gradclip {
namespace compiled {

/// A partial_norm's fields (partial_norm.hpp; its type differs between ABI namespaces).
struct part {
  int exponent;
  double sum;
  bool finite;
  double p;
  double low;
};

/// A census's fields (census.hpp).
struct counts {
  std::size_t size, nan, inf, zeros, subnormals;
  double max_abs;
};

/// observe(context, chunk, n): the reduction's observer, called after each chunk it read (reduce.hpp).
using observer = void (*)(void* context, const void* chunk, std::size_t n);

/// The L2 sum of squares of a run, in Acc, blocks rescaled when MaxScales (detail::sum_squares).
template <class Acc, bool MaxScales, class T>
part sum_squares(const T* p, std::size_t n, observer observe, void* context) noexcept;
/// sum_squares counting every element into `out` as it reads it (options::report's census).
template <class Acc, bool MaxScales, class T>
part counted_sum_squares(const T* p, std::size_t n, counts& out) noexcept;
/// The compensated FP64 sum of squares (detail::compensated_sum_squares).
part compensated_sum_squares(const double* p, std::size_t n) noexcept;
/// sum |x|^p, or max |x| for p = inf (detail::power_sum_kernel).
template <class T>
part power_sum(const T* p, std::size_t n, double order) noexcept;
/// The census of a run (detail::count_elements).
template <class T>
counts census_of(const T* p, std::size_t n) noexcept;
/// p[i] <- p[i] * (mantissa + low) * 2^exponent for FP64 elements (detail::multiply_with_tail).
void multiply_with_tail(double* p, std::size_t n, double mantissa, int exponent, double low) noexcept;
/// p[i] <- p[i] * c computed in Compute, rounded once to T (detail::multiply_run).
template <class Compute, class T>
void multiply(T* p, std::size_t n, Compute c) noexcept;

// ---- The clipping pipeline of a group under one fixed threshold (clip_by_norm, clip_by_global_norm) ----

/// A gradient as the library reads it: a strided_view's fields, and its element type as a gradclip::dtype.
struct view {
  void* data;
  unsigned char type;
  std::size_t inner_size;
  std::ptrdiff_t inner_stride;
  std::size_t outer_size;
  std::ptrdiff_t outer_stride;
};

/// A group of `count` gradients: each(gradients, take, sink) calls take(sink, view) for every one, in order.
struct group {
  const void* gradients;
  std::size_t count;
  void (*each)(const void* gradients, void (*take)(void* sink, const view& v), void* sink);
};

/// One gradient's tensor_stats (report.hpp).
struct stats {
  double norm, max_abs;
  std::size_t size, nan, inf, zeros, subnormals;
};

/// A call's options (options.hpp). The caller's executor and report stay the caller's: the library runs
/// its jobs through run_pool(pool, count, job, context), job(context.get(), k) running job k (an executor
/// may keep a job after run() returns: `context` owns its state), and hands over the finished report
/// through deliver(report, stats, n) once the call can no longer throw.
struct settings {
  const char* function;
  int nonfinite;
  double epsilon;
  double norm;
  unsigned threads;
  const void* pool;
  void (*run_pool)(const void* pool, unsigned count, void (*job)(void* context, unsigned k),
                   const std::shared_ptr<void>& context);
  void* report;
  void (*deliver)(void* report, const stats* entries, std::size_t n);
};

/// A clip_result's fields; `failed` when the call threw nonfinite_error (options::nonfinite is error),
/// with that error's fields.
struct outcome {
  double norm, coefficient;
  bool clipped, finite;
  double threshold;
  bool skip;
  bool failed;
  std::size_t tensor, nan, inf;
};

/// The policies of policies.hpp.
enum class policy : unsigned char { naive, promote, max_scale, robust };

/// The pipeline of detail::clip (pipeline.hpp) on `grads` with the fixed threshold `max_norm`.
outcome clip_group(policy rule, const settings& call, const group& grads, double max_norm);

/// What with_isa hands its function in compiled mode: the kernels that front-ends call by name, each
/// dispatching to the best instruction set inside the library (kernels.inc has their contracts).
struct kernels {
  template <class Acc, class T>
  static void column_squares(const T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                             double* sums) noexcept;
  static void column_squares_compensated(const double* base, std::size_t units, std::size_t columns,
                                         std::ptrdiff_t stride, double* sum, double* compensation,
                                         double* top) noexcept;
  template <class Compute, class T>
  static void column_multiply(T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                              const Compute* factor) noexcept;
  template <class Acc, bool Masked, class T>
  static void column_dot(const T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                         const Acc* factor, const unsigned char* keep, Acc* out) noexcept;
  template <class Acc, class T>
  static void add_scaled(Acc* acc, const T* const* rows, const Acc* factors, std::size_t count, std::size_t n) noexcept;
  template <class T>
  static void divide(T* p, std::size_t n, double s) noexcept;
  template <class T, class V>
  static double quotient_lanes(const T* g, const V* v, std::size_t m, double eps_squared) noexcept;
  template <class T, class V>
  static std::size_t spam_unclear(const T* g, const V* v, std::size_t m, double theta) noexcept;
  static bool spam_unclear_one(double x, double w, double theta) noexcept;
};

}  // namespace compiled

// The rest is the compiled mode's side: the library itself includes only the declarations above.
#if defined(GRADCLIP_COMPILED)
inline namespace GRADCLIP_ABI {
namespace detail {

/// In compiled mode the library picks the instruction set: best_isa() names no choice, and with_isa
/// (simd.hpp) calls f once, with the library's entry points, instead of once per instruction set.
struct library_isa {};
inline library_isa best_isa() noexcept { return {}; }
inline library_isa column_dot_isa() noexcept { return {}; }
template <class F>
decltype(auto) with_isa(library_isa, F&& f) {
  return f(compiled::kernels{});
}

inline partial_norm from_library(const compiled::part& q) noexcept { return {q.exponent, q.sum, q.finite, q.p, q.low}; }

// The header-only functions of the same names (reduce.hpp, scale.hpp, p_norm_kernels.hpp), as calls into
// the library; K, the instruction set, is the library's to choose.
template <class T>
census count_elements(const T* p, std::size_t n) noexcept {
  const compiled::counts c = compiled::census_of(p, n);
  return {c.size, c.nan, c.inf, c.zeros, c.subnormals, c.max_abs};
}

template <class K, class Acc, bool MaxScales, class T, class Observe>
partial_norm sum_squares(const T* p, std::size_t n, Observe&& observe) noexcept {
  if constexpr (std::is_same_v<std::decay_t<Observe>, census_observer>) {  // counted in the library's loop
    compiled::counts c{};
    const partial_norm part = from_library(compiled::counted_sum_squares<Acc, MaxScales>(p, n, c));
    observe.counts->merge({c.size, c.nan, c.inf, c.zeros, c.subnormals, c.max_abs});
    return part;
  }
  using observer_type = std::remove_reference_t<Observe>;
  const compiled::observer thunk = [](void* context, const void* chunk, std::size_t m) {
    (*static_cast<observer_type*>(context))(static_cast<const T*>(chunk), m);
  };
  return from_library(
      compiled::sum_squares<Acc, MaxScales>(p, n, thunk, const_cast<void*>(static_cast<const void*>(&observe))));
}

template <class K>
partial_norm compensated_sum_squares(const double* p, std::size_t n) noexcept {
  return from_library(compiled::compensated_sum_squares(p, n));
}

template <class T>
partial_norm power_sum_kernel(const T* p, std::size_t n, double order) noexcept {
  return from_library(compiled::power_sum(p, n, order));
}

inline void multiply_with_tail(double* p, std::size_t n, const scaled& c) noexcept {
  compiled::multiply_with_tail(p, n, c.mantissa, c.exponent, c.low);
}

template <class Compute, class T>
void multiply_run(T* p, std::size_t n, Compute c) noexcept {
  compiled::multiply(p, n, c);
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
#endif
}  // namespace gradclip
