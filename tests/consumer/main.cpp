#include <gradclip/gradclip.hpp>

#include <cstdio>
#include <vector>

#if defined(GRADCLIP_PACKAGE_VERSION_MAJOR)
static_assert(GRADCLIP_VERSION_MAJOR == GRADCLIP_PACKAGE_VERSION_MAJOR &&
                  GRADCLIP_VERSION_MINOR == GRADCLIP_PACKAGE_VERSION_MINOR &&
                  GRADCLIP_VERSION_PATCH == GRADCLIP_PACKAGE_VERSION_PATCH,
              "The CMake package's version must be the one gradclip/version.hpp states.");
#endif

#if defined(GRADCLIP_CONSUMER_EXPECT_COMPILED) != defined(GRADCLIP_COMPILED)
#error "gradclip::gradclip or pkg-config gave the wrong mode: only the compiled library defines GRADCLIP_COMPILED"
#endif

int main() {
  std::vector<Eigen::half> grad{Eigen::half(300.0f)};
  const auto result = gradclip::clip_by_norm(grad, 1.0);
  std::printf("norm %g, clipped to %g\n", result.norm, static_cast<double>(grad[0]));
  // The threaded overloads need the package's Threads dependency (a 16 MiB gradient uses two threads).
  std::vector<float> large(std::size_t{4} << 20, 1.0f);
  const auto threaded = gradclip::clip_by_norm(large.data(), large.size(), 1.0,
                                               {gradclip::on_nonfinite::skip, 0.0, gradclip::l2_norm, 2});
  std::printf("threaded: norm %g\n", threaded.norm);
  return static_cast<float>(grad[0]) == 1.0f && threaded.norm == 2048.0 ? 0 : 1;
}
