// The libtorch adapter against torch::nn::utils::clip_grad_norm_ itself (libtorch 1.13).
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

const gradclip::options pytorch{gradclip::on_nonfinite::propagate, 1e-6};

/// A parameter of the given dtype whose gradient holds `values`.
torch::Tensor parameter_with_grad(const std::vector<double>& values, torch::Dtype type) {
  auto p = torch::zeros({static_cast<std::int64_t>(values.size())}, torch::dtype(type)).requires_grad_(true);
  p.mutable_grad() = torch::tensor(values, torch::kDouble).to(type);
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
    auto p = torch::zeros(shape, torch::dtype(type)).requires_grad_(true);
    p.mutable_grad() = (torch::randn(shape, torch::kDouble) * std::pow(10.0, exponent(rng))).to(type);
    parameters.push_back(p);
  }
  return parameters;
}

std::vector<torch::Tensor> clone_with_grads(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> copies;
  for (const auto& p : parameters) {
    auto c = p.detach().clone().requires_grad_(true);
    c.mutable_grad() = p.grad().clone();
    copies.push_back(c);
  }
  return copies;
}

/// The exact global norm of the models' gradients, in binary128.
gradclip_test::quad exact_global_norm(const std::vector<torch::Tensor>& parameters) {
  gradclip_test::quad sum = 0;
  for (const auto& p : parameters) {
    const auto g = p.grad().to(torch::kDouble).contiguous();
    const double* data = g.data_ptr<double>();
    for (std::int64_t k = 0; k < g.numel(); ++k) sum += gradclip_test::to_quad(data[k]) * data[k];
  }
  return gradclip_test::quad_sqrt(sum);
}

/// On random models clipped with PyTorch's epsilon, every element of ours is the exact
/// g * max_norm / (norm + 1e-6) rounded once (FP32) or within 4 ulp of it (FP64: the norm is summed in double), and so
/// within one rounding of libtorch's result plus libtorch's own error, which the test measures and prints: libtorch
/// rounds its norm (FP32 for FP32 gradients) and its coefficient to the element type before multiplying.
template <class T>
void expect_parity_on_random_models(torch::Dtype type) {
  // FP32 is clipped in double and rounded once; FP64 adds the roundings of the norm and the coefficient.
  const double tolerance = std::is_same_v<T, float> ? 0.5 + 1e-6 : 4.0;
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937 rng(gradclip_test::seed);
  torch::manual_seed(gradclip_test::seed);
  double ours_worst = 0;
  double theirs_worst = 0;
  double apart_worst = 0;
  std::int64_t elements = 0;
  for (int model = 0; model < 50; ++model) {
    const auto ours = random_model(type, rng);
    const auto theirs = clone_with_grads(ours);
    const auto originals = clone_with_grads(ours);
    const double max_norm = std::pow(10.0, std::uniform_real_distribution<double>(-2, 3)(rng));
    const auto exact_norm = exact_global_norm(ours);
    const auto coefficient = exact_norm > max_norm ? max_norm / (exact_norm + gradclip_test::quad(1e-6)) : 1;
    const double reference = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    const auto result = gradclip::libtorch::clip_grad_norm_(ours, max_norm, pytorch);
    EXPECT_LE(gradclip_test::relative_error(result.norm, exact_norm), 1e-12) << "model " << model;
    EXPECT_NEAR(result.norm, reference, reference * 8 * std::numeric_limits<T>::epsilon()) << "model " << model;
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const auto original = originals[i].grad().to(torch::kDouble).contiguous().view(-1);
      const auto a = ours[i].grad().contiguous().view(-1);
      const auto b = theirs[i].grad().contiguous().view(-1);
      for (std::int64_t k = 0; k < a.numel(); ++k, ++elements) {
        const auto exact = gradclip_test::to_quad(original.data_ptr<double>()[k]) * coefficient;
        const double ours_error = gradclip_test::ulps<T>(a.data_ptr<T>()[k], exact);
        ours_worst = std::max(ours_worst, ours_error);
        theirs_worst = std::max(theirs_worst, gradclip_test::ulps<T>(b.data_ptr<T>()[k], exact));
        apart_worst = std::max(apart_worst, gradclip_test::ulps<T>(a.data_ptr<T>()[k], b.data_ptr<T>()[k]));
        ASSERT_LE(ours_error, tolerance) << "model " << model << ", tensor " << i << ", element " << k;
      }
    }
  }
  std::printf("%lld elements; largest error in ulp: gradclip %.2f, libtorch %.2f; largest difference %.2f\n",
              static_cast<long long>(elements), ours_worst, theirs_worst, apart_worst);
  EXPECT_LE(apart_worst, theirs_worst + 1.0);
}

TEST(TorchParity, Float32AgreesWithLibtorchOnRandomModels) { expect_parity_on_random_models<float>(torch::kFloat); }

TEST(TorchParity, Float64AgreesWithLibtorchOnRandomModels) { expect_parity_on_random_models<double>(torch::kDouble); }

TEST(TorchParity, BelowThresholdLeavesGradientsBitForBit) {
  std::mt19937 rng(7);
  const auto ours = random_model(torch::kFloat, rng);
  const auto before = clone_with_grads(ours);
  const auto result = gradclip::libtorch::clip_grad_norm_(ours, 1e9, pytorch);
  EXPECT_FALSE(result.clipped);
  EXPECT_EQ(result.coefficient, 1.0);
  for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(torch::equal(ours[i].grad(), before[i].grad()));
}

TEST(TorchFixes, HalfClipsWhereLibtorchThrows) {
  auto theirs = parameter_with_grad({300}, torch::kHalf);
  EXPECT_ANY_THROW(torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{theirs}, 1.0));
  auto ours = parameter_with_grad({300}, torch::kHalf);
  const auto result = gradclip::libtorch::clip_grad_norm_({ours}, 1.0);
  EXPECT_EQ(result.norm, 300.0);
  EXPECT_EQ(ours.grad().item<double>(), 1.0);
  EXPECT_EQ(ours.grad().scalar_type(), torch::kHalf);
}

TEST(TorchFixes, HalfNearMaximumKeepsAFiniteNorm) {
  auto ours = parameter_with_grad({60000, 60000}, torch::kHalf);
  const auto result = gradclip::libtorch::clip_grad_norm_({ours}, 1.0);
  EXPECT_NEAR(result.norm, 60000 * std::sqrt(2.0), 1e-9 * result.norm);
  EXPECT_NEAR(ours.grad()[0].item<double>(), std::sqrt(0.5), 1e-3);
}

TEST(TorchFixes, BFloat16RoundsOnceWhereLibtorchGives0996) {
  auto theirs = parameter_with_grad({300}, torch::kBFloat16);
  (void)torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{theirs}, 1.0);
  EXPECT_EQ(theirs.grad().item<double>(), 0.99609375);
  auto ours = parameter_with_grad({300}, torch::kBFloat16);
  (void)gradclip::libtorch::clip_grad_norm_({ours}, 1.0, pytorch);
  EXPECT_EQ(ours.grad().item<double>(), 1.0);
}

TEST(TorchFixes, ExtremesWhereLibtorchReturnsInf) {
  struct extreme {
    torch::Dtype type;
    double value;
  };
  for (const auto& [type, value] :
       {extreme{torch::kFloat, 1e20}, extreme{torch::kDouble, 1e200}, extreme{torch::kDouble, 1.5e308}}) {
    auto theirs = parameter_with_grad({value, value}, type);
    EXPECT_TRUE(std::isinf(torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{theirs}, 1.0)));
    EXPECT_EQ(theirs.grad()[0].item<double>(), 0.0) << "libtorch zeroes the gradient";
    auto ours = parameter_with_grad({value, value}, type);
    const double stored = ours.grad()[0].item<double>();  // value rounded to the element type
    const auto result = gradclip::libtorch::clip_grad_norm_({ours}, 1.0, pytorch);
    EXPECT_TRUE(result.finite);
    EXPECT_TRUE(result.clipped);
    if (value < 1e300) {
      EXPECT_NEAR(result.norm, stored * std::sqrt(2.0), 1e-12 * stored);
    }
    EXPECT_NEAR(ours.grad()[0].item<double>(), std::sqrt(0.5), 1e-6) << value;
    EXPECT_NEAR(ours.grad()[1].item<double>(), std::sqrt(0.5), 1e-6) << value;
  }
}

TEST(TorchAdapter, MixedDtypesShareOneGlobalNorm) {
  auto weight = parameter_with_grad({300, -400}, torch::kHalf);
  auto bias = parameter_with_grad({1200}, torch::kFloat);
  auto scale = parameter_with_grad({0.5}, torch::kBFloat16);
  auto shift = parameter_with_grad({-0.25}, torch::kDouble);
  const auto result = gradclip::libtorch::clip_grad_norm_({weight, bias, scale, shift}, 13.0);
  const double expected = std::sqrt(300.0 * 300 + 400.0 * 400 + 1200.0 * 1200 + 0.25 + 0.0625);
  EXPECT_NEAR(result.norm, expected, 1e-12 * expected);
  const double c = 13.0 / expected;
  EXPECT_NEAR(weight.grad()[1].item<double>(), -400 * c, 2e-3);
  EXPECT_NEAR(bias.grad()[0].item<double>(), 1200 * c, 1e-5);
  EXPECT_NEAR(scale.grad()[0].item<double>(), 0.5 * c, 1e-4);
  EXPECT_NEAR(shift.grad()[0].item<double>(), -0.25 * c, 1e-15);
}

TEST(TorchAdapter, ParametersWithoutGradientAreIgnored) {
  auto with = parameter_with_grad({3, 4}, torch::kFloat);
  auto without = torch::ones({2}).requires_grad_(true);
  const auto result = gradclip::libtorch::clip_grad_norm_({without, with, torch::Tensor()}, 1.0);
  EXPECT_DOUBLE_EQ(result.norm, 5.0);
  EXPECT_FALSE(without.grad().defined());
  EXPECT_FLOAT_EQ(with.grad()[1].item<float>(), 0.8f);
  EXPECT_EQ(gradclip::libtorch::clip_grad_norm_({without}, 1.0).norm, 0.0);
}

TEST(TorchAdapter, ClipGradsTakesGradientTensors) {
  auto g = torch::tensor({3.0f, 4.0f});
  const auto result = gradclip::libtorch::clip_grads_({g, torch::Tensor()}, 1.0);
  EXPECT_DOUBLE_EQ(result.norm, 5.0);
  EXPECT_FLOAT_EQ(g[0].item<float>(), 0.6f);
}

TEST(TorchAdapter, NonContiguousGradientsAreClippedInPlace) {
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
  const std::vector<torch::Tensor> contiguous{transposed.contiguous(), column.contiguous(), every_other.contiguous()};
  // column and every_other overlap in base, so clip them in separate calls, each against its copy.
  for (const auto& g : {transposed, column}) {
    auto expected = g.contiguous();
    const auto r1 = gradclip::libtorch::clip_grads_({g}, 1.0);
    const auto r2 = gradclip::libtorch::clip_grads_({expected}, 1.0);
    EXPECT_TRUE(r1.clipped);
    EXPECT_NEAR(r1.norm, r2.norm, 1e-15 * r2.norm);  // the transpose is summed in another order
    EXPECT_TRUE(torch::allclose(g, expected, 1e-6, 0));
  }
  // Elements outside the column are untouched; the column is clipped in the caller's tensor.
  EXPECT_TRUE(torch::equal(base.select(1, 1), reference_base.select(1, 1)));
  EXPECT_NEAR(torch::norm(base.select(1, 2)).item<double>(), 1.0, 1e-6);
  auto expected = every_other.contiguous();
  (void)gradclip::libtorch::clip_grads_({expected}, 1.0);
  (void)gradclip::libtorch::clip_grads_({every_other}, 1.0);
  EXPECT_TRUE(torch::equal(every_other, expected));
  EXPECT_TRUE(torch::equal(base.select(1, 3), reference_base.select(1, 3)));
}

TEST(TorchAdapter, NonFiniteNormsFollowTheOptions) {
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

TEST(TorchAdapter, PolicyIsPassedThrough) {
  auto ours = parameter_with_grad({300}, torch::kHalf);
  (void)gradclip::libtorch::clip_grad_norm_<gradclip::naive>({ours}, 1.0, pytorch);
  EXPECT_EQ(ours.grad().item<double>(), 0.0) << "naive reproduces the FP16 overflow on purpose";
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
  EXPECT_TRUE(torch::equal(valid, before));
}

TEST(TorchAdapter, UnsupportedTensorsThrowBeforeAnythingIsModified) {
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
  expect_rejected([&] { (void)gradclip::libtorch::clip_grad_norm_({p}, 1.0); }, valid,
                  "gradclip::libtorch::clip_grad_norm_", "parameter 0");
}

}  // namespace

namespace {

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

}  // namespace
