// The vector instruction sets a test compares with the portable kernels, and the suites of tests that do
// nothing else. Those suites are named *VectorKernels*, so that a CPU that runs no vector target (arm64,
// an x86 CPU without AVX2) excludes them by name (the arm64 test preset, scripts/qemu_x86_64.sh's EXCLUDE)
// instead of passing them with nothing compared; where one runs them anyway, they skip, saying why.
#pragma once

#include <gradclip/detail/simd.hpp>

#include <gtest/gtest.h>

#include <vector>

namespace gradclip_test {

/// AVX2 and AVX-512, those of them this CPU runs (none outside x86).
inline std::vector<gradclip::detail::isa> vector_isas() {
  std::vector<gradclip::detail::isa> found;
  for (const auto target : {gradclip::detail::isa::avx2, gradclip::detail::isa::avx512})
    if (gradclip::detail::isa_supported(target)) found.push_back(target);
  return found;
}

/// The fixture of a *VectorKernels* suite: skips each test on a CPU without a vector target.
class vector_kernels_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (vector_isas().empty())
      GTEST_SKIP() << "no vector target on this CPU: nothing to compare the portable kernels with";
  }
};

}  // namespace gradclip_test
