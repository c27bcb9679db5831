// Compiled mode: clipping a group under one fixed threshold (clip_by_norm, clip_by_global_norm) as one call
// into the library, which runs the whole pipeline (pipeline.hpp) for it. A unit then instantiates only the
// loop that hands the library its gradients' views, not the pipeline per gradient type: the compiled-mode
// call row of issue 26. The options, the executor, the report and nonfinite_error are types of the
// unit's ABI namespace, so they cross as the plain structs of compiled.hpp.
#pragma once

#include <gradclip/detail/compiled.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/report.hpp>

#include <cstddef>
#include <iterator>
#include <memory>
#include <type_traits>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

template <class Policy>
struct library_policy;
template <>
struct library_policy<naive> : std::integral_constant<compiled::policy, compiled::policy::naive> {};
template <>
struct library_policy<promote> : std::integral_constant<compiled::policy, compiled::policy::promote> {};
template <>
struct library_policy<max_scale> : std::integral_constant<compiled::policy, compiled::policy::max_scale> {};
template <>
struct library_policy<robust> : std::integral_constant<compiled::policy, compiled::policy::robust> {};

/// What the library calls back: the caller's executor, and the hand-over of the caller's report.
struct library_callbacks {
  static void run_pool(const void* pool, unsigned count, void (*job)(void*, unsigned),
                       const std::shared_ptr<void>& context) {
    static_cast<const executor*>(pool)->run(count, [job, context](unsigned k) { job(context.get(), k); });
  }
  static void deliver(void* report, const compiled::stats* entries, std::size_t n) {
    tensor_report& r = *static_cast<tensor_report*>(report);
    report_staging::stage(r, n);
    std::vector<tensor_stats>& out = report_staging::stats(r);
    for (std::size_t k = 0; k < n; ++k) {
      const compiled::stats& e = entries[k];
      out[k] = {e.norm, e.max_abs, e.size, e.nan, e.inf, e.zeros, e.subnormals};
    }
    report_staging::commit(r);
  }
};

/// compiled::group::each for a range of gradients of type Grads, which the library clips.
template <class Grads>
void each_library_view(const void* gradients, void (*take)(void*, const compiled::view&), void* sink) {
  for (auto& g : *static_cast<Grads*>(const_cast<void*>(gradients)))
    visit_gradient(g, [&](const auto& v) {
      using T = typename std::decay_t<decltype(v)>::element_type;
      static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
      take(sink, {v.data, static_cast<unsigned char>(element_traits<T>::tag), v.inner_size, v.inner_stride,
                  v.outer_size, v.outer_stride});
    });
}

/// detail::clip<Policy>(function, grads, fixed_threshold{max_norm}, opt), run by the library.
template <class Policy, class Grads>
clip_result library_clip(const char* function, Grads& grads, double max_norm, const options& opt) {
  const compiled::settings call{function,
                                static_cast<int>(opt.nonfinite),
                                opt.epsilon,
                                opt.norm.p(),
                                opt.threads,
                                opt.pool,
                                &library_callbacks::run_pool,
                                opt.report,
                                &library_callbacks::deliver};
  const auto count = static_cast<std::size_t>(std::distance(std::begin(grads), std::end(grads)));
  const compiled::group group{&grads, count, &each_library_view<Grads>};
  const compiled::outcome o = compiled::clip_group(library_policy<Policy>::value, call, group, max_norm);
  if (o.failed) throw nonfinite_error(function, o.norm, o.tensor, o.nan, o.inf);
  return {o.norm, o.coefficient, o.clipped, o.finite, o.threshold, o.skip};
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
