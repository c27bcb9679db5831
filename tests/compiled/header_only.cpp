// The header-only half of test_compiled: its target defines GRADCLIP_COMPILED, which this unit takes
// back, so its gradclip lives in another ABI namespace (detail/config.hpp) and calls no library.
#undef GRADCLIP_COMPILED
#include <gradclip/gradclip.hpp>

#include <unsupported/Eigen/CXX11/Tensor>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

namespace {
#include "cases.inc"
}  // namespace

std::vector<std::uint64_t> header_only_results() { return all_results(); }
