// What a clipping call is told (options) and what it reports (clip_result, nonfinite_error).
#pragma once

#include <stdexcept>
#include <string>

namespace gradclip {

/// What to do when the norm is not finite: a NaN or Inf element, or (naive, promote) an overflow.
enum class on_nonfinite {
  skip,       ///< leave every gradient untouched and report `finite = false`; the caller skips the step
  error,      ///< throw gradclip::nonfinite_error; no gradient has been modified
  propagate,  ///< PyTorch's default: multiply by min(1, max_norm / (norm + epsilon)) anyway
};

struct options {
  on_nonfinite nonfinite = on_nonfinite::skip;
  /// Added to the norm in the denominator of the coefficient; 1e-6 reproduces PyTorch.
  double epsilon = 0.0;
};

/// Thrown with on_nonfinite::error when the norm is not finite. Nothing has been modified.
struct nonfinite_error : std::runtime_error {
  nonfinite_error(const std::string& function, double computed_norm)
      : std::runtime_error(function + ": the gradient norm is not finite (" + std::to_string(computed_norm) +
                           "); no gradient was modified"),
        norm(computed_norm) {}
  double norm;  ///< the norm the policy computed: NaN or +inf
};

/// What a clipping call did.
struct [[nodiscard]] clip_result {
  double norm;         ///< L2 norm before clipping (+inf when it exceeds double's range)
  double coefficient;  ///< the factor applied to every element: exactly 1 when nothing was changed
  bool clipped;        ///< true when the gradients were multiplied by `coefficient`
  bool finite;         ///< false when the policy's norm was NaN or Inf
};

}  // namespace gradclip
