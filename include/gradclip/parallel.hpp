// Norms and clipping of large gradients (or groups) on several threads. Each thread reduces, then
// scales, its own run of whole 1024-element blocks and whole small gradients, so every block sums as on
// one thread; the threads' parts merge in a fixed order, so results depend on the thread count but never
// on scheduling.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cstddef>
#include <thread>
#include <type_traits>
#include <vector>

namespace gradclip {

/// How many threads one call may use, the caller's included; each is a std::thread started for the
/// call. A thread gets at least parallel_grain_bytes of gradient (starting one costs about as much as
/// reading 1 MiB), so small gradients run on the caller alone, allocating nothing.
///
///     auto result = gradclip::clip_by_norm(grad, 1.0, {}, gradclip::threads{2});
struct threads {
  unsigned count = 1;
};

/// The least gradient bytes worth a thread of their own.
inline constexpr std::size_t parallel_grain_bytes = std::size_t{4} << 20;

namespace detail {

/// A share of the work: a gradient, or a block-aligned slice of a large contiguous one.
struct piece {
  grad_view view;
  std::size_t bytes;
};

template <class G>
std::size_t gradient_bytes(const G& g) {
  return visit_gradient(
      g, [](const auto& v) { return v.size() * sizeof(typename std::decay_t<decltype(v)>::element_type); });
}

/// Appends g as pieces of about `slice` bytes (contiguous gradients are cut at block boundaries).
template <class G>
void append_pieces(std::vector<piece>& pieces, const G& g, std::size_t slice) {
  visit_gradient(g, [&](const auto& v) {
    using T = std::remove_const_t<typename std::decay_t<decltype(v)>::element_type>;
    auto* data = const_cast<T*>(v.data);  // scaled only by clipping calls, whose gradients are not const
    const bool contiguous = v.outer_size == 1 && v.inner_stride == 1;
    if (!contiguous) {
      pieces.push_back({grad_view(strided_view<T>{data, v.inner_size, v.inner_stride, v.outer_size, v.outer_stride}),
                        v.size() * sizeof(T)});
      return;
    }
    const std::size_t step = std::max<std::size_t>(1, slice / sizeof(T) / block_size) * block_size;
    for (std::size_t start = 0; start < v.size(); start += step) {
      const std::size_t m = std::min(step, v.size() - start);
      pieces.push_back({grad_view(data + start, m), m * sizeof(T)});
    }
  });
}

/// The pieces of a group, and how many threads they are worth (at most `wanted`).
template <class Grads>
std::vector<piece> split_group(const Grads& grads, unsigned wanted, unsigned& used) {
  std::size_t total = 0;
  for (const auto& g : grads) total += gradient_bytes(g);
  used = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(wanted, total / parallel_grain_bytes)));
  std::vector<piece> pieces;
  if (used == 1) return pieces;
  const std::size_t slice = (total + used - 1) / used;
  for (const auto& g : grads) append_pieces(pieces, g, slice);
  return pieces;
}

/// Runs job(k) for k in [0, count): k = 0 on the caller, the others on threads started here. A job
/// whose thread cannot be started runs on the caller, so every job runs exactly once.
template <class Job>
void run_jobs(unsigned count, Job&& job) {
  std::vector<std::thread> started;
  started.reserve(count);
  unsigned k = 1;
  try {
    for (; k < count; ++k) started.emplace_back([&job, k] { job(k); });
  } catch (...) {  // std::system_error: out of threads; the caller takes the rest
  }
  job(0);
  for (unsigned rest = k; rest < count; ++rest) job(rest);
  for (auto& t : started) t.join();
}

/// The first piece of each of `count` runs of pieces with about equal bytes, and the end.
inline std::vector<std::size_t> balanced_runs(const std::vector<piece>& pieces, unsigned count) {
  std::size_t total = 0;
  for (const auto& p : pieces) total += p.bytes;
  std::vector<std::size_t> bounds{0};
  std::size_t done = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    done += pieces[i].bytes;
    if (bounds.size() < count && done * count >= total * bounds.size()) bounds.push_back(i + 1);
  }
  while (bounds.size() <= count) bounds.push_back(pieces.size());
  return bounds;
}

template <class Policy>
partial_norm parallel_partial_norm(const std::vector<piece>& pieces, const std::vector<std::size_t>& bounds) {
  const unsigned count = static_cast<unsigned>(bounds.size() - 1);
  std::vector<partial_norm> parts(count);
  run_jobs(count, [&](unsigned k) {
    for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) parts[k].merge(partial_norm_of<Policy>(pieces[i].view));
  });
  partial_norm total;
  for (const auto& part : parts) total.merge(part);
  return total;
}

template <class Policy>
void parallel_apply(const std::vector<piece>& pieces, const std::vector<std::size_t>& bounds, const factor& c) {
  run_jobs(static_cast<unsigned>(bounds.size() - 1), [&](unsigned k) {
    for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i)
      pieces[i].view.visit([&](const auto& view) { apply_coefficient<Policy>(view, c); });
  });
}

template <class Policy, class Grads>
partial_norm partial_norm_of_group(const Grads& grads, threads t) {
  unsigned used = 1;
  const std::vector<piece> pieces = split_group(grads, t.count, used);
  if (used == 1) return partial_norm_of_group<Policy>(grads);
  return parallel_partial_norm<Policy>(pieces, balanced_runs(pieces, used));
}

template <class Policy, class Grads>
clip_result clip_group(const char* function, Grads& grads, double max_norm, const options& opt, threads t) {
  unsigned used = 1;
  const std::vector<piece> pieces = split_group(grads, t.count, used);  // reads sizes only
  if (used == 1)
    return clip_group<Policy>(
        grads, max_norm, opt, [&] { return partial_norm_of_group<Policy>(grads); }, function);
  check_clip_arguments(function, max_norm, opt);
  const std::vector<std::size_t> bounds = balanced_runs(pieces, used);
  const clip_plan plan = plan_clip(function, parallel_partial_norm<Policy>(pieces, bounds), max_norm, opt);
  if (plan.result.clipped) parallel_apply<Policy>(pieces, bounds, plan.coefficient);
  return plan.result;
}

// One gradient as a group of one, without copying it.
template <class G>
struct single {
  G* gradient;
  G* begin() const noexcept { return gradient; }
  G* end() const noexcept { return gradient + 1; }
};

}  // namespace detail

/// norm(g) on up to t.count threads.
template <class Policy = robust, class Grad>
double norm(const Grad& g, threads t) {
  return detail::partial_norm_of_group<Policy>(detail::single<const Grad>{&g}, t).norm();
}

/// norm(data, size) on up to t.count threads.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
double norm(const T* data, std::size_t size, threads t) {
  return norm<Policy>(detail::strided_view<const T>{data, size}, t);
}

/// partial_global_norm(grads) on up to t.count threads.
template <class Policy = robust, class Grads>
partial_norm partial_global_norm(const Grads& grads, threads t) {
  return detail::partial_norm_of_group<Policy>(grads, t);
}

/// global_norm(grads) on up to t.count threads.
template <class Policy = robust, class Grads>
double global_norm(const Grads& grads, threads t) {
  return partial_global_norm<Policy>(grads, t).norm();
}

/// clip_by_norm(g, max_norm, opt) on up to t.count threads; the same semantics and errors.
template <class Policy = robust, class Grad, class = std::enable_if_t<detail::is_gradient_v<Grad>>>
clip_result clip_by_norm(Grad&& g, double max_norm, options opt, threads t) {
  using G = std::remove_reference_t<Grad>;
  detail::single<G> group{&g};
  return detail::clip_group<Policy>("gradclip::clip_by_norm", group, max_norm, opt, t);
}

/// clip_by_norm(data, size, max_norm, opt) on up to t.count threads.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_by_norm(T* data, std::size_t size, double max_norm, options opt, threads t) {
  return clip_by_norm<Policy>(detail::strided_view<T>{data, size}, max_norm, opt, t);
}

/// clip_by_global_norm(grads, max_norm, opt) on up to t.count threads.
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(Grads& grads, double max_norm, options opt, threads t) {
  return detail::clip_group<Policy>("gradclip::clip_by_global_norm", grads, max_norm, opt, t);
}

}  // namespace gradclip
