// Must not compile: clipping writes the gradient, and a const_grad_view (or const data) cannot be written.
#include <gradclip/gradclip.hpp>

#include <vector>

int main() {
  const std::vector<float> weights(4, 1.0f);
  std::vector<gradclip::const_grad_view> group{weights};
  return static_cast<int>(gradclip::clip_by_global_norm(group, 1.0).clipped);
}
