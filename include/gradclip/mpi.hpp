// Global norms and global-norm clipping over gradients sharded across the ranks of an MPI communicator.
// Needs an MPI library (link MPI::MPI_CXX); the umbrella header gradclip.hpp does not include it.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>

#include <mpi.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace gradclip::mpi {

/// Thrown when an MPI call made by gradclip fails; `code` is the MPI error code. gradclip's collectives
/// run on a duplicate of the caller's communicator whose error handler returns instead of aborting.
struct mpi_error : std::runtime_error {
  mpi_error(const std::string& function, const char* call, int error_code)
      : std::runtime_error(function + ": " + call + " failed: " + describe(error_code)), code(error_code) {}
  int code;

 private:
  static std::string describe(int error_code) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    if (MPI_Error_string(error_code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(error_code);
    return std::string(text, static_cast<std::size_t>(length));
  }
};

namespace detail {

inline void check(int code, const char* function, const char* call) {
  if (code != MPI_SUCCESS) throw mpi_error(function, call, code);
}

// Frees gradclip's duplicate when MPI deletes the attribute that holds it (the user's communicator is
// freed, or MPI finalizes).
inline int free_cached_comm(MPI_Comm, int, void* attribute, void*) {
  auto* own = static_cast<MPI_Comm*>(attribute);
  const int code = MPI_Comm_free(own);
  delete own;
  return code;
}

/// gradclip's own duplicate of `comm`: its collectives cannot match the caller's, and its errors are
/// returned (then thrown as mpi_error) instead of aborting the job. Created collectively on the first
/// call with a communicator and cached on it as an attribute, so later calls cost no extra collective.
/// Bad communicators throw std::invalid_argument and a missing MPI_Init std::logic_error, on every rank
/// that passes them, before any communication.
inline MPI_Comm library_comm(const char* function, MPI_Comm comm) {
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), function, "MPI_Initialized");
  check(MPI_Finalized(&finalized), function, "MPI_Finalized");
  if (!initialized || finalized)
    throw std::logic_error(std::string(function) + ": MPI must be initialized and not finalized");
  if (comm == MPI_COMM_NULL) throw std::invalid_argument(std::string(function) + ": comm is MPI_COMM_NULL");
  int inter = 0;
  check(MPI_Comm_test_inter(comm, &inter), function, "MPI_Comm_test_inter");
  if (inter) throw std::invalid_argument(std::string(function) + ": comm must be an intracommunicator");

  static const int keyval = [] {
    int key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_cached_comm, &key, nullptr);
    return key;
  }();
  if (keyval == MPI_KEYVAL_INVALID) throw mpi_error(function, "MPI_Comm_create_keyval", MPI_ERR_KEYVAL);
  void* cached = nullptr;
  int found = 0;
  check(MPI_Comm_get_attr(comm, keyval, &cached, &found), function, "MPI_Comm_get_attr");
  if (found) return *static_cast<MPI_Comm*>(cached);

  auto* own = new MPI_Comm(MPI_COMM_NULL);
  int code = MPI_Comm_dup(comm, own);
  if (code == MPI_SUCCESS) code = MPI_Comm_set_errhandler(*own, MPI_ERRORS_RETURN);
  if (code == MPI_SUCCESS) code = MPI_Comm_set_attr(comm, keyval, own);
  if (code != MPI_SUCCESS) {
    if (*own != MPI_COMM_NULL) MPI_Comm_free(own);
    delete own;
    throw mpi_error(function, "MPI_Comm_dup", code);
  }
  return *own;
}

inline std::uint64_t bits_of(double x) noexcept {
  x += 0.0;  // -0 and +0 agree
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// Exponents travel as unsigned words in one MAX all-reduce with the argument checks; no_exponent is 0.
inline std::uint64_t exponent_word(int exponent) noexcept {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(exponent) - std::numeric_limits<int>::min());
}
inline int exponent_of_word(std::uint64_t word) noexcept {
  return static_cast<int>(static_cast<std::int64_t>(word) + std::numeric_limits<int>::min());
}

/// The second all-reduce: the exact integer SUM of every rank's part at the common exponent. The same
/// integers reach every rank whatever the order MPI adds in, so every rank gets the same bits.
inline partial_norm sum_parts(const char* function, MPI_Comm own, const partial_norm& local, int max_exponent) {
  const partial_norm::exact_sum part = local.reduction_exact_sum(max_exponent);
  partial_norm::exact_sum total{};
  check(MPI_Allreduce(part.data(), total.data(), static_cast<int>(part.size()), MPI_INT64_T, MPI_SUM, own), function,
        "MPI_Allreduce");
  return partial_norm::from_reduction(max_exponent, total);
}

}  // namespace detail

/// The L2 norm of the concatenation of every rank's `local_grads` (a group, as for
/// gradclip::global_norm; it may be empty), returned bit for bit the same on every rank.
///
/// Collective: every rank of `comm` must call it. Each rank reduces its own gradients under the policy;
/// the parts are then combined exactly with two all-reduces (a MAX of their exponents, an integer SUM of
/// their sums rescaled to it), so no rank's contribution can overflow, underflow or depend on the order.
/// NaN on any rank gives NaN everywhere, else an Inf gives +inf. MPI failures throw mpi_error.
///
///     double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, my_shards);
template <class Policy = robust, class Grads>
double global_norm(MPI_Comm comm, const Grads& local_grads) {
  constexpr const char* function = "gradclip::mpi::global_norm";
  const MPI_Comm own = detail::library_comm(function, comm);
  const partial_norm local = partial_global_norm<Policy>(local_grads);
  std::uint64_t word = detail::exponent_word(local.reduction_exponent()), max_word = 0;
  detail::check(MPI_Allreduce(&word, &max_word, 1, MPI_UINT64_T, MPI_MAX, own), function, "MPI_Allreduce");
  return detail::sum_parts(function, own, local, detail::exponent_of_word(max_word)).norm();
}

/// Clips every rank's `local_grads` in place by one coefficient computed from the global norm of all of
/// them, with the semantics of gradclip::clip_by_global_norm; every rank returns the same clip_result,
/// bit for bit, and applies the same coefficient.
///
/// Collective: every rank of `comm` must call it, with the same max_norm and options; a rank with no
/// gradients takes part. A non-finite value on any rank makes every rank skip (on_nonfinite::skip), throw
/// nonfinite_error (error) or propagate. Bad arguments on any rank, or arguments that differ between
/// ranks, throw std::invalid_argument on every rank (the ranks agree on them in the first all-reduce,
/// before anything is modified). MPI failures throw mpi_error. Two all-reduces of a few words each.
///
///     auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, my_shards, 1.0);
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(MPI_Comm comm, Grads& local_grads, double max_norm, options opt = {}) {
  constexpr const char* function = "gradclip::mpi::clip_by_global_norm";
  const MPI_Comm own = detail::library_comm(function, comm);
  int rank = 0;
  detail::check(MPI_Comm_rank(own, &rank), function, "MPI_Comm_rank");

  // Validate locally but throw only once every rank knows, so that no rank waits in a collective alone.
  std::string problem;
  try {
    gradclip::detail::check_clip_arguments(function, max_norm, opt);
  } catch (const std::invalid_argument& e) {
    problem = e.what();
  }
  const partial_norm local = problem.empty() ? partial_global_norm<Policy>(local_grads) : partial_norm{};

  // One MAX all-reduce carries the exponent, the highest rank with bad arguments (plus one), and each
  // argument with its complement: the MAX of a complement is the complement of the minimum, so
  // max == ~max(~x) exactly when every rank passed the same value.
  const auto mode = static_cast<std::uint64_t>(opt.nonfinite);
  const std::array<std::uint64_t, 8> words{detail::exponent_word(local.reduction_exponent()),
                                           problem.empty() ? 0u : static_cast<std::uint64_t>(rank) + 1,
                                           detail::bits_of(max_norm),
                                           ~detail::bits_of(max_norm),
                                           detail::bits_of(opt.epsilon),
                                           ~detail::bits_of(opt.epsilon),
                                           mode,
                                           ~mode};
  std::array<std::uint64_t, 8> agreed{};
  detail::check(MPI_Allreduce(words.data(), agreed.data(), static_cast<int>(words.size()), MPI_UINT64_T, MPI_MAX, own),
                function, "MPI_Allreduce");
  if (!problem.empty()) throw std::invalid_argument(problem);
  if (agreed[1] != 0)
    throw std::invalid_argument(std::string(function) + ": invalid arguments on rank " + std::to_string(agreed[1] - 1));
  for (std::size_t i = 2; i < agreed.size(); i += 2)
    if (agreed[i] != ~agreed[i + 1])
      throw std::invalid_argument(std::string(function) +
                                  ": max_norm and options must be the same on every rank of comm");

  const partial_norm total = detail::sum_parts(function, own, local, detail::exponent_of_word(agreed[0]));
  const gradclip::detail::clip_plan plan = gradclip::detail::plan_clip(function, total, max_norm, opt);
  if (plan.result.clipped)
    for (auto& g : local_grads)
      gradclip::detail::visit_gradient(
          g, [&](const auto& view) { gradclip::detail::apply_coefficient<Policy>(view, plan.coefficient); });
  return plan.result;
}

}  // namespace gradclip::mpi
