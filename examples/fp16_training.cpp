// A small training loop with FP16 gradient buffers and FP32 master weights: linear regression from a
// far-off start, so gradients have a norm in the thousands (finite in FP16, whose maximum is 65504). Each step clips
// with the robust policy, and a second model trained identically with naive FP16 clipping shows what the textbook
// square().sum().sqrt() does: its norm overflows, its coefficient is 0, and it never learns.
//
// Exit status 0 when the robust model converges and the naive one stalls, so CTest can assert it.
#include <gradclip/gradclip.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr int dims = 8, batch = 32, steps = 300;
constexpr double max_norm = 50.0, learning_rate = 0.5;

struct model {
  Eigen::VectorXf weights = Eigen::VectorXf::Zero(dims);           // FP32 master weights
  std::vector<Eigen::half> grad = std::vector<Eigen::half>(dims);  // FP16 gradient buffer

  // Mean squared error on a batch; writes the gradient into the FP16 buffer.
  float loss_and_gradient(const Eigen::MatrixXf& x, const Eigen::VectorXf& y) {
    const Eigen::VectorXf error = x * weights - y;
    const Eigen::VectorXf g = x.transpose() * error / float(batch);
    for (int i = 0; i < dims; ++i) grad[i] = Eigen::half(g[i]);
    return 0.5f * error.squaredNorm() / float(batch);
  }
  void step() {
    for (int i = 0; i < dims; ++i) weights[i] -= float(learning_rate) * static_cast<float>(grad[i]);
  }
};

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Eigen::VectorXf target(dims);
  target << 2000, -1500, 1000, -800, 600, -400, 200, -100;

  model robust, naive;
  float first_loss = 0, robust_loss = 0, naive_loss = 0;
  int naive_zeroed = 0;
  std::printf("%5s  %12s %10s %12s  %12s %10s\n", "step", "robust loss", "norm", "coefficient", "naive loss",
              "naive norm");
  for (int step = 1; step <= steps; ++step) {
    Eigen::MatrixXf x(batch, dims);
    for (int i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
    const Eigen::VectorXf y = x * target;

    robust_loss = robust.loss_and_gradient(x, y);
    if (step == 1) first_loss = robust_loss;
    const auto r = gradclip::clip_by_norm(robust.grad, max_norm);
    robust.step();

    naive_loss = naive.loss_and_gradient(x, y);
    const auto n = gradclip::clip_by_norm<gradclip::naive>(naive.grad, max_norm, {gradclip::on_nonfinite::propagate});
    naive_zeroed += n.coefficient == 0.0;
    naive.step();

    if (step == 1 || step % 50 == 0)
      std::printf("%5d  %12.4g %10.4g %12.4g  %12.4g %10.4g\n", step, robust_loss, r.norm, r.coefficient, naive_loss,
                  n.norm);
  }
  std::printf("naive clipping zeroed %d of %d finite FP16 gradients\n", naive_zeroed, steps);
  const bool converged = robust_loss < 1e-6f * first_loss && naive_loss > 0.5f * first_loss;
  std::printf(converged ? "robust converged, naive stalled\n" : "unexpected: check the training run\n");
  return converged ? 0 : 1;
}
