// The pipeline every norm and clipping call is a front-end of, over K units: a call's elements cut into a
// fixed sequence of pieces, each belonging to one unit (a gradient, a group, a slice of a tensor, an
// example) or to a block of interleaved units; each piece reduced to partial norms (on up to
// options::threads threads); the parts merged per unit in piece order; a threshold per unit from the
// call's source; one plan rule that turns norm and threshold into a coefficient; then one write step.
// The pieces depend on the gradients alone, so every norm, coefficient and written bit is the same for
// any thread count and any scheduling. The global norm is its K = 1 case, and allocates nothing on one
// thread. Internal (namespace detail): the public calls are in norm.hpp, clip.hpp and the feature headers.
#pragma once

#include <gradclip/detail/census.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/dispatch.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/detail/policy_traits.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/detail/scale.hpp>
#include <gradclip/detail/scaled.hpp>
#include <gradclip/detail/scratch.hpp>
#include <gradclip/detail/strided_view.hpp>
#include <gradclip/detail/thread_pool.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/report.hpp>
#if defined(GRADCLIP_COMPILED)
#include <gradclip/compiled_clip.hpp>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <exception>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
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

inline void check_options(const char* function, const options& opt) {
  const double p = opt.norm.p();
  if (!norm_kind{p}.accepted())
    throw std::invalid_argument(std::string(function) +
                                ": options::norm must be in (0, 1000], inf or a named kind, not " + std::to_string(p));
  if (!(opt.epsilon >= 0) || !std::isfinite(opt.epsilon))
    throw std::invalid_argument(std::string(function) + ": options::epsilon must be finite and >= 0");
  if (opt.nonfinite != on_nonfinite::skip && opt.nonfinite != on_nonfinite::error &&
      opt.nonfinite != on_nonfinite::propagate)
    throw std::invalid_argument(std::string(function) + ": options::nonfinite is not an on_nonfinite value");
}

template <class Grads>
void check_group() {
  static_assert(is_gradient_range_v<Grads>,
                "A group of gradients is a range (a std::vector, std::array, ...) whose elements are gradients.");
}

// ---- Units and pieces ----

/// One piece of a call's elements. `interleaved` false: the view's elements all belong to unit `unit`.
/// `interleaved` true: the view's segments are columns and its inner index is the unit, so element c of
/// unit `unit + u` is view.data[c * outer_stride + u] (u < inner_size, c < outer_size). `tensor` is the
/// gradient of the call it comes from (per-tensor reports).
template <class T>
struct piece {
  strided_view<T> view;
  std::size_t unit = 0;
  std::size_t tensor = 0;
  bool interleaved = false;

  std::size_t units() const noexcept { return interleaved ? view.inner_size : 1; }
  std::size_t bytes() const noexcept { return view.size() * sizeof(T); }
  /// Calls f(*this), as erased_piece::visit does: a piece in the threads' lists (threads_piece).
  template <class F>
  decltype(auto) visit(F&& f) const {
    return f(*this);
  }
};

/// A piece with its element type erased, for the threads' lists.
template <bool Const>
class erased_piece : erased_view {
 public:
  template <class T>
  explicit erased_piece(const piece<T>& p) noexcept
      : erased_view(p.view), unit_(p.unit), tensor_(p.tensor), interleaved_(p.interleaved) {}

  /// Calls f(piece<T>) with the element type restored (const when Const).
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_as<Const>([&](const auto& view) {
      using T = typename std::decay_t<decltype(view)>::element_type;
      return f(piece<T>{view, unit_, tensor_, interleaved_});
    });
  }
  std::size_t bytes() const noexcept {
    return visit([](const auto& p) { return p.bytes(); });
  }

 private:
  std::size_t unit_, tensor_;
  bool interleaved_;
};

/// Calls f(piece<T>) for every piece of a contiguous-or-strided gradient that is all one unit: contiguous
/// gradients cut every piece_elements elements, other gradients whole.
template <class T, class F>
[[gnu::always_inline]] inline void cut_into_pieces(const strided_view<T>& view, std::size_t unit, std::size_t tensor,
                                                   F&& f) {
  if (view.outer_size != 1 || view.inner_stride != 1) return f(piece<T>{view, unit, tensor, false});
  for (std::size_t start = 0; start < view.inner_size; start += piece_elements)
    f(piece<T>{{view.data + start, std::min(piece_elements, view.inner_size - start)}, unit, tensor, false});
}

/// Columns per piece of interleaved units, at least: each piece adds a part to every unit, and merging
/// those once per 1024 of a unit's elements costs little (AGC's rows of a 4096 x 4096 matrix spent a tenth
/// of their time merging parts every 256 columns).
inline constexpr std::size_t piece_columns = 1024;

/// Calls f(piece<T>) for blocks of about piece_elements elements (and at least piece_columns columns) of
/// `units` interleaved units whose element c lies at base[c * stride + u]: column ranges.
template <class T, class F>
void cut_columns(T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride, std::size_t first_unit,
                 std::size_t tensor, F&& f) {
  if (units == 0) return;
  const std::size_t per_piece = std::max(piece_columns, piece_elements / units);
  for (std::size_t c = 0; c < columns; c += per_piece)
    f(piece<T>{{base + static_cast<std::ptrdiff_t>(c) * stride, units, 1, std::min(per_piece, columns - c), stride},
               first_unit,
               tensor,
               true});
}

/// The units of a range of gradients: all of them one unit (`whole_group`, the global norm), or each its
/// own (`per_gradient`).
template <class Grads, bool PerGradient>
struct gradient_units {
  Grads& grads;

  static constexpr bool single_unit = !PerGradient;
  std::size_t units() const {
    if constexpr (PerGradient)
      return tensor_count();
    else
      return 1;
  }
  std::size_t tensor_count() const {
    return static_cast<std::size_t>(std::distance(std::begin(grads), std::end(grads)));
  }
  template <class F>
  void for_each_piece(F&& f) const {
    std::size_t k = 0;
    for (auto& g : grads) {
      visit_gradient(
          g, [&](const auto& view) GRADCLIP_INLINE_LAMBDA { cut_into_pieces(view, PerGradient ? k : 0, k, f); });
      ++k;
    }
  }
};

/// Whether a layout's pieces may interleave units: not a range of gradients' (each piece is one unit), so
/// calls on gradients instantiate no column kernels (issue 26).
template <class Layout>
struct interleaves : std::true_type {};
template <class Grads, bool PerGradient>
struct interleaves<gradient_units<Grads, PerGradient>> : std::false_type {};

template <class Grads>
using whole_group = gradient_units<Grads, false>;
template <class Grads>
using per_gradient = gradient_units<Grads, true>;

/// One gradient as a group of one, without copying it.
template <class G>
struct single {
  G* gradient;
  G* begin() const noexcept { return gradient; }
  G* end() const noexcept { return gradient + 1; }
};

// ---- Threads ----

/// The view visit_gradient gives for a gradient type, or void where it is known at run time only
/// (grad_view, pointers and references to gradients).
struct view_of {
  template <class View>
  View operator()(const View& view) const noexcept {
    return view;
  }
};
template <class G, class = void>
struct fixed_view {
  using type = void;
};
template <class G>
struct fixed_view<G, std::enable_if_t<!view_traits<G>::erased && !view_traits<G>::indirect>> {
  using type = decltype(visit_gradient(std::declval<G&>(), view_of{}));
};
/// Calls f(group) with gradient g as a group of one, without copying it. A gradient whose view type is
/// known at compile time (Eigen objects, tensors, containers, raw buffers) goes in as its view, so that
/// every such type of one element type shares one instantiation of the pipeline: a unit that clips a
/// matrix, a vector and a tensor of floats compiles the pipeline once, not three times (issue 26).
template <class G, class F>
decltype(auto) with_single(G& g, F&& f) {
  if constexpr (std::is_void_v<typename fixed_view<G>::type>) {
    single<G> one{&g};
    return f(one);
  } else {
    auto view = visit_gradient(g, view_of{});
    single<decltype(view)> one{&view};
    return f(one);
  }
}

template <class View, bool Const>
struct piece_for {
  using type = piece<typename View::element_type>;
};
template <bool Const>
struct piece_for<void, Const> {
  using type = erased_piece<Const>;
};

/// The pieces the threads take: typed where the layout's gradients fix the element type, so that a call
/// instantiates its work for that type only; erased_piece, whose visit reaches all four types, otherwise.
/// (Typing them halved the compile time of a call on one FP32 and one FP16 vector: issue 26.)
template <class Layout, bool Const>
struct threads_piece {
  using type = erased_piece<Const>;
};
template <class Grads, bool PerGradient, bool Const>
struct threads_piece<gradient_units<Grads, PerGradient>, Const> {
  using gradient = std::remove_reference_t<decltype(*std::begin(std::declval<Grads&>()))>;
  using type = typename piece_for<typename fixed_view<gradient>::type, Const>::type;
};

/// The pieces of a layout for the threads, and how many threads they are worth (at most `wanted`); no
/// pieces when one thread does.
template <bool Const, class Layout>
std::vector<typename threads_piece<Layout, Const>::type> pieces_for_threads(const Layout& layout, unsigned wanted,
                                                                            unsigned& used) {
  used = 1;
  std::vector<typename threads_piece<Layout, Const>::type> pieces;
  if (wanted <= 1) return pieces;
  std::size_t bytes = 0, count = 0;
  layout.for_each_piece([&](const auto& p) {
    bytes += p.bytes();
    ++count;
  });
  used = static_cast<unsigned>(
      std::min<std::size_t>({wanted, count, std::max<std::size_t>(1, bytes / parallel_grain_bytes)}));
  if (used <= 1) return pieces;
  pieces.reserve(count);
  layout.for_each_piece([&](const auto& p) { pieces.emplace_back(p); });
  return pieces;
}

/// Runs job(k) for every k in [0, count) on `pool` (options::pool), or on gradclip's own pool when it is
/// null, and returns when all have run. Each job runs exactly once whatever the executor does: every call
/// it makes of its job runs one job not yet started (or nothing), and the caller then runs the jobs it
/// left and waits for those it started. Only then is the executor's exception, else a job's, rethrown.
inline void run_jobs(const executor* pool, unsigned count, const std::function<void(unsigned)>& job) {
  if (pool == nullptr || count <= 1) return thread_pool::shared().run(count, job);
  const auto jobs = std::make_shared<job_set>(count, job);
  std::exception_ptr failure;
  try {
    pool->run(count, [jobs](unsigned) { jobs->run_one(); });
  } catch (...) {
    failure = std::current_exception();
  }
  jobs->finish(failure);
}

/// Runs task(i) for every piece on `threads` threads, each taking a run of consecutive pieces of about
/// equal bytes.
template <class Piece, class Task>
void run_pieces(const std::vector<Piece>& pieces, unsigned threads, const executor* pool, Task&& task) {
  std::size_t total = 0;
  for (const auto& p : pieces) total += p.bytes();
  std::vector<std::size_t> bounds{0};
  std::size_t done = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    done += pieces[i].bytes();
    if (bounds.size() < threads && done * threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  while (bounds.size() <= threads) bounds.push_back(pieces.size());
  const std::function<void(unsigned)> job = [&](unsigned k) {
    for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) task(i);
  };
  run_jobs(pool, threads, job);
}

// ---- Reduction ----

/// The parts of K units: one inline for the single-unit layouts (no allocation), a vector otherwise.
template <bool Single>
class unit_parts {
 public:
  explicit unit_parts(std::size_t units, double order) : parts_(units, partial_norm{0, 0.0, true, order}) {}
  partial_norm& operator[](std::size_t u) noexcept { return parts_[u]; }
  const partial_norm& operator[](std::size_t u) const noexcept { return parts_[u]; }
  std::size_t size() const noexcept { return parts_.size(); }

 private:
  scratch_vector<partial_norm> parts_;
};
template <>
class unit_parts<true> {
 public:
  explicit unit_parts(std::size_t, double order) noexcept : part_{0, 0.0, true, order} {}
  explicit unit_parts(const partial_norm& part) noexcept : part_(part) {}
  partial_norm& operator[](std::size_t) noexcept { return part_; }
  const partial_norm& operator[](std::size_t) const noexcept { return part_; }
  std::size_t size() const noexcept { return 1; }

 private:
  partial_norm part_;
};

template <class Layout, class = void>
struct is_single_unit : std::false_type {};
template <class Layout>
struct is_single_unit<Layout, std::enable_if_t<Layout::single_unit>> : std::true_type {};

/// The partial norm of a piece that is one unit and not one contiguous run.
template <class Policy, class T, class Observe>
partial_norm reduce_runs(const strided_view<T>& view, double order, Observe&& observe) {
  partial_norm part{0, 0.0, true, order};
  view.for_each_run([&](const auto* p, std::size_t n) { part.merge(reduce_run<Policy>(p, n, order, observe)); });
  return part;
}

/// The partial norm of a piece that is one unit. Always inlined, as reduce_run is: a short contiguous
/// gradient is summed in the caller's loop.
template <class Policy, class T, class Observe = no_observer>
[[gnu::always_inline]] inline partial_norm reduce_view(const strided_view<T>& view, double order,
                                                       Observe&& observe = {}) {
  if (view.outer_size == 1 && view.inner_stride == 1)
    return reduce_run<Policy>(view.data, view.inner_size, order, observe);
  return reduce_runs<Policy>(view, order, observe);
}

/// The robust L2 parts of the interleaved units of a piece, out[u] for u < piece.units(): each unit summed
/// over the piece's columns in one sweep, and a unit whose sum is not accurate unscaled (BF16 squares that
/// over- or underflow FP32, FP64 units outside the compensated kernel's range, NaN, Inf) rescanned on its
/// own by the contiguous kernels. Other norms and policies reduce each unit on its own.
template <class Policy, class T>
void reduce_columns(const piece<T>& p, double order, partial_norm* out) {
  using element = std::remove_const_t<T>;
  const std::size_t units = p.view.inner_size, columns = p.view.outer_size;
  const std::ptrdiff_t stride = p.view.outer_stride;
  const auto unit_view = [&](std::size_t u) {
    return strided_view<T>{p.view.data + static_cast<std::ptrdiff_t>(u), columns, stride};
  };
  if (norm_kind{order}.kernel() != run_kernel::sum_of_squares || !std::is_same_v<Policy, robust>) {
    for (std::size_t u = 0; u < units; ++u) out[u] = reduce_view<Policy>(unit_view(u), order);
    return;
  }
  with_isa(best_isa(), [&](auto k) {
    using K = decltype(k);
    if constexpr (std::is_same_v<element, double>) {
      scratch_vector<double> sum(units), compensation(units), top(units);
      K::column_squares_compensated(p.view.data, units, columns, stride, sum.data(), compensation.data(), top.data());
      const double lo = std::ldexp(1.0, -safe_exponent_range<double> - 1);
      const double hi = std::ldexp(1.0, safe_exponent_range<double>);
      for (std::size_t u = 0; u < units; ++u) {
        if (top[u] != 0 && !(top[u] >= lo && top[u] < hi)) {
          out[u] = reduce_view<Policy>(unit_view(u), order);
          continue;
        }
        const double hi_sum = sum[u] + compensation[u];
        out[u] = {0, hi_sum, true, order, compensation[u] - (hi_sum - sum[u]), columns};
        if (!std::isfinite(hi_sum)) out[u] = reduce_view<Policy>(unit_view(u), order);
      }
    } else {
      using Acc = robust_t<element>;
      scratch_vector<double> sums(units);
      K::template column_squares<Acc>(p.view.data, units, columns, stride, sums.data());
      const double min_sum = fits_without_scaling<element, Acc> ? 0.0 : std::ldexp(1.0, -2 * safe_exponent_range<Acc>);
      for (std::size_t u = 0; u < units; ++u) {
        const bool accurate = fits_without_scaling<element, Acc>
                                  ? std::isfinite(sums[u])
                                  : sums[u] >= min_sum && sums[u] <= std::numeric_limits<double>::max();
        out[u] =
            accurate ? partial_norm{0, sums[u], true, order, 0.0, columns} : reduce_view<Policy>(unit_view(u), order);
      }
    }
  });
}

/// Merges the parts of one piece into the units' parts, and into its tensor's part when `tensors` is given.
/// Always inlined: a loop over many small pieces keeps its parts' common merges inline (partial_norm::merge).
template <class Parts>
[[gnu::always_inline]] inline void merge_piece(Parts& parts, std::vector<partial_norm>* tensors, std::size_t first,
                                               std::size_t tensor, const partial_norm* piece_parts, std::size_t count,
                                               double order) {
  for (std::size_t u = 0; u < count; ++u) parts[first + u].merge(piece_parts[u]);
  if (!tensors) return;
  if (tensors->size() <= tensor) tensors->resize(tensor + 1, partial_norm{0, 0.0, true, order});
  for (std::size_t u = 0; u < count; ++u) (*tensors)[tensor].merge(piece_parts[u]);
}

/// Whether a layout's pieces are whole gradients or slices of them, counted by tensor_count() in the order
/// of options::report (layouts of other units get no report).
template <class Layout, class = void>
struct reports_tensors : std::false_type {};
template <class Layout>
struct reports_tensors<Layout, std::void_t<decltype(std::declval<const Layout&>().tensor_count())>> : std::true_type {};

/// Writes a call's staged report in piece order, which is gradient order: each piece's parts and census
/// complete its gradient's entry as they come, so that a gradient of one piece (every small one) is
/// written once, with no pass over the entries beforehand or afterwards; a gradient without pieces gets an
/// empty entry. Inlined into the reduction's loop; the parts are stored only where they are read again
/// (a gradient cut into pieces, the loss scaler's unscale), so that a report of many small gradients
/// costs little more than their census and their entries' stores.
class report_writer {
 public:
  report_writer(tensor_report& report, std::size_t tensors, double order)
      : stats_(report_staging::stats(report)), kind_(order), order_(order), last_{0, 0.0, true, order} {
    report_staging::stage(report, tensors);
    parts_ = report_staging::parts(report);
  }
  /// Adds a piece of gradient k (k never decreases): its parts, of the call's kind, and its census.
  [[gnu::always_inline]] void add(std::size_t k, const partial_norm* piece_parts, std::size_t count,
                                  const census& counts) noexcept {
    if (k + 1 == written_) return add_to_last(piece_parts, count, counts);
    while (written_ < k) write(written_++, {0, 0.0, true, order_}, {});
    partial_norm part = first_part(piece_parts, count);
    write(written_++, part, counts);
    if (counts.size == piece_elements) keep(last_, part);  // a whole piece: more of its gradient may follow
  }
  /// Whether add_normal() may write this call's entries: its kind sums squares, and it keeps no parts.
  bool writes_normal() const noexcept { return kind_.kernel() == run_kernel::sum_of_squares && !parts_; }
  /// Whether gradient k's first piece comes next, after every gradient before it.
  bool next_is(std::size_t k) const noexcept { return k == written_; }
  /// Adds the gradient next_is() named, read whole as one part of an unscaled sum of squares, all of its
  /// elements finite normal numbers (so the sum is finite and positive), `top` the largest magnitude: add()
  /// without its checks, for the reduction's loop over small gradients, where writes_normal().
  [[gnu::always_inline]] void add_normal(const partial_norm& part, double top) noexcept {
    stats_[written_++] = {kind_.root_value(part.sum, part.low, part.exponent, part.elements), top, part.elements};
  }
  /// Writes the empty entries of the gradients after the last piece.
  void finish() noexcept {
    while (written_ < stats_.size()) write(written_++, {0, 0.0, true, order_}, {});
  }

 private:
  [[gnu::always_inline]] void write(std::size_t k, const partial_norm& part, const census& counts) noexcept {
    tensor_stats& t = stats_[k];
    // part.norm(), with the kind's decisions taken once for the call
    t.norm = part.finite && part.sum > 0.0 ? kind_.root_value(part.sum, part.low, part.exponent, part.elements)
                                           : norm_of(part);
    t.max_abs = counts.nan ? std::numeric_limits<double>::quiet_NaN() : counts.max_abs;
    t.size = counts.size, t.nan = counts.nan, t.inf = counts.inf;
    t.zeros = counts.zeros, t.subnormals = counts.subnormals;
    if (parts_) keep((*parts_)[k], part);
  }
  /// out = part, field by field: a copy of the whole part is assembled on the stack from registers and read
  /// back wide, which stalls on the narrow stores (store forwarding) once per gradient.
  [[gnu::always_inline]] static void keep(partial_norm& out, const partial_norm& part) noexcept {
    out.exponent = part.exponent, out.sum = part.sum, out.finite = part.finite, out.p = part.p;
    out.low = part.low, out.elements = part.elements;
  }
  /// The parts of a gradient's first piece merged into an empty part. One finite part of an additive kind
  /// at scale 0 (every small gradient's) is copied: merging it would give its sum and elements, and its
  /// low plus zero, with no need for merge's scale and kind checks.
  [[gnu::always_inline]] partial_norm first_part(const partial_norm* piece_parts, std::size_t count) const noexcept {
    if (count == 1 && !kind_.merges_by_maximum() && piece_parts->finite && piece_parts->exponent == 0 &&
        piece_parts->p == order_) {
      partial_norm part = *piece_parts;
      part.low = 0.0 + part.low;
      return part;
    }
    partial_norm part{0, 0.0, true, order_};
    for (std::size_t u = 0; u < count; ++u) part.merge(piece_parts[u]);
    return part;
  }
  /// part.norm() on a copy, not inlined: the part written stays in registers.
  [[gnu::noinline]] static double norm_of(partial_norm part) noexcept { return part.norm(); }
  /// Another piece of the gradient written last (one of more than piece_elements elements): its entry
  /// rewritten from the parts and census so far.
  void add_to_last(const partial_norm* piece_parts, std::size_t count, const census& counts) noexcept {
    const std::size_t k = written_ - 1;
    const tensor_stats& t = stats_[k];
    census total{t.size, t.nan, t.inf, t.zeros, t.subnormals, t.max_abs};  // a NaN max_abs stays: nan > 0
    total.merge(counts);
    partial_norm part = last_;
    for (std::size_t u = 0; u < count; ++u) part.merge(piece_parts[u]);
    write(k, part, total);
    keep(last_, part);
  }

  std::vector<tensor_stats>& stats_;
  std::vector<partial_norm>* parts_ = nullptr;  // each gradient's part, when the report keeps them
  norm_kind kind_;
  double order_;
  partial_norm last_;  // the part of gradient written_ - 1, when its last piece was a whole one
  std::size_t written_ = 0;
};

/// Reduces piece p to the parts of its units, counting its elements into `counts` when reporting (in the
/// same pass as the norm where it can: reduce_run), and hands them to sink(parts, count). Always inlined,
/// as reduce_view is. Interleaves false (a layout of gradients): no piece interleaves, and no column kernel
/// is instantiated.
template <class Policy, bool Interleaves, class T, class Sink>
[[gnu::always_inline]] inline void reduce_piece(const piece<T>& p, double order, census* counts, Sink&& sink) {
  const census_observer observer{counts};
  if (!p.interleaved) {
    const partial_norm part =
        counts ? reduce_view<Policy>(p.view, order, observer) : reduce_view<Policy>(p.view, order);
    return sink(&part, 1);
  }
  if constexpr (Interleaves) {
    scratch_vector<partial_norm> columns(p.units());
    reduce_columns<Policy>(p, order, columns.data());
    if (counts) p.view.for_each_run([&](const auto* q, std::size_t n) { observer(q, n); });
    sink(columns.data(), columns.size());
  }
}

/// Piece p reduced, counted, merged (see merge_piece) and added to the report: merge_pieces' step for the
/// pieces that are not small gradients. Not inlined, so that its frame (a strided view's gather buffer)
/// is not set up for every small one, and p by value, so that no small one's piece is kept in memory.
template <class Policy, bool Interleaves, class T, class Parts>
[[gnu::noinline]] void merge_reported_piece(const piece<T> p, double order, Parts& parts,
                                            std::vector<partial_norm>* tensors, report_writer& report) {
  census counts;
  reduce_piece<Policy, Interleaves>(p, order, &counts, [&](const partial_norm* piece_parts, std::size_t count) {
    merge_piece(parts, tensors, p.unit, p.tensor, piece_parts, count, order);
    report.add(p.tensor, piece_parts, count, counts);
  });
}

/// The reduction on one thread: each piece's parts merged into the units' `parts` (and `tensors`, see
/// merge_piece) as they come, and, when Reporting, counted and added to the report. Nothing else per
/// piece, as many small gradients make many pieces; not inlined, so that the compiler inlines the short
/// runs' sums and the merges into its loop instead (a call per piece would spill the parts).
template <class Policy, bool Reporting, class Layout, class Parts>
[[gnu::noinline]] void merge_pieces(const Layout& layout, double order, Parts& parts,
                                    std::vector<partial_norm>* tensors, report_writer* report) {
  if constexpr (Reporting) {
    const bool writes_normal = report->writes_normal();
    layout.for_each_piece([&](const auto& p) GRADCLIP_INLINE_LAMBDA {
      // A small gradient of normal numbers, whole: summed, merged and written in this loop (reduce_run's
      // part, with nothing to count but its size and maximum). Others take the full count. (A piece of a
      // contiguous gradient is never empty, as normal_short_squares requires.)
      const auto& v = p.view;
      if constexpr (sums_short_runs<Policy, typename std::decay_t<decltype(v)>::element_type>) {
        double sum, top;
        if (writes_normal && v.outer_size == 1 && v.inner_stride == 1 && v.inner_size <= short_run &&
            report->next_is(p.tensor) && normal_short_squares(v.data, v.inner_size, sum, top)) {
          const partial_norm part{0, sum, true, order, 0.0, v.inner_size};
          merge_piece(parts, tensors, p.unit, p.tensor, &part, 1, order);
          return report->add_normal(part, top);
        }
      }
      merge_reported_piece<Policy, interleaves<Layout>::value>(p, order, parts, tensors, *report);
    });
  } else {
    layout.for_each_piece([&](const auto& p) {
      reduce_piece<Policy, interleaves<Layout>::value>(
          p, order, nullptr, [&](const partial_norm* piece_parts, std::size_t count) GRADCLIP_INLINE_LAMBDA {
            merge_piece(parts, tensors, p.unit, p.tensor, piece_parts, count, order);
          });
    });
  }
}

/// The parts of every unit of the layout, of kind options::norm, each merged in piece order; with
/// `tensors`, also each gradient's own part (tensors[k] for the pieces of gradient k, merged in the same
/// order), from the same pass. With options::report on a layout of gradients, stages the report (each
/// gradient's part and census) for run_units to publish.
template <class Policy, class Layout>
unit_parts<is_single_unit<Layout>::value> reduce_units(const Layout& layout, const options& opt,
                                                       std::vector<partial_norm>* tensors = nullptr) {
  const double order = opt.norm.p();
  unit_parts<is_single_unit<Layout>::value> parts(layout.units(), order);
  if (tensors) tensors->clear();
  std::optional<report_writer> report;
  if constexpr (reports_tensors<Layout>::value)
    if (opt.report) report.emplace(*opt.report, layout.tensor_count(), order);
  unsigned threads = 1;
  const auto pieces = pieces_for_threads<true>(layout, opt.threads, threads);
  if (threads <= 1) {
    if (report)
      merge_pieces<Policy, true>(layout, order, parts, tensors, &*report);
    else
      merge_pieces<Policy, false>(layout, order, parts, tensors, nullptr);
  } else {
    // Every piece's parts in one array, piece i's from first[i]: no allocation per piece (a row-major
    // matrix makes a piece of each row).
    scratch_vector<std::size_t> first(pieces.size() + 1);
    for (std::size_t i = 0; i < pieces.size(); ++i)
      pieces[i].visit([&](const auto& p) { first[i + 1] = first[i] + p.units(); });
    scratch_vector<partial_norm> results(first.back());
    std::vector<census> counts(report ? pieces.size() : 0);
    run_pieces(pieces, threads, opt.pool, [&](std::size_t i) {
      pieces[i].visit([&](const auto& p) {
        reduce_piece<Policy, interleaves<Layout>::value>(
            p, order, report ? &counts[i] : nullptr, [&](const partial_norm* piece_parts, std::size_t count) {
              std::copy(piece_parts, piece_parts + count, results.data() + first[i]);
            });
      });
    });
    // Merged in piece order, as on one thread.
    for (std::size_t i = 0; i < pieces.size(); ++i)
      pieces[i].visit([&](const auto& p) {
        const partial_norm* piece_parts = results.data() + first[i];
        const std::size_t count = first[i + 1] - first[i];
        merge_piece(parts, tensors, p.unit, p.tensor, piece_parts, count, order);
        if (report) report->add(p.tensor, piece_parts, count, counts[i]);
      });
  }
  if (report) report->finish();
  return parts;
}

/// The group's partial norm of kind options::norm, merged in partition order.
template <class Policy, class Grads>
partial_norm reduce(const Grads& grads, const options& opt) {
  check_group<const Grads&>();
  return reduce_units<Policy>(whole_group<const Grads>{grads}, opt)[0];
}

/// reduce, then options::report published: for the norm front-ends, which cannot throw once they read.
template <class Policy, class Grads>
partial_norm reduce_and_report(const Grads& grads, const options& opt) {
  if (!opt.report) return reduce<Policy>(grads, opt);
  try {
    const partial_norm part = reduce<Policy>(grads, opt);
    report_staging::commit(*opt.report);
    return part;
  } catch (...) {
    report_staging::unstage(*opt.report);
    throw;
  }
}

// ---- Plans ----

/// What to do with one unit, decided before any gradient is touched.
struct clip_plan {
  clip_result result;
  scaled coefficient;
};

/// PyTorch's rule (clip_by_norm, clip_by_global_norm, per-example clipping): the part and the threshold
/// become c = max_norm / (norm + epsilon), and the unit clips when c < 1. Works on the scaled forms, so
/// the coefficient is right even where the norm overflows double. Non-finite norms follow opt.nonfinite:
/// skip leaves the unit alone, error throws nonfinite_error, propagate is PyTorch's arithmetic.
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
  const scaled root = part.sum > 0
                          ? norm_kind{part.p}.root_for_quotient(part.sum, part.low, part.exponent, part.elements)
                          : norm_scaled(part);
  const scaled c = quotient_with_tail(max_norm, root, opt.epsilon);
  // c < 1: zero (max_norm = 0), or a normalized mantissa in [1, 2) with a negative exponent. A zero norm
  // gives an infinite c (or NaN with max_norm = 0), which never clips.
  const bool below_one = std::isfinite(c.mantissa) && (c.mantissa == 0.0 || c.exponent < 0);
  if (!below_one) return {{norm, 1.0, false, true, max_norm}, scaled{1.0, 0}};
  return {{norm, c.value(), true, true, max_norm}, c};
}

// Optax's guard in AGC's denominator, max(||g_u||, 1e-6).
inline constexpr double agc_div_eps = 1e-6;

/// Optax's rule for thresholds relative to another norm (AGC): with max_norm = clipping * max(||w||, eps)
/// formed by the caller as a scaled number (it may exceed double's range), the unit clips when ||g|| >=
/// max_norm, by c = max_norm / max(||g||, 1e-6). A non-finite norm or threshold follows opt.nonfinite,
/// propagate being Optax's arithmetic in double (NaN and Inf as they come).
inline clip_plan plan_relative(const char* function, const partial_norm& part, const scaled& max_norm,
                               const options& opt) {
  const double norm = part.norm(), threshold = max_norm.value();
  if (!part.finite || !std::isfinite(max_norm.mantissa)) {
    if (opt.nonfinite == on_nonfinite::error) throw nonfinite_error(function, part.finite ? max_norm.mantissa : norm);
    if (opt.nonfinite == on_nonfinite::skip)
      return {{norm, 1.0, false, false, std::numeric_limits<double>::infinity()}, scaled{1.0, 0}};
    if (norm < threshold) return {{norm, 1.0, false, false, threshold}, scaled{1.0, 0}};
    const double c = threshold / (std::isnan(norm) ? norm : std::max(norm, agc_div_eps));  // max keeps no NaN
    return {{norm, c, true, false, threshold}, scaled{c, 0}};
  }
  const scaled g = norm_scaled(part);
  if (g < max_norm) return {{norm, 1.0, false, true, threshold}, scaled{1.0, 0}};
  const scaled c = max_norm / std::max(g, scaled::of(agc_div_eps));
  return {{norm, c.value(), true, true, threshold}, c};
}

// ---- Threshold sources: what decides each unit's threshold ----

/// A threshold fixed by the caller, the same for every unit: the source of every call without a
/// controller.
struct fixed_threshold {
  double max_norm;

  void check(const char* function) const {
    if (!(max_norm >= 0)) throw std::invalid_argument(std::string(function) + ": max_norm must be >= 0 and not NaN");
  }
  threshold_decision decide(std::size_t, const partial_norm&) const noexcept { return {max_norm, false}; }
  double fallback_threshold(std::size_t) const noexcept { return max_norm; }
  void update(std::size_t, const clip_result&) const noexcept {}
  std::string where(const char* function, std::size_t) const { return function; }
};

inline void check_clip_arguments(const char* function, double max_norm, const options& opt) {
  fixed_threshold{max_norm}.check(function);
  check_options(function, opt);
}

/// A threshold controller (controller.hpp) as the source of a single unit's threshold.
template <class Controller>
struct controlled {
  Controller& controller;

  void check(const char*) const noexcept {}
  threshold_decision decide(std::size_t, const partial_norm& part) const { return controller.decide(part.norm()); }
  double fallback_threshold(std::size_t) const { return controller.fallback_threshold(); }
  void update(std::size_t, const clip_result& step) const { controller.update(step); }
  std::string where(const char* function, std::size_t) const { return function; }
};

/// One threshold per unit, given by the caller (per-group and per-layer clipping); `where(u)` names unit
/// u in error messages.
template <class Where>
struct unit_thresholds {
  const double* max_norms;
  std::size_t count;
  Where where_;

  void check(const char* function) const {
    for (std::size_t u = 0; u < count; ++u)
      if (!(max_norms[u] >= 0)) throw std::invalid_argument(where(function, u) + ": max_norm must be >= 0 and not NaN");
  }
  threshold_decision decide(std::size_t u, const partial_norm&) const noexcept { return {max_norms[u], false}; }
  double fallback_threshold(std::size_t u) const noexcept { return max_norms[u]; }
  void update(std::size_t, const clip_result&) const noexcept {}
  std::string where(const char* function, std::size_t u) const { return std::string(function) + ": " + where_(u); }
};

// ---- The pipeline ----

/// One plan per unit: inline for the single-unit layouts (no allocation), a vector otherwise.
template <bool Single>
using unit_plans = std::conditional_t<Single, std::array<clip_plan, 1>, scratch_vector<clip_plan>>;

template <class Source, class = void>
struct plans_by_itself : std::false_type {};
template <class Source>
struct plans_by_itself<Source, std::void_t<decltype(&Source::template plan<unit_parts<false>>)>> : std::true_type {};

/// decide -> plan for each of the `units` units, from the parts, before anything is written. A source
/// with a `plan` member makes its own (AGC's relative thresholds); the others decide a threshold per unit
/// and PyTorch's rule plans: a non-finite part never reaches the source (it follows opt.nonfinite, with
/// the source's fallback threshold under propagate), a unit the source skips is left alone.
template <bool Single, class Parts, class Source>
unit_plans<Single> decide_units(const char* function, std::size_t units, const Parts& parts, const Source& source,
                                const options& opt) {
  unit_plans<Single> plans{};
  if constexpr (!Single) plans.resize(units);
  for (std::size_t u = 0; u < units; ++u) {
    if constexpr (plans_by_itself<Source>::value) {
      plans[u] = source.plan(function, u, parts, opt);
    } else {
      const partial_norm& part = parts[u];
      const threshold_decision decision =
          part.finite ? source.decide(u, part) : threshold_decision{source.fallback_threshold(u), false};
      if (decision.skip)
        plans[u] = {{part.norm(), 1.0, false, part.finite, decision.threshold, true}, scaled{1.0, 0}};
      else if (part.finite || opt.nonfinite != on_nonfinite::error)
        plans[u] = plan_clip(function, part, decision.threshold, opt);
      else
        throw nonfinite_error(source.where(function, u), part.norm());
    }
  }
  return plans;
}

/// Calls write(piece) for every piece of the layout, on up to options::threads threads.
template <class Layout, class Write>
void write_pieces(const Layout& layout, const options& opt, Write&& write) {
  unsigned threads = 1;
  const auto pieces = pieces_for_threads<false>(layout, opt.threads, threads);
  if (threads <= 1) return layout.for_each_piece(write);
  run_pieces(pieces, threads, opt.pool, [&](std::size_t i) { pieces[i].visit(write); });
}

/// The robust policy's scaling of 16-bit and FP32 elements as one factor per unit of interleaved units:
/// FP32 factors for 16-bit elements when every factor is a normal float (as scaler does), FP64 for FP32
/// elements. False (and nothing written) when the piece needs the scalers unit by unit: FP64 elements,
/// other policies, tiny factors, or a unit that does not clip and is not finite (it must keep its bits).
/// `values` holds each unit's coefficient, computed once for all the pieces.
template <class Policy, class T, class Plans>
bool scale_columns(const piece<T>& p, const Plans& plans, const scratch_vector<double>& values) {
  using element = T;
  if constexpr (std::is_same_v<element, double> || !std::is_same_v<Policy, robust>) {
    return false;
  } else {
    using Compute = std::conditional_t<sizeof(T) == 2, float, double>;
    const std::size_t units = p.view.inner_size;
    scratch_vector<Compute> factor(units, Compute(1));
    for (std::size_t u = 0; u < units; ++u) {
      const clip_plan& plan = plans[p.unit + u];
      if (!plan.result.clipped) {
        if (!plan.result.finite) return false;
        continue;
      }
      const double c = values[p.unit + u];
      if (sizeof(T) == 2 && !(c == 0 || (std::abs(c) >= std::numeric_limits<float>::min() &&
                                         std::abs(c) <= std::numeric_limits<float>::max())))
        return false;
      factor[u] = static_cast<Compute>(c);
    }
    with_isa(best_isa(), [&](auto k) {
      decltype(k)::template column_multiply<Compute>(p.view.data, units, p.view.outer_size, p.view.outer_stride,
                                                     factor.data());
    });
    return true;
  }
}

/// The write step that scales: every unit whose plan clips is multiplied by its coefficient with the
/// policy's scaling, on up to options::threads threads. Units that do not clip are neither read nor
/// written, except finite ones interleaved with clipping units, which are rewritten with their own values.
template <class Policy, class Layout, class Plans>
void apply_units(const Layout& layout, const Plans& plans, const options& opt) {
  constexpr bool single = is_single_unit<Layout>::value;
  bool any = false;
  for (const auto& plan : plans) any = any || plan.result.clipped;
  if (!any) return;
  // The coefficients, each prepared once for every run of its unit (many small tensors make many runs).
  std::conditional_t<single, std::array<scaler<Policy>, 1>, scratch_vector<scaler<Policy>>> scalers = [&] {
    if constexpr (single) {
      return std::array<scaler<Policy>, 1>{scaler<Policy>(plans[0].coefficient)};
    } else {
      scratch_vector<scaler<Policy>> all;
      all.reserve(plans.size());
      for (const auto& plan : plans) all.emplace_back(plan.coefficient);
      return all;
    }
  }();
  scratch_vector<double> values;
  if constexpr (!single) {
    values.resize(plans.size());
    for (std::size_t u = 0; u < plans.size(); ++u)
      values[u] = plans[u].result.clipped ? plans[u].coefficient.value() : 1.0;
  }
  const auto scale_piece = [&](const auto& p) {
    using T = typename std::decay_t<decltype(p.view)>::element_type;
    static_assert(!std::is_const_v<T>, "Clipping modifies the gradient in place, so it cannot be const.");
    if constexpr (interleaves<Layout>::value)
      if (p.interleaved && scale_columns<Policy>(p, plans, values)) return;
    // The piece's own view, not a copy of it: a copy, read back wide, stalls on the narrow stores that
    // built the piece, once for every small gradient.
    const auto scale_unit = [&](const strided_view<T>& unit, const scaler<Policy>& scale) {
      unit.for_each_run([&](T* data, std::size_t n) { scale(data, n); }, true);
    };
    for (std::size_t u = 0; u < p.units(); ++u) {
      if (!plans[p.unit + u].result.clipped) continue;
      if (p.interleaved)
        scale_unit(strided_view<T>{p.view.data + u, p.view.outer_size, p.view.outer_stride}, scalers[p.unit + u]);
      else
        scale_unit(p.view, scalers[p.unit + u]);
    }
  };
  write_pieces(layout, opt, scale_piece);
}

/// `e` naming the layout's first gradient that holds NaN or Inf (from the staged report, else from a
/// census of the gradients), or saying that none does; `e` itself when the layout is not one of gradients.
template <class Layout>
nonfinite_error located(const char* function, const nonfinite_error& e, const Layout& layout, const options& opt) {
  if constexpr (!reports_tensors<Layout>::value) {
    return e;
  } else {
    std::vector<census> counts;
    if (opt.report && report_staging::staged(*opt.report)) {
      for (const tensor_stats& t : report_staging::stats(*opt.report)) counts.push_back({t.size, t.nan, t.inf});
    } else {
      counts.resize(layout.tensor_count());
      layout.for_each_piece([&](const auto& p) {
        p.view.for_each_run([&](const auto* q, std::size_t n) { counts[p.tensor].merge(count_elements(q, n)); });
      });
    }
    for (std::size_t k = 0; k < counts.size(); ++k)
      if (counts[k].nan != 0 || counts[k].inf != 0)
        return nonfinite_error(function, e.norm, k, counts[k].nan, counts[k].inf);
    return nonfinite_error(function, e.norm, nonfinite_error::no_tensor, 0, 0);
  }
}

/// The whole pipeline on `layout`: check, reduce (`reduced()` returns the unit parts), decide and plan
/// every unit, then `write(plans)`, and tell `source` each unit's outcome. Returns the plans.
template <class Layout, class Source, class Reduced, class Write>
auto run_units(const char* function, const Layout& layout, const Source& source, const options& opt, Reduced&& reduced,
               Write&& write) {
  source.check(function);
  check_options(function, opt);
  // The report is published once the write is done: a call that throws (a nonfinite_error, an executor's
  // exception) leaves it as it was.
  auto plans = [&] {
    try {
      const auto parts = reduced();
      auto decided = decide_units<is_single_unit<Layout>::value>(function, layout.units(), parts, source, opt);
      write(decided);
      return decided;
    } catch (const nonfinite_error& e) {
      const nonfinite_error named = located(function, e, layout, opt);
      if (opt.report) report_staging::unstage(*opt.report);
      throw named;
    } catch (...) {
      if (opt.report) report_staging::unstage(*opt.report);
      throw;
    }
  }();
  if (opt.report) report_staging::commit(*opt.report);
  for (std::size_t u = 0; u < plans.size(); ++u) source.update(u, plans[u].result);
  return plans;
}

/// One coefficient for a group of gradients (clip_by_norm, clip_by_global_norm and their controller
/// forms): the pipeline with K = 1 and the scale kernel as its write step. `reduced` may replace the
/// reduction (a norm reduced elsewhere).
template <class Policy, class Grads, class Source, class Reduced>
clip_result clip(const char* function, Grads& grads, const Source& source, const options& opt, Reduced&& reduced) {
  check_group<Grads&>();
  const whole_group<Grads> layout{grads};
  return run_units(
             function, layout, source, opt, [&] { return unit_parts<true>(reduced()); },
             [&](const auto& plans) { apply_units<Policy>(layout, plans, opt); })[0]
      .result;
}

/// The pipeline on the group's own norm.
template <class Policy, class Grads, class Source>
clip_result clip(const char* function, Grads& grads, const Source& source, const options& opt) {
#if defined(GRADCLIP_COMPILED)
  if constexpr (std::is_same_v<Source, fixed_threshold>) {  // the library runs it (compiled_clip.hpp)
    check_group<Grads&>();
    return library_clip<Policy>(function, grads, source.max_norm, opt);
  } else
#endif
  {
    return clip<Policy>(function, grads, source, opt, [&] { return reduce<Policy>(grads, opt); });
  }
}

/// The pipeline on the group's own norm up to the plan: the clip_result clip would return, nothing written.
template <class Policy, class Grads, class Source>
clip_result plan_only(const char* function, const Grads& grads, const Source& source, const options& opt) {
  check_group<const Grads&>();
  const whole_group<const Grads> layout{grads};
  return run_units(
             function, layout, source, opt, [&] { return unit_parts<true>(reduce<Policy>(grads, opt)); },
             [](const auto&) {})[0]
      .result;
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
