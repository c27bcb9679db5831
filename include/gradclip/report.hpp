// Per-tensor reports: what one clipping call saw in each gradient of its group, from the same read pass
// that computes the norm (options::report).
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/partial_norm.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// One gradient as the call read it, before anything was written.
struct tensor_stats {
  double norm = 0.0;      ///< options::norm of this gradient (+inf beyond double's range; NaN or +inf if not finite)
  double max_abs = 0.0;   ///< max |x| (NaN when an element is NaN)
  std::size_t size = 0;   ///< elements
  std::size_t nan = 0;    ///< NaN elements
  std::size_t inf = 0;    ///< +-inf elements
  std::size_t zeros = 0;  ///< +-0 elements
  std::size_t subnormals = 0;  ///< subnormal elements, in the gradient's own type (FP16: below 6.1e-5)

  bool finite() const noexcept { return nan == 0 && inf == 0; }
  /// (zeros + subnormals) / size, the underflow signal of a loss scale that is too low; 0 when empty.
  double underflow_fraction() const noexcept {
    return size == 0 ? 0.0 : static_cast<double>(zeros + subnormals) / static_cast<double>(size);
  }
};

namespace detail {
struct report_staging;
}

/// One tensor_stats per gradient of a call's group, in the group's order. Reusable: a call that fills it
/// resizes it, so steady-state steps allocate nothing; a call that throws leaves it as it was.
///
///     gradclip::tensor_report report;
///     gradclip::options opt;
///     opt.report = &report;
///     auto r = gradclip::clip_by_global_norm(grads, 1.0, opt);
///     for (std::size_t i = 0; i < report.size(); ++i) log(i, report[i].norm, report[i].nan);
class tensor_report {
 public:
  std::size_t size() const noexcept { return tensors_.size(); }
  bool empty() const noexcept { return tensors_.empty(); }
  const tensor_stats& operator[](std::size_t i) const noexcept { return tensors_[i]; }
  std::vector<tensor_stats>::const_iterator begin() const noexcept { return tensors_.begin(); }
  std::vector<tensor_stats>::const_iterator end() const noexcept { return tensors_.end(); }

  /// The index of the first gradient holding a NaN or an Inf, or size() when there is none.
  std::size_t first_nonfinite() const noexcept {
    std::size_t i = 0;
    while (i < tensors_.size() && tensors_[i].finite()) ++i;
    return i;
  }

  /// Replaces the contents (e.g. with stats gathered elsewhere, for clip_stats::record).
  void assign(std::vector<tensor_stats>&& tensors) noexcept { tensors_.swap(tensors); }
  void clear() noexcept { tensors_.clear(); }

 private:
  friend struct detail::report_staging;
  std::vector<tensor_stats> tensors_;
  std::vector<tensor_stats> pending_;  // filled while a call reads; swapped in once nothing can throw
  std::vector<partial_norm> parts_;    // each gradient's part while the call reads, when kept (keep_parts)
  bool staged_ = false;                // pending_ belongs to the call in progress
  bool keep_parts_ = false;            // the call in progress keeps parts_ (the loss scaler unscales them)
};

namespace detail {
/// How the pipeline fills a report: stage() while reading, commit() once the call can no longer throw, so
/// a call that throws leaves the report as it was. Both vectors keep their capacity: steady-state steps
/// allocate nothing.
struct report_staging {
  /// Asks the next stage() to keep each gradient's part beside its entry, for unscale(); until the call
  /// commits or unstages. Other calls store no parts: a report of many small gradients writes less.
  static void keep_parts(tensor_report& r) noexcept { r.keep_parts_ = true; }
  /// Sizes the pending entries (and the parts, when kept) for `tensors` gradients, left as they are: the
  /// caller writes every one (pipeline.hpp's report_writer), so they are not cleared first.
  static void stage(tensor_report& r, std::size_t tensors) {
    r.staged_ = false;
    r.pending_.resize(tensors);
    if (r.keep_parts_) r.parts_.resize(tensors);
    r.staged_ = true;
  }
  static std::vector<tensor_stats>& stats(tensor_report& r) noexcept { return r.pending_; }
  /// Where the staged parts go: null unless keep_parts() asked for them.
  static std::vector<partial_norm>* parts(tensor_report& r) noexcept { return r.keep_parts_ ? &r.parts_ : nullptr; }
  static bool staged(const tensor_report& r) noexcept { return r.staged_; }
  static void unstage(tensor_report& r) noexcept { r.staged_ = r.keep_parts_ = false; }
  /// The staged norms and maxima of gradients read scaled by S (the loss scaler): each norm recomputed from
  /// unscale(part), each max_abs divided by S; the counts stay those of the stored elements.
  template <class Unscale>
  static void unscale(tensor_report& r, Unscale&& unscale_part, double s) {
    if (!r.staged_ || !r.keep_parts_) return;
    for (std::size_t k = 0; k < r.pending_.size(); ++k) {
      r.pending_[k].norm = unscale_part(r.parts_[k]).norm();
      r.pending_[k].max_abs /= s;
    }
  }
  /// Publishes what the call in progress staged; nothing when it staged nothing (a norm reduced elsewhere).
  static void commit(tensor_report& r) noexcept {
    r.keep_parts_ = false;
    if (!r.staged_) return;
    r.tensors_.swap(r.pending_);
    r.staged_ = false;
  }
};
}  // namespace detail

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
