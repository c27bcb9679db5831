// Compiled mode gives the header-only results bit for bit: the same calls made by a unit built with
// GRADCLIP_COMPILED against the library and by one built header-only (header_only.cpp), in one program.
#include <gradclip/gradclip.hpp>

#include <gtest/gtest.h>
#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#if !defined(GRADCLIP_COMPILED)
#error "test_compiled is built in compiled mode (GRADCLIP_COMPILED_LIBRARY=ON)"
#endif

namespace {
#include "cases.inc"
}  // namespace

std::vector<std::uint64_t> header_only_results();

TEST(Compiled, BitIdenticalToHeaderOnly) {
  const std::vector<std::uint64_t> compiled = all_results();
  const std::vector<std::uint64_t> header_only = header_only_results();
  ASSERT_EQ(compiled.size(), header_only.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < compiled.size(); ++i) differ += compiled[i] != header_only[i];
  EXPECT_EQ(differ, 0u) << "of " << compiled.size() << " results";
}
