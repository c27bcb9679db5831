// What a clipping call is told (options, norm_type) and what it reports (clip_result, nonfinite_error).
#pragma once

#include <gradclip/detail/config.hpp>

#include <cstddef>
#include <cstdio>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// What to do when the norm is not finite: a NaN or Inf element, or (naive, promote) an overflow.
enum class on_nonfinite {
  skip,       ///< leave every gradient untouched and report `finite = false`; the caller skips the step
  error,      ///< throw gradclip::nonfinite_error; no gradient has been modified
  propagate,  ///< PyTorch's arithmetic: multiply by max_norm / (norm + epsilon) when that is below 1, or NaN
};

/// Which norm: ||g||_p = (sum |g_i|^p)^(1/p) for p > 0, max |g_i| for p = +inf (PyTorch's norm_type), or
/// a named kind whose key is a p no p-norm has (rms_norm, -2). Explicit, so that a plain number never
/// becomes a norm by accident.
class norm_type {
 public:
  constexpr explicit norm_type(double p) noexcept : p_(p) {}
  constexpr double p() const noexcept { return p_; }
  friend constexpr bool operator==(norm_type a, norm_type b) noexcept { return a.p_ == b.p_; }
  friend constexpr bool operator!=(norm_type a, norm_type b) noexcept { return !(a == b); }

 private:
  double p_;
};

inline constexpr norm_type l1_norm{1.0};                                       ///< sum of magnitudes
inline constexpr norm_type l2_norm{2.0};                                       ///< the default norm
inline constexpr norm_type inf_norm{std::numeric_limits<double>::infinity()};  ///< max magnitude
/// The root mean square ||g||_2 / sqrt(n) over the n elements (of a tensor, a group, every rank). Its key,
/// p = -2, is no p-norm's: norm_type{-2} is this kind, not a p-norm.
inline constexpr norm_type rms_norm{-2.0};

/// Threads the caller already has, for options::pool (e.g. an Eigen::ThreadPoolDevice through
/// gradclip::eigen_executor, eigen_executor.hpp). gradclip only asks it to run jobs and wait for them,
/// and stays correct whatever it does: the jobs are interchangeable, each call of `job` runs one that has
/// not started yet (or nothing, once all have), and when run() returns or throws, the caller runs every
/// job the executor did not start and waits for those it did. So each job runs exactly once, even if
/// run() skips, repeats or leaves calls running. An exception from run() is rethrown after that: from a
/// read pass (every norm, and the first pass of a clip) nothing has been written; from a write pass the
/// gradients are completely written, as the call would have left them had it returned
/// (docs/reliability.md, "Threads").
class executor {
 public:
  virtual ~executor() = default;
  /// Runs job(k) for every k in [0, count), on any threads, and returns when all have run.
  virtual void run(unsigned count, const std::function<void(unsigned)>& job) const = 0;
};

class tensor_report;  // report.hpp: one tensor_stats per gradient of a call

/// How every norm and clipping call runs. Aggregate: `{on_nonfinite::propagate, 1e-6}` is PyTorch's
/// clip_grad_norm_, `{on_nonfinite::skip, 0.0, gradclip::inf_norm, 4}` the max norm on four threads.
struct options {
  on_nonfinite nonfinite = on_nonfinite::skip;
  /// Added to the norm in the denominator of the coefficient: clip when max_norm / (norm + epsilon) < 1.
  double epsilon = 0.0;
  /// The norm that is reported and compared with the threshold.
  norm_type norm = l2_norm;
  /// Threads the call may use, the caller's included (0 counts as 1). The result is the same, bit for
  /// bit, for every count.
  unsigned threads = 1;
  /// Where those threads come from: gradclip's own persistent pool when null.
  const executor* pool = nullptr;
  /// When set, the call also fills *report with one tensor_stats per gradient (report.hpp), from the same
  /// read pass; the norm, the coefficient and every written bit are the same as without it.
  tensor_report* report = nullptr;
};

/// Thrown with on_nonfinite::error when the norm is not finite. Nothing has been modified. It names the
/// first gradient of the group (by its index) that holds a NaN or an Inf, with its counts; when no element
/// is NaN or Inf (the norm itself overflowed, as naive's FP16 sum does, or with gradclip::mpi another rank
/// holds them) `tensor` is no_tensor.
struct nonfinite_error : std::runtime_error {
  static constexpr std::size_t no_tensor = static_cast<std::size_t>(-1);

  nonfinite_error(const std::string& function, double computed_norm)
      : std::runtime_error(message(function, computed_norm, "")), norm(computed_norm) {}
  nonfinite_error(const std::string& function, double computed_norm, std::size_t first_tensor, std::size_t nan_count,
                  std::size_t inf_count)
      : std::runtime_error(message(function, computed_norm, location(first_tensor, nan_count, inf_count))),
        norm(computed_norm),
        tensor(first_tensor),
        nan(nan_count),
        inf(inf_count) {}
  double norm;                     ///< the norm the policy computed: NaN or +inf
  std::size_t tensor = no_tensor;  ///< the index of the first gradient holding NaN or Inf, or no_tensor
  std::size_t nan = 0;             ///< that gradient's NaN elements
  std::size_t inf = 0;             ///< that gradient's +-Inf elements

 private:
  // "<function>: the gradient norm is not finite (<norm>)<detail>; no gradient was modified", the norm as
  // std::to_string prints it (%f), by snprintf: cheaper to compile in every unit than std::to_string and +.
  static std::string message(const std::string& function, double computed_norm, const std::string& detail) {
    const int length = std::snprintf(nullptr, 0, "%s: the gradient norm is not finite (%f)%s; no gradient was modified",
                                     function.c_str(), computed_norm, detail.c_str());
    std::string text(static_cast<std::size_t>(length), '\0');
    std::snprintf(&text[0], text.size() + 1, "%s: the gradient norm is not finite (%f)%s; no gradient was modified",
                  function.c_str(), computed_norm, detail.c_str());
    return text;
  }
  static std::string location(std::size_t first_tensor, std::size_t nan_count, std::size_t inf_count) {
    if (first_tensor == no_tensor)
      return "; no element of these gradients is NaN or Inf (the norm overflowed, or another rank's is not finite)";
    char text[128];
    std::snprintf(text, sizeof text, "; gradient %zu is the first with NaN or Inf (%zu NaN, %zu Inf)", first_tensor,
                  nan_count, inf_count);
    return text;
  }
};

/// What a threshold controller decides for one step: the threshold to clip to (+inf: no clipping), or to
/// skip the step.
struct threshold_decision {
  double threshold = std::numeric_limits<double>::infinity();
  bool skip = false;
};

/// What a clipping call did.
struct [[nodiscard]] clip_result {
  double norm;         ///< options::norm before clipping (+inf when it exceeds double's range)
  double coefficient;  ///< the factor applied to every element: exactly 1 when nothing was changed
  bool clipped;        ///< true when the gradients were multiplied by `coefficient`
  bool finite;         ///< false when the policy's norm was NaN or Inf
  /// The threshold the norm was compared with (+inf when none applied).
  double threshold = std::numeric_limits<double>::infinity();
  /// True when a threshold controller decided to skip the step; the gradients are then untouched.
  bool skip = false;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
