// The libtorch adapter against torch::nn::utils::clip_grad_norm_ and clip_grad_value_ themselves (libtorch 1.13)
// and against binary128 references. Run twice (tests/CMakeLists.txt): CPU tensors through gradclip's kernels,
// and with GRADCLIP_TEST_TORCH_OPS=1 every tensor through libtorch's operations, the CUDA path, as a program
// built with GRADCLIP_TORCH_FORCE_OPS=1 sends them (here the macro reads the variable, so that one build
// serves both runs). GRADCLIP_TEST_DEVICE (e.g. cuda) puts the gradients of the shared helpers on that
// device (scripts/gpu_check.sh).
#include <cstdlib>
#include <cstring>

namespace gradclip_test {
/// Whether this run sends CPU tensors through libtorch's operations (GRADCLIP_TEST_TORCH_OPS=1).
inline bool ops_forced() {
  static const bool forced = [] {
    const char* value = std::getenv("GRADCLIP_TEST_TORCH_OPS");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return forced;
}
}  // namespace gradclip_test
#define GRADCLIP_TORCH_FORCE_OPS (::gradclip_test::ops_forced())

#include <gradclip/norm.hpp>
#include <gradclip/torch.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using gradclip_test::quad;
constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double nan = std::numeric_limits<double>::quiet_NaN();

const gradclip::options pytorch{gradclip::on_nonfinite::propagate, 1e-6};

/// The device of the test gradients: GRADCLIP_TEST_DEVICE, the CPU by default.
torch::Device test_device() {
  const char* name = std::getenv("GRADCLIP_TEST_DEVICE");
  return torch::Device(name && *name ? name : "cpu");
}

/// A parameter of the given dtype whose gradient holds `values`.
torch::Tensor parameter_with_grad(const std::vector<double>& values, torch::Dtype type) {
  auto p = torch::zeros({static_cast<std::int64_t>(values.size())}, torch::dtype(type).device(test_device()))
               .requires_grad_(true);
  p.mutable_grad() = torch::tensor(values, torch::kDouble).to(test_device(), type);
  return p;
}

/// A "model": parameters of random shapes (matrices, vectors, a 4-d kernel) with random gradients whose
/// scales differ by orders of magnitude, so a few tensors dominate the global norm as in real training.
std::vector<torch::Tensor> random_model(torch::Dtype type, std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> dim(1, 48);
  std::uniform_real_distribution<double> exponent(-3, 3);
  std::vector<std::vector<std::int64_t>> shapes{{dim(rng), dim(rng)}, {dim(rng)},          {dim(rng), dim(rng)},
                                                {dim(rng)},           {dim(rng), 3, 3, 3}, {dim(rng)}};
  std::vector<torch::Tensor> parameters;
  for (const auto& shape : shapes) {
    auto p = torch::zeros(shape, torch::dtype(type).device(test_device())).requires_grad_(true);
    p.mutable_grad() = (torch::randn(shape, torch::kDouble) * std::pow(10.0, exponent(rng))).to(test_device(), type);
    parameters.push_back(p);
  }
  return parameters;
}

std::vector<torch::Tensor> clone_with_grads(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> copies;
  for (const auto& p : parameters) {
    auto c = p.detach().clone().requires_grad_(true);
    if (p.grad().defined()) c.mutable_grad() = p.grad().clone();
    copies.push_back(c);
  }
  return copies;
}

/// Every element of a tensor as a double (exact for all four dtypes).
std::vector<double> values_of(const torch::Tensor& t) {
  const auto d = t.to(torch::kDouble).cpu().contiguous();
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

/// True when two tensors hold the same bytes, NaN payloads and signs of zero included.
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.cpu().contiguous();
  const auto y = b.cpu().contiguous();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// The same, except that any NaN matches any NaN (libtorch's NaN is sometimes negative).
bool same_bits_any_nan(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = values_of(a);
  const auto y = values_of(b);
  if (x.size() != y.size()) return false;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) {
      if (!(std::isnan(x[i]) && std::isnan(y[i]))) return false;
    } else if (std::memcmp(&x[i], &y[i], sizeof(double)) != 0) {
      return false;
    }
  }
  return true;
}

/// s^(1/p) in binary128 for an integer p >= 1, by Newton's method from a double estimate.
quad quad_root(quad s, int p) {
  if (p == 1 || s == 0) return s;
  if (p == 2) return gradclip_test::quad_sqrt(s);
  quad y = std::pow(static_cast<double>(s), 1.0 / p);
  for (int i = 0; i < 6; ++i) {
    quad power = 1;
    for (int k = 0; k < p - 1; ++k) power *= y;
    y -= (power * y - s) / (p * power);
  }
  return y;
}

/// The exact global p-norm (p = 1, 2, 3 or inf) of the parameters' gradients, in binary128.
quad exact_global_norm(const std::vector<torch::Tensor>& parameters, double p) {
  quad sum = 0;
  for (const auto& parameter : parameters)
    for (const double x : values_of(parameter.grad())) {
      const quad a = gradclip_test::quad_abs(gradclip_test::to_quad(x));
      if (std::isinf(p)) {
        sum = std::max(sum, a);
      } else {
        quad power = 1;
        for (int k = 0; k < static_cast<int>(p); ++k) power *= a;
        sum += power;
      }
    }
  return std::isinf(p) ? sum : quad_root(sum, static_cast<int>(p));
}

/// The documented relative error bound of the drop-in's norm of T elements for the norm of order p: 1e-12
/// for p-norms other than L2, exact for the max norm, and robust_norm_bound for L2, except FP64 through the
/// libtorch-ops path (`through_ops`), whose sums are libtorch's plain FP64 sums, not robust's compensated
/// one: 1e-14 there.
template <class T>
double documented_norm_bound(double p, bool through_ops = gradclip_test::ops_forced()) {
  if (std::isinf(p)) return 0;
  if (p != 2) return 1e-12;
  if (std::is_same_v<T, double> && through_ops) return 1e-14;
  return gradclip_test::robust_norm_bound<T>();
}

/// The documented bound, in ulp of T (FP32 or FP64), of an element the drop-in clips, from the exact g * c
/// with c from the exact norm: FP64 under L2 within one ulp (robust, numerics.md), 2.5 ulp through the
/// libtorch-ops path (libtorch.md measures 2.4 on random models); otherwise the exact g * c rounded once
/// (0.5 ulp) give or take the coefficient's relative error, the correctly rounded quotient by a norm within
/// b of the exact one: b / (1 - b) + 2^-52 (as compare_elements holds them, with the documented b instead of
/// the measured error).
template <class T>
double documented_element_bound(double p, bool through_ops = gradclip_test::ops_forced()) {
  if (std::is_same_v<T, double> && p == 2) return through_ops ? 2.5 : 1.0;
  const double b = documented_norm_bound<T>(p, through_ops);
  return 0.5 + std::ldexp(b / (1 - b) + 0x1p-52, std::numeric_limits<T>::digits);
}

template <class T>
T element_at(const torch::Tensor& contiguous, std::int64_t k) {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return Eigen::numext::bit_cast<Eigen::half>(contiguous.data_ptr<c10::Half>()[k].x);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return Eigen::numext::bit_cast<Eigen::bfloat16>(contiguous.data_ptr<c10::BFloat16>()[k].x);
  } else {
    return contiguous.data_ptr<T>()[k];
  }
}

struct element_errors {
  double ours = 0;       ///< gradclip's largest distance from the exact g * c, in ulp of T
  double theirs = 0;     ///< libtorch's
  double apart = 0;      ///< the largest distance between the two
  double tolerance = 0;  ///< the largest tolerance ours was held to
};

/// Compares every element of `ours` (and of `theirs`, when libtorch ran) with the exact g * coefficient.
/// Ours must be that value rounded once, give or take the coefficient's relative error
/// `coefficient_error`: within 0.5 + 2^digits * coefficient_error ulp.
template <class T>
void compare_elements(const std::vector<torch::Tensor>& originals, const std::vector<torch::Tensor>& ours,
                      const std::vector<torch::Tensor>* theirs, quad coefficient, double coefficient_error,
                      element_errors& errors) {
  const double tolerance = 0.5 + std::ldexp(coefficient_error, std::numeric_limits<T>::digits);
  errors.tolerance = std::max(errors.tolerance, tolerance);
  for (std::size_t i = 0; i < ours.size(); ++i) {
    const auto original = values_of(originals[i].grad());
    const auto a = ours[i].grad().cpu().contiguous().view(-1);
    const auto b = theirs ? (*theirs)[i].grad().cpu().contiguous().view(-1) : a;
    for (std::int64_t k = 0; k < a.numel(); ++k) {
      const quad exact = gradclip_test::to_quad(original[static_cast<std::size_t>(k)]) * coefficient;
      const double ours_error = gradclip_test::ulps<T>(element_at<T>(a, k), exact);
      errors.ours = std::max(errors.ours, ours_error);
      ASSERT_LE(ours_error, tolerance) << "tensor " << i << ", element " << k;
      if (!theirs) continue;
      errors.theirs = std::max(errors.theirs, gradclip_test::ulps<T>(element_at<T>(b, k), exact));
      errors.apart = std::max(errors.apart,
                              gradclip_test::ulps<T>(element_at<T>(a, k), gradclip_test::to_quad(element_at<T>(b, k))));
    }
  }
}

/// c = max_norm / (norm + 1e-6) when c < 1, else 1 (PyTorch's rule), in binary128.
quad exact_coefficient(quad norm, double max_norm) {
  const quad c = max_norm / (norm + quad(1e-6));
  return c < 1 ? c : quad(1);
}

// ---- clip_grad_norm_, the drop-in, against libtorch ----

/// On random models the drop-in's norm is within the documented bound of the exact norm, so it differs from
/// libtorch's by no more than libtorch's own error plus that bound (printed in units of T's epsilon); every
/// element is the exact g * max_norm / (norm + 1e-6) rounded once, within the rounding of its coefficient.
/// Neither the norm nor any element is less accurate than libtorch's.
template <class T>
void expect_parity_on_random_models(torch::Dtype type, double p) {
  std::printf("seed %llu, p = %g\n", static_cast<unsigned long long>(gradclip_test::seed), p);
  std::mt19937 rng(gradclip_test::seed);
  torch::manual_seed(gradclip_test::seed);
  double ours_worst = 0;
  double theirs_worst = 0;
  double apart_worst = 0;
  element_errors errors;
  for (int model = 0; model < 50; ++model) {
    SCOPED_TRACE("model " + std::to_string(model));
    const auto ours = random_model(type, rng);
    const auto theirs = clone_with_grads(ours);
    const auto originals = clone_with_grads(ours);
    const double max_norm = std::pow(10.0, std::uniform_real_distribution<double>(-2, 3)(rng));
    const quad exact = exact_global_norm(originals, p);
    const double theirs_norm = torch::nn::utils::clip_grad_norm_(theirs, max_norm, p);
    const double ours_norm = gradclip::libtorch::clip_grad_norm_(ours, max_norm, p);
    const double ours_error = gradclip_test::relative_error(ours_norm, exact);
    EXPECT_LE(ours_error, documented_norm_bound<T>(p));
    const double theirs_error = gradclip_test::relative_error(theirs_norm, exact);
    const double apart = std::abs(ours_norm - theirs_norm) / static_cast<double>(exact);
    EXPECT_LE(apart, theirs_error + documented_norm_bound<T>(p)) << ours_norm << " against libtorch's " << theirs_norm;
    ours_worst = std::max(ours_worst, ours_error);
    theirs_worst = std::max(theirs_worst, theirs_error);
    apart_worst = std::max(apart_worst, apart);
    // The coefficient carries the norm's error, the rounding of norm + 1e-6 and of the quotient.
    compare_elements<T>(originals, ours, &theirs, exact_coefficient(exact, max_norm), ours_error + 0x1p-52, errors);
  }
  std::printf("norm relative error: gradclip %.3g, libtorch %.3g; apart %.3g (%.2f eps)\n", ours_worst, theirs_worst,
              apart_worst, apart_worst / gradclip_test::epsilon_of<T>());
  std::printf("elements in ulp: gradclip %.3f (held to %.3f), libtorch %.3f; apart %.3f\n", errors.ours,
              errors.tolerance, errors.theirs, errors.apart);
  EXPECT_LE(ours_worst, theirs_worst);
  EXPECT_LE(errors.ours, errors.theirs);
}

TEST(TorchDropIn, Float32L1MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<float>(torch::kFloat, 1); }
TEST(TorchDropIn, Float32L2MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<float>(torch::kFloat, 2); }
TEST(TorchDropIn, Float32P3MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<float>(torch::kFloat, 3); }
TEST(TorchDropIn, Float32MaxNormMatchesLibtorchOnRandomModels) {
  expect_parity_on_random_models<float>(torch::kFloat, inf);
}
TEST(TorchDropIn, Float64L1MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<double>(torch::kDouble, 1); }
TEST(TorchDropIn, Float64L2MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<double>(torch::kDouble, 2); }
TEST(TorchDropIn, Float64P3MatchesLibtorchOnRandomModels) { expect_parity_on_random_models<double>(torch::kDouble, 3); }
TEST(TorchDropIn, Float64MaxNormMatchesLibtorchOnRandomModels) {
  expect_parity_on_random_models<double>(torch::kDouble, inf);
}

TEST(TorchDropIn, BelowThresholdLeavesGradientsBitForBit) {
  std::mt19937 rng(7);
  const auto ours = random_model(torch::kFloat, rng);
  const auto before = clone_with_grads(ours);
  for (const double p : {1.0, 2.0, 3.0, inf}) (void)gradclip::libtorch::clip_grad_norm_(ours, 1e9, p);
  for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(same_bits(ours[i].grad(), before[i].grad()));
}

// PyTorch's rule: clip when max_norm / (norm + 1e-6) < 1, so a norm equal to max_norm, or below it by less
// than 1e-6, is clipped, by libtorch and the drop-in alike.
TEST(TorchDropIn, NormAtMaxNormIsClippedAsByLibtorch) {
  for (const double max_norm : {5.0, 5.0 + 5e-7}) {
    auto ours = parameter_with_grad({3, 4}, torch::kDouble);
    auto theirs = parameter_with_grad({3, 4}, torch::kDouble);
    EXPECT_EQ(gradclip::libtorch::clip_grad_norm_(ours, max_norm), 5.0);
    EXPECT_EQ(torch::nn::utils::clip_grad_norm_(theirs, max_norm), 5.0);
    const quad c = quad(max_norm) / (quad(5) + quad(1e-6));
    ASSERT_LT(c, 1);
    const auto got = values_of(ours.grad());
    const auto reference = values_of(theirs.grad());
    // The norm is exact; the coefficient carries the roundings of 5 + 1e-6 and of the quotient.
    const double tolerance = 0.5 + 0x1p-52 * 0x1p53;
    EXPECT_LT(got[0], 3.0) << max_norm;
    EXPECT_LE(gradclip_test::ulps<double>(got[0], 3 * c), tolerance) << max_norm;
    EXPECT_LE(gradclip_test::ulps<double>(got[1], 4 * c), tolerance) << max_norm;
    EXPECT_NEAR(got[0], reference[0], 4 * std::abs(reference[0]) * gradclip_test::epsilon_of<double>());
  }
}

TEST(TorchDropIn, NoGradientReturnsZero) {
  auto without = torch::ones({2}).requires_grad_(true);
  EXPECT_EQ(torch::nn::utils::clip_grad_norm_(without, 1.0), 0.0);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_(without, 1.0), 0.0);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_(std::vector<torch::Tensor>{}, 1.0), 0.0);
  EXPECT_FALSE(without.grad().defined());
}

// NaN and infinite norms propagate as in libtorch: a NaN norm makes every element NaN; an infinite one
// multiplies by 0 (so the infinite elements become NaN and the others signed zeros), or by NaN when max_norm
// is infinite too. The returned norm is libtorch's, and so is every element (NaN signs aside).
TEST(TorchDropIn, NonFiniteNormsPropagateAsInLibtorch) {
  struct scenario {
    std::vector<double> first, second;
    double max_norm;
  };
  const scenario scenarios[] = {{{nan, 1, -2}, {0.5, -0.0}, 1.0},  {{inf, 1, -2}, {0.5, -0.0}, 1.0},
                                {{-inf, 1, -2}, {0.5, 0.0}, 1.0},  {{nan, inf, -3}, {0.5}, 1.0},
                                {{inf, 1, -2}, {0.5, -0.0}, inf},  {{nan, 1, -2}, {0.5}, 0.0},
                                {{1e-3, -inf, 2}, {-7, 0.0}, 1e3}, {{inf, 1, -2}, {0.5}, 0.0}};
  for (const auto type : {torch::kFloat, torch::kDouble})
    for (const double p : {1.0, 2.0, 3.0, inf})
      for (const auto& s : scenarios) {
        const std::vector<torch::Tensor> ours{parameter_with_grad(s.first, type), parameter_with_grad(s.second, type)};
        const auto theirs = clone_with_grads(ours);
        const double expected = torch::nn::utils::clip_grad_norm_(theirs, s.max_norm, p);
        const double got = gradclip::libtorch::clip_grad_norm_(ours, s.max_norm, p);
        SCOPED_TRACE(std::string(c10::toString(type)) + ", p = " + std::to_string(p) +
                     ", max_norm = " + std::to_string(s.max_norm) + ", first element " + std::to_string(s.first[0]));
        EXPECT_TRUE(std::isnan(expected) ? std::isnan(got) : got == expected) << got << " against " << expected;
        for (std::size_t i = 0; i < ours.size(); ++i)
          EXPECT_TRUE(same_bits_any_nan(ours[i].grad(), theirs[i].grad()))
              << ours[i].grad() << " against libtorch's " << theirs[i].grad();
      }
}

TEST(TorchDropIn, ErrorIfNonfiniteThrowsAndModifiesNothing) {
  for (const auto type : {torch::kFloat, torch::kDouble})
    for (const double p : {1.0, 2.0, 3.0, inf})
      for (const double bad : {nan, inf, -inf}) {
        SCOPED_TRACE(std::string(c10::toString(type)) + ", p = " + std::to_string(p) + ", " + std::to_string(bad));
        const std::vector<torch::Tensor> ours{parameter_with_grad({30, 40}, type), parameter_with_grad({bad, 1}, type)};
        const auto theirs = clone_with_grads(ours);
        const auto before = clone_with_grads(ours);
        EXPECT_THROW((void)torch::nn::utils::clip_grad_norm_(theirs, 1.0, p, true), c10::Error);
        try {
          (void)gradclip::libtorch::clip_grad_norm_(ours, 1.0, p, true);
          ADD_FAILURE() << "expected gradclip::nonfinite_error";
        } catch (const gradclip::nonfinite_error& e) {
          EXPECT_EQ(std::string(e.what()).rfind("gradclip::libtorch::clip_grad_norm_", 0), 0u) << e.what();
          EXPECT_EQ(std::isnan(e.norm), std::isnan(bad));
        }
        for (std::size_t i = 0; i < ours.size(); ++i) {
          EXPECT_TRUE(same_bits(ours[i].grad(), before[i].grad()));
          EXPECT_TRUE(same_bits(theirs[i].grad(), before[i].grad()));
        }
        // A finite norm clips as without the flag.
        const auto finite = parameter_with_grad({30, 40}, type);
        const quad exact = exact_global_norm({finite}, p);
        const double norm = gradclip::libtorch::clip_grad_norm_(finite, 1.0, p, true);
        EXPECT_LE(gradclip_test::relative_error(norm, exact), documented_norm_bound<double>(p));
        EXPECT_LT(finite.grad()[1].item<double>(), 2.0);
      }
}

TEST(TorchDropIn, SingleTensorAndBracedListOverloads) {
  auto w = parameter_with_grad({300, -400}, torch::kFloat);
  auto b = parameter_with_grad({1200}, torch::kFloat);
  auto w_ref = parameter_with_grad({300, -400}, torch::kFloat);
  auto b_ref = parameter_with_grad({1200}, torch::kFloat);
  const double expected = torch::nn::utils::clip_grad_norm_({w_ref, b_ref}, 13.0, 2.0, false);
  const double got = gradclip::libtorch::clip_grad_norm_({w, b}, 13.0, 2.0, false);
  EXPECT_EQ(got, 1300.0);
  EXPECT_EQ(expected, 1300.0);
  EXPECT_FLOAT_EQ(w.grad()[1].item<float>(), w_ref.grad()[1].item<float>());
  EXPECT_FLOAT_EQ(b.grad()[0].item<float>(), b_ref.grad()[0].item<float>());
  EXPECT_FLOAT_EQ(b.grad()[0].item<float>(), 12.0f);

  auto single = parameter_with_grad({3, 4}, torch::kDouble);
  auto single_ref = parameter_with_grad({3, 4}, torch::kDouble);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_(single, 1.0, 1.0),
            torch::nn::utils::clip_grad_norm_(single_ref, 1.0, 1.0));
  // The L1 norm 7 is exact, so each element is within robust's one ulp of the exact g / (7 + 1e-6)
  // (numerics.md), 2.5 ulp through the libtorch-ops path (libtorch.md); libtorch's rounds three times
  // (7 + 1e-6, the quotient, the product: 3 * 2^-53 relative, at most 3 ulp).
  const double element_bound = gradclip_test::ops_forced() ? 2.5 : 1.0;
  const quad c = exact_coefficient(quad(7), 1.0);
  for (int i = 0; i < 2; ++i) {
    const double ours = single.grad()[i].item<double>();
    const double theirs = single_ref.grad()[i].item<double>();
    EXPECT_LE(gradclip_test::ulps<double>(ours, (3 + i) * c), element_bound) << "element " << i;
    EXPECT_LE(gradclip_test::ulps<double>(ours, gradclip_test::to_quad(theirs)), element_bound + 3) << "element " << i;
  }
  // The L2 norm of the clipped elements, within the documented bound of their exact norm.
  const quad clipped_norm = gradclip_test::exact_norm(values_of(single.grad()));
  EXPECT_LE(gradclip_test::relative_error(gradclip::libtorch::clip_grad_norm_(single, 10.0), clipped_norm),
            documented_norm_bound<double>(2));
}

// The drop-in runs on libtorch's intra-op thread count; on the native path the bits do not depend on it. The
// op path's sums are libtorch's, whose CPU kernels split by thread count: there the norms agree within the
// policy's bound.
TEST(TorchDropIn, LibtorchThreadCountGivesTheSameBits) {
  torch::manual_seed(11);
  const int threads = torch::get_num_threads();
  auto big = torch::zeros({3 << 20}).requires_grad_(true);
  big.mutable_grad() = torch::randn({3 << 20});
  auto strided = torch::zeros({300}, torch::kDouble).requires_grad_(true);
  strided.mutable_grad() = torch::randn({300, 2}, torch::kDouble).select(1, 1);
  const std::vector<torch::Tensor> ours{big, strided};
  const auto reference = clone_with_grads(ours);
  torch::set_num_threads(2);
  const double got = gradclip::libtorch::clip_grad_norm_(ours, 1.0);
  torch::set_num_threads(1);
  const double expected = gradclip::libtorch::clip_grad_norm_(reference, 1.0);
  torch::set_num_threads(threads);
  EXPECT_LT(expected, 1e6);
  EXPECT_GT(expected, 1.0);
  if (gradclip::libtorch::detail::use_ops(ours)) {
    EXPECT_LE(std::abs(got - expected), 1e-14 * expected) << got << " against " << expected;
    return;
  }
  EXPECT_EQ(got, expected);
  for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(same_bits(ours[i].grad(), reference[i].grad()));
}

/// Calls f, expects std::invalid_argument whose message starts with `prefix` and contains `what`, and
/// checks that the valid gradient passed with the bad one was not modified.
template <class F>
void expect_rejected(F f, const torch::Tensor& valid, const std::string& prefix, const std::string& what) {
  const auto before = valid.clone();
  try {
    f();
    ADD_FAILURE() << "expected std::invalid_argument mentioning " << what;
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(prefix, 0), 0u) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
  }
  EXPECT_TRUE(same_bits(valid, before));
}

// Where libtorch computes something from a meaningless argument (a negative max_norm flips every gradient,
// norm_type 0 counts the tensors), the drop-in refuses it before anything is modified.
TEST(TorchDropIn, BadArgumentsThrowBeforeAnythingIsModified) {
  const std::string name = "gradclip::libtorch::clip_grad_norm_";
  auto p = parameter_with_grad({300, 400}, torch::kFloat);
  const auto call = [&](double max_norm, double norm_type) {
    return [=] { (void)gradclip::libtorch::clip_grad_norm_(p, max_norm, norm_type); };
  };
  expect_rejected(call(-1.0, 2.0), p.grad(), name, "max_norm");
  expect_rejected(call(nan, 2.0), p.grad(), name, "max_norm");
  expect_rejected(call(1.0, 0.0), p.grad(), name, "norm");
  expect_rejected(call(1.0, -1.0), p.grad(), name, "norm");
  expect_rejected(call(1.0, nan), p.grad(), name, "norm");
  auto q = torch::zeros({2}).requires_grad_(true);
  q.mutable_grad() = torch::tensor({1, 2}, torch::kLong);
  expect_rejected([&] { (void)gradclip::libtorch::clip_grad_norm_({p, q}, 1.0); }, p.grad(), name, "parameter 1");
}

// ---- clip_grad_norm_ where libtorch 1.13 is wrong ----

/// On random FP16 and BF16 models the drop-in's norm is within the documented bound of the binary128 norm
/// and every element within one ulp of the exact g * c, for every norm order. libtorch cannot clip FP16 on
/// the CPU and rounds the BF16 coefficient to BF16; its worst element is printed beside ours.
template <class T>
void expect_right_on_random_models(torch::Dtype type, double p) {
  std::printf("seed %llu, p = %g\n", static_cast<unsigned long long>(gradclip_test::seed), p);
  std::mt19937 rng(gradclip_test::seed);
  torch::manual_seed(gradclip_test::seed);
  element_errors errors;
  double norm_worst = 0;
  const bool libtorch_clips = type != torch::kHalf;
  for (int model = 0; model < 50; ++model) {
    SCOPED_TRACE("model " + std::to_string(model));
    const auto ours = random_model(type, rng);
    const auto theirs = clone_with_grads(ours);
    const auto originals = clone_with_grads(ours);
    const double max_norm = std::pow(10.0, std::uniform_real_distribution<double>(-2, 3)(rng));
    const quad exact = exact_global_norm(originals, p);
    if (libtorch_clips)
      (void)torch::nn::utils::clip_grad_norm_(theirs, max_norm, p);
    else
      EXPECT_THROW((void)torch::nn::utils::clip_grad_norm_(theirs, max_norm, p), c10::Error);
    const double norm = gradclip::libtorch::clip_grad_norm_(ours, max_norm, p);
    const double norm_error = gradclip_test::relative_error(norm, exact);
    EXPECT_LE(norm_error, documented_norm_bound<T>(p));
    norm_worst = std::max(norm_worst, norm_error);
    // Within one ulp: the coefficient's error (the norm's, and FP64 roundings) is far below half an ulp.
    ASSERT_LE(std::ldexp(norm_error + 0x1p-52, std::numeric_limits<T>::digits), 0.5);
    compare_elements<T>(originals, ours, libtorch_clips ? &theirs : nullptr, exact_coefficient(exact, max_norm),
                        0.5 * std::ldexp(1.0, -std::numeric_limits<T>::digits), errors);
  }
  std::printf("norm relative error: gradclip %.3g; elements in ulp: gradclip %.3f (held to %.3f), libtorch ",
              norm_worst, errors.ours, errors.tolerance);
  if (!libtorch_clips) {
    std::printf("throws\n");
    return;
  }
  std::printf("%.3f\n", errors.theirs);
  EXPECT_LE(errors.ours, errors.theirs);
}

TEST(TorchFixes, Float16L1IsRightOnRandomModels) { expect_right_on_random_models<Eigen::half>(torch::kHalf, 1); }
TEST(TorchFixes, Float16L2IsRightOnRandomModels) { expect_right_on_random_models<Eigen::half>(torch::kHalf, 2); }
TEST(TorchFixes, Float16P3IsRightOnRandomModels) { expect_right_on_random_models<Eigen::half>(torch::kHalf, 3); }
TEST(TorchFixes, Float16MaxNormIsRightOnRandomModels) { expect_right_on_random_models<Eigen::half>(torch::kHalf, inf); }
TEST(TorchFixes, BFloat16L1IsRightOnRandomModels) {
  expect_right_on_random_models<Eigen::bfloat16>(torch::kBFloat16, 1);
}
TEST(TorchFixes, BFloat16L2IsRightOnRandomModels) {
  expect_right_on_random_models<Eigen::bfloat16>(torch::kBFloat16, 2);
}
TEST(TorchFixes, BFloat16P3IsRightOnRandomModels) {
  expect_right_on_random_models<Eigen::bfloat16>(torch::kBFloat16, 3);
}
TEST(TorchFixes, BFloat16MaxNormIsRightOnRandomModels) {
  expect_right_on_random_models<Eigen::bfloat16>(torch::kBFloat16, inf);
}

TEST(TorchFixes, HalfClipsWhereLibtorchThrows) {
  auto theirs = parameter_with_grad({300}, torch::kHalf);
  EXPECT_THROW((void)torch::nn::utils::clip_grad_norm_(theirs, 1.0), c10::Error);
  auto ours = parameter_with_grad({300}, torch::kHalf);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_(ours, 1.0), 300.0);
  EXPECT_EQ(ours.grad().item<double>(), 1.0);
  EXPECT_EQ(ours.grad().scalar_type(), torch::kHalf);
}

TEST(TorchFixes, HalfNearMaximumKeepsAFiniteNorm) {
  auto ours = parameter_with_grad({60000, 60000}, torch::kHalf);
  const double norm = gradclip::libtorch::clip_grad_norm_(ours, 1.0);
  EXPECT_LE(gradclip_test::relative_error(norm, quad(60000) * gradclip_test::quad_sqrt(2)), 4 * 0x1p-24);
  EXPECT_EQ(ours.grad()[0].item<double>(), static_cast<double>(Eigen::half(std::sqrt(0.5))));
}

TEST(TorchFixes, BFloat16RoundsOnceWhereLibtorchGives0996) {
  auto theirs = parameter_with_grad({300}, torch::kBFloat16);
  (void)torch::nn::utils::clip_grad_norm_(theirs, 1.0);
  EXPECT_EQ(theirs.grad().item<double>(), 0.99609375);
  auto ours = parameter_with_grad({300}, torch::kBFloat16);
  (void)gradclip::libtorch::clip_grad_norm_(ours, 1.0);
  EXPECT_EQ(ours.grad().item<double>(), 1.0);
}

// Finite gradients whose L2 (or p = 3) norm overflows libtorch's arithmetic: libtorch returns inf and zeroes
// the gradient, or throws with error_if_nonfinite; the drop-in clips them.
TEST(TorchFixes, ExtremesWhereLibtorchReturnsInf) {
  struct extreme {
    torch::Dtype type;
    double value;
    double p;
  };
  for (const auto& [type, value, p] :
       {extreme{torch::kFloat, 1e20, 2}, extreme{torch::kFloat, 1e20, 3}, extreme{torch::kDouble, 1e200, 2},
        extreme{torch::kDouble, 1e110, 3}, extreme{torch::kDouble, 1.5e308, 2}}) {
    SCOPED_TRACE(std::string(c10::toString(type)) + ", " + std::to_string(value) + ", p = " + std::to_string(p));
    auto theirs = parameter_with_grad({value, value}, type);
    EXPECT_TRUE(std::isinf(torch::nn::utils::clip_grad_norm_(theirs, 1.0, p)));
    EXPECT_EQ(theirs.grad()[0].item<double>(), 0.0) << "libtorch zeroes the gradient";
    auto throwing = parameter_with_grad({value, value}, type);
    EXPECT_THROW((void)torch::nn::utils::clip_grad_norm_(throwing, 1.0, p, true), c10::Error);
    for (const bool error_if_nonfinite : {false, true}) {
      auto ours = parameter_with_grad({value, value}, type);
      const double stored = ours.grad()[0].item<double>();  // value rounded to the element type
      const quad exact = gradclip_test::to_quad(stored) * quad_root(quad(2), static_cast<int>(p));
      const double norm = gradclip::libtorch::clip_grad_norm_(ours, 1.0, p, error_if_nonfinite);
      EXPECT_LE(gradclip_test::relative_error(norm, exact), documented_norm_bound<double>(p)) << norm;
      // Each element within the documented bound of the exact g * c, c = 1 / (exact norm + 1e-6).
      const quad expected = gradclip_test::to_quad(stored) * exact_coefficient(exact, 1.0);
      for (int i = 0; i < 2; ++i) {
        const double got = ours.grad()[i].item<double>();
        if (type == torch::kDouble)
          EXPECT_LE(gradclip_test::ulps<double>(got, expected), documented_element_bound<double>(p)) << got;
        else
          EXPECT_LE(gradclip_test::ulps<float>(static_cast<float>(got), expected), documented_element_bound<float>(p))
              << got;
      }
    }
  }
}

// ---- clip_grad_value_ ----

/// Random values with the edge cases clamping meets: NaN, infinities, signed zeros, subnormals, values at
/// and beside the bounds used below.
std::vector<double> clamp_inputs(std::mt19937& rng) {
  std::vector<double> v{nan, -nan, inf, -inf, 0.0, -0.0, 1e-40, -1e-40, 0.1, -0.1, 0.5, -0.5, 1.0, -1.0, 3.3, -3.3};
  std::normal_distribution<double> normal(0, 2);
  while (v.size() < 256) v.push_back(normal(rng));
  return v;
}

const double clip_values[] = {0.0, 1e-40, 0.1, 0.5, 1.0, 3.3, 1e30, inf};

TEST(TorchClipValue, MatchesLibtorchBitForBit) {
  std::mt19937 rng(gradclip_test::seed);
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  for (const auto type : {torch::kBFloat16, torch::kFloat, torch::kDouble})
    for (const double clip_value : clip_values) {
      SCOPED_TRACE(std::string(c10::toString(type)) + ", clip_value " + std::to_string(clip_value));
      const auto values = clamp_inputs(rng);
      auto matrix = torch::tensor(values, torch::kDouble).view({16, 16}).to(type);
      std::vector<torch::Tensor> ours{parameter_with_grad(values, type), parameter_with_grad({2.5, -7}, type),
                                      torch::zeros({16, 16}, torch::dtype(type)).requires_grad_(true)};
      ours[2].mutable_grad() = matrix.t();  // transposed: not contiguous
      const auto theirs = clone_with_grads(ours);
      ASSERT_FALSE(ours[2].grad().is_contiguous());
      gradclip::libtorch::clip_grad_value_(ours, clip_value);
      torch::nn::utils::clip_grad_value_(theirs, clip_value);
      for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(same_bits(ours[i].grad(), theirs[i].grad())) << i;
      // The single-tensor and braced-list overloads.
      auto one = parameter_with_grad(values, type);
      auto two = parameter_with_grad({-9, 9}, type);
      gradclip::libtorch::clip_grad_value_(one, clip_value);
      gradclip::libtorch::clip_grad_value_({two}, clip_value);
      EXPECT_TRUE(same_bits(one.grad(), theirs[0].grad()));
      auto two_ref = parameter_with_grad({-9, 9}, type);
      torch::nn::utils::clip_grad_value_({two_ref}, clip_value);
      EXPECT_TRUE(same_bits(two.grad(), two_ref.grad()));
    }
}

// libtorch 1.13 cannot clamp Half on the CPU; the drop-in clamps it to the bound rounded to half, leaving
// the elements within it (NaN, signed zeros) bit for bit as they were.
TEST(TorchClipValue, HalfClampsWhereLibtorchThrows) {
  std::mt19937 rng(gradclip_test::seed);
  auto theirs = parameter_with_grad({3}, torch::kHalf);
  EXPECT_THROW(torch::nn::utils::clip_grad_value_(theirs, 1.0), c10::Error);
  for (const double clip_value : clip_values) {
    SCOPED_TRACE("clip_value " + std::to_string(clip_value));
    const auto values = clamp_inputs(rng);
    auto ours = parameter_with_grad(values, torch::kHalf);
    const auto before = ours.grad().clone();
    gradclip::libtorch::clip_grad_value_(ours, clip_value);
    const auto bound = static_cast<Eigen::half>(static_cast<float>(clip_value));
    const auto* got = ours.grad().data_ptr<c10::Half>();
    const auto* input = before.data_ptr<c10::Half>();
    for (std::size_t k = 0; k < values.size(); ++k) {
      const auto x = Eigen::numext::bit_cast<Eigen::half>(input[k].x);
      Eigen::half expected = x;
      if (x > bound) expected = bound;
      if (x < -bound) expected = -bound;
      EXPECT_EQ(got[k].x, Eigen::numext::bit_cast<std::uint16_t>(expected)) << "element " << k;
    }
  }
}

// libtorch throws when the bound does not fit the dtype (1e300 for FP32, 1e5 for FP16): no element can
// exceed it, so the drop-in leaves the gradient as it is.
TEST(TorchClipValue, BoundBeyondTheDtypeLeavesGradientsUnchanged) {
  std::mt19937 rng(gradclip_test::seed);
  const auto values = clamp_inputs(rng);
  for (const auto& [type, clip_value] :
       {std::pair{torch::kFloat, 1e300}, std::pair{torch::kBFloat16, 1e300}, std::pair{torch::kHalf, 1e5}}) {
    auto theirs = parameter_with_grad(values, type);
    if (type == torch::kHalf)
      EXPECT_THROW(torch::nn::utils::clip_grad_value_(theirs, clip_value), c10::Error);  // no Half clamp at all
    else
      EXPECT_THROW(torch::nn::utils::clip_grad_value_(theirs, clip_value), std::runtime_error);
    auto ours = parameter_with_grad(values, type);
    const auto before = ours.grad().clone();
    gradclip::libtorch::clip_grad_value_(ours, clip_value);
    EXPECT_TRUE(same_bits(ours.grad(), before)) << c10::toString(type);
  }
}

TEST(TorchClipValue, BadArgumentsThrowBeforeAnythingIsModified) {
  const std::string name = "gradclip::libtorch::clip_grad_value_";
  auto p = parameter_with_grad({300, -400}, torch::kFloat);
  expect_rejected([&] { gradclip::libtorch::clip_grad_value_(p, -1.0); }, p.grad(), name, "clip_value");
  expect_rejected([&] { gradclip::libtorch::clip_grad_value_(p, nan); }, p.grad(), name, "clip_value");
  auto q = torch::zeros({2}).requires_grad_(true);
  q.mutable_grad() = torch::tensor({1, 2}, torch::kInt);
  expect_rejected([&] { gradclip::libtorch::clip_grad_value_({p, q}, 1.0); }, p.grad(), name, "parameter 1");
}

// ---- clip_grad_norm_with and clip_grads_: options, policy, the whole clip_result ----

TEST(TorchWithOptions, DefaultsSkipNonFiniteNormsAndReportTheResult) {
  auto p = parameter_with_grad({3, 4}, torch::kFloat);
  const auto result = gradclip::libtorch::clip_grad_norm_with({p}, 1.0);
  EXPECT_EQ(result.norm, 5.0);
  EXPECT_TRUE(result.clipped);
  EXPECT_TRUE(result.finite);
  EXPECT_EQ(result.coefficient, 0.2);
  EXPECT_EQ(result.threshold, 1.0);
  EXPECT_FLOAT_EQ(p.grad()[1].item<float>(), 0.8f);
  auto bad = parameter_with_grad({nan, 4}, torch::kFloat);
  const auto skipped = gradclip::libtorch::clip_grad_norm_with({bad}, 1.0);
  EXPECT_FALSE(skipped.finite);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_EQ(bad.grad()[1].item<float>(), 4.0f);
}

TEST(TorchWithOptions, OptionsNormAndThreadsAreHonoured) {
  torch::manual_seed(12);
  auto big = torch::zeros({3 << 20}).requires_grad_(true);
  big.mutable_grad() = torch::randn({3 << 20});
  auto small = parameter_with_grad({-40, 3}, torch::kHalf);
  const std::vector<torch::Tensor> one_thread{big, small};
  const auto two_threads = clone_with_grads(one_thread);
  const auto a = gradclip::libtorch::clip_grad_norm_with(one_thread, 4.0,
                                                         {gradclip::on_nonfinite::skip, 0.0, gradclip::inf_norm, 1});
  const auto b = gradclip::libtorch::clip_grad_norm_with(two_threads, 4.0,
                                                         {gradclip::on_nonfinite::skip, 0.0, gradclip::inf_norm, 2});
  EXPECT_EQ(a.norm, 40.0);
  EXPECT_EQ(a.coefficient, 0.1);
  EXPECT_EQ(small.grad()[0].item<double>(), -4.0);
  EXPECT_EQ(b.norm, a.norm);
  for (std::size_t i = 0; i < one_thread.size(); ++i)
    EXPECT_TRUE(same_bits(one_thread[i].grad(), two_threads[i].grad()));
  auto l1 = torch::tensor({3.0, -4.0}, torch::kDouble);
  const auto c = gradclip::libtorch::clip_grads_({l1}, 1.0, {gradclip::on_nonfinite::skip, 0.0, gradclip::l1_norm});
  EXPECT_EQ(c.norm, 7.0);
  EXPECT_NEAR(l1[1].item<double>(), -4.0 / 7, 1e-16);
}

TEST(TorchWithOptions, MixedDtypesShareOneGlobalNorm) {
  auto weight = parameter_with_grad({300, -400}, torch::kHalf);
  auto bias = parameter_with_grad({1200}, torch::kFloat);
  auto scale = parameter_with_grad({0.5}, torch::kBFloat16);
  auto shift = parameter_with_grad({-0.25}, torch::kDouble);
  const auto result = gradclip::libtorch::clip_grad_norm_with({weight, bias, scale, shift}, 13.0);
  const quad exact = gradclip_test::quad_sqrt(quad(300) * 300 + quad(400) * 400 + quad(1200) * 1200 + quad(0.3125));
  EXPECT_LE(gradclip_test::relative_error(result.norm, exact), 1e-14);
  const quad c = 13 / exact;
  EXPECT_LE(gradclip_test::ulps<Eigen::half>(Eigen::half(weight.grad()[1].item<float>()), -400 * c), 1.0);
  EXPECT_LE(gradclip_test::ulps<float>(bias.grad()[0].item<float>(), 1200 * c), 1.0);
  EXPECT_LE(gradclip_test::ulps<Eigen::bfloat16>(Eigen::bfloat16(scale.grad()[0].item<float>()), quad(0.5) * c), 1.0);
  EXPECT_LE(gradclip_test::ulps<double>(shift.grad()[0].item<double>(), quad(-0.25) * c), 1.0);
}

TEST(TorchWithOptions, ParametersWithoutGradientAreIgnored) {
  auto with = parameter_with_grad({3, 4}, torch::kFloat);
  auto without = torch::ones({2}).requires_grad_(true);
  const auto result = gradclip::libtorch::clip_grad_norm_with({without, with, torch::Tensor()}, 1.0);
  EXPECT_EQ(result.norm, 5.0);
  EXPECT_FALSE(without.grad().defined());
  EXPECT_FLOAT_EQ(with.grad()[1].item<float>(), 0.8f);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_with({without}, 1.0).norm, 0.0);
}

/// options::report from clip_grad_norm_with: one entry per defined gradient (parameters without one are left
/// out), in order, each counted exactly as its dtype sees it and its norm within the documented bound of
/// the exact one; under skip it names the gradient that went NaN; a call that throws leaves it as it was.
TEST(TorchWithOptions, ReportHasEveryDefinedGradientAsItWasRead) {
  const double fp16_subnormal = std::ldexp(1.0, -20), fp32_subnormal = 1e-40, fp64_subnormal = 1e-310;
  for (const gradclip::norm_type norm : {gradclip::l2_norm, gradclip::inf_norm}) {
    const double p = norm.p();
    auto half = parameter_with_grad({0, fp16_subnormal, -3, 0, 4}, torch::kHalf);
    auto without = torch::ones({2}).requires_grad_(true);
    auto single = parameter_with_grad({fp32_subnormal, -0.0, 12}, torch::kFloat);
    auto wide = parameter_with_grad({1e300, -1e300, fp64_subnormal}, torch::kDouble);
    auto empty = torch::zeros({0}, torch::dtype(torch::kBFloat16).device(test_device())).requires_grad_(true);
    empty.mutable_grad() = torch::zeros({0}, torch::dtype(torch::kBFloat16).device(test_device()));
    const std::vector<torch::Tensor> defined{half, single, wide, empty};
    std::vector<quad> exact;
    for (const auto& parameter : defined) exact.push_back(exact_global_norm({parameter}, p));

    gradclip::tensor_report report;
    gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, norm};
    opt.report = &report;
    const auto result = gradclip::libtorch::clip_grad_norm_with({half, without, single, wide, empty}, 1.0, opt);
    EXPECT_TRUE(result.clipped);
    ASSERT_EQ(report.size(), 4u);
    const double bounds[] = {documented_norm_bound<Eigen::half>(p), documented_norm_bound<float>(p),
                             documented_norm_bound<double>(p), 0.0};
    const std::size_t sizes[] = {5, 3, 3, 0}, zeros[] = {2, 1, 0, 0}, subnormals[] = {1, 1, 1, 0};
    const double max_abs[] = {4, 12, 1e300, 0};
    for (std::size_t i = 0; i < report.size(); ++i) {
      SCOPED_TRACE("gradient " + std::to_string(i) + ", p = " + std::to_string(p));
      EXPECT_EQ(report[i].size, sizes[i]);
      EXPECT_EQ(report[i].nan, 0u);
      EXPECT_EQ(report[i].inf, 0u);
      EXPECT_EQ(report[i].zeros, zeros[i]);
      EXPECT_EQ(report[i].subnormals, subnormals[i]);
      EXPECT_EQ(report[i].max_abs, max_abs[i]);
      if (exact[i] == 0) {
        EXPECT_EQ(report[i].norm, 0.0);
      } else {
        EXPECT_LE(gradclip_test::relative_error(report[i].norm, exact[i]), bounds[i]);
      }
    }

    auto poisoned = parameter_with_grad({1, nan, -inf}, torch::kFloat);
    auto fine = parameter_with_grad({2}, torch::kHalf);
    const auto skipped = gradclip::libtorch::clip_grad_norm_with({fine, poisoned}, 1.0, opt);
    EXPECT_FALSE(skipped.finite);
    ASSERT_EQ(report.size(), 2u);
    EXPECT_EQ(report.first_nonfinite(), 1u);
    EXPECT_EQ(report[0].norm, 2.0);
    EXPECT_EQ(report[1].nan, 1u);
    EXPECT_EQ(report[1].inf, 1u);
    EXPECT_TRUE(std::isnan(report[1].max_abs));
    EXPECT_FALSE(std::isfinite(report[1].norm));

    opt.nonfinite = gradclip::on_nonfinite::error;
    auto other = parameter_with_grad({5, 6, 7}, torch::kFloat);
    EXPECT_THROW((void)gradclip::libtorch::clip_grad_norm_with({other, poisoned}, 1.0, opt), gradclip::nonfinite_error);
    ASSERT_EQ(report.size(), 2u);  // still the skipped call's
    EXPECT_EQ(report[0].norm, 2.0);
    EXPECT_EQ(report[1].nan, 1u);
  }
}

TEST(TorchWithOptions, ClipGradsTakesGradientTensors) {
  auto g = torch::tensor({3.0f, 4.0f});
  const auto result = gradclip::libtorch::clip_grads_({g, torch::Tensor()}, 1.0);
  EXPECT_EQ(result.norm, 5.0);
  EXPECT_FLOAT_EQ(g[0].item<float>(), 0.6f);
}

TEST(TorchWithOptions, NonContiguousGradientsAreClippedInPlace) {
  torch::manual_seed(3);
  // A transposed matrix (dense, permuted), a column slice and a strided slice (gaps between elements).
  auto base = torch::randn({6, 8}) * 10;
  auto reference_base = base.clone();
  auto transposed = torch::randn({5, 7}).t();
  auto column = base.select(1, 2);
  auto every_other = base.index({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)});
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_FALSE(column.is_contiguous());
  ASSERT_FALSE(every_other.is_contiguous());
  // column and every_other overlap in base, so clip them in separate calls, each against its copy.
  for (const auto& g : {transposed, column}) {
    const auto original = values_of(g);
    const quad exact = gradclip_test::exact_norm(original);
    auto expected = g.contiguous();
    const auto r1 = gradclip::libtorch::clip_grads_({g}, 1.0);
    const auto r2 = gradclip::libtorch::clip_grads_({expected}, 1.0);
    EXPECT_TRUE(r1.clipped);
    EXPECT_LE(gradclip_test::relative_error(r1.norm, exact), documented_norm_bound<float>(2));
    EXPECT_LE(gradclip_test::relative_error(r2.norm, exact), documented_norm_bound<float>(2));
    EXPECT_NEAR(r1.norm, r2.norm, 1e-15 * r2.norm);  // the transpose is summed in another order
    // Both within the documented bound of the exact projection g / ||g|| (FP32: 0.5 ulp and the coefficient's
    // error).
    const auto got = values_of(g);
    const auto contiguous = values_of(expected);
    for (std::size_t k = 0; k < original.size(); ++k) {
      const quad projection = gradclip_test::to_quad(original[k]) / exact;
      EXPECT_LE(gradclip_test::ulps<float>(static_cast<float>(got[k]), projection), documented_element_bound<float>(2))
          << "element " << k;
      EXPECT_LE(gradclip_test::ulps<float>(static_cast<float>(contiguous[k]), projection),
                documented_element_bound<float>(2))
          << "element " << k;
    }
  }
  // Elements outside the column are untouched; the column is clipped in the caller's tensor, each element
  // within the documented bound of the exact projection of the original column.
  EXPECT_TRUE(torch::equal(base.select(1, 1), reference_base.select(1, 1)));
  const auto original_column = values_of(reference_base.select(1, 2));
  const auto clipped_column = values_of(base.select(1, 2));
  const quad column_norm = gradclip_test::exact_norm(original_column);
  for (std::size_t k = 0; k < original_column.size(); ++k)
    EXPECT_LE(gradclip_test::ulps<float>(static_cast<float>(clipped_column[k]),
                                         gradclip_test::to_quad(original_column[k]) / column_norm),
              documented_element_bound<float>(2))
        << "element " << k;
  auto expected = every_other.contiguous();
  (void)gradclip::libtorch::clip_grads_({expected}, 1.0);
  (void)gradclip::libtorch::clip_grads_({every_other}, 1.0);
  EXPECT_TRUE(torch::equal(every_other, expected));
  EXPECT_TRUE(torch::equal(base.select(1, 3), reference_base.select(1, 3)));
}

TEST(TorchWithOptions, NonFiniteNormsFollowTheOptions) {
  auto g = torch::tensor({std::numeric_limits<float>::infinity(), 1.0f});
  const auto skipped = gradclip::libtorch::clip_grads_({g}, 1.0);
  EXPECT_FALSE(skipped.finite);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_EQ(g[1].item<float>(), 1.0f);
  try {
    (void)gradclip::libtorch::clip_grads_({g}, 1.0, {gradclip::on_nonfinite::error});
    FAIL() << "expected gradclip::nonfinite_error";
  } catch (const gradclip::nonfinite_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("gradclip::libtorch::clip_grads_", 0), 0u) << e.what();
  }
  (void)gradclip::libtorch::clip_grads_({g}, 1.0, pytorch);
  EXPECT_EQ(g[1].item<float>(), 0.0f);
}

TEST(TorchWithOptions, PolicyIsPassedThrough) {
  auto ours = parameter_with_grad({300}, torch::kHalf);
  if (gradclip::libtorch::detail::use_ops({ours.grad()})) {
    // libtorch's operations compute the robust policy only, and say so.
    expect_rejected([&] { (void)gradclip::libtorch::clip_grad_norm_with<gradclip::naive>({ours}, 1.0, pytorch); },
                    ours.grad(), "gradclip::libtorch::clip_grad_norm_with", "robust policy only");
    return;
  }
  (void)gradclip::libtorch::clip_grad_norm_with<gradclip::naive>({ours}, 1.0, pytorch);
  EXPECT_EQ(ours.grad().item<double>(), 0.0) << "naive reproduces the FP16 overflow on purpose";
}

// gradclip::rms_norm is no p-norm: the drop-ins, whose norm_type is libtorch's p, refuse its key; the
// options front-ends take it on the CPU and refuse it on libtorch's operations, which compute p-norms only.
TEST(TorchWithOptions, RmsNormRunsNativelyAndIsRefusedWhereOnlyPNormsRun) {
  auto w = torch::zeros({10, 10}, torch::kFloat).requires_grad_();
  w.mutable_grad() = torch::full({10, 10}, 3.0, torch::kFloat);
  const auto original = w.grad().clone();
  EXPECT_THROW((void)gradclip::libtorch::clip_grad_norm_(w, 1.0, -2.0), std::invalid_argument);
  EXPECT_THROW((void)gradclip::libtorch::get_total_norm({w.grad()}, -2.0), std::invalid_argument);
  EXPECT_TRUE(torch::equal(w.grad(), original));
  const gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, gradclip::rms_norm};
  if (GRADCLIP_TORCH_FORCE_OPS) {
    try {
      (void)gradclip::libtorch::clip_grad_norm_with({w}, 1.0, opt);
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("p-norms only"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(w.grad(), original));
  } else {
    const auto result = gradclip::libtorch::clip_grad_norm_with({w}, 1.0, opt);
    EXPECT_EQ(result.norm, 3.0);
    EXPECT_TRUE(result.clipped);
    EXPECT_LE((w.grad() - 1.0).abs().max().item<double>(), 0x1p-24);
  }
}

TEST(TorchWithOptions, UnsupportedTensorsThrowBeforeAnythingIsModified) {
  const std::string name = "gradclip::libtorch::clip_grads_";
  auto valid = torch::tensor({300.0f, 400.0f});
  const auto call = [&](torch::Tensor bad) {
    return [=] { (void)gradclip::libtorch::clip_grads_({valid, bad}, 1.0); };
  };
  expect_rejected(call(torch::tensor({1, 2}, torch::kInt)), valid, name, "Int");
  expect_rejected(call(torch::tensor({1.0f, 2.0f}).to_sparse()), valid, name, "sparse");
  expect_rejected(call(torch::empty({2}, torch::device(torch::kMeta))), valid, name, "meta");
  expect_rejected(call(torch::tensor({1.0f}).expand({4})), valid, name, "share memory");
  expect_rejected([&] { (void)gradclip::libtorch::clip_grads_({valid}, -1.0); }, valid, name, "max_norm");
  auto p = torch::zeros({2}).requires_grad_(true);
  p.mutable_grad() = torch::tensor({1, 2}, torch::kLong);
  expect_rejected([&] { (void)gradclip::libtorch::clip_grad_norm_with({p}, 1.0); }, valid,
                  "gradclip::libtorch::clip_grad_norm_with", "parameter 0");
}

// ---- adaptive_clip_ ----

// The libtorch AGC equals gradclip::adaptive_clip on the same numbers in a row-major Eigen matrix
// (PyTorch's [out, in] layout: one unit per row), bit for bit.
TEST(TorchAdaptiveClip, MatchesTheEigenImplementationRowByRow) {
  torch::manual_seed(5);
  auto weight = torch::randn({8, 5}, torch::kFloat).requires_grad_(true);
  auto grad = torch::randn({8, 5}, torch::kFloat) * torch::linspace(0.001, 1.0, 8, torch::kFloat).unsqueeze(1);
  weight.mutable_grad() = grad.clone();
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMajor expected = Eigen::Map<const RowMajor>(grad.data_ptr<float>(), 8, 5);
  const RowMajor w = Eigen::Map<const RowMajor>(weight.detach().data_ptr<float>(), 8, 5);
  const auto eigen = gradclip::adaptive_clip(expected, w, 0.05);
  const auto torch_result = gradclip::libtorch::adaptive_clip_(weight, 0.05);
  EXPECT_EQ(torch_result.units, 8u);
  EXPECT_EQ(torch_result.clipped, eigen.clipped);
  EXPECT_GT(torch_result.clipped, 0u);
  EXPECT_LT(torch_result.clipped, 8u);
  EXPECT_EQ(torch_result.min_coefficient, eigen.min_coefficient);
  const RowMajor got = Eigen::Map<const RowMajor>(weight.grad().data_ptr<float>(), 8, 5);
  EXPECT_TRUE((got.array() == expected.array()).all());
}

TEST(TorchAdaptiveClip, NonContiguousGradientAndMixedDtypesAreClippedInPlace) {
  torch::manual_seed(6);
  auto weight = torch::randn({6, 4}, torch::kDouble).requires_grad_(true);
  // A transposed BFloat16 gradient: clipped through a contiguous copy, written back into the caller's tensor.
  auto storage = (torch::randn({4, 6}, torch::kFloat) * 10).to(torch::kBFloat16);
  weight.mutable_grad() = storage.t();
  ASSERT_FALSE(weight.grad().is_contiguous());
  const auto expected_input = weight.grad().contiguous().clone();
  const auto result = gradclip::libtorch::adaptive_clip_(weight, 0.01);
  EXPECT_EQ(result.units, 6u);
  EXPECT_EQ(result.clipped, 6u);
  for (std::int64_t u = 0; u < 6; ++u) {
    const double w_norm = weight.detach()[u].norm().item<double>();
    const double g_norm = expected_input[u].to(torch::kDouble).norm().item<double>();
    const double coefficient = 0.01 * std::max(w_norm, 1e-3) / g_norm;
    for (std::int64_t i = 0; i < 4; ++i) {
      const double exact = expected_input[u][i].item<double>() * coefficient;
      EXPECT_NEAR(storage[i][u].item<double>(), exact, std::abs(exact) * 0x1p-8 + 1e-30) << "unit " << u;
    }
  }
}

TEST(TorchAdaptiveClip, ParametersWithoutGradientAndBadArguments) {
  auto weight = torch::ones({3, 3}, torch::kFloat).requires_grad_(true);
  EXPECT_EQ(gradclip::libtorch::adaptive_clip_(weight, 0.01).units, 0u);
  weight.mutable_grad() = torch::ones({3, 3}, torch::kFloat);
  EXPECT_THROW((void)gradclip::libtorch::adaptive_clip_(weight, -1.0), std::invalid_argument);
  weight.mutable_grad() = torch::ones({3, 2}, torch::kFloat);
  EXPECT_THROW((void)gradclip::libtorch::adaptive_clip_(weight, 0.01), std::invalid_argument);
  EXPECT_TRUE(torch::equal(weight.grad(), torch::ones({3, 2}, torch::kFloat)));
}

// ---- the libtorch-ops path: tensors on any device but the CPU (all of them under GRADCLIP_TEST_TORCH_OPS=1) ----

/// The gradients of `parameters`.
std::vector<torch::Tensor> gradients_of(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : parameters) grads.push_back(p.grad());
  return grads;
}

/// clip_grad_norm_'s steps through the op path whatever the build: reduce, plan, scale.
double clip_through_ops(const std::vector<torch::Tensor>& parameters, double max_norm, double p = 2.0) {
  const auto grads = gradients_of(parameters);
  const gradclip::partial_norm part = gradclip::libtorch::detail::op_reduce(grads, p);
  const gradclip::options opt{gradclip::on_nonfinite::propagate, 1e-6, gradclip::norm_type{p}};
  const auto plan = gradclip::detail::plan_clip("clip_through_ops", part, max_norm, opt);
  if (plan.result.clipped) gradclip::libtorch::detail::op_scale(grads, plan.coefficient);
  return plan.result.norm;
}

/// The op path's norm of random models is within the documented bound of the binary128 norm, so within
/// twice that bound of the native path's (CPU runs); every element it clips is the exact g * c within
/// 0.5 ulp plus its coefficient's error: the norm's, FP64's roundings, and for FP16/BF16 the FP32
/// coefficient and product (2 * 2^-24).
template <class T>
void expect_op_path_within_bound(torch::Dtype type, double p) {
  std::printf("seed %llu, p = %g\n", static_cast<unsigned long long>(gradclip_test::seed), p);
  std::mt19937 rng(gradclip_test::seed + 27);
  torch::manual_seed(gradclip_test::seed + 27);
  element_errors errors;
  double op_worst = 0, apart_worst = 0;
  const gradclip::options opt{gradclip::on_nonfinite::propagate, 1e-6, gradclip::norm_type{p}};
  for (int model = 0; model < 20; ++model) {
    SCOPED_TRACE("model " + std::to_string(model));
    const auto ops = random_model(type, rng);
    const auto originals = clone_with_grads(ops);
    const double max_norm = std::pow(10.0, std::uniform_real_distribution<double>(-2, 3)(rng));
    const quad exact = exact_global_norm(originals, p);
    const double op_norm = clip_through_ops(ops, max_norm, p);
    const double op_error = gradclip_test::relative_error(op_norm, exact);
    EXPECT_LE(op_error, documented_norm_bound<T>(p, true));
    op_worst = std::max(op_worst, op_error);
    if (test_device().is_cpu()) {
      std::vector<gradclip::grad_view> native;
      for (const auto& g : gradients_of(originals)) native.push_back(gradclip::libtorch::detail::flat_view(g));
      const double native_norm = gradclip::global_norm(native, opt);
      const double apart = std::abs(op_norm - native_norm) / static_cast<double>(exact);
      EXPECT_LE(apart, documented_norm_bound<T>(p, true) + documented_norm_bound<T>(p, false))
          << op_norm << " against the native " << native_norm;
      apart_worst = std::max(apart_worst, apart);
    }
    const double narrow = sizeof(T) == 2 ? 0x1p-23 : 0.0;
    compare_elements<T>(originals, ops, nullptr, exact_coefficient(exact, max_norm), op_error + 0x1p-52 + narrow,
                        errors);
  }
  std::printf("op path: norm relative error %.3g, apart from the native path %.3g; elements %.3f ulp (held to %.3f)\n",
              op_worst, apart_worst, errors.ours, errors.tolerance);
}

TEST(TorchOpPath, Float16AgreesWithTheNativePath) {
  for (const double p : {1.0, 2.0, 3.0, inf}) expect_op_path_within_bound<Eigen::half>(torch::kHalf, p);
}
TEST(TorchOpPath, BFloat16AgreesWithTheNativePath) {
  for (const double p : {1.0, 2.0, 3.0, inf}) expect_op_path_within_bound<Eigen::bfloat16>(torch::kBFloat16, p);
}
TEST(TorchOpPath, Float32AgreesWithTheNativePath) {
  for (const double p : {1.0, 2.0, 3.0, inf}) expect_op_path_within_bound<float>(torch::kFloat, p);
}
TEST(TorchOpPath, Float64AgreesWithTheNativePath) {
  for (const double p : {1.0, 2.0, 3.0, inf}) expect_op_path_within_bound<double>(torch::kDouble, p);
}

// The seed cases through libtorch's operations: FP16 [300] -> [1]; FP16 [60000, 60000] and FP32 [1e20, 1e20]
// -> 0.7071 each, with the right norm (libtorch: an FP16 error on the CPU, inf on CUDA).
TEST(TorchOpPath, SeedCasesHold) {
  auto small = parameter_with_grad({300}, torch::kHalf);
  EXPECT_EQ(clip_through_ops({small}, 1.0), 300.0);
  EXPECT_EQ(small.grad().item<double>(), 1.0);
  for (const auto& [type, value] : {std::pair{torch::kHalf, 60000.0}, std::pair{torch::kFloat, 1e20}}) {
    SCOPED_TRACE(c10::toString(type));
    auto big = parameter_with_grad({value, value}, type);
    const double stored = big.grad()[0].item<double>();
    const quad exact = gradclip_test::to_quad(stored) * gradclip_test::quad_sqrt(2);
    const double norm = clip_through_ops({big}, 1.0);
    EXPECT_LE(gradclip_test::relative_error(norm, exact), type == torch::kHalf
                                                              ? documented_norm_bound<Eigen::half>(2, true)
                                                              : documented_norm_bound<float>(2, true))
        << norm;
    const quad expected = gradclip_test::to_quad(stored) * exact_coefficient(exact, 1.0);
    for (int i = 0; i < 2; ++i) {
      const double got = big.grad()[i].item<double>();
      if (type == torch::kHalf)
        EXPECT_EQ(got, static_cast<double>(Eigen::half(static_cast<float>(expected))));
      else
        EXPECT_LE(gradclip_test::ulps<float>(static_cast<float>(got), expected), 0.5 + 0x1p-20);
    }
    EXPECT_EQ(big.grad().scalar_type(), type);
  }
}

// Each tensor keeps its dtype, device, shape and storage (clipped in place, strided ones too).
TEST(TorchOpPath, DeviceDtypeAndStorageAreKept) {
  std::vector<torch::Tensor> parameters;
  for (const auto type : {torch::kHalf, torch::kBFloat16, torch::kFloat, torch::kDouble}) {
    parameters.push_back(parameter_with_grad({300, -400, 1200}, type));
    auto strided = torch::zeros({3}, torch::dtype(type).device(test_device())).requires_grad_(true);
    strided.mutable_grad() = (torch::ones({3, 2}, torch::dtype(type).device(test_device())) * 7).select(1, 1);
    parameters.push_back(strided);
  }
  std::vector<const void*> storage;
  for (const auto& p : parameters) storage.push_back(p.grad().data_ptr());
  (void)clip_through_ops(parameters, 1.0);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    EXPECT_EQ(parameters[i].grad().data_ptr(), storage[i]) << i;
    EXPECT_EQ(parameters[i].grad().device(), test_device()) << i;
    EXPECT_EQ(parameters[i].grad().scalar_type(), parameters[i].scalar_type()) << i;
    EXPECT_EQ(parameters[i].grad().numel(), 3) << i;
    EXPECT_LT(std::abs(parameters[i].grad()[0].item<double>()), 1.0) << i;
  }
}

// Tensors on two devices in one call: std::invalid_argument naming both, before anything is modified.
TEST(TorchOpPath, MixedDevicesAreRefusedNamingBoth) {
  auto valid = parameter_with_grad({300, 400}, torch::kFloat);
  const auto other = test_device().is_cpu() ? torch::Device(torch::kMeta) : torch::Device(torch::kCPU);
  auto elsewhere = torch::zeros({2}, torch::device(other)).requires_grad_(true);
  elsewhere.mutable_grad() = torch::ones({2}, torch::device(other));
  const std::string both =
      "device " + test_device().str() + " and the gradient of parameter 1 on device " + other.str();
  expect_rejected(
      [&] {
        (void)gradclip::libtorch::clip_grad_norm_({valid, elsewhere}, 1.0);
      },
      valid.grad(), "gradclip::libtorch::clip_grad_norm_", both);
  expect_rejected(
      [&] {
        gradclip::libtorch::clip_grads_with_norm_({valid, elsewhere}, 1.0, 500.0);
      },
      valid.grad(), "gradclip::libtorch::clip_grads_with_norm_", both);
  expect_rejected(
      [&] {
        (void)gradclip::libtorch::get_total_norm({valid.grad(), elsewhere.grad()});
      },
      valid.grad(), "gradclip::libtorch::get_total_norm", "one device");
}

// ---- PyTorch 2.x's split API: get_total_norm, clip_grads_with_norm_ ----

/// get_total_norm then clip_grads_with_norm_ give clip_grad_norm_'s norm and elements bit for bit.
template <class T>
void expect_split_gives_the_same_bits(torch::Dtype type) {
  std::mt19937 rng(gradclip_test::seed + 2);
  torch::manual_seed(gradclip_test::seed + 2);
  for (const double p : {1.0, 2.0, 3.0, inf})
    for (int model = 0; model < 10; ++model) {
      SCOPED_TRACE("p = " + std::to_string(p) + ", model " + std::to_string(model));
      const auto whole = random_model(type, rng);
      const auto split = clone_with_grads(whole);
      const double max_norm = std::pow(10.0, std::uniform_real_distribution<double>(-2, 3)(rng));
      const double norm = gradclip::libtorch::clip_grad_norm_(whole, max_norm, p);
      const double total = gradclip::libtorch::get_total_norm(gradients_of(split), p);
      gradclip::libtorch::clip_grads_with_norm_(split, max_norm, total);
      EXPECT_EQ(std::memcmp(&norm, &total, sizeof(double)), 0) << norm << " against " << total;
      for (std::size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(same_bits(whole[i].grad(), split[i].grad())) << i;
    }
}

TEST(TorchSplitApi, Float16GivesClipGradNormsBits) { expect_split_gives_the_same_bits<Eigen::half>(torch::kHalf); }
TEST(TorchSplitApi, BFloat16GivesClipGradNormsBits) {
  expect_split_gives_the_same_bits<Eigen::bfloat16>(torch::kBFloat16);
}
TEST(TorchSplitApi, Float32GivesClipGradNormsBits) { expect_split_gives_the_same_bits<float>(torch::kFloat); }
TEST(TorchSplitApi, Float64GivesClipGradNormsBits) { expect_split_gives_the_same_bits<double>(torch::kDouble); }

// Non-finite gradients: NaN or +inf from get_total_norm, propagated by clip_grads_with_norm_ as by
// clip_grad_norm_; error_if_nonfinite throws from get_total_norm, naming it, and modifies nothing.
TEST(TorchSplitApi, NonFiniteNormsAsClipGradNorm) {
  for (const double bad : {nan, inf}) {
    const std::vector<torch::Tensor> whole{parameter_with_grad({bad, 1, -2}, torch::kFloat),
                                           parameter_with_grad({0.5}, torch::kDouble)};
    const auto split = clone_with_grads(whole);
    const auto before = clone_with_grads(whole);
    const double norm = gradclip::libtorch::clip_grad_norm_(whole, 1.0);
    const double total = gradclip::libtorch::get_total_norm(gradients_of(split));
    EXPECT_EQ(std::isnan(total), std::isnan(bad));
    EXPECT_EQ(std::isnan(norm), std::isnan(total));
    gradclip::libtorch::clip_grads_with_norm_(split, 1.0, total);
    for (std::size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(same_bits_any_nan(whole[i].grad(), split[i].grad()));
    try {
      (void)gradclip::libtorch::get_total_norm(gradients_of(before), 2.0, true);
      ADD_FAILURE() << "expected gradclip::nonfinite_error";
    } catch (const gradclip::nonfinite_error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::libtorch::get_total_norm", 0), 0u) << e.what();
    }
  }
  EXPECT_EQ(gradclip::libtorch::get_total_norm({}), 0.0);
  EXPECT_EQ(gradclip::libtorch::get_total_norm({torch::Tensor()}), 0.0);
}

// The one difference: a finite FP64 group whose norm exceeds double's range. clip_grad_norm_ returns +inf
// and clips it right; the double get_total_norm returns cannot carry it, so clip_grads_with_norm_ applies
// PyTorch's arithmetic to +inf (the gradients are zeroed, as PyTorch does).
TEST(TorchSplitApi, NormBeyondDoublesRangeIsTheOneDifference) {
  auto whole = parameter_with_grad({1.5e308, 1.5e308}, torch::kDouble);
  auto split = parameter_with_grad({1.5e308, 1.5e308}, torch::kDouble);
  EXPECT_TRUE(std::isinf(gradclip::libtorch::clip_grad_norm_(whole, 1.0)));
  // Within the documented bound of the exact 1.5e308 / (1.5e308 * sqrt(2) + 1e-6).
  const quad whole_norm = gradclip_test::to_quad(1.5e308) * gradclip_test::quad_sqrt(2);
  EXPECT_LE(gradclip_test::ulps<double>(whole.grad()[0].item<double>(),
                                        gradclip_test::to_quad(1.5e308) * exact_coefficient(whole_norm, 1.0)),
            documented_element_bound<double>(2));
  const double total = gradclip::libtorch::get_total_norm({split.grad()});
  EXPECT_TRUE(std::isinf(total));
  gradclip::libtorch::clip_grads_with_norm_({split}, 1.0, total);
  EXPECT_EQ(split.grad()[0].item<double>(), 0.0);
}

TEST(TorchSplitApi, BadArgumentsThrowBeforeAnythingIsModified) {
  auto p = parameter_with_grad({300, 400}, torch::kFloat);
  const std::string clip = "gradclip::libtorch::clip_grads_with_norm_";
  expect_rejected([&] { gradclip::libtorch::clip_grads_with_norm_({p}, 1.0, -1.0); }, p.grad(), clip, "total_norm");
  expect_rejected([&] { gradclip::libtorch::clip_grads_with_norm_({p}, -1.0, 5.0); }, p.grad(), clip, "max_norm");
  expect_rejected([&] { gradclip::libtorch::clip_grads_with_norm_({p}, nan, 5.0); }, p.grad(), clip, "max_norm");
  expect_rejected([&] { (void)gradclip::libtorch::get_total_norm({p.grad()}, 0.0); }, p.grad(),
                  "gradclip::libtorch::get_total_norm", "norm");
  expect_rejected(
      [&] {
        (void)gradclip::libtorch::get_total_norm({torch::tensor({1, 2}, torch::kInt)});
      },
      p.grad(), "gradclip::libtorch::get_total_norm", "gradient 0");
  // A total norm that does not clip leaves the gradients alone; one that does clips by max_norm / (total + 1e-6).
  const auto before = p.grad().clone();
  gradclip::libtorch::clip_grads_with_norm_({p}, 1e3, 500.0);
  EXPECT_TRUE(same_bits(p.grad(), before));
  gradclip::libtorch::clip_grads_with_norm_({p}, 1.0, 500.0);
  const quad c = quad(1) / (quad(500) + quad(1e-6));
  EXPECT_LE(gradclip_test::ulps<float>(p.grad()[1].item<float>(), 400 * c), 0.5 + 0x1p-20);
}

}  // namespace
