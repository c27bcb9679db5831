// The clipping pipeline every public entry point is a front-end of: the gradients cut into a fixed
// partition of pieces, each piece reduced to a partial_norm (on up to options::threads threads), the parts
// merged in partition order, a plan that turns the merged part and the threshold into a coefficient, and
// one scale kernel. The partition depends on the gradients alone, so the norm, the coefficient and every
// clipped bit are the same for any thread count and any scheduling.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/detail/scale.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/thread_pool.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// Elements per piece of a contiguous gradient (a multiple of the kernels' block size): small enough to
/// balance two to sixteen threads on large gradients, large enough that merging pieces costs nothing.
inline constexpr std::size_t piece_elements = std::size_t{1} << 20;

/// The least gradient bytes worth waking one more thread for.
inline constexpr std::size_t parallel_grain_bytes = std::size_t{1} << 20;

/// The largest finite p a norm may have: a part keeps sum |x|^p as sum * 2^(p * exponent) with a whole
/// exponent, which leaves a block's largest term inside double's range only up to about p = 1900. Above
/// it the p-norm differs from the max norm by less than a factor n^(1/p) anyway: use inf_norm.
inline constexpr double largest_finite_p = 1000.0;

inline void check_options(const char* function, const options& opt) {
  const double p = opt.norm.p();
  if (!(p > 0) || (p > largest_finite_p && !std::isinf(p)))
    throw std::invalid_argument(std::string(function) + ": options::norm must be in (0, 1000] or inf, not " +
                                std::to_string(p));
  if (!(opt.epsilon >= 0) || !std::isfinite(opt.epsilon))
    throw std::invalid_argument(std::string(function) + ": options::epsilon must be finite and >= 0");
  if (opt.nonfinite != on_nonfinite::skip && opt.nonfinite != on_nonfinite::error &&
      opt.nonfinite != on_nonfinite::propagate)
    throw std::invalid_argument(std::string(function) + ": options::nonfinite is not an on_nonfinite value");
}

/// One gradient as a group of one, without copying it.
template <class G>
struct single {
  G* gradient;
  G* begin() const noexcept { return gradient; }
  G* end() const noexcept { return gradient + 1; }
};

template <class Grads>
void check_group() {
  static_assert(is_gradient_range_v<Grads>,
                "A group of gradients is a range (a std::vector, std::array, ...) whose elements are gradients.");
}

/// Calls f(strided_view<T>) for every piece of the group, in partition order: contiguous gradients cut
/// every piece_elements elements, other gradients whole.
template <class Grads, class F>
void for_each_piece(Grads& grads, F&& f) {
  for (auto& g : grads)
    visit_gradient(g, [&](const auto& view) {
      using view_t = std::decay_t<decltype(view)>;
      if (view.outer_size != 1 || view.inner_stride != 1) return f(view);
      for (std::size_t start = 0; start < view.inner_size; start += piece_elements)
        f(view_t{view.data + start, std::min(piece_elements, view.inner_size - start)});
    });
}

template <class Policy, class T>
partial_norm reduce_piece(const strided_view<T>& piece, double order) {
  if (piece.outer_size == 1 && piece.inner_stride == 1) return reduce_run<Policy>(piece.data, piece.inner_size, order);
  partial_norm part{0, 0.0, true, order};
  piece.for_each_run([&](const auto* p, std::size_t n) { part.merge(reduce_run<Policy>(p, n, order)); });
  return part;
}

template <class Piece>
std::size_t piece_bytes(const Piece& piece) {
  return piece.visit([](const auto& v) { return v.size() * sizeof(typename std::decay_t<decltype(v)>::element_type); });
}

/// The pieces of a group as views for the threads, and how many threads they are worth (at most
/// `wanted`); no pieces when one thread does.
template <class View, class Grads>
std::vector<View> pieces_for_threads(Grads& grads, unsigned wanted, unsigned& used) {
  used = 1;
  std::vector<View> pieces;
  if (wanted <= 1) return pieces;
  std::size_t bytes = 0, count = 0;
  for_each_piece(grads, [&](const auto& piece) {
    bytes += piece.size() * sizeof(typename std::decay_t<decltype(piece)>::element_type);
    ++count;
  });
  used = static_cast<unsigned>(
      std::min<std::size_t>({wanted, count, std::max<std::size_t>(1, bytes / parallel_grain_bytes)}));
  if (used <= 1) return pieces;
  pieces.reserve(count);
  for_each_piece(grads, [&](const auto& piece) { pieces.emplace_back(piece); });
  return pieces;
}

/// Runs task(i) for every piece on `threads` threads, each taking a run of consecutive pieces of about
/// equal bytes.
template <class View, class Task>
void run_pieces(const std::vector<View>& pieces, unsigned threads, const executor* pool, Task&& task) {
  std::size_t total = 0;
  for (const auto& p : pieces) total += piece_bytes(p);
  std::vector<std::size_t> bounds{0};
  std::size_t done = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    done += piece_bytes(pieces[i]);
    if (bounds.size() < threads && done * threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  while (bounds.size() <= threads) bounds.push_back(pieces.size());
  const std::function<void(unsigned)> job = [&](unsigned k) {
    for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) task(i);
  };
  run_jobs(pool, threads, job);
}

/// The group's partial norm of kind options::norm, merged in partition order.
template <class Policy, class Grads>
partial_norm reduce(const Grads& grads, const options& opt) {
  check_group<const Grads&>();
  const double order = opt.norm.p();
  partial_norm total{0, 0.0, true, order};
  unsigned threads = 1;
  const std::vector<const_grad_view> pieces = pieces_for_threads<const_grad_view>(grads, opt.threads, threads);
  if (threads <= 1) {
    for_each_piece(grads, [&](const auto& piece) { total.merge(reduce_piece<Policy>(piece, order)); });
    return total;
  }
  std::vector<partial_norm> parts(pieces.size());
  run_pieces(pieces, threads, opt.pool, [&](std::size_t i) {
    parts[i] = pieces[i].visit([&](const auto& piece) { return reduce_piece<Policy>(piece, order); });
  });
  for (const auto& part : parts) total.merge(part);
  return total;
}

/// Calls kernel(T* p, n) on every contiguous run of the group's elements, on up to options::threads
/// threads; strided runs are gathered, passed to the kernel and scattered back.
template <class Grads, class Kernel>
void for_each_run_in_place(Grads& grads, const options& opt, Kernel&& kernel) {
  const auto in_place = [&](const auto& piece) {
    using T = typename std::decay_t<decltype(piece)>::element_type;
    static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
    piece.for_each_run([&](T* p, std::size_t n) { kernel(p, n); }, true);
  };
  unsigned threads = 1;
  const std::vector<grad_view> pieces = pieces_for_threads<grad_view>(grads, opt.threads, threads);
  if (threads <= 1) return for_each_piece(grads, in_place);
  run_pieces(pieces, threads, opt.pool, [&](std::size_t i) { pieces[i].visit(in_place); });
}

/// Multiplies every element of the group by c with the policy's scaling.
template <class Policy, class Grads>
void apply(Grads& grads, const scaled& c, const options& opt) {
  const scaler<Policy> scale(c);
  for_each_run_in_place(grads, opt, [&](auto* p, std::size_t n) { scale(p, n); });
}

/// What to do, decided before any gradient is touched.
struct clip_plan {
  clip_result result;
  scaled coefficient;
};

/// Turns a norm's partial and the threshold into a coefficient, PyTorch's rule: clip when
/// c = max_norm / (norm + epsilon) < 1. Works on the scaled forms, so the coefficient is right even where
/// the norm overflows double. Non-finite norms follow opt.nonfinite.
inline clip_plan plan_clip(const char* function, const partial_norm& part, double max_norm, const options& opt) {
  const double norm = part.norm();
  if (!part.finite) {
    if (opt.nonfinite == on_nonfinite::error) throw nonfinite_error(function, norm);
    if (opt.nonfinite == on_nonfinite::skip)  // no threshold was applied
      return {{norm, 1.0, false, false, std::numeric_limits<double>::infinity()}, scaled{1.0, 0}};
    // PyTorch's arithmetic (std::min keeps a NaN quotient): an infinite norm gives 0, NaN when max_norm is
    // infinite too; a NaN norm gives NaN.
    const double c = std::min(max_norm / (norm + opt.epsilon), 1.0);
    return {{norm, c, !(c == 1.0), false, max_norm}, scaled{c, 0}};
  }
  // The root of the L2 sum (with its tail) and the quotient in double-double: the coefficient is the
  // correctly rounded quotient, and its tail lets the FP64 scale kernel round each element once from the
  // unrounded quotient.
  const scaled root =
      part.p == 2.0 && part.sum > 0 ? root_with_tail(part.sum, part.low, part.exponent) : part.norm_scaled();
  const scaled c = quotient_with_tail(max_norm, root, opt.epsilon);
  // c < 1: zero (max_norm = 0), or a normalized mantissa in [1, 2) with a negative exponent. A zero norm
  // gives an infinite c (or NaN with max_norm = 0), which never clips.
  const bool below_one = std::isfinite(c.mantissa) && (c.mantissa == 0.0 || c.exponent < 0);
  if (!below_one) return {{norm, 1.0, false, true, max_norm}, scaled{1.0, 0}};
  return {{norm, c.value(), true, true, max_norm}, c};
}

/// A threshold fixed by the caller: the source of the threshold for every call without a controller.
struct fixed_threshold {
  double max_norm;

  void check(const char* function) const {
    if (!(max_norm >= 0)) throw std::invalid_argument(std::string(function) + ": max_norm must be >= 0 and not NaN");
  }
  threshold_decision decide(double) const noexcept { return {max_norm, false}; }
  double fallback_threshold() const noexcept { return max_norm; }
  void update(const clip_result&) const noexcept {}
};

inline void check_clip_arguments(const char* function, double max_norm, const options& opt) {
  fixed_threshold{max_norm}.check(function);
  check_options(function, opt);
}

/// A threshold controller (controller.hpp) as a source of the threshold.
template <class Controller>
struct controlled {
  Controller& controller;

  void check(const char*) const noexcept {}
  threshold_decision decide(double norm) const { return controller.decide(norm); }
  double fallback_threshold() const { return controller.fallback_threshold(); }
  void update(const clip_result& step) const { controller.update(step); }
};

/// The whole pipeline: check, reduce (`reduced()` returns the part), ask `source` for the threshold (a
/// non-finite norm never reaches it: it follows opt.nonfinite, with the source's fallback threshold
/// under propagate), plan, then `write(plan)` unless the step is skipped, and tell `source` the outcome.
template <class Source, class Reduced, class Write>
clip_result run_pipeline(const char* function, const Source& source, const options& opt, Reduced&& reduced,
                         Write&& write) {
  source.check(function);
  check_options(function, opt);
  const partial_norm part = reduced();
  const threshold_decision decision =
      part.finite ? source.decide(part.norm()) : threshold_decision{source.fallback_threshold(), false};
  if (decision.skip) {
    const clip_result skipped{part.norm(), 1.0, false, part.finite, decision.threshold, true};
    source.update(skipped);
    return skipped;
  }
  const clip_plan plan = plan_clip(function, part, decision.threshold, opt);
  write(plan);
  source.update(plan.result);
  return plan.result;
}

/// The pipeline with the scale kernel as its write pass.
template <class Policy, class Grads, class Source, class Reduced>
clip_result clip(const char* function, Grads& grads, const Source& source, const options& opt, Reduced&& reduced) {
  check_group<Grads&>();
  return run_pipeline(function, source, opt, std::forward<Reduced>(reduced), [&](const clip_plan& plan) {
    if (plan.result.clipped) apply<Policy>(grads, plan.coefficient, opt);
  });
}

/// The pipeline on the group's own norm.
template <class Policy, class Grads, class Source>
clip_result clip(const char* function, Grads& grads, const Source& source, const options& opt) {
  return clip<Policy>(function, grads, source, opt, [&] { return reduce<Policy>(grads, opt); });
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
