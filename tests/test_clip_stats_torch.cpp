// clip_stats::norm_quantile against libtorch's torch::quantile (interpolation "linear", its default) on
// the same norms, bit for bit. libtorch's AVX2 and AVX-512 kernels contract lerp into an FMA, which the
// formula does not do, so this test asks for its portable kernels (ATEN_CPU_CAPABILITY=default), whose
// result does not depend on the CPU. Built only where libtorch is found.
#include <gradclip/clip_stats.hpp>

#include "reference.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

// Before libtorch's first kernel call, which reads it once.
const bool portable_kernels = setenv("ATEN_CPU_CAPABILITY", "default", 1) == 0;

double torch_quantile(const std::vector<double>& norms, double q) {
  const auto values = torch::tensor(norms, torch::dtype(torch::kFloat64));
  return torch::quantile(values, q).item<double>();
}

TEST(ClipStatsTorch, ExactIntervalsAreTorchQuantileBitForBit) {
  ASSERT_TRUE(portable_kernels);
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  std::mt19937_64 rng(gradclip_test::seed + 20);
  std::uniform_real_distribution<double> exponent(-40.0, 40.0), uniform(0.0, 1.0);
  int interpolated = 0;
  for (std::size_t n : {1u, 2u, 3u, 10u, 99u, 1000u, 4096u}) {
    std::vector<double> norms(n);
    for (double& x : norms) x = std::exp2(exponent(rng));
    if (n > 4) norms[3] = 0.0;
    if (n > 5) norms[4] = norms[5];  // a tie
    gradclip::clip_stats stats;
    for (double x : norms) stats.record({x, 1.0, false, true});
    ASSERT_TRUE(stats.quantiles_exact());
    std::vector<double> qs{0.0, 0.5, 0.9, 0.99, 1.0, 0.25, 0.75, 1.0 / 3};
    for (int i = 0; i < 200; ++i) qs.push_back(uniform(rng));
    for (double q : qs) {
      const double expected = torch_quantile(norms, q);
      EXPECT_EQ(stats.norm_quantile(q), expected) << "n " << n << " q " << q;
      interpolated += n > 1 && std::floor(q * static_cast<double>(n - 1)) != q * static_cast<double>(n - 1);
    }
  }
  EXPECT_GT(interpolated, 1000);  // most positions fall between two norms
}

}  // namespace
