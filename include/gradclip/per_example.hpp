// Per-example clipping for differentially private training (DP-SGD): each example's gradient clipped to
// norm C over all tensors (or per tensor), and the clipped gradients summed over the batch.
#pragma once

#include <gradclip/adaptive_clip.hpp>  // unit_split, split_units, unit_norms: a batch is cut into examples as AGC cuts units
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/pipeline.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// What a per-example clipping call did: the counts a privacy accountant and an adaptive bound need.
struct [[nodiscard]] per_example_result {
  std::size_t examples = 0;   ///< the batch size B
  std::size_t clipped = 0;    ///< finite examples whose norm exceeded the bound (factor < 1)
  std::size_t nonfinite = 0;  ///< examples whose norm was NaN or Inf (skip: left out of every sum)
  bool finite = true;         ///< nonfinite == 0

  /// Examples whose norm was finite and within the bound: the count an adaptive bound tracks.
  std::size_t unclipped() const noexcept { return examples - clipped - nonfinite; }
};

/// Each example's factor f_i and whether it enters the sums; made from per-example norms, applied by
/// accumulate_per_example and ghost_weighted_sum.
struct per_example_plan {
  per_example_result result;
  std::vector<detail::scaled> factors;  ///< f_i as mantissa * 2^exponent, exact where f_i itself would underflow
  std::vector<unsigned char> included;  ///< 0: a non-finite example left out of the sums (on_nonfinite::skip)
  std::vector<unsigned char> clipped;   ///< 1: a finite example whose norm exceeded the bound
  std::vector<unsigned char> finite;    ///< 0: an example whose norm was NaN or Inf

  double coefficient(std::size_t i) const noexcept { return factors[i].value(); }
};

namespace detail {

template <class M>
struct is_tuple_like : std::false_type {};
template <class... Ts>
struct is_tuple_like<std::tuple<Ts...>> : std::true_type {};
template <class A, class B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};

/// The object behind a member of a range: pointers and reference_wrappers are followed.
template <class G>
decltype(auto) member_object(G& g) {
  if constexpr (std::is_pointer_v<std::remove_cv_t<G>>)
    return *g;
  else if constexpr (is_reference_wrapper<std::remove_cv_t<G>>::value)
    return g.get();
  else
    return (g);
}

/// Calls f(member, index) for every member of a range or a tuple (std::tie(w, b) mixes types and ranks).
template <class Members, class F>
void for_each_member(Members& members, F&& f) {
  std::size_t k = 0;
  if constexpr (is_tuple_like<std::remove_cv_t<Members>>::value)
    std::apply([&](auto&... m) { (f(member_object(m), k++), ...); }, members);
  else
    for (auto& m : members) f(member_object(m), k++);
}

template <class Members>
std::size_t member_count(const Members& members) {
  if constexpr (is_tuple_like<std::remove_cv_t<Members>>::value)
    return std::tuple_size_v<std::remove_cv_t<Members>>;
  else
    return static_cast<std::size_t>(std::distance(std::begin(members), std::end(members)));
}

/// A tensor whose first index is the example: one unit per example, each unit example i's gradient in
/// the tensor's storage order over the remaining indices.
template <class T>
struct example_batch {
  unit_split<T> split;
  std::vector<std::ptrdiff_t> example_shape;  ///< the shape without the batch dimension
  bool row_major = false;

  std::size_t examples() const noexcept { return split.units; }
};

template <class G>
auto batch_of(G& g) {
  using raw = std::remove_cv_t<G>;
  static_assert(is_eigen_dense_v<raw> || is_eigen_tensor<raw>::value,
                "Per-example gradients are Eigen tensors or tensor maps of rank >= 1, or Eigen matrices and maps "
                "(rows are examples), whose first index is the example.");
  if constexpr (is_eigen_tensor<raw>::value)
    static_assert(raw::NumIndices >= 1, "A per-example gradient needs a batch dimension (rank >= 1).");
  auto split = split_units(g);
  example_batch<std::remove_pointer_t<decltype(split.whole.data)>> batch;
  const std::size_t examples = static_cast<std::size_t>(split.shape[0]);
  batch.example_shape.assign(split.shape.begin() + 1, split.shape.end());
  std::size_t example_size = 1;
  for (std::ptrdiff_t d : batch.example_shape) example_size *= static_cast<std::size_t>(d);
  if constexpr (is_eigen_dense_v<raw>)
    batch.row_major = raw::IsRowMajor;
  else
    batch.row_major = static_cast<int>(raw::Layout) == static_cast<int>(Eigen::RowMajor);
  split.unit_size = example_size;
  if (split.units != examples || examples * example_size == 0) {
    // Optax's vector rule made the batch one unit, or it is empty: examples of one element (or none)
    // lie one stride of the whole vector apart.
    split.units = examples;
    split.unit_stride = examples * example_size == 0 ? 0 : split.whole.inner_stride;
    split.element_stride = 0;
  }
  batch.split = split;
  return batch;
}

inline std::vector<std::ptrdiff_t> squeezed(const std::vector<std::ptrdiff_t>& shape) {
  std::vector<std::ptrdiff_t> s;
  for (std::ptrdiff_t d : shape)
    if (d != 1) s.push_back(d);
  return s;
}

/// Checks that `sum` can receive the sum over the batch of `batch`: the same elements in the same order.
template <class T, class S>
void check_sum_shape(const char* function, std::size_t k, const example_batch<T>& batch, S& sum) {
  using raw = std::remove_cv_t<S>;
  static_assert(is_gradient_v<S>,
                "Each sum is an Eigen tensor, tensor map or dense object, or a container with "
                "data() and size(), of Eigen::half, Eigen::bfloat16, float or double.");
  std::vector<std::ptrdiff_t> shape;
  bool known = false, row_major = false;
  if constexpr (is_eigen_dense_v<raw>) {
    shape = {static_cast<std::ptrdiff_t>(sum.rows()), static_cast<std::ptrdiff_t>(sum.cols())};
    known = true;
    row_major = raw::IsRowMajor;
  } else if constexpr (is_eigen_tensor<raw>::value) {
    for (std::size_t d = 0; d < static_cast<std::size_t>(raw::NumIndices); ++d)
      shape.push_back(static_cast<std::ptrdiff_t>(sum.dimensions()[d]));
    known = true;
    row_major = static_cast<int>(raw::Layout) == static_cast<int>(Eigen::RowMajor);
  } else {
    shape = {static_cast<std::ptrdiff_t>(visit_gradient(sum, [](const auto& view) { return view.size(); }))};
  }
  // Outputs without a shape of their own (containers, grad_view) only need the right size.
  const std::vector<std::ptrdiff_t> want = squeezed(batch.example_shape), got = squeezed(shape);
  const std::string where = std::string(function) + ": sums[" + std::to_string(k) + "] ";
  if (known ? got != want : batch.split.unit_size != static_cast<std::size_t>(shape[0]))
    throw std::invalid_argument(where + "has shape " + shape_string(shape) + ", expected " +
                                shape_string(batch.example_shape) + " (the per-example shape without the batch)");
  if (known && want.size() > 1 && row_major != batch.row_major)
    throw std::invalid_argument(where + "has another storage order than per_example[" + std::to_string(k) +
                                "], so its elements would not line up");
}

/// The batch size shared by every per-example tensor; throws when they disagree.
template <class PerExample>
std::size_t common_batch_size(const char* function, PerExample& per_example) {
  std::size_t examples = 0;
  for_each_member(per_example, [&](auto& g, std::size_t k) {
    const std::size_t b = batch_of(g).examples();
    if (k == 0) examples = b;
    if (b != examples)
      throw std::invalid_argument(std::string(function) + ": per_example[" + std::to_string(k) + "] has batch size " +
                                  std::to_string(b) + ", per_example[0] has " + std::to_string(examples));
  });
  return examples;
}

template <class PerExample, class Sums>
std::size_t check_batch_and_sums(const char* function, PerExample& per_example, Sums& sums) {
  const std::size_t examples = common_batch_size(function, per_example);
  const std::size_t count = member_count(per_example);
  if (member_count(sums) != count)
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(count) + " per-example tensors but " +
                                std::to_string(member_count(sums)) + " sums");
  for_each_member(per_example, [&](auto& g, std::size_t k) {
    for_each_member(sums, [&](auto& s, std::size_t j) {
      if (j == k) check_sum_shape(function, k, batch_of(g), s);
    });
  });
  return examples;
}

/// f_i * x with f_i a normal number of Compute (or 0 or NaN): one multiplication in Compute.
template <class Compute>
struct plain_weight {
  Compute value;
  template <class T>
  Compute operator()(T x) const noexcept {
    return widen<Compute>(x) * value;
  }
};

/// f_i * x for FP64 factors below double's normal range: x * 2^k1 * m * 2^k2, one rounding that matters.
struct split_weight {
  double first, mantissa, second;
  double operator()(double x) const noexcept { return x * first * mantissa * second; }
};

/// Adds f_i * g_i over the included examples of `batch` into acc (Acc per element of one example).
template <class Acc, class Weight, class T>
void accumulate_batch(const unit_split<T>& split, const std::vector<Weight>& w,
                      const std::vector<unsigned char>& included, Acc* acc) {
  if (!interleaved(split)) {
    // Each example's elements follow each other (row-major batches): one axpy per example.
    for (std::size_t i = 0; i < split.units; ++i) {
      if (!included[i]) continue;
      std::size_t k = 0;
      split.unit(i).for_each_run([&](const auto* p, std::size_t m) {
        for (std::size_t j = 0; j < m; ++j) acc[k + j] += static_cast<Acc>(w[i](p[j]));
        k += m;
      });
    }
    return;
  }
  // Examples interleave (column-major batches): each element is a dot product over the examples,
  // which run contiguously; independent lanes let it vectorize.
  constexpr std::size_t L = portable::lanes<Acc>;
  const std::size_t examples = split.units;
  for (std::size_t k = 0; k < split.unit_size; ++k) {
    const T* column = split.whole.data + static_cast<std::ptrdiff_t>(k) * split.element_stride;
    const auto term = [&](std::size_t i) {
      const T& x = column[static_cast<std::ptrdiff_t>(i) * split.unit_stride];
      return included[i] ? static_cast<Acc>(w[i](x)) : Acc(0);
    };
    Acc lane[L] = {};
    std::size_t i = 0;
    for (; i + L <= examples; i += L)
      for (std::size_t j = 0; j < L; ++j) lane[j] += term(i + j);
    for (std::size_t j = 0; i + j < examples; ++j) lane[j] += term(i + j);
    acc[k] += portable::sum_lanes(lane);
  }
}

/// Rounds the accumulated sum once into the output, in the output's storage order.
template <class Acc, class S>
void write_sum(S& sum, const std::vector<Acc>& acc) {
  visit_gradient(sum, [&](const auto& view) {
    using U = typename std::decay_t<decltype(view)>::element_type;
    static_assert(!std::is_const_v<U>, "The sums are written, so they cannot be const.");
    std::size_t k = 0;
    view.for_each_run(
        [&](U* p, std::size_t m) {
          for (std::size_t j = 0; j < m; ++j) p[j] = narrow<U>(acc[k + j]);
          k += m;
        },
        true);
  });
}

/// Calls f(weights) with each example's f_i as a weight for elements of type T: FP32 products for 16-bit
/// and FP32 elements when every factor is a normal float (the common case), else FP64; FP64 products for
/// FP64 elements, in two power-of-two steps for factors below double's normal range.
template <class T, class F>
void with_weights(const std::vector<scaled>& factors, const std::vector<unsigned char>& included, F&& f) {
  const std::size_t examples = factors.size();
  if constexpr (std::is_same_v<T, double>) {
    bool normal = true;
    for (std::size_t i = 0; i < examples; ++i)
      normal = normal && !(factors[i].mantissa != 0 && std::isfinite(factors[i].mantissa) &&
                           std::abs(factors[i].value()) < std::numeric_limits<double>::min());
    if (!normal) {
      std::vector<split_weight> w(examples);
      for (std::size_t i = 0; i < examples; ++i) {
        const auto [first, second] = power_of_two_factors(factors[i].exponent);
        w[i] = {first, factors[i].mantissa, second};
      }
      return f(w);
    }
  } else {
    bool normal_float = true;
    for (std::size_t i = 0; i < examples; ++i) {
      const double v = std::abs(factors[i].value());
      normal_float =
          normal_float && (!included[i] || v == 0 ||
                           (v >= std::numeric_limits<float>::min() && v <= std::numeric_limits<float>::max()));
    }
    if (normal_float) {
      std::vector<plain_weight<float>> w(examples);
      for (std::size_t i = 0; i < examples; ++i) w[i] = {static_cast<float>(factors[i].value())};
      return f(w);
    }
  }
  std::vector<plain_weight<double>> w(examples);
  for (std::size_t i = 0; i < examples; ++i) w[i] = {factors[i].value()};
  f(w);
}

/// sum <- sum_i f_i g_i over one per-example tensor, accumulated in FP32 (FP64 for FP64 input).
template <class G, class S>
void accumulate_one(G& g, S& sum, const std::vector<scaled>& factors, const std::vector<unsigned char>& included) {
  const auto batch = batch_of(g);
  using T = std::remove_const_t<typename decltype(batch.split.whole)::element_type>;
  using Acc = promoted_t<T>;
  std::vector<Acc> acc(batch.split.unit_size, Acc(0));
  with_weights<T>(factors, included, [&](const auto& w) { accumulate_batch(batch.split, w, included, acc.data()); });
  write_sum(sum, acc);
}

/// One plan per tensor (per-layer mode) or the same plan for every tensor (flat mode).
template <class PerExample, class Sums, class PlanOf>
void accumulate_all(PerExample& per_example, Sums& sums, PlanOf&& plan_of, const std::vector<unsigned char>& included) {
  for_each_member(per_example, [&](auto& g, std::size_t k) {
    for_each_member(sums, [&](auto& s, std::size_t j) {
      if (j == k) accumulate_one(g, s, plan_of(k).factors, included);
    });
  });
}

inline void check_per_example_options(const char* function, double max_norm, const options& opt) {
  check_clip_arguments(function, max_norm, opt);
  if (opt.norm != l2_norm)
    throw std::invalid_argument(std::string(function) + ": per-example clipping takes the L2 norm only");
}

}  // namespace detail

/// Each example's sum of squares over every per-example tensor (first index = example), as partial
/// norms that merge exactly: with ghost norms of other layers (add_ghost_norms), or across processes.
/// Robust numerics: overflow-free for every finite input, FP16 and BF16 norms within 16 * 2^-24.
///
///     std::vector<gradclip::partial_norm> parts = gradclip::per_example_partial_norms(std::tie(dw, db));
template <class PerExample>
std::vector<partial_norm> per_example_partial_norms(const PerExample& per_example) {
  const std::size_t examples = detail::common_batch_size("gradclip::per_example_partial_norms", per_example);
  std::vector<partial_norm> parts(examples);
  detail::for_each_member(per_example, [&](auto& g, std::size_t) {
    const auto batch = detail::batch_of(g);
    const std::vector<partial_norm> norms = detail::unit_norms(batch.split, examples);
    for (std::size_t i = 0; i < examples; ++i) parts[i].merge(norms[i]);
  });
  return parts;
}

namespace detail {

inline per_example_plan plan_examples(const char* function, const std::vector<partial_norm>& parts, double max_norm,
                                      const options& opt) {
  check_per_example_options(function, max_norm, opt);
  per_example_plan plan;
  plan.result.examples = parts.size();
  plan.factors.resize(parts.size());
  plan.included.assign(parts.size(), 1);
  plan.clipped.assign(parts.size(), 0);
  plan.finite.assign(parts.size(), 1);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const clip_plan p = plan_clip(function, parts[i], max_norm, opt);  // throws for `error`
    plan.factors[i] = p.coefficient;
    if (parts[i].finite) {
      plan.clipped[i] = p.result.clipped;
      plan.result.clipped += p.result.clipped ? 1 : 0;
      continue;
    }
    plan.finite[i] = 0;
    ++plan.result.nonfinite;
    plan.result.finite = false;
    if (opt.nonfinite == on_nonfinite::skip) plan.included[i] = 0;
  }
  return plan;
}

}  // namespace detail

/// Each example's factor from its norm n_i: f_i = max_norm / (n_i + epsilon) when n_i > max_norm, else 1,
/// formed as clip_by_norm forms its coefficient. A non-finite n_i follows opt.nonfinite: skip leaves the
/// example out of the sums and counts it, error throws nonfinite_error, propagate uses Opacus's
/// arithmetic (f_i = 0 for an infinite norm, NaN for a NaN one). Throws std::invalid_argument for a
/// negative or NaN max_norm, a bad epsilon, or a norm other than L2.
inline per_example_plan plan_per_example(const std::vector<partial_norm>& parts, double max_norm, options opt = {}) {
  return detail::plan_examples("gradclip::plan_per_example", parts, max_norm, opt);
}

/// sums[k] <- sum_i f_i * per_example[k][i, ...] over the examples the plan includes, accumulated in FP32
/// (FP64 for FP64 input) and rounded once to the sum's type. Shapes are checked before anything is written.
template <class PerExample, class Sums>
void accumulate_per_example(const PerExample& per_example, Sums&& sums, const per_example_plan& plan) {
  constexpr const char* function = "gradclip::accumulate_per_example";
  const std::size_t examples = detail::check_batch_and_sums(function, per_example, sums);
  if (plan.factors.size() != examples || plan.included.size() != examples)
    throw std::invalid_argument(std::string(function) + ": the plan has " + std::to_string(plan.factors.size()) +
                                " examples, the batch " + std::to_string(examples));
  detail::accumulate_all(
      per_example, sums, [&](std::size_t) -> const per_example_plan& { return plan; }, plan.included);
}

namespace detail {

template <class PerExample, class Sums>
per_example_result clip_per_example(const PerExample& per_example, Sums& sums, double max_norm, const options& opt,
                                    std::vector<double>* norms) {
  constexpr const char* function = "gradclip::clip_per_example";
  check_per_example_options(function, max_norm, opt);
  const std::size_t examples = check_batch_and_sums(function, per_example, sums);
  const std::vector<partial_norm> parts = per_example_partial_norms(per_example);
  const per_example_plan plan = plan_examples(function, parts, max_norm, opt);
  if (norms) {
    norms->resize(examples);
    for (std::size_t i = 0; i < examples; ++i) (*norms)[i] = parts[i].norm();
  }
  accumulate_all(
      per_example, sums, [&](std::size_t) -> const per_example_plan& { return plan; }, plan.included);
  return plan.result;
}

}  // namespace detail

/// DP-SGD's clip-and-accumulate (Opacus, flat clipping): n_i is example i's L2 norm over all tensors,
/// f_i = max_norm / (n_i + epsilon) when n_i > max_norm (else 1), and sums[k] <- sum_i f_i g_i[k].
///
/// `per_example` is a range (std::vector, std::array, ...) or a tuple (std::tie(dw, db)) of Eigen tensors,
/// tensor maps, matrices or maps whose first index is the example, in either storage order, all with the
/// same batch size B. `sums` is the matching range or tuple of outputs shaped like one example (dimensions
/// of 1 aside; with two or more dimensions above 1, the same storage order), of any element type: FP16
/// examples may sum into FP32 outputs. Sums accumulate in FP32 (FP64 for FP64 input), rounded once.
/// Norms use the robust numerics (no overflow in 16-bit). Non-finite examples follow opt.nonfinite (see
/// plan_per_example); with error nothing is written. Bad shapes or batch sizes, a bad max_norm or
/// epsilon, or a norm other than L2 throw std::invalid_argument before anything is written. opt.threads
/// is not used: the call runs on the caller's thread.
///
///     auto r = gradclip::clip_per_example(std::tie(dw, db), std::tie(sum_w, sum_b), 1.0);
///     // dw: Eigen::Tensor<Eigen::half, 3> [B, out, in]; sum_w: Eigen::Tensor<float, 2> [out, in]
template <class PerExample, class Sums>
per_example_result clip_per_example(const PerExample& per_example, Sums&& sums, double max_norm, options opt = {}) {
  return detail::clip_per_example(per_example, sums, max_norm, opt, nullptr);
}

/// The same, writing each example's norm n_i to `norms` (resized to B; written only when nothing throws):
/// what a bound controller or a log may want. +inf for an FP64 example whose norm exceeds double's range.
template <class PerExample, class Sums>
per_example_result clip_per_example(const PerExample& per_example, Sums&& sums, double max_norm, options opt,
                                    std::vector<double>& norms) {
  return detail::clip_per_example(per_example, sums, max_norm, opt, &norms);
}

/// Per-layer clipping (Opacus's per-layer mode): tensor k of each example is clipped on its own to
/// max_norms[k], so example i's whole gradient has norm at most sqrt(sum_k max_norms[k]^2): the
/// sensitivity an accountant is given. An example counts as clipped when any of its tensors is, and as
/// non-finite when any of its tensors is (skip then leaves the whole example out of every sum).
/// Otherwise as clip_per_example; max_norms.size() must be the number of tensors.
template <class PerExample, class Sums>
per_example_result clip_per_example_per_layer(const PerExample& per_example, Sums&& sums,
                                              const std::vector<double>& max_norms, options opt = {}) {
  constexpr const char* function = "gradclip::clip_per_example_per_layer";
  const std::size_t examples = detail::check_batch_and_sums(function, per_example, sums);
  const std::size_t layers = detail::member_count(per_example);
  if (max_norms.size() != layers)
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(max_norms.size()) + " max_norms for " +
                                std::to_string(layers) + " tensors");
  for (double c : max_norms) detail::check_per_example_options(function, c, opt);
  std::vector<per_example_plan> plans;
  detail::for_each_member(per_example, [&](auto& g, std::size_t k) {
    plans.push_back(detail::plan_examples(function, per_example_partial_norms(std::tie(g)), max_norms[k], opt));
  });
  per_example_result result;
  result.examples = examples;
  std::vector<unsigned char> included(examples, 1);
  for (std::size_t i = 0; i < examples; ++i) {
    bool clipped = false, finite = true;
    for (const auto& p : plans) {
      finite = finite && p.finite[i];
      clipped = clipped || p.clipped[i];
    }
    result.clipped += finite && clipped ? 1 : 0;
    result.nonfinite += finite ? 0 : 1;
    if (!finite && opt.nonfinite == on_nonfinite::skip) included[i] = 0;
  }
  result.finite = result.nonfinite == 0;
  detail::accumulate_all(
      per_example, sums, [&](std::size_t k) -> const per_example_plan& { return plans[k]; }, included);
  return result;
}

/// One bound for an example's whole gradient, shared equally by its K tensors: each is clipped to
/// total / sqrt(K), so the whole gradient still has norm at most `total`.
struct equal_split {
  double total;
};

/// Per-layer clipping with one bound split equally: clip_per_example_per_layer(g, sums, {C / sqrt(K), ...}).
/// For a split weighted by size, pass max_norms[k] = C * sqrt(d_k / d) to the overload above.
///
///     auto r = gradclip::clip_per_example_per_layer(std::tie(dw, db), std::tie(sw, sb), gradclip::equal_split{1.0});
template <class PerExample, class Sums>
per_example_result clip_per_example_per_layer(const PerExample& per_example, Sums&& sums, equal_split bound,
                                              options opt = {}) {
  const std::size_t layers = detail::member_count(per_example);
  const double share = layers == 0 ? bound.total : bound.total / std::sqrt(static_cast<double>(layers));
  return clip_per_example_per_layer(per_example, std::forward<Sums>(sums), std::vector<double>(layers, share), opt);
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
