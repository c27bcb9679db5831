// The vectorizable FP16 and BF16 decoders, checked exhaustively against Eigen's own conversions.
#include <gradclip/detail/element.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

namespace {

TEST(Element, HalfDecoderMatchesEigenForAll65536Patterns) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = Eigen::numext::bit_cast<Eigen::half>(static_cast<std::uint16_t>(bits));
    const float expected = static_cast<float>(h);
    const float got = gradclip::detail::half_bits_to_float(static_cast<std::uint16_t>(bits));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << bits;
    } else {
      ASSERT_EQ(gradclip::detail::bits_of(got), gradclip::detail::bits_of(expected)) << std::hex << bits;
    }
  }
}

TEST(Element, BFloat16DecoderMatchesEigenForAll65536Patterns) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto b = Eigen::numext::bit_cast<Eigen::bfloat16>(static_cast<std::uint16_t>(bits));
    const float expected = static_cast<float>(b);
    const float got = gradclip::detail::bfloat16_bits_to_float(static_cast<std::uint16_t>(bits));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << bits;
    } else {
      ASSERT_EQ(gradclip::detail::bits_of(got), gradclip::detail::bits_of(expected)) << std::hex << bits;
    }
  }
}

TEST(Element, NarrowRoundsOnceToNearestEven) {
  using gradclip::detail::narrow;
  EXPECT_EQ(static_cast<float>(narrow<Eigen::half>(1.0f + 0x1p-11f)), 1.0f);  // tie to even
  EXPECT_EQ(static_cast<float>(narrow<Eigen::half>(1.0f + 0x1p-11f + 0x1p-20f)), 1.0f + 0x1p-10f);
  EXPECT_EQ(static_cast<float>(narrow<Eigen::half>(70000.0f)), INFINITY);
  EXPECT_EQ(static_cast<float>(narrow<Eigen::bfloat16>(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(narrow<float>(1.0 + 0x1p-24), 1.0f);
}

}  // namespace
