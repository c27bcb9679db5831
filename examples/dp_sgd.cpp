// Differentially private SGD (Abadi et al. 2016) on logistic regression with FP16 per-example gradients:
// each step clips every example's gradient to norm C, sums the clipped gradients, adds Gaussian noise of
// standard deviation sigma * C and takes a step with the noisy mean. C adapts to the median per-example
// norm (Andrew et al. 2021) from a noisy count of the unclipped examples. The features are large, so the
// per-example gradient norms reach the hundreds: above 256, where a textbook FP16 sum of squares overflows.
// A second model trains without privacy (plain mean gradient) on the same batches.
//
// Exit status 0 when the private model learns (test accuracy >= 0.8; chance is 0.5), so CTest asserts it.
#include <gradclip/adaptive_bound.hpp>
#include <gradclip/per_example.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>

namespace {

constexpr int dims = 16, train_size = 4096, test_size = 1024, batch = 64, steps = 400;
constexpr double sigma = 1.0;                 // noise multiplier z of the gradient sum
constexpr double count_sigma = batch / 20.0;  // noise on the unclipped count (Andrew et al.: B / 20)
constexpr double learning_rate = 0.2;
constexpr float feature_scale = 100.0f;

struct data_set {
  Eigen::MatrixXf x;  // examples in rows
  Eigen::VectorXf y;  // labels in {0, 1}
};

// Two Gaussian classes whose means differ along a random direction.
data_set make_data(int n, std::mt19937_64& rng, const Eigen::VectorXf& direction) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  data_set d{Eigen::MatrixXf(n, dims), Eigen::VectorXf(n)};
  for (int i = 0; i < n; ++i) {
    d.y(i) = static_cast<float>(i % 2);
    for (int j = 0; j < dims; ++j) d.x(i, j) = normal(rng) + (d.y(i) > 0 ? 1.0f : -1.0f) * direction(j);
  }
  d.x *= feature_scale;
  return d;
}

struct model {
  Eigen::VectorXf w = Eigen::VectorXf::Zero(dims);
  float b = 0;

  float probability(const Eigen::VectorXf& x) const { return 1.0f / (1.0f + std::exp(-(w.dot(x) + b))); }
  double accuracy(const data_set& d) const {
    int right = 0;
    for (int i = 0; i < d.x.rows(); ++i)
      right += (probability(d.x.row(i).transpose()) > 0.5f) == (d.y(i) > 0.5f) ? 1 : 0;
    return static_cast<double>(right) / static_cast<double>(d.x.rows());
  }
};

}  // namespace

int main() {
  std::mt19937_64 rng(20261202);
  std::normal_distribution<double> noise(0.0, 1.0);
  Eigen::VectorXf direction = Eigen::VectorXf::Random(dims).normalized() * 1.5f;
  const data_set train = make_data(train_size, rng, direction), test = make_data(test_size, rng, direction);

  model priv, plain;
  gradclip::adaptive_bound bound;  // C = 1 at first, tracking the median norm (gamma = 0.5, eta = 0.2)
  Eigen::Tensor<Eigen::half, 2> grad_w(batch, dims);  // per-example gradients: [B, dims], FP16
  Eigen::Tensor<Eigen::half, 1> grad_b(batch);
  Eigen::Tensor<float, 1> sum_w(dims), sum_b(1);  // clipped sums, FP32
  // The count and the sum share the budget of sigma (Andrew et al.): the sum gets a little more noise.
  const double gradient_sigma = 1.0 / std::sqrt(1.0 / (sigma * sigma) - 1.0 / (4 * count_sigma * count_sigma));
  // Uniform sampling with replacement keeps the example short; the accountant's q assumes Poisson sampling.
  std::uniform_int_distribution<int> pick(0, train_size - 1);
  double clipped_fraction = 0, largest_norm = 0;
  std::vector<double> norms;
  std::printf(" step  clip bound  clip fraction  max norm  private acc  plain acc\n");
  for (int step = 1; step <= steps; ++step) {
    Eigen::VectorXf plain_w = Eigen::VectorXf::Zero(dims);
    float plain_b = 0;
    for (int i = 0; i < batch; ++i) {
      const int k = pick(rng);
      const Eigen::VectorXf x = train.x.row(k).transpose();
      const float residual = priv.probability(x) - train.y(k);  // d(log loss)/d(logit)
      for (int j = 0; j < dims; ++j) grad_w(i, j) = Eigen::half(residual * x(j));
      grad_b(i) = Eigen::half(residual);
      const float plain_residual = plain.probability(x) - train.y(k);
      plain_w += plain_residual * x / float(batch);
      plain_b += plain_residual / float(batch);
    }
    const double c = bound.value();
    const auto r = gradclip::clip_per_example(std::tie(grad_w, grad_b), std::tie(sum_w, sum_b), c, {}, norms);
    // The privacy mechanism, the caller's part: Gaussian noise of sd ~sigma * C on the sum (the sensitivity is
    // C), the noisy mean, and a noisy count for the bound. An accountant is told q = B / N, sigma and steps.
    for (int j = 0; j < dims; ++j)
      priv.w(j) -= float(learning_rate * (sum_w(j) + gradient_sigma * c * noise(rng)) / batch / feature_scale);
    priv.b -= float(learning_rate * (sum_b(0) + gradient_sigma * c * noise(rng)) / batch);
    bound.update(static_cast<double>(r.unclipped()) + count_sigma * noise(rng), batch);
    plain.w -= float(learning_rate / feature_scale) * plain_w;
    plain.b -= float(learning_rate) * plain_b;
    clipped_fraction = static_cast<double>(r.clipped) / static_cast<double>(r.examples);
    for (double n : norms) largest_norm = std::max(largest_norm, n);
    if (step % 50 == 0)
      std::printf("%5d  %10.4g  %13.2f  %8.4g  %11.3f  %9.3f\n", step, c, clipped_fraction, largest_norm,
                  priv.accuracy(test), plain.accuracy(test));
  }
  const double private_accuracy = priv.accuracy(test), plain_accuracy = plain.accuracy(test);
  std::printf("private accuracy %.3f, non-private %.3f (chance 0.5); last clip fraction %.2f, largest norm %.4g\n",
              private_accuracy, plain_accuracy, clipped_fraction, largest_norm);
  std::printf("accountant input: sampling rate q = %g, noise multiplier %g, %d steps\n", double(batch) / train_size,
              sigma, steps);
  if (private_accuracy < 0.8 || largest_norm <= 256) {
    std::printf("FAILED: private training did not learn, or the norms stayed below 256\n");
    return 1;
  }
  std::printf("private training learned\n");
  return 0;
}
