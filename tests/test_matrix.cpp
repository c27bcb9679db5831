// Every front-end composes with every norm and policy: {single tensor, mixed-type group, raw buffer,
// braced list, two threads (gradclip's pool, an executor), loss scaler} x {L1, L2, inf, p = 3} x
// {promote, max_scale, robust}, each norm and each clipped element against binary128. (MPI on 1-4 ranks:
// tests/mpi; libtorch: test_torch.)
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace gradclip_test;

const gradclip::norm_type norms[] = {gradclip::l1_norm, gradclip::l2_norm, gradclip::inf_norm,
                                     gradclip::norm_type{3.0}};

/// The documented relative error of the norm: the policy's bound for L2 (policies.hpp), the p-norm
/// kernels' 1e-12 for the others (exact for the maximum).
template <class Policy, class T>
double norm_bound(double p) {
  if (std::isinf(p)) return 0.0;
  if (p != 2.0) return 1e-12;
  if constexpr (std::is_same_v<Policy, gradclip::robust>) return robust_norm_bound<T>();
  return chain_norm_bound<T>();
}

/// A clipped element: one rounding of the exact g * c, plus the coefficient's error, which is the norm's
/// (a relative error r is r * 2^digits ulps of T), plus one rounding of the coefficient to FP32 (FP64 for
/// FP64 input) under promote.
template <class Policy, class T>
double element_bound(double norm_error) {
  const double promoted = std::is_same_v<Policy, gradclip::promote> ? 1.0 : 0.0;
  return 1.0 + promoted + norm_error * std::ldexp(1.0, std::numeric_limits<T>::digits);
}

/// One front-end: it clips `values` (a model of several tensors of T, and one FP32 bias for the mixed
/// group) under `opt` and returns what the call reported; `norm_only` returns the norm it computes.
template <class T>
struct model {
  std::vector<std::vector<T>> tensors;
  std::vector<float> bias;

  explicit model(std::uint64_t salt) {
    std::mt19937_64 rng(seed + salt);
    for (std::size_t n : {3000u, 1u, 257u, 4096u}) tensors.push_back(random_gradient<T>(n, rng, 3.0));
    bias = random_gradient<float>(33, rng, 3.0);
  }
};

/// Copies of the first tensor that the two-threads cases append, 3 MB of them, so that the call is worth
/// two threads (one per MiB). A power of two, so their share of the exact sum is exact.
template <class T>
constexpr std::size_t large_copies = 1024 / sizeof(T);

template <class T>
std::vector<T> copies_of(const std::vector<T>& tensor) {
  std::vector<T> copies;
  for (std::size_t copy = 0; copy < large_copies<T>; ++copy) copies.insert(copies.end(), tensor.begin(), tensor.end());
  return copies;
}

// Runs each job on a thread of its own (the first on the caller) and records how many each call had.
struct thread_per_job final : gradclip::executor {
  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    counts.push_back(count);
    std::vector<std::thread> helpers;
    for (unsigned k = 1; k < count; ++k) helpers.emplace_back(job, k);
    if (count > 0) job(0);
    for (auto& helper : helpers) helper.join();
  }
  mutable std::vector<unsigned> counts;
};

template <class T>
class Matrix : public ::testing::Test {};
TYPED_TEST_SUITE(Matrix, element_types);

template <class Policy, class T>
void check_front_ends(double p) {
  SCOPED_TRACE("p = " + std::to_string(p) + ", seed " + std::to_string(seed));
  const gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, gradclip::norm_type{p}};
  gradclip::options two_threads = opt;
  two_threads.threads = 2;
  const thread_per_job executor;
  gradclip::options two_threads_executor = two_threads;
  two_threads_executor.pool = &executor;

  // front-end name -> (values it covers, whether the FP32 bias is included, the call)
  struct front_end {
    std::string name;
    bool single, with_bias;
    bool large;    // with the copies of the first tensor appended
    double scale;  // the loss scale the gradients are multiplied by first (1: none)
    std::function<gradclip::clip_result(model<T>&, double)> clip;
  };
  const std::vector<front_end> front_ends{
      {"single tensor", true, false, false, 1.0,
       [&](model<T>& m, double c) { return gradclip::clip_by_norm<Policy>(m.tensors[0], c, opt); }},
      {"raw buffer", true, false, false, 1.0,
       [&](model<T>& m, double c) {
         return gradclip::clip_by_norm<Policy>(m.tensors[0].data(), m.tensors[0].size(), c, opt);
       }},
      {"mixed-type group", false, true, false, 1.0,
       [&](model<T>& m, double c) {
         std::vector<gradclip::grad_view> group(m.tensors.begin(), m.tensors.end());
         group.emplace_back(m.bias);
         return gradclip::clip_by_global_norm<Policy>(group, c, opt);
       }},
      {"braced list", false, true, false, 1.0,
       [&](model<T>& m, double c) {
         return gradclip::clip_by_global_norm<Policy>({m.tensors[0], m.tensors[1], m.tensors[2], m.tensors[3], m.bias},
                                                      c, opt);
       }},
      {"two threads", false, false, true, 1.0,
       [&](model<T>& m, double c) { return gradclip::clip_by_global_norm<Policy>(m.tensors, c, two_threads); }},
      {"two threads of an executor", false, false, true, 1.0,
       [&](model<T>& m, double c) {
         executor.counts.clear();
         const gradclip::clip_result r = gradclip::clip_by_global_norm<Policy>(m.tensors, c, two_threads_executor);
         EXPECT_EQ(executor.counts, (std::vector<unsigned>{2, 2})) << "two jobs in the read and the write pass";
         return r;
       }},
      {"loss scaler, S = 1024", false, false, false, 1024.0,
       [&](model<T>& m, double c) {
         return gradclip::loss_scaler(gradclip::loss_scaler_config{1024.0}).unscale_and_clip<Policy>(m.tensors, c, opt);
       }},
      {"loss scaler, S = 3", false, false, false, 3.0,
       [&](model<T>& m, double c) {
         return gradclip::loss_scaler(gradclip::loss_scaler_config{3.0}).unscale_and_clip<Policy>(m.tensors, c, opt);
       }},
  };

  for (const auto& f : front_ends) {
    SCOPED_TRACE(f.name);
    model<T> m(7);
    if (f.single) m.tensors.resize(1);
    if (!f.with_bias) m.bias.clear();
    // The stored (scaled) values, and the true gradient they hold, in binary128.
    std::vector<quad> truth;
    for (auto& t : m.tensors)
      for (auto& x : t) {
        x = static_cast<T>(static_cast<double>(x) * f.scale);
        truth.push_back(to_quad(x) / to_quad(f.scale));
      }
    for (const float x : m.bias) truth.push_back(to_quad(x));
    quad exact = exact_p_norm(truth, p);
    if (f.large) {
      const std::vector<quad> first(truth.begin(), truth.begin() + static_cast<std::ptrdiff_t>(m.tensors[0].size()));
      m.tensors.push_back(copies_of(m.tensors[0]));
      if (!std::isinf(p))
        exact = exact_p_root(exact_p_sum(truth, p) + static_cast<quad>(large_copies<T>) * exact_p_sum(first, p), p);
    }
    const double max_norm = 0.5 * static_cast<double>(exact);
    const model<T> before = m;

    const gradclip::clip_result result = f.clip(m, max_norm);
    // Unscaling by a scale that is not a power of two rounds the part's sum once more.
    const double unscale_rounding = f.scale == 3.0 ? 0x1p-52 : 0.0;
    const double bound =
        norm_bound<Policy, T>(p) + (f.with_bias ? norm_bound<Policy, float>(p) : 0.0) + unscale_rounding;
    EXPECT_LE(relative_error(result.norm, exact), bound);
    ASSERT_TRUE(result.clipped);
    EXPECT_EQ(result.threshold, max_norm);
    const quad c = static_cast<quad>(max_norm) / exact;
    // The copies are clipped as the first tensor is, bit for bit; the rest against binary128.
    if (f.large) {
      EXPECT_TRUE(same_bits(m.tensors.back(), copies_of(m.tensors[0]))) << "the copies of the first tensor";
      m.tensors.pop_back();
    }
    double worst = 0;
    for (std::size_t k = 0; k < m.tensors.size(); ++k)
      for (std::size_t i = 0; i < m.tensors[k].size(); ++i)
        worst = std::max(worst, ulps(m.tensors[k][i], to_quad(before.tensors[k][i]) / to_quad(f.scale) * c));
    EXPECT_LE(worst, (element_bound<Policy, T>(bound)));
    double worst_bias = 0;
    for (std::size_t i = 0; i < m.bias.size(); ++i)
      worst_bias = std::max(worst_bias, ulps(m.bias[i], to_quad(before.bias[i]) * c));
    EXPECT_LE(worst_bias, (element_bound<Policy, float>(bound)));
  }
}

TYPED_TEST(Matrix, EveryFrontEndEveryNormRobust) {
  for (const auto type : norms) check_front_ends<gradclip::robust, TypeParam>(type.p());
}
TYPED_TEST(Matrix, EveryFrontEndEveryNormMaxScale) {
  for (const auto type : norms) check_front_ends<gradclip::max_scale, TypeParam>(type.p());
}
TYPED_TEST(Matrix, EveryFrontEndEveryNormPromote) {
  for (const auto type : norms) check_front_ends<gradclip::promote, TypeParam>(type.p());
}

// The norm functions take every front-end as well, read-only views of const data included.
TYPED_TEST(Matrix, NormFunctionsTakeConstViews) {
  using T = TypeParam;
  const model<T> m(11);
  for (const auto type : norms) {
    const gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, type};
    std::vector<quad> truth;
    for (const auto& t : m.tensors)
      for (const T x : t) truth.push_back(to_quad(x));
    const quad exact = exact_p_norm(truth, type.p());
    const std::vector<gradclip::const_grad_view> group(m.tensors.begin(), m.tensors.end());
    const double bound = norm_bound<gradclip::robust, T>(type.p());
    EXPECT_LE(relative_error(gradclip::global_norm(group, opt), exact), bound) << type.p();
    EXPECT_LE(relative_error(gradclip::partial_global_norm(m.tensors, opt).norm(), exact), bound) << type.p();
    EXPECT_LE(
        relative_error(gradclip::global_norm({m.tensors[0], m.tensors[1], m.tensors[2], m.tensors[3]}, opt), exact),
        bound)
        << type.p();
    const gradclip::const_grad_view first(m.tensors[0].data(), m.tensors[0].size());
    EXPECT_EQ(gradclip::norm(first, opt), gradclip::norm(m.tensors[0].data(), m.tensors[0].size(), opt));
  }
}

}  // namespace
