// The compiled library (GRADCLIP_COMPILED_LIBRARY=ON): the entry points detail/compiled.hpp declares, each
// the header-only function it stands for, instantiated once here for every element type, accumulator and
// instruction set; with_isa picks the instruction set at run time. Built for the baseline ISA like any
// header-only unit, so it runs on every x86-64 CPU and its users may be built with any -m flags.
#undef GRADCLIP_COMPILED  // the library is the header-only code, compiled once
#include <gradclip/detail/compiled.hpp>
#include <gradclip/detail/p_norm_kernels.hpp>
#include <gradclip/detail/reduce.hpp>
#include <gradclip/detail/scale.hpp>
#include <gradclip/detail/simd.hpp>
#include <gradclip/pipeline.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace gradclip::compiled {
namespace {

part to_part(const partial_norm& q) noexcept { return {q.exponent, q.sum, q.finite, q.p, q.low}; }

}  // namespace

template <class Acc, bool MaxScales, class T>
part sum_squares(const T* p, std::size_t n, observer observe, void* context) noexcept {
  const auto chunk = [&](const T* q, std::size_t m) { observe(context, q, m); };
  return to_part(detail::with_isa(
      detail::best_isa(), [&](auto k) { return detail::sum_squares<decltype(k), Acc, MaxScales>(p, n, chunk); }));
}

template <class Acc, bool MaxScales, class T>
part counted_sum_squares(const T* p, std::size_t n, counts& out) noexcept {
  detail::census c;
  const part q = to_part(detail::with_isa(detail::best_isa(), [&](auto k) {
    return detail::sum_squares<decltype(k), Acc, MaxScales>(p, n, detail::census_observer{&c});
  }));
  out = {c.size, c.nan, c.inf, c.zeros, c.subnormals, c.max_abs};
  return q;
}

part compensated_sum_squares(const double* p, std::size_t n) noexcept {
  return to_part(
      detail::with_isa(detail::best_isa(), [&](auto k) { return detail::compensated_sum_squares<decltype(k)>(p, n); }));
}

template <class T>
part power_sum(const T* p, std::size_t n, double order) noexcept {
  return to_part(detail::power_sum_kernel(p, n, order));
}

template <class T>
counts census_of(const T* p, std::size_t n) noexcept {
  const detail::census c = detail::count_elements(p, n);
  return {c.size, c.nan, c.inf, c.zeros, c.subnormals, c.max_abs};
}

void multiply_with_tail(double* p, std::size_t n, double mantissa, int exponent, double low) noexcept {
  detail::multiply_with_tail(p, n, detail::scaled{mantissa, exponent, low});
}

template <class Compute, class T>
void multiply(T* p, std::size_t n, Compute c) noexcept {
  detail::multiply_run<Compute>(p, n, c);
}

template <class Acc, class T>
void kernels::column_squares(const T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                             double* sums) noexcept {
  detail::with_isa(detail::best_isa(),
                   [&](auto k) { decltype(k)::template column_squares<Acc>(base, units, columns, stride, sums); });
}

void kernels::column_squares_compensated(const double* base, std::size_t units, std::size_t columns,
                                         std::ptrdiff_t stride, double* sum, double* compensation,
                                         double* top) noexcept {
  detail::with_isa(detail::best_isa(), [&](auto k) {
    decltype(k)::column_squares_compensated(base, units, columns, stride, sum, compensation, top);
  });
}

template <class Compute, class T>
void kernels::column_multiply(T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                              const Compute* factor) noexcept {
  detail::with_isa(detail::best_isa(), [&](auto k) {
    decltype(k)::template column_multiply<Compute>(base, units, columns, stride, factor);
  });
}

template <class Acc, bool Masked, class T>
void kernels::column_dot(const T* base, std::size_t units, std::size_t columns, std::ptrdiff_t stride,
                         const Acc* factor, const unsigned char* keep, Acc* out) noexcept {
  detail::with_isa(detail::column_dot_isa(), [&](auto k) {
    decltype(k)::template column_dot<Acc, Masked>(base, units, columns, stride, factor, keep, out);
  });
}

template <class Acc, class T>
void kernels::add_scaled(Acc* acc, const T* const* rows, const Acc* factors, std::size_t count,
                         std::size_t n) noexcept {
  detail::with_isa(detail::best_isa(), [&](auto k) { decltype(k)::add_scaled(acc, rows, factors, count, n); });
}

template <class T>
void kernels::divide(T* p, std::size_t n, double s) noexcept {
  detail::with_isa(detail::best_isa(), [&](auto k) { decltype(k)::divide(p, n, s); });
}

template <class T, class V>
double kernels::quotient_lanes(const T* g, const V* v, std::size_t m, double eps_squared) noexcept {
  return detail::with_isa(detail::best_isa(),
                          [&](auto k) { return decltype(k)::quotient_lanes(g, v, m, eps_squared); });
}

template <class T, class V>
std::size_t kernels::spam_unclear(const T* g, const V* v, std::size_t m, double theta) noexcept {
  return detail::with_isa(detail::best_isa(), [&](auto k) { return decltype(k)::spam_unclear(g, v, m, theta); });
}

bool kernels::spam_unclear_one(double x, double w, double theta) noexcept {
  return detail::portable::spam_unclear_one(x, w, theta);
}

// ---- clip_group: the pipeline of detail::clip on the caller's group ----

namespace {

/// A caller's view with its element type restored by erased_view::visit_as.
struct library_view : detail::erased_view {
  explicit library_view(const view& v) noexcept
      : erased_view(v.data, static_cast<dtype>(v.type), v.inner_size, v.inner_stride, v.outer_size, v.outer_stride) {}
  using erased_view::visit_as;
};

/// The caller's group as the pipeline's layout of one unit (whole_group, pipeline.hpp), cut into the same
/// pieces in the same order, so every result is the header-only one bit for bit.
template <bool Const>
struct caller_group {
  const group& grads;

  static constexpr bool single_unit = true;
  std::size_t units() const noexcept { return 1; }
  std::size_t tensor_count() const noexcept { return grads.count; }
  template <class F>
  void for_each_piece(F&& f) const {
    std::size_t k = 0;
    auto take = [&](const view& v) {
      library_view(v).visit_as<Const>([&](const auto& typed) { detail::cut_into_pieces(typed, 0, k, f); });
      ++k;
    };
    grads.each(
        grads.gradients, [](void* sink, const view& v) { (*static_cast<decltype(take)*>(sink))(v); }, &take);
  }
};

}  // namespace
}  // namespace gradclip::compiled

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {
template <bool Const>
struct interleaves<compiled::caller_group<Const>> : std::false_type {};  // each piece is one unit
}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip

namespace gradclip::compiled {
namespace {

/// The caller's executor, run through its callback.
class caller_executor final : public executor {
 public:
  explicit caller_executor(const settings& call) noexcept : call_(call) {}
  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    using job_type = std::function<void(unsigned)>;
    call_.run_pool(
        call_.pool, count, [](void* context, unsigned k) { (*static_cast<const job_type*>(context))(k); },
        std::make_shared<job_type>(job));
  }

 private:
  const settings& call_;
};

/// Where a call fills the report it hands over: kept from call to call on each thread, so steady-state
/// steps allocate nothing, unless a call on this thread is still using it (one nested in an executor).
struct report_scratch {
  tensor_report report;
  std::vector<stats> entries;
  bool busy = false;
};

class scratch_lease {
 public:
  scratch_lease() : scratch_(kept().busy ? own_ : kept()) { scratch_.busy = true; }
  ~scratch_lease() { scratch_.busy = false; }
  scratch_lease(const scratch_lease&) = delete;
  scratch_lease& operator=(const scratch_lease&) = delete;
  report_scratch* operator->() noexcept { return &scratch_; }

 private:
  static report_scratch& kept() {
    thread_local report_scratch scratch;
    return scratch;
  }
  report_scratch own_;
  report_scratch& scratch_;
};

template <class Policy>
outcome clip_with(const settings& call, const group& grads, double max_norm) {
  scratch_lease scratch;
  tensor_report& report = scratch->report;
  std::vector<stats>& entries = scratch->entries;
  const caller_executor pool(call);
  const options opt{static_cast<on_nonfinite>(call.nonfinite),
                    call.epsilon,
                    norm_type{call.norm},
                    call.threads,
                    call.pool ? &pool : nullptr,
                    call.report ? &report : nullptr};
  const caller_group<false> layout{grads};
  try {
    const clip_result r =
        detail::run_units(
            call.function, layout, detail::fixed_threshold{max_norm}, opt,
            [&] { return detail::unit_parts<true>(detail::reduce_units<Policy>(caller_group<true>{grads}, opt)[0]); },
            [&](const auto& plans) { detail::apply_units<Policy>(layout, plans, opt); })[0]
            .result;
    if (call.report) {
      entries.clear();
      for (const tensor_stats& t : report)
        entries.push_back({t.norm, t.max_abs, t.size, t.nan, t.inf, t.zeros, t.subnormals});
      call.deliver(call.report, entries.data(), entries.size());
    }
    return {r.norm, r.coefficient, r.clipped, r.finite, r.threshold, r.skip, false, 0, 0, 0};
  } catch (const nonfinite_error& e) {
    return {e.norm, 1.0, false, false, 0.0, false, true, e.tensor, e.nan, e.inf};
  }
}

}  // namespace

outcome clip_group(policy rule, const settings& call, const group& grads, double max_norm) {
  switch (rule) {
    case policy::naive:
      return clip_with<naive>(call, grads, max_norm);
    case policy::promote:
      return clip_with<promote>(call, grads, max_norm);
    case policy::max_scale:
      return clip_with<max_scale>(call, grads, max_norm);
    case policy::robust:
      break;
  }
  return clip_with<robust>(call, grads, max_norm);
}

// Every combination the headers reach: the four element types, with the accumulators and compute types
// the policies' traits (policies.hpp) and the front-ends choose for each.
using half = Eigen::half;
using bf16 = Eigen::bfloat16;
using observer_t = observer;

template part sum_squares<float, false, half>(const half*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<float, true, half>(const half*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, false, half>(const half*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, true, half>(const half*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<float, false, bf16>(const bf16*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<float, true, bf16>(const bf16*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, false, bf16>(const bf16*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, true, bf16>(const bf16*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<float, false, float>(const float*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<float, true, float>(const float*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, false, float>(const float*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, true, float>(const float*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, false, double>(const double*, std::size_t, observer_t, void*) noexcept;
template part sum_squares<double, true, double>(const double*, std::size_t, observer_t, void*) noexcept;
template part counted_sum_squares<float, false, half>(const half*, std::size_t, counts&) noexcept;
template part counted_sum_squares<float, true, half>(const half*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, false, half>(const half*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, true, half>(const half*, std::size_t, counts&) noexcept;
template part counted_sum_squares<float, false, bf16>(const bf16*, std::size_t, counts&) noexcept;
template part counted_sum_squares<float, true, bf16>(const bf16*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, false, bf16>(const bf16*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, true, bf16>(const bf16*, std::size_t, counts&) noexcept;
template part counted_sum_squares<float, false, float>(const float*, std::size_t, counts&) noexcept;
template part counted_sum_squares<float, true, float>(const float*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, false, float>(const float*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, true, float>(const float*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, false, double>(const double*, std::size_t, counts&) noexcept;
template part counted_sum_squares<double, true, double>(const double*, std::size_t, counts&) noexcept;

template part power_sum(const half*, std::size_t, double) noexcept;
template part power_sum(const bf16*, std::size_t, double) noexcept;
template part power_sum(const float*, std::size_t, double) noexcept;
template part power_sum(const double*, std::size_t, double) noexcept;

template counts census_of(const half*, std::size_t) noexcept;
template counts census_of(const bf16*, std::size_t) noexcept;
template counts census_of(const float*, std::size_t) noexcept;
template counts census_of(const double*, std::size_t) noexcept;

template void multiply(half*, std::size_t, float) noexcept;
template void multiply(half*, std::size_t, double) noexcept;
template void multiply(bf16*, std::size_t, float) noexcept;
template void multiply(bf16*, std::size_t, double) noexcept;
template void multiply(float*, std::size_t, float) noexcept;
template void multiply(float*, std::size_t, double) noexcept;
template void multiply(double*, std::size_t, double) noexcept;

template void kernels::column_squares<float>(const half*, std::size_t, std::size_t, std::ptrdiff_t, double*) noexcept;
template void kernels::column_squares<float>(const bf16*, std::size_t, std::size_t, std::ptrdiff_t, double*) noexcept;
template void kernels::column_squares<double>(const float*, std::size_t, std::size_t, std::ptrdiff_t, double*) noexcept;

template void kernels::column_multiply(half*, std::size_t, std::size_t, std::ptrdiff_t, const float*) noexcept;
template void kernels::column_multiply(bf16*, std::size_t, std::size_t, std::ptrdiff_t, const float*) noexcept;
template void kernels::column_multiply(float*, std::size_t, std::size_t, std::ptrdiff_t, const double*) noexcept;

template void kernels::column_dot<float, false>(const half*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                                const unsigned char*, float*) noexcept;
template void kernels::column_dot<float, true>(const half*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                               const unsigned char*, float*) noexcept;
template void kernels::column_dot<float, false>(const bf16*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                                const unsigned char*, float*) noexcept;
template void kernels::column_dot<float, true>(const bf16*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                               const unsigned char*, float*) noexcept;
template void kernels::column_dot<float, false>(const float*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                                const unsigned char*, float*) noexcept;
template void kernels::column_dot<float, true>(const float*, std::size_t, std::size_t, std::ptrdiff_t, const float*,
                                               const unsigned char*, float*) noexcept;
template void kernels::column_dot<double, false>(const double*, std::size_t, std::size_t, std::ptrdiff_t, const double*,
                                                 const unsigned char*, double*) noexcept;
template void kernels::column_dot<double, true>(const double*, std::size_t, std::size_t, std::ptrdiff_t, const double*,
                                                const unsigned char*, double*) noexcept;

template void kernels::add_scaled(float*, const half* const*, const float*, std::size_t, std::size_t) noexcept;
template void kernels::add_scaled(float*, const bf16* const*, const float*, std::size_t, std::size_t) noexcept;
template void kernels::add_scaled(float*, const float* const*, const float*, std::size_t, std::size_t) noexcept;
template void kernels::add_scaled(double*, const double* const*, const double*, std::size_t, std::size_t) noexcept;

template void kernels::divide(half*, std::size_t, double) noexcept;
template void kernels::divide(bf16*, std::size_t, double) noexcept;
template void kernels::divide(float*, std::size_t, double) noexcept;
template void kernels::divide(double*, std::size_t, double) noexcept;

template double kernels::quotient_lanes(const half*, const float*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const half*, const double*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const bf16*, const float*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const bf16*, const double*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const float*, const float*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const float*, const double*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const double*, const float*, std::size_t, double) noexcept;
template double kernels::quotient_lanes(const double*, const double*, std::size_t, double) noexcept;

template std::size_t kernels::spam_unclear(const half*, const float*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const half*, const double*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const bf16*, const float*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const bf16*, const double*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const float*, const float*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const float*, const double*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const double*, const float*, std::size_t, double) noexcept;
template std::size_t kernels::spam_unclear(const double*, const double*, std::size_t, double) noexcept;

}  // namespace gradclip::compiled
