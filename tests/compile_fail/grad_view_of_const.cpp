// Must not compile: a grad_view can be clipped, so it cannot view const data.
#include <gradclip/gradclip.hpp>

#include <vector>

int main() {
  const std::vector<float> weights(4, 1.0f);
  const gradclip::grad_view view(weights.data(), weights.size());
  return static_cast<int>(view.size());
}
