// Global norms and global-norm clipping over gradients sharded across the ranks of an MPI communicator.
// Needs an MPI library (link MPI::MPI_CXX); the umbrella header gradclip.hpp does not include it.
#pragma once

#include <gradclip/controller.hpp>
#include <gradclip/detail/config.hpp>
#include <gradclip/detail/norm_kind.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/report.hpp>

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace mpi {

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

// The maximum norm travels as the bits of its value, which never overflows double: the bits of
// non-negative doubles order as their values, and NaN's above +inf's, so the MAX is NaN if any rank saw
// one, else +inf if any did, else the largest magnitude.
inline std::uint64_t max_word(const partial_norm& part) noexcept {
  return bits_of(part.finite ? part.norm() : std::abs(part.sum));
}
inline partial_norm part_of_max_word(std::uint64_t word) noexcept {
  double value = 0;
  std::memcpy(&value, &word, sizeof value);
  if (!std::isfinite(value)) return partial_norm::nonfinite(value, std::numeric_limits<double>::infinity());
  return partial_norm{0, value, true, std::numeric_limits<double>::infinity()}.normalized();
}

/// The local part and the agreed arguments after the first all-reduce.
struct agreement {
  partial_norm local;
  std::array<std::uint64_t, 11> words;
};

/// agree's all-reduce and checks, after the local reduction.
inline void agree_on_arguments(const char* function, MPI_Comm own, agreement& a, const std::string& problem, int rank,
                               double max_norm, const options& opt) {
  const double order = opt.norm.p();
  const std::uint64_t bad = problem.empty() ? 0u : static_cast<std::uint64_t>(rank) + 1;
  const bool by_maximum = gradclip::detail::norm_kind{order}.ranks() == gradclip::detail::rank_reduction::maximum_bits;
  const std::uint64_t head = by_maximum ? max_word(a.local) : exponent_word(a.local.reduction_exponent());
  const auto mode = static_cast<std::uint64_t>(opt.nonfinite);
  const std::array<std::uint64_t, 11> words{head,
                                            bad,
                                            problem.empty() ? 0u : ~bad,
                                            bits_of(max_norm),
                                            ~bits_of(max_norm),
                                            bits_of(opt.epsilon),
                                            ~bits_of(opt.epsilon),
                                            bits_of(order),
                                            ~bits_of(order),
                                            mode,
                                            ~mode};
  check(MPI_Allreduce(words.data(), a.words.data(), static_cast<int>(words.size()), MPI_UINT64_T, MPI_MAX, own),
        function, "MPI_Allreduce");
  if (!problem.empty()) throw std::invalid_argument(problem);
  if (a.words[1] != 0) {
    const std::uint64_t lowest = ~a.words[2] - 1, highest = a.words[1] - 1;
    throw std::invalid_argument(std::string(function) + ": invalid arguments on rank " + std::to_string(lowest) +
                                (lowest == highest ? std::string() : " to rank " + std::to_string(highest)) +
                                " (see the exception thrown there)");
  }
  for (std::size_t i = 3; i + 1 < a.words.size(); i += 2)
    if (a.words[i] != ~a.words[i + 1])
      throw std::invalid_argument(std::string(function) +
                                  ": max_norm and options must be the same on every rank of comm");
}

/// Validates the arguments on every rank and reduces the local gradients, then agrees in one MAX
/// all-reduce on: the exponent (sums) or the maximum's bits (max norm), the lowest and highest rank whose
/// arguments are bad, and each argument with its complement (the MAX of a complement is the complement
/// of the minimum, so max == ~max(~x) exactly when every rank passed the same value). Throws
/// std::invalid_argument on every rank, naming the offending ranks, before anything is modified.
template <class Policy, class Grads>
agreement agree(const char* function, MPI_Comm own, const Grads& local_grads, double max_norm, const options& opt) {
  int rank = 0;
  check(MPI_Comm_rank(own, &rank), function, "MPI_Comm_rank");
  std::string problem;
  try {
    gradclip::detail::check_clip_arguments(function, max_norm, opt);
  } catch (const std::invalid_argument& e) {
    problem = std::string(function) + ": rank " + std::to_string(rank) + ": " +
              std::string(e.what()).substr(std::string(function).size() + 2);
  }
  const double order = opt.norm.p();
  agreement a{problem.empty() ? gradclip::detail::reduce<Policy>(local_grads, opt) : partial_norm{0, 0.0, true, order},
              {}};
  try {
    agree_on_arguments(function, own, a, problem, rank, max_norm, opt);
  } catch (...) {
    if (opt.report) gradclip::detail::report_staging::unstage(*opt.report);  // nothing is published
    throw;
  }
  return a;
}

/// The global part from the local one and the agreed first word, as the kind's row says (norm_kind.hpp):
/// the exact integer SUM of every rank's part at the common exponent (p <= 2), the same integers on every
/// rank whatever the order MPI adds in; the agreed word itself (the max norm); or every rank's part
/// gathered and merged in rank order. Every rank gets the same bits.
inline partial_norm combine(const char* function, MPI_Comm own, const agreement& a) {
  using gradclip::detail::rank_reduction;
  const double order = a.local.p;
  const rank_reduction ranks = gradclip::detail::norm_kind{order}.ranks();
  if (ranks == rank_reduction::maximum_bits) return part_of_max_word(a.words[0]);  // no element count
  if (ranks == rank_reduction::exact_sum) {
    const int max_exponent = exponent_of_word(a.words[0]);
    const partial_norm::exact_sum limbs = a.local.reduction_exact_sum(max_exponent);
    // The limbs, then the element count, in the same SUM.
    std::array<std::int64_t, limbs.size() + 1> part{}, total{};
    std::copy(limbs.begin(), limbs.end(), part.begin());
    part.back() = static_cast<std::int64_t>(a.local.elements);
    check(MPI_Allreduce(part.data(), total.data(), static_cast<int>(part.size()), MPI_INT64_T, MPI_SUM, own), function,
          "MPI_Allreduce");
    partial_norm::exact_sum summed{};
    std::copy(total.begin(), total.begin() + summed.size(), summed.begin());
    return partial_norm::from_reduction(max_exponent, summed, order, static_cast<std::uint64_t>(total.back()));
  }
  int size = 0;
  check(MPI_Comm_size(own, &size), function, "MPI_Comm_size");
  const std::array<std::uint64_t, 4> mine{static_cast<std::uint64_t>(static_cast<std::int64_t>(a.local.exponent)),
                                          bits_of(a.local.sum), a.local.finite ? 1u : 0u, a.local.elements};
  std::vector<std::uint64_t> all(mine.size() * static_cast<std::size_t>(size));
  check(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_UINT64_T, all.data(),
                      static_cast<int>(mine.size()), MPI_UINT64_T, own),
        function, "MPI_Allgather");
  partial_norm total{0, 0.0, true, order};
  for (std::size_t r = 0; r < all.size(); r += mine.size()) {
    double sum = 0;
    std::memcpy(&sum, &all[r + 1], sizeof sum);
    total.merge({static_cast<int>(static_cast<std::int64_t>(all[r])), sum, all[r + 2] != 0, order, 0.0, all[r + 3]});
  }
  return total;
}

/// A controller whose decision every rank checks against every other's.
template <class Controller>
struct agreed_controller {
  Controller& controller;
  MPI_Comm own;

  void check(const char*) const noexcept {}
  threshold_decision decide(std::size_t, const partial_norm& part) const {
    const threshold_decision d = controller.decide(part.norm());
    const std::uint64_t skip = d.skip ? 1u : 0u;
    const std::array<std::uint64_t, 4> words{bits_of(d.threshold), ~bits_of(d.threshold), skip, ~skip};
    std::array<std::uint64_t, 4> agreed{};
    mpi::detail::check(MPI_Allreduce(words.data(), agreed.data(), 4, MPI_UINT64_T, MPI_MAX, own),
                       "gradclip::mpi::clip_by_global_norm", "MPI_Allreduce");
    if (agreed[0] != ~agreed[1] || agreed[2] != ~agreed[3])
      throw std::logic_error(
          "gradclip::mpi::clip_by_global_norm: the controllers decided differently on different ranks; their states "
          "must be the same on every rank");
    return d;
  }
  double fallback_threshold(std::size_t) const { return controller.fallback_threshold(); }
  void update(std::size_t, const clip_result& step) const { controller.update(step); }
  std::string where(const char* function, std::size_t) const { return function; }
};

}  // namespace detail

/// The norm (options::norm) of the concatenation of every rank's `local_grads` (a group, as for
/// gradclip::global_norm; it may be empty), returned bit for bit the same on every rank.
///
/// Collective: every rank of `comm` must call it, with the same options. Each rank reduces its own
/// gradients under the policy; the parts are then combined: L1 and L2 exactly, with two all-reduces (a
/// MAX of 88 bytes: the exponents and the arguments, then an integer SUM of 48 bytes: the sums rescaled
/// to the common exponent, and the element counts), so no rank's contribution can overflow, underflow or depend on the
/// order; the max norm with the first all-reduce alone (Megatron's MAX); other p by gathering 32 bytes per rank and
/// merging in rank order. NaN on any rank gives NaN everywhere, else an Inf gives +inf. Bad or differing
/// options throw std::invalid_argument on every rank; MPI failures throw mpi_error.
///
///     double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, my_shards);
template <class Policy = robust, class Grads>
double global_norm(MPI_Comm comm, const Grads& local_grads, const options& opt = {}) {
  constexpr const char* function = "gradclip::mpi::global_norm";
  const MPI_Comm own = detail::library_comm(function, comm);
  const detail::agreement a = detail::agree<Policy>(function, own, local_grads, 0.0, opt);
  if (!opt.report) return detail::combine(function, own, a).norm();
  try {  // the report of the local gradients, published once the collectives succeeded
    const double global = detail::combine(function, own, a).norm();
    gradclip::detail::report_staging::commit(*opt.report);
    return global;
  } catch (...) {
    gradclip::detail::report_staging::unstage(*opt.report);
    throw;
  }
}

/// Clips every rank's `local_grads` in place by one coefficient computed from the global norm of all of
/// them, with the semantics of gradclip::clip_by_global_norm; every rank returns the same clip_result,
/// bit for bit, and applies the same coefficient.
///
/// Collective: every rank of `comm` must call it, with the same max_norm and options; a rank with no
/// gradients takes part. A non-finite value on any rank makes every rank skip (on_nonfinite::skip), throw
/// nonfinite_error (error) or propagate. Bad arguments on any rank, or arguments that differ between
/// ranks, throw std::invalid_argument on every rank (the ranks agree on them in the first all-reduce,
/// before anything is modified): the rank that holds them names itself, the others name it. MPI failures
/// throw mpi_error. The same collectives as global_norm.
///
///     auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, my_shards, 1.0);
template <class Policy = robust, class Grads>
clip_result clip_by_global_norm(MPI_Comm comm, Grads& local_grads, double max_norm, const options& opt = {}) {
  constexpr const char* function = "gradclip::mpi::clip_by_global_norm";
  const MPI_Comm own = detail::library_comm(function, comm);
  const detail::agreement a = detail::agree<Policy>(function, own, local_grads, max_norm, opt);
  return gradclip::detail::clip<Policy>(function, local_grads, gradclip::detail::fixed_threshold{max_norm}, opt,
                                        [&] { return detail::combine(function, own, a); });
}

/// Clips every rank's `local_grads` to the threshold a controller (controller.hpp) sets from the global
/// norm. Every rank's controller sees the same norm, bit for bit, and must make the same decision: the
/// ranks check that they did in one more MAX all-reduce (32 bytes) and throw std::logic_error on every
/// rank, before anything is modified, when their controllers' states differ (construct them alike, or
/// restore them from the same checkpoint).
///
///     gradclip::zclip controller;   // the same on every rank
///     auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, my_shards, controller);
template <class Policy = robust, class Grads, class Controller,
          class = std::enable_if_t<is_threshold_controller_v<Controller>>>
clip_result clip_by_global_norm(MPI_Comm comm, Grads& local_grads, Controller& controller, const options& opt = {}) {
  constexpr const char* function = "gradclip::mpi::clip_by_global_norm";
  const MPI_Comm own = detail::library_comm(function, comm);
  const detail::agreement a = detail::agree<Policy>(function, own, local_grads, 0.0, opt);
  return gradclip::detail::clip<Policy>(function, local_grads, detail::agreed_controller<Controller>{controller, own},
                                        opt, [&] { return detail::combine(function, own, a); });
}

}  // namespace mpi
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
