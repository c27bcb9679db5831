// Per-example clipping for differentially private training (DP-SGD): each example's gradient clipped to
// norm C over all tensors (or per tensor), and the clipped gradients summed over the batch.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/dispatch.hpp>
#include <gradclip/detail/element.hpp>
#include <gradclip/detail/numerics.hpp>
#include <gradclip/detail/policy_traits.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/tensor_units.hpp>

#include <Eigen/Core>

#include <algorithm>
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

namespace detail {
struct plan_factors;
}  // namespace detail

/// Each example's factor f_i and whether it enters the sums; made from per-example norms, applied by
/// accumulate_per_example and ghost_weighted_sum.
struct per_example_plan {
  per_example_result result;
  std::vector<unsigned char> included;  ///< 0: a non-finite example left out of the sums (on_nonfinite::skip)
  std::vector<unsigned char> clipped;   ///< 1: a finite example whose norm exceeded the bound
  std::vector<unsigned char> finite;    ///< 0: an example whose norm was NaN or Inf

  /// f_i (0 where it underflows double; the sums use it unrounded, as mantissa and power of two).
  double coefficient(std::size_t i) const noexcept { return factors_[i].value(); }
  std::size_t size() const noexcept { return factors_.size(); }

 private:
  friend struct detail::plan_factors;
  std::vector<detail::scaled> factors_;
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

/// The batches of the per-example tensors, each built once: a vector for a range, a tuple for a tuple.
template <class PerExample>
auto batches_of(PerExample& per_example) {
  if constexpr (is_tuple_like<std::remove_cv_t<PerExample>>::value) {
    return std::apply([](auto&... m) { return std::make_tuple(batch_of(member_object(m))...); }, per_example);
  } else {
    using batch = decltype(batch_of(member_object(*std::begin(per_example))));
    std::vector<batch> batches;
    for (auto& m : per_example) batches.push_back(batch_of(member_object(m)));
    return batches;
  }
}

/// The batch size shared by every per-example tensor; throws when they disagree.
template <class Batches>
std::size_t common_batch_size(const char* function, const Batches& batches) {
  std::size_t examples = 0;
  for_each_member(batches, [&](const auto& batch, std::size_t k) {
    const std::size_t b = batch.examples();
    if (k == 0) examples = b;
    if (b != examples)
      throw std::invalid_argument(std::string(function) + ": per_example[" + std::to_string(k) + "] has batch size " +
                                  std::to_string(b) + ", per_example[0] has " + std::to_string(examples));
  });
  return examples;
}

/// Checks that there is one sum per tensor, each shaped to receive its tensor's sum over the batch.
template <class Batches, class Sums>
void check_sums(const char* function, const Batches& batches, Sums& sums) {
  const std::size_t count = member_count(batches);
  if (member_count(sums) != count)
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(count) + " per-example tensors but " +
                                std::to_string(member_count(sums)) + " sums");
  for_each_member(sums, [&](auto& sum, std::size_t k) {
    for_each_member(batches, [&](const auto& batch, std::size_t j) {
      if (j == k) check_sum_shape(function, k, batch, sum);
    });
  });
}

/// The examples of every per-example tensor as units: example i of each tensor is unit i (flat
/// clipping: one norm per example over all tensors) or, per layer, tensor k's example i is unit k B + i.
template <class Batches>
struct example_units {
  const Batches& batches;
  std::size_t examples;
  bool per_layer;

  std::size_t units() const noexcept { return per_layer ? examples * member_count(batches) : examples; }
  template <class F>
  void for_each_piece(F&& f) const {
    for_each_member(batches, [&](const auto& batch, std::size_t k) {
      batch.split.for_each_piece(per_layer ? k * examples : 0, k, f);
    });
  }
};

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

// Elements of the sum per job of the accumulation: a block of accumulators that stays in L1 cache while
// every example adds to it.
inline constexpr std::size_t sum_block = 4096;

/// acc[j] += sum_i f_i g_i[j] over the included examples of one batch, for j in [j0, j1), examples in
/// order: by the vector kernels where the weights are plain (column_dot when examples interleave,
/// add_scaled when each example's elements follow each other), element by element otherwise.
template <class Acc, class Weight, class T>
void accumulate_block(const unit_split<T>& split, const std::vector<Weight>& w,
                      const std::vector<unsigned char>& included, bool all_included, Acc* acc, std::size_t j0,
                      std::size_t j1) {
  constexpr bool plain = std::is_same_v<Weight, plain_weight<Acc>>;
  const std::size_t examples = split.units;
  if constexpr (plain) {
    if (split.interleaved()) {
      std::vector<Acc> factor(examples);
      for (std::size_t i = 0; i < examples; ++i) factor[i] = w[i].value;
      const T* base = split.whole.data + static_cast<std::ptrdiff_t>(j0) * split.element_stride;
      with_isa(column_dot_isa(), [&](auto k) {
        if (all_included)
          decltype(k)::template column_dot<Acc, false>(base, examples, j1 - j0, split.element_stride, factor.data(),
                                                       included.data(), acc + j0);
        else
          decltype(k)::template column_dot<Acc, true>(base, examples, j1 - j0, split.element_stride, factor.data(),
                                                      included.data(), acc + j0);
      });
      return;
    }
    if (split.element_stride == 1 || split.unit_size == 1) {
      std::vector<const T*> rows;
      std::vector<Acc> factor;
      for (std::size_t i = 0; i < examples; ++i) {
        if (!included[i]) continue;
        rows.push_back(split.unit(i).data + j0);
        factor.push_back(w[i].value);
      }
      with_isa(best_isa(),
               [&](auto k) { decltype(k)::add_scaled(acc + j0, rows.data(), factor.data(), rows.size(), j1 - j0); });
      return;
    }
  }
  // Element by element, in the vector kernels' order: lanes over the examples when they interleave, else
  // each example's products added in turn.
  if (split.interleaved()) {
    constexpr std::size_t L = lanes<Acc>;
    for (std::size_t j = j0; j < j1; ++j) {
      const T* column = split.whole.data + static_cast<std::ptrdiff_t>(j) * split.element_stride;
      Acc lane[L];
      std::fill(lane, lane + L, Acc(-0.0));  // column_dot's start: -0, the identity of addition
      for (std::size_t i = 0; i < examples; ++i)
        if (included[i]) {
          const Acc product = static_cast<Acc>(w[i](column[static_cast<std::ptrdiff_t>(i)]));
          lane[i % L] += product;
        }
      acc[j] += sum_lanes(lane);
    }
    return;
  }
  for (std::size_t i = 0; i < examples; ++i) {
    if (!included[i]) continue;
    const strided_view<T> unit = split.unit(i);
    for (std::size_t j = j0; j < j1; ++j) {
      const Acc product = static_cast<Acc>(w[i](unit.data[static_cast<std::ptrdiff_t>(j) * unit.inner_stride]));
      acc[j] += product;
    }
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

/// sum <- sum_i f_i g_i over one per-example tensor, accumulated in FP32 (FP64 for FP64 input), in blocks
/// of the sum on up to options::threads threads: each element's terms are added in example order, so
/// the sum's bits do not depend on the thread count.
template <class T, class S>
void accumulate_one(const example_batch<T>& batch, S& sum, const std::vector<scaled>& factors,
                    const std::vector<unsigned char>& included, const options& opt) {
  using element = std::remove_const_t<T>;
  using Acc = promoted_t<element>;
  const unit_split<T>& split = batch.split;
  std::vector<Acc> acc(split.unit_size, Acc(0));
  bool all_included = true;
  for (unsigned char keep : included) all_included = all_included && keep;
  with_weights<element>(factors, included, [&](const auto& w) {
    const std::size_t blocks = (split.unit_size + sum_block - 1) / sum_block;
    const std::size_t bytes = split.whole.size() * sizeof(T);
    const unsigned threads = static_cast<unsigned>(std::min<std::size_t>(
        {std::max(1u, opt.threads), blocks, std::max<std::size_t>(1, bytes / parallel_grain_bytes)}));
    const auto block_range = [&](std::size_t b0, std::size_t b1) {
      for (std::size_t b = b0; b < b1; ++b)
        accumulate_block(split, w, included, all_included, acc.data(), b * sum_block,
                         std::min(split.unit_size, (b + 1) * sum_block));
    };
    if (threads <= 1 || split.units == 0) return block_range(0, blocks);
    run_jobs(opt.pool, threads, [&](unsigned k) { block_range(blocks * k / threads, blocks * (k + 1) / threads); });
  });
  write_sum(sum, acc);
}

/// The factors of a plan, which stay internal: mantissa and power of two.
struct plan_factors {
  static std::vector<scaled>& of(per_example_plan& plan) noexcept { return plan.factors_; }
  static const std::vector<scaled>& of(const per_example_plan& plan) noexcept { return plan.factors_; }
};

/// Each tensor's sum over the examples: tensor k with the factors of units k B + i (per layer) or i.
template <class Batches, class Sums>
void accumulate_all(const Batches& batches, Sums& sums, const std::vector<scaled>& factors, bool per_layer,
                    const std::vector<unsigned char>& included, const options& opt) {
  const std::size_t examples = included.size();
  for_each_member(sums, [&](auto& sum, std::size_t k) {
    for_each_member(batches, [&](const auto& batch, std::size_t j) {
      if (j != k) return;
      if (!per_layer) return accumulate_one(batch, sum, factors, included, opt);
      const auto first = factors.begin() + static_cast<std::ptrdiff_t>(k * examples);
      accumulate_one(batch, sum, std::vector<scaled>(first, first + static_cast<std::ptrdiff_t>(examples)), included,
                     opt);
    });
  });
}

inline void check_per_example_options(const char* function, const options& opt) {
  check_options(function, opt);
  if (opt.norm != l2_norm)
    throw std::invalid_argument(std::string(function) + ": per-example clipping takes the L2 norm only");
}

/// Turns the units' plans into the per-example plan: example i's factors (one per unit), whether it
/// enters the sums (skip leaves out an example any of whose units is not finite), and the counts.
template <class Plans>
per_example_plan per_example_plan_of(const Plans& plans, std::size_t examples, const options& opt) {
  per_example_plan plan;
  plan.result.examples = examples;
  plan.included.assign(examples, 1);
  plan.clipped.assign(examples, 0);
  plan.finite.assign(examples, 1);
  std::vector<scaled>& factors = plan_factors::of(plan);
  factors.reserve(plans.size());
  for (std::size_t u = 0; u < plans.size(); ++u) {
    const clip_result& r = plans[u].result;
    factors.push_back(plans[u].coefficient);
    const std::size_t i = examples == 0 ? 0 : u % examples;
    plan.finite[i] = plan.finite[i] && r.finite;
    plan.clipped[i] = plan.clipped[i] || (r.finite && r.clipped);
  }
  for (std::size_t i = 0; i < examples; ++i) {
    if (!plan.finite[i]) {
      plan.clipped[i] = 0;
      ++plan.result.nonfinite;
      if (opt.nonfinite == on_nonfinite::skip) plan.included[i] = 0;
    }
    plan.result.clipped += plan.clipped[i];
  }
  plan.result.finite = plan.result.nonfinite == 0;
  return plan;
}

/// The whole of per-example clipping: check, norms, plans (one threshold per layer, `max_norms[k]`, or
/// one for all), then the weighted sums; `norms` receives each unit's norm when given.
template <class PerExample, class Sums>
per_example_result clip_examples(const char* function, const PerExample& per_example, Sums& sums,
                                 const std::vector<double>& max_norms, bool per_layer, const options& opt,
                                 std::vector<double>* norms) {
  check_per_example_options(function, opt);
  const auto batches = batches_of(per_example);
  const std::size_t examples = common_batch_size(function, batches);
  check_sums(function, batches, sums);
  const std::size_t layers = member_count(batches);
  if (per_layer && max_norms.size() != layers)
    throw std::invalid_argument(std::string(function) + ": " + std::to_string(max_norms.size()) + " max_norms for " +
                                std::to_string(layers) + " tensors");
  const example_units<decltype(batches)> layout{batches, examples, per_layer};
  std::vector<double> thresholds(layout.units());
  for (std::size_t u = 0; u < thresholds.size(); ++u) thresholds[u] = max_norms[per_layer ? u / examples : 0];
  const auto where = [&](std::size_t u) {
    const std::string example = "example " + std::to_string(u % examples);
    return per_layer ? "per_example[" + std::to_string(u / examples) + "] " + example : example;
  };
  const unit_thresholds<decltype(where)> source{thresholds.data(), thresholds.size(), where};
  std::vector<partial_norm> parts;
  per_example_plan plan;
  run_units(
      function, layout, source, opt,
      [&] {
        auto reduced = reduce_units<robust>(layout, opt);
        if (norms) {
          norms->resize(reduced.size());
          for (std::size_t u = 0; u < reduced.size(); ++u) (*norms)[u] = reduced[u].norm();
        }
        return reduced;
      },
      [&](const auto& plans) {
        plan = per_example_plan_of(plans, examples, opt);
        accumulate_all(batches, sums, plan_factors::of(plan), per_layer, plan.included, opt);
      });
  return plan.result;
}

}  // namespace detail

/// Each example's sum of squares over every per-example tensor (first index = example), as partial
/// norms that merge exactly: with ghost norms of other layers (add_ghost_norms), or across processes.
/// Robust numerics: overflow-free for every finite input, FP16 and BF16 norms within 16 * 2^-24; on up
/// to opt.threads threads, with the same bits for any count.
///
///     std::vector<gradclip::partial_norm> parts = gradclip::per_example_partial_norms(std::tie(dw, db));
template <class PerExample>
std::vector<partial_norm> per_example_partial_norms(const PerExample& per_example, const options& opt = {}) {
  constexpr const char* function = "gradclip::per_example_partial_norms";
  detail::check_per_example_options(function, opt);
  const auto batches = detail::batches_of(per_example);
  const std::size_t examples = detail::common_batch_size(function, batches);
  const detail::example_units<decltype(batches)> layout{batches, examples, false};
  auto parts = detail::reduce_units<robust>(layout, opt);
  std::vector<partial_norm> result(parts.size());
  for (std::size_t i = 0; i < parts.size(); ++i) result[i] = parts[i];
  return result;
}

/// Each example's factor from its norm n_i: f_i = max_norm / (n_i + epsilon) when n_i > max_norm, else 1,
/// formed as clip_by_norm forms its coefficient. A non-finite n_i follows opt.nonfinite: skip leaves the
/// example out of the sums and counts it, error throws nonfinite_error, propagate uses Opacus's
/// arithmetic (f_i = 0 for an infinite norm, NaN for a NaN one). Throws std::invalid_argument for a
/// negative or NaN max_norm, a bad epsilon, or a norm other than L2.
inline per_example_plan plan_per_example(const std::vector<partial_norm>& parts, double max_norm, options opt = {}) {
  constexpr const char* function = "gradclip::plan_per_example";
  detail::check_per_example_options(function, opt);
  const detail::fixed_threshold source{max_norm};
  source.check(function);
  return detail::per_example_plan_of(detail::decide_units<false>(function, parts.size(), parts, source, opt),
                                     parts.size(), opt);
}

/// sums[k] <- sum_i f_i * per_example[k][i, ...] over the examples the plan includes, accumulated in FP32
/// (FP64 for FP64 input) and rounded once to the sum's type. Shapes are checked before anything is written.
template <class PerExample, class Sums>
void accumulate_per_example(const PerExample& per_example, Sums&& sums, const per_example_plan& plan,
                            const options& opt = {}) {
  constexpr const char* function = "gradclip::accumulate_per_example";
  const auto batches = detail::batches_of(per_example);
  const std::size_t examples = detail::common_batch_size(function, batches);
  detail::check_sums(function, batches, sums);
  if (plan.size() != examples || plan.included.size() != examples)
    throw std::invalid_argument(std::string(function) + ": the plan has " + std::to_string(plan.size()) +
                                " examples, the batch " + std::to_string(examples));
  detail::accumulate_all(batches, sums, detail::plan_factors::of(plan), false, plan.included, opt);
}

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
/// epsilon, or a norm other than L2 throw std::invalid_argument before anything is written. Both passes
/// (norms, then sums) run on up to opt.threads threads, with the same bits for any count.
///
///     auto r = gradclip::clip_per_example(std::tie(dw, db), std::tie(sum_w, sum_b), 1.0);
///     // dw: Eigen::Tensor<Eigen::half, 3> [B, out, in]; sum_w: Eigen::Tensor<float, 2> [out, in]
template <class PerExample, class Sums>
per_example_result clip_per_example(const PerExample& per_example, Sums&& sums, double max_norm, options opt = {}) {
  return detail::clip_examples("gradclip::clip_per_example", per_example, sums, {max_norm}, false, opt, nullptr);
}

/// The same, writing each example's norm n_i to `norms` (resized to B; written only when nothing throws):
/// what a bound controller or a log may want. +inf for an FP64 example whose norm exceeds double's range.
template <class PerExample, class Sums>
per_example_result clip_per_example(const PerExample& per_example, Sums&& sums, double max_norm, options opt,
                                    std::vector<double>& norms) {
  std::vector<double> computed;
  const per_example_result r =
      detail::clip_examples("gradclip::clip_per_example", per_example, sums, {max_norm}, false, opt, &computed);
  norms.swap(computed);
  return r;
}

/// Per-layer clipping (Opacus's per-layer mode): tensor k of each example is clipped on its own to
/// max_norms[k], so example i's whole gradient has norm at most sqrt(sum_k max_norms[k]^2): the
/// sensitivity an accountant is given. An example counts as clipped when any of its tensors is, and as
/// non-finite when any of its tensors is (skip then leaves the whole example out of every sum).
/// Otherwise as clip_per_example; max_norms.size() must be the number of tensors.
template <class PerExample, class Sums>
per_example_result clip_per_example_per_layer(const PerExample& per_example, Sums&& sums,
                                              const std::vector<double>& max_norms, options opt = {}) {
  return detail::clip_examples("gradclip::clip_per_example_per_layer", per_example, sums, max_norms, true, opt,
                               nullptr);
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
