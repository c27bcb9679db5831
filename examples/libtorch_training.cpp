// A tiny libtorch model trained with gradclip::libtorch::clip_grad_norm_ where a libtorch program calls
// torch::nn::utils::clip_grad_norm_: the same arguments, the same returned norm, only the namespace
// changes. The model runs in BF16 on the CPU with gradient norms in the hundreds: libtorch 1.13 would
// round each clipping coefficient to BF16 before using it (turning a clip to norm 1 into a clip to 0.996),
// and it cannot clip FP16 gradients on the CPU at all.
#include <gradclip/torch.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  torch::manual_seed(0);
  // y = x W + b with a target W of large entries, so the first gradients are far above max_norm.
  const auto x = torch::randn({64, 8});
  const auto target = torch::matmul(x, torch::randn({8, 1}) * 50) + 3;
  torch::nn::Linear model(8, 1);
  model->to(torch::kBFloat16);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.4));

  const auto x_bf16 = x.to(torch::kBFloat16);
  double first_loss = 0;
  double loss_value = 0;
  int clipped_steps = 0;
  const double max_norm = 5.0;
  std::printf(" step        loss       norm\n");
  for (int step = 1; step <= 300; ++step) {
    optimizer.zero_grad();
    // The loss is computed in FP32 (as autocast would), the gradients flow back into BF16 parameters.
    const auto loss = torch::mse_loss(model->forward(x_bf16).to(torch::kFloat), target);
    loss.backward();
    // Was: torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
    const double norm = gradclip::libtorch::clip_grad_norm_(model->parameters(), max_norm);
    if (!std::isfinite(norm)) continue;             // a NaN/Inf gradient (propagated as in libtorch): skip the step
    clipped_steps += max_norm / (norm + 1e-6) < 1;  // PyTorch's rule, which the drop-in follows
    optimizer.step();
    loss_value = loss.item<double>();
    if (step == 1) first_loss = loss_value;
    if (step == 1 || step % 50 == 0) std::printf("%5d  %10.4g %10.4g\n", step, loss_value, norm);
  }
  std::printf("clipped %d of 300 steps; loss %.4g -> %.4g\n", clipped_steps, first_loss, loss_value);
  // BF16 weights keep between two and three significant digits, so "converged" means a loss 100 times smaller.
  const bool converged = std::isfinite(loss_value) && loss_value < first_loss / 100;
  std::printf(converged ? "converged\n" : "did not converge\n");
  return converged ? 0 : 1;
}
