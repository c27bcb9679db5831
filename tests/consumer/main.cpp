#include <gradclip/gradclip.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<Eigen::half> grad{Eigen::half(300.0f)};
  const auto result = gradclip::clip_by_norm(grad, 1.0);
  std::printf("norm %g, clipped to %g\n", result.norm, static_cast<double>(grad[0]));
  return static_cast<float>(grad[0]) == 1.0f ? 0 : 1;
}
