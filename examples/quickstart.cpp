#include <gradclip/gradclip.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<Eigen::half> grad{Eigen::half(300.0f), Eigen::half(-400.0f)};  // a finite FP16 gradient
  std::vector<Eigen::half> copy = grad;

  auto naive = gradclip::clip_by_norm<gradclip::naive>(copy, 1.0, {gradclip::on_nonfinite::propagate});
  auto robust = gradclip::clip_by_norm(grad, 1.0);  // the default policy

  std::printf("naive:  norm %g -> [%g, %g]\n", naive.norm, float(copy[0]), float(copy[1]));
  std::printf("robust: norm %g -> [%g, %g]\n", robust.norm, float(grad[0]), float(grad[1]));
}
