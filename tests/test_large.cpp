// Gradients longer than 2^31 elements: a 32-bit index or counter anywhere would wrap, stop early or
// overflow. An FP16 buffer of 2^31 + 3 elements (4 GiB) whose norm is known in closed form proves the
// norm, the clip and clip_by_value, contiguous and strided. Labelled `long` and run serially (tests/CMakeLists.txt).
#include <gradclip/gradclip.hpp>

#include <gtest/gtest.h>

#include "reference.hpp"

#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace {

using half = Eigen::half;

constexpr std::size_t count = (std::size_t{1} << 31) + 3;
constexpr std::size_t last = count - 1;  // past 2^31: a wrapped 32-bit index never reaches it

std::uint16_t bits(half x) { return Eigen::numext::bit_cast<std::uint16_t>(x); }

/// All ones except 256 at the last element: sum of squares (count - 1) + 65 536, exact in FP64.
struct big_gradient {
  std::unique_ptr<half[]> data{new half[count]};
  big_gradient() {
    std::fill(data.get(), data.get() + count, half(1.0f));
    data[last] = half(256.0f);
  }
  /// Elements (other than the last) that differ from `value`; the last must be `last_value`.
  std::size_t mismatches(half value, half last_value) const {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < last; ++i) wrong += bits(data[i]) != bits(value);
    return wrong + (bits(data[last]) != bits(last_value));
  }
};

const double exact_norm = std::sqrt(static_cast<double>(count - 1) + 65536.0);

TEST(Past2To31Elements, EveryPolicyGivesTheClosedFormNorm) {
  big_gradient g;
  // Every square and block sum is an exact integer in FP32, so only the final totals round.
  EXPECT_NEAR(gradclip::norm(static_cast<const half*>(g.data.get()), count), exact_norm, exact_norm * 1e-15);
  EXPECT_NEAR(gradclip::norm<gradclip::max_scale>(static_cast<const half*>(g.data.get()), count), exact_norm,
              exact_norm * gradclip_test::chain_norm_bound<half>());
  EXPECT_NEAR(gradclip::norm<gradclip::promote>(static_cast<const half*>(g.data.get()), count), exact_norm,
              exact_norm * gradclip_test::chain_norm_bound<half>());
  // An Eigen TensorMap and a group see the same elements.
  Eigen::TensorMap<Eigen::Tensor<half, 1>> map(g.data.get(), static_cast<Eigen::Index>(count));
  EXPECT_NEAR(gradclip::norm(map), exact_norm, exact_norm * 1e-15);
  float bias[1] = {3.0f};
  EXPECT_NEAR(gradclip::global_norm({gradclip::grad_view(map), gradclip::grad_view(bias, 1)}),
              std::sqrt(exact_norm * exact_norm + 9.0), exact_norm * 1e-15);
}

TEST(Past2To31Elements, ClipScalesEveryElementUpToTheLast) {
  big_gradient g;
  // Half the norm: every 1 becomes 0.5 and the 256 becomes 128, exactly after rounding to FP16.
  const auto result = gradclip::clip_by_norm(g.data.get(), count, exact_norm / 2);
  EXPECT_TRUE(result.clipped);
  EXPECT_NEAR(result.coefficient, 0.5, 1e-15);
  EXPECT_EQ(g.mismatches(half(0.5f), half(128.0f)), 0u);

  gradclip::clip_by_value(Eigen::TensorMap<Eigen::Tensor<half, 1>>(g.data.get(), static_cast<Eigen::Index>(count)),
                          0.25);
  EXPECT_EQ(g.mismatches(half(0.25f), half(0.25f)), 0u);
}

TEST(Past2To31Elements, StridedViewsAddressPast2To31) {
  big_gradient g;
  // Every second element: 2^30 + 2 elements whose offsets (up to 2^31 + 2) exceed a 32-bit int.
  const Eigen::Index every_second = static_cast<Eigen::Index>((count + 1) / 2);
  Eigen::Map<Eigen::Matrix<half, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<2>> strided(g.data.get(), every_second);
  const double expected = std::sqrt(static_cast<double>(every_second - 1) + 65536.0);
  EXPECT_NEAR(gradclip::norm(strided), expected, expected * 1e-15);
  const auto result = gradclip::clip_by_norm(strided, expected / 2);
  EXPECT_TRUE(result.clipped);
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, std::size_t{1} << 31, last - 1})
    EXPECT_EQ(bits(g.data[i]), bits(half(i % 2 == 0 ? 0.5f : 1.0f))) << i;
  EXPECT_EQ(bits(g.data[last]), bits(half(128.0f)));
}

}  // namespace
