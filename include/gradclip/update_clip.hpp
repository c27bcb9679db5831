// Clipping the optimizer's update instead of (or beside) the gradient: Adafactor's RMS clip of an update,
// StableAdamW's per-tensor learning-rate factor and SPAM's spike clipping against the second moment.
// Each reads its tensors overflow-free in FP16, BF16, FP32 and FP64 (docs/update_clipping.md).
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/detail/update_kernels.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

namespace detail {

inline void check_rms_arguments(const char* function, double max_rms, const options& opt) {
  if (!(max_rms >= 0)) throw std::invalid_argument(std::string(function) + ": max_rms must be >= 0 and not NaN");
  check_options(function, opt);
  if (opt.norm != l2_norm)
    throw std::invalid_argument(std::string(function) +
                                ": options::norm must be the L2 norm (RMS = ||u||_2 / sqrt(n))");
}

template <class G>
std::size_t element_count(G& g) {
  return visit_gradient(g, [](const auto& view) { return view.size(); });
}

template <class G, class = void>
struct is_eigen_tensor_like : std::false_type {};
template <class G>
struct is_eigen_tensor_like<
    G, std::void_t<decltype(G::NumIndices), decltype(G::Layout), decltype(std::declval<const G&>().dimensions())>>
    : std::true_type {};

/// Throws std::invalid_argument unless g and v pair their elements one to one: the same count and, for
/// two Eigen objects, the same shape and (for matrices that are not vectors) the same storage order.
template <class G, class V>
void check_pairing(const char* function, const G& g, const V& v, std::size_t g_size, std::size_t v_size) {
  const auto fail = [&](const std::string& what) { throw std::invalid_argument(std::string(function) + ": " + what); };
  if (g_size != v_size)
    fail("g has " + std::to_string(g_size) + " elements, v has " + std::to_string(v_size) + "; they must match");
  if constexpr (is_eigen_dense_v<std::remove_cv_t<G>> && is_eigen_dense_v<std::remove_cv_t<V>>) {
    if (g.rows() != v.rows() || g.cols() != v.cols()) fail("g and v must have the same shape");
    if (g.rows() > 1 && g.cols() > 1 && static_cast<bool>(G::IsRowMajor) != static_cast<bool>(V::IsRowMajor))
      fail("g and v must have the same storage order");
  } else if constexpr (is_eigen_tensor_like<std::remove_cv_t<G>>::value &&
                       is_eigen_tensor_like<std::remove_cv_t<V>>::value) {
    bool same = static_cast<int>(G::NumIndices) == static_cast<int>(V::NumIndices) &&
                static_cast<int>(G::Layout) == static_cast<int>(V::Layout);
    for (int d = 0; same && d < static_cast<int>(G::NumIndices); ++d) same = g.dimensions()[d] == v.dimensions()[d];
    if (!same) fail("g and v must have the same dimensions and layout");
  }
}

template <class V>
inline constexpr bool is_moment_v =
    std::is_same_v<std::remove_const_t<V>, float> || std::is_same_v<std::remove_const_t<V>, double>;

inline void check_positive(const char* function, const char* name, double x) {
  if (!(x > 0) || !std::isfinite(x))
    throw std::invalid_argument(std::string(function) + ": " + name + " must be finite and > 0");
}

/// Runs task(first, last) on the fixed pieces [k, k + 1) * piece_elements of [0, n) on up to
/// opt.threads threads and merges the results into `total` in piece order, so the result is the same for
/// every thread count; `element_bytes` says how many threads the bytes are worth.
template <class R, class Task, class Merge>
R reduce_pieces(std::size_t n, std::size_t element_bytes, const options& opt, R total, Task&& task, Merge&& merge) {
  const std::size_t pieces = n == 0 ? 0 : (n - 1) / piece_elements + 1;
  const unsigned threads = static_cast<unsigned>(std::min<std::size_t>(
      {std::max(opt.threads, 1u), pieces, std::max<std::size_t>(1, n * element_bytes / parallel_grain_bytes)}));
  const auto run = [&](std::size_t k) { return task(k * piece_elements, std::min(n, (k + 1) * piece_elements)); };
  if (threads <= 1) {
    for (std::size_t k = 0; k < pieces; ++k) merge(total, run(k));
    return total;
  }
  std::vector<R> results(pieces);
  const std::function<void(unsigned)> job = [&](unsigned j) {
    for (std::size_t k = j; k < pieces; k += threads) results[k] = run(k);
  };
  run_jobs(opt.pool, threads, job);
  for (const R& r : results) merge(total, r);
  return total;
}

/// 1 / max(1, sqrt(sum / n)) from the sum's part (p = 1): in (0, 1] for a finite sum, the smallest
/// positive double where the exact value is below it; NaN for a NaN sum and 0 for an infinite one.
inline double factor_of_sum(const partial_norm& sum, std::size_t n) noexcept {
  if (!sum.finite) return std::isnan(sum.sum) ? sum.sum : 0.0;
  if (n == 0 || sum.sum == 0.0) return 1.0;
  const scaled mean = scaled{sum.sum + sum.low, sum.exponent}.normalized() / scaled::of(static_cast<double>(n));
  if (!(scaled::of(1.0) < mean)) return 1.0;
  const bool odd = mean.exponent % 2 != 0;  // halve an even exponent exactly
  const scaled rms = scaled{std::sqrt(odd ? 2 * mean.mantissa : mean.mantissa), (mean.exponent - odd) / 2}.normalized();
  const double f = (scaled::of(1.0) / rms).value();
  return f > 0 ? f : std::numeric_limits<double>::denorm_min();
}

template <class T, class V>
double stable_adamw_factor_of(const char* function, const strided_view<T>& g, const strided_view<V>& v, double eps,
                              const options& opt) {
  static_assert(is_moment_v<V>, "stable_adamw_factor's v (the second moment) must be float or double.");
  const double eps_squared = eps * eps;
  const scaled eps_squared_scaled = scaled::of(eps) * scaled::of(eps);
  const quotient_sum total = reduce_pieces(
      g.size(), sizeof(T) + sizeof(V), opt, quotient_sum{},
      [&](std::size_t first, std::size_t last) {
        quotient_sum part;
        for_each_paired_block(g, v, first, last, [&](const auto* a, const auto* b, std::size_t m) {
          part.merge(quotient_block(a, b, m, eps_squared, eps_squared_scaled));
        });
        return part;
      },
      [](quotient_sum& t, const quotient_sum& p) { t.merge(p); });
  if (total.nonfinite_input && opt.nonfinite == on_nonfinite::skip) return 1.0;
  if (total.nonfinite_input && opt.nonfinite == on_nonfinite::error)
    throw nonfinite_error(function, total.sum.finite ? total.witness : total.sum.sum);
  return factor_of_sum(total.sum, g.size());
}

template <class T, class V>
std::size_t spam_clip_of(const char* function, const strided_view<T>& g, const strided_view<V>& v, double theta,
                         const options& opt) {
  static_assert(!std::is_const_v<T>, "spam_clip modifies the gradient in place, so it cannot be const.");
  static_assert(is_moment_v<V>, "spam_clip's v (the second moment) must be float or double.");
  const std::size_t n = g.size(), bytes = sizeof(T) + sizeof(V);
  if (opt.nonfinite == on_nonfinite::error) {  // a read pass first, so that nothing is written when it throws
    const strided_view<const T> read{g.data, g.inner_size, g.inner_stride, g.outer_size, g.outer_stride};
    const double bad = reduce_pieces(
        n, bytes, opt, 0.0,
        [&](std::size_t first, std::size_t last) {
          double found = 0.0;
          for_each_paired_block(read, v, first, last, [&](const auto* a, const auto* b, std::size_t m) {
            if (found == 0.0) found = first_nonfinite(a, b, m);
          });
          return found;
        },
        [](double& t, double p) {
          if (t == 0.0) t = p;
        });
    if (bad != 0.0) throw nonfinite_error(function, bad);
  }
  return reduce_pieces(
      n, bytes, opt, std::size_t{0},
      [&](std::size_t first, std::size_t last) {
        std::size_t clipped = 0;
        for_each_paired_block(g, v, first, last, [&](auto* a, const auto* b, std::size_t m) {
          clipped += spam_block(a, b, m, theta, opt.nonfinite == on_nonfinite::propagate);
        });
        return clipped;
      },
      [](std::size_t& t, std::size_t c) { t += c; });
}

/// Calls f(view of g, view of v) after check_pairing.
template <class G, class V, class F>
decltype(auto) visit_paired(const char* function, G& g, const V& v, F&& f) {
  return visit_gradient(g, [&](const auto& gv) {
    return visit_gradient(v, [&](const auto& vv) {
      check_pairing(function, g, v, gv.size(), vv.size());
      return f(gv, vv);
    });
  });
}

}  // namespace detail

/// Clips one optimizer update by its root mean square, Adafactor's update clipping:
///
///     RMS = ||u||_2 / sqrt(n),   u <- u * c  with  c = max_rms / (RMS + epsilon)  when c < 1
///
/// (Adafactor divides by max(1, RMS / d), the same with epsilon = 0; its d is max_rms, 1.0 by default).
/// The sum of squares is the policy's (overflow-free for every finite input under robust: 16-bit updates
/// whose squares overflow their type are handled as by clip_by_norm) and is divided by n in
/// double-double, so the coefficient and the clipped elements have clip_by_norm's precision. The result's
/// `norm` is the RMS and `threshold` is max_rms: the two quantities compared. An empty or zero update is
/// left alone. Non-finite values follow opt.nonfinite as in clip_by_norm. options::norm must be the L2
/// norm; max_rms >= 0 and not NaN (+inf: never clips), else std::invalid_argument.
///
///     std::vector<float> update = adam_direction(...);           // m^ / (sqrt(v^) + eps)
///     auto r = gradclip::clip_update_by_rms(update, 1.0);        // r.norm: the RMS before clipping
template <class Policy = robust, class Update, class = std::enable_if_t<detail::is_gradient_v<Update>>>
clip_result clip_update_by_rms(Update&& update, double max_rms, const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_update_by_rms";
  detail::check_rms_arguments(function, max_rms, opt);
  const std::size_t n = detail::element_count(update);
  return detail::with_single(update, [&](auto& one) {
    return detail::clip<Policy>(function, one, detail::fixed_threshold{max_rms}, opt,
                                [&] { return detail::rms_part(detail::reduce<Policy>(one, opt), n); });
  });
}

/// Clips a raw buffer of `size` elements by its RMS; see the overload above.
template <class Policy = robust, class T, class = std::enable_if_t<detail::is_element_v<T>>>
clip_result clip_update_by_rms(T* data, std::size_t size, double max_rms, const options& opt = {}) {
  return clip_update_by_rms<Policy>(detail::strided_view<T>{data, size}, max_rms, opt);
}

/// Clips every update of a range (one per parameter tensor, any element types through grad_view) by
/// its own RMS, as clip_update_by_rms does for each, and returns their results in order. Every RMS and
/// decision is made before anything is written: one read pass, then one write pass over the updates that
/// clip; with on_nonfinite::error nothing is modified when it throws (skip leaves only the non-finite
/// updates alone).
///
///     std::vector<Eigen::MatrixXf> updates = ...;
///     auto results = gradclip::clip_updates_by_rms(updates, 1.0);
template <class Policy = robust, class Updates, class = std::enable_if_t<detail::is_gradient_range_v<Updates&>>>
std::vector<clip_result> clip_updates_by_rms(Updates&& updates, double max_rms, const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_updates_by_rms";
  detail::check_rms_arguments(function, max_rms, opt);
  const detail::per_gradient<std::remove_reference_t<Updates>> layout{updates};
  const auto plans = detail::run_units(
      function, layout, detail::fixed_threshold{max_rms}, opt,
      [&] {
        auto parts = detail::reduce_units<Policy>(layout, opt);
        std::size_t k = 0;
        for (auto& u : updates) {
          parts[k] = detail::rms_part(parts[k], detail::element_count(u));
          ++k;
        }
        return parts;
      },
      [&](const auto& unit_plans) { detail::apply_units<Policy>(layout, unit_plans, opt); });
  std::vector<clip_result> results;
  results.reserve(plans.size());
  for (const auto& plan : plans) results.push_back(plan.result);
  return results;
}

/// The same for a braced list of updates of any element types: clip_updates_by_rms({w, b}, 1.0).
template <class Policy = robust>
std::vector<clip_result> clip_updates_by_rms(std::initializer_list<grad_view> updates, double max_rms,
                                             const options& opt = {}) {
  return clip_updates_by_rms<Policy>(std::vector<grad_view>(updates), max_rms, opt);
}

/// StableAdamW's learning-rate factor for one tensor (Wortsman et al. 2023; optimi's StableAdamW):
///
///     f = 1 / max(1, sqrt(mean_j(g_j^2 / max(v_j, eps^2))))      in (0, 1]
///
/// to multiply the tensor's learning rate by. g is the gradient (any element type), v the second moment
/// after this step's update (float or double), as the references pass it; elements pair in memory order
/// (same count, and for two Eigen objects the same shape and storage order, else std::invalid_argument).
/// One read pass over g and v, in FP64: overflow- and underflow-free for every finite input and any
/// eps > 0, within 1e-14 relative of the exact factor; a factor below double's range returns the smallest
/// positive double. On opt.threads with the same bits for any count (options::epsilon and norm are not
/// used). A NaN or infinite element of g or v follows opt.nonfinite: `skip` returns 1 (the tensor's step
/// is left as it is: skip the step on the overflow flag as usual), `error` throws nonfinite_error,
/// `propagate` is the formula in IEEE arithmetic, NaN propagating through the max (NaN for a NaN term, 0
/// when a term is +inf). Throws std::invalid_argument for an eps that is not finite and > 0.
///
///     const double f = gradclip::stable_adamw_factor(grad, exp_avg_sq, 1e-6);
///     param -= (lr * f) * update;
template <class Grad, class Moment,
          class = std::enable_if_t<detail::is_gradient_v<const Grad&> && detail::is_gradient_v<const Moment&>>>
double stable_adamw_factor(const Grad& g, const Moment& v, double eps, const options& opt = {}) {
  constexpr const char* function = "gradclip::stable_adamw_factor";
  detail::check_positive(function, "eps", eps);
  detail::check_options(function, opt);
  return detail::visit_paired(function, g, v, [&](const auto& gv, const auto& vv) {
    return detail::stable_adamw_factor_of(function, gv, vv, eps, opt);
  });
}

/// The factor of raw buffers of `size` elements each; see the overload above.
template <class T, class V, class = std::enable_if_t<detail::is_element_v<T> && detail::is_element_v<V>>>
double stable_adamw_factor(const T* g, const V* v, std::size_t size, double eps, const options& opt = {}) {
  return stable_adamw_factor(detail::strided_view<const T>{g, size}, detail::strided_view<const V>{v, size}, eps, opt);
}

/// SPAM's spike-aware clipping (Huang et al., ICLR 2025), before the moments are updated with g:
///
///     where g_j^2 > theta * v_j:   g_j <- sign(g_j) * sqrt(theta * v_j)
///
/// with v the previous second moment (float or double; paired with g as in stable_adamw_factor). Returns
/// how many elements it clipped. An element with v_j <= 0 (no history yet) is left alone, unlike the
/// reference, which zeroes it. The test is decided exactly for FP16, BF16 and FP32 g (to one rounding of
/// g^2 for FP64), without overflow; sqrt(theta * v_j) is computed in FP64 and rounded once to g's type,
/// never above |g_j|. One read pass over g and v; only clipped elements are written. Elements where g_j or
/// v_j is NaN or infinite follow opt.nonfinite: `skip` leaves them alone (the others are clipped),
/// `error` throws nonfinite_error before anything is written (a read pass first), `propagate` is the
/// reference's mask (an infinite g_j with a finite v_j > 0 is clipped; NaN never is). Threads as
/// stable_adamw_factor. Throws std::invalid_argument for a theta that is not finite and > 0 (the
/// reference's theta = 0 switches the clip off: do not call it).
///
///     std::size_t spikes = gradclip::spam_clip(grad, exp_avg_sq, 5000.0);
template <class Grad, class Moment,
          class = std::enable_if_t<detail::is_gradient_v<Grad> && detail::is_gradient_v<const Moment&>>>
std::size_t spam_clip(Grad&& g, const Moment& v, double theta, const options& opt = {}) {
  constexpr const char* function = "gradclip::spam_clip";
  detail::check_positive(function, "theta", theta);
  detail::check_options(function, opt);
  return detail::visit_paired(function, g, v, [&](const auto& gv, const auto& vv) {
    return detail::spam_clip_of(function, gv, vv, theta, opt);
  });
}

/// SPAM's clip of raw buffers of `size` elements each; see the overload above.
template <class T, class V, class = std::enable_if_t<detail::is_element_v<T> && detail::is_element_v<V>>>
std::size_t spam_clip(T* g, const V* v, std::size_t size, double theta, const options& opt = {}) {
  return spam_clip(detail::strided_view<T>{g, size}, detail::strided_view<const V>{v, size}, theta, opt);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
