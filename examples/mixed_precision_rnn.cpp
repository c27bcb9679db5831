// Mixed-precision training done right: an Elman RNN learns a delayed copy of its input with FP16 gradients,
// FP32 master weights, dynamic loss scaling, global-norm clipping and Adam, all in Eigen.
//
// Two runs see the same data. "robust" uses gradclip::loss_scaler::unscale_and_clip: one read pass checks for
// overflow and measures ||g / S||, one write pass unscales and clips. "naive" is what a PyTorch user with a
// textbook FP16 clip runs: GradScaler's unscale (multiply by 1/S, flag Inf/NaN), then the norm squared and
// summed in FP16 (gradclip::naive, PyTorch's non-finite behaviour): whenever the true gradient norm reaches
// 256 its sum of squares overflows FP16, the coefficient is 0 and the step is taken with a zero gradient, which
// the scaler does not see as an overflow. With --clip-update both runs clip Adam's update after the adaptive
// division instead of the gradient before it (the seed's alternative; the update is FP32, so both converge).
//
// Usage: mixed_precision_rnn [--clip-update] [--steps N] [log.csv]
// Logs every 50 steps (loss, loss scale, clip fraction, mean norm, skipped steps) and writes them as CSV
// (default mixed_precision_rnn.csv in the working directory; plot with scripts/plot.py training).
// Exit status 0 when robust converges (and, clipping the gradient, naive stalls), so CTest asserts it.
#include <gradclip/gradclip.hpp>

#include <Eigen/Core>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int hidden = 32, batch = 16, length = 40, delay = 3, log_every = 50;
constexpr double max_grad_norm = 20.0;   // clips the unscaled gradient (whose norm starts in the hundreds)
constexpr double max_update_norm = 6.0;  // with --clip-update: clips Adam's update instead
constexpr float learning_rate = 3e-3f, beta1 = 0.9f, beta2 = 0.999f, adam_epsilon = 1e-8f;

using matrix = Eigen::MatrixXf;
using half_matrix = Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic>;

// Parameters, in this order: input weights, recurrent weights, hidden bias, output weights, output bias.
constexpr int parameter_count = 5;
using parameters = std::array<matrix, parameter_count>;

struct sequence_batch {
  std::vector<Eigen::RowVectorXf> x, y;  // one row of `batch` values per time step
};

// Inputs uniform in [-1, 1]; the target is the input `delay` steps earlier.
sequence_batch make_batch(std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  sequence_batch b;
  for (int t = 0; t < length; ++t) {
    b.x.push_back(Eigen::RowVectorXf::NullaryExpr(batch, [&] { return uniform(rng); }));
    b.y.push_back(t >= delay ? b.x[t - delay] : Eigen::RowVectorXf::Zero(batch));
  }
  return b;
}

// Recurrent weights with spectral radius about 1.6: the regime where the gradients of a tanh RNN explode.
parameters initial_parameters() {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random = [&](int rows, int cols, float sd) {
    return matrix(matrix::NullaryExpr(rows, cols, [&] { return sd * normal(rng); }));
  };
  return {random(hidden, 1, 1.0f), random(hidden, hidden, 1.6f / std::sqrt(float(hidden))), matrix::Zero(hidden, 1),
          random(1, hidden, 1.0f / std::sqrt(float(hidden))), matrix::Zero(1, 1)};
}

// An FP16 round trip: what storing an activation gradient in half precision does (overflow included).
matrix through_half(const matrix& m) { return m.cast<Eigen::half>().cast<float>(); }

// The loss (summed over time and batch, PyTorch's reduction="sum", so gradient norms start in the hundreds)
// and the gradients of scale * loss, stored in FP16.
// The backward pass keeps its activation gradients in FP16, so they overflow and underflow as on a GPU.
float loss_and_scaled_gradients(const parameters& w, const sequence_batch& b, float scale,
                                std::vector<half_matrix>& grads) {
  std::vector<matrix> h(length + 1, matrix::Zero(hidden, batch));
  std::vector<Eigen::RowVectorXf> error(length);
  float loss = 0;
  for (int t = 0; t < length; ++t) {
    matrix a = w[0] * b.x[t] + w[1] * h[t];
    a.colwise() += w[2].col(0);
    h[t + 1] = a.array().tanh().matrix();
    error[t] = (w[3] * h[t + 1]).array() + w[4](0, 0) - b.y[t].array();
    loss += 0.5f * error[t].squaredNorm();
  }
  parameters g{matrix::Zero(hidden, 1), matrix::Zero(hidden, hidden), matrix::Zero(hidden, 1), matrix::Zero(1, hidden),
               matrix::Zero(1, 1)};
  matrix dh_next = matrix::Zero(hidden, batch);
  for (int t = length - 1; t >= 0; --t) {
    const matrix dy = through_half(error[t] * scale);
    g[3] += dy * h[t + 1].transpose();
    g[4](0, 0) += dy.sum();
    const matrix dh = w[3].transpose() * dy + dh_next;
    const matrix da = through_half((dh.array() * (1.0f - h[t + 1].array().square())).matrix());
    g[0] += da * b.x[t].transpose();
    g[1] += da * h[t].transpose();
    g[2] += da.rowwise().sum();
    dh_next = w[1].transpose() * da;
  }
  for (int k = 0; k < parameter_count; ++k) grads[k] = g[k].cast<Eigen::half>();
  return loss;
}

// PyTorch's GradScaler.unscale_: g * (1/S) in FP32, rounded back to FP16; reports whether all were finite.
bool pytorch_unscale(std::vector<half_matrix>& grads, double scale) {
  const float inverse = static_cast<float>(1.0 / scale);
  bool finite = true;
  for (auto& g : grads)
    for (Eigen::Index i = 0; i < g.size(); ++i) {
      const float x = static_cast<float>(g.data()[i]) * inverse;
      finite = finite && std::isfinite(x);
      g.data()[i] = Eigen::half(x);
    }
  return finite;
}

struct adam {
  parameters m, v;
  int t = 0;
  explicit adam(const parameters& w) {
    for (int k = 0; k < parameter_count; ++k) {
      m[k] = matrix::Zero(w[k].rows(), w[k].cols());
      v[k] = m[k];
    }
  }
  // Adam's update direction m^ / (sqrt(v^) + eps) from FP16 gradients, in FP32.
  std::vector<matrix> direction(const std::vector<half_matrix>& grads) {
    ++t;
    std::vector<matrix> u(parameter_count);
    for (int k = 0; k < parameter_count; ++k) {
      const matrix g = grads[k].cast<float>();
      m[k] = beta1 * m[k] + (1 - beta1) * g;
      v[k] = beta2 * v[k] + (1 - beta2) * g.cwiseProduct(g);
      const float c1 = 1 - std::pow(beta1, float(t)), c2 = 1 - std::pow(beta2, float(t));
      u[k] = ((m[k] / c1).array() / ((v[k] / c2).array().sqrt() + adam_epsilon)).matrix();
    }
    return u;
  }
};

struct log_row {
  int step;
  double loss, scale, clip_fraction, mean_norm, max_norm;
  std::size_t nonfinite, skipped;
};

// Trains one model; `robust` selects the pipeline described at the top of the file.
std::vector<log_row> train(bool robust, bool clip_update, int steps) {
  parameters w = initial_parameters();
  adam optimizer(w);
  std::vector<half_matrix> grads(parameter_count);
  gradclip::loss_scaler_config config;
  config.growth_interval = 100;  // PyTorch's 2000 is longer than this whole run
  gradclip::loss_scaler scaler(config);
  std::size_t parameters_total = 0;
  for (const auto& p : w) parameters_total += static_cast<std::size_t>(p.size());
  gradclip::clip_stats stats(parameters_total);
  std::mt19937 data(42);  // both runs see the same batches
  std::vector<log_row> log;
  double loss_sum = 0;
  std::size_t skipped = 0;
  for (int step = 1; step <= steps; ++step) {
    loss_sum += loss_and_scaled_gradients(w, make_batch(data), static_cast<float>(scaler.scale()), grads);
    const double scale = scaler.scale();
    gradclip::clip_result step_result;
    bool take_step;
    if (robust) {
      step_result = clip_update ? scaler.unscale(grads) : scaler.unscale_and_clip(grads, max_grad_norm);
      take_step = step_result.finite;
      scaler.update(step_result);
    } else {
      take_step = pytorch_unscale(grads, scale);
      step_result = clip_update ? gradclip::clip_result{gradclip::global_norm(grads), 1.0, false, take_step}
                                : gradclip::clip_by_global_norm<gradclip::naive>(grads, max_grad_norm,
                                                                                 {gradclip::on_nonfinite::propagate});
      scaler.update({step_result.norm, 1.0, false, take_step});  // GradScaler sees element overflow only
    }
    if (take_step) {
      std::vector<matrix> u = optimizer.direction(grads);
      if (clip_update) {
        step_result = robust ? gradclip::clip_by_global_norm(u, max_update_norm)
                             : gradclip::clip_by_global_norm<gradclip::naive>(u, max_update_norm,
                                                                              {gradclip::on_nonfinite::propagate});
      }
      for (int k = 0; k < parameter_count; ++k) w[k] -= learning_rate * u[k];
    } else {
      ++skipped;
    }
    stats.record(step_result);  // with --clip-update: the update's clip, or the overflow of a skipped step
    if (step % log_every == 0) {
      log.push_back({step, loss_sum / log_every, scaler.scale(), stats.clip_fraction(), stats.mean_norm(),
                     stats.max_norm(), stats.nonfinite_steps(), skipped});
      if (step % (4 * log_every) == 0) {
        std::printf("  %-6s step %4d  %s\n", robust ? "robust" : "naive", step, stats.log_line().c_str());
      }
      stats.reset();
      loss_sum = 0;
      skipped = 0;
    }
  }
  return log;
}

}  // namespace

int main(int argc, char** argv) {
  bool clip_update = false;
  int steps = 600;
  std::string csv_path;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--clip-update") == 0) {
      clip_update = true;
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (argv[i][0] != '-') {
      csv_path = argv[i];
    } else {
      std::fprintf(stderr, "usage: %s [--clip-update] [--steps N] [log.csv]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 2 * log_every) steps = 2 * log_every;
  if (csv_path.empty()) csv_path = clip_update ? "mixed_precision_rnn_clip_update.csv" : "mixed_precision_rnn.csv";

  std::printf("Elman RNN, delayed copy by %d over %d steps, FP16 gradients, clipping the %s\n", delay, length,
              clip_update ? "Adam update" : "gradient");
  const std::vector<log_row> robust = train(true, clip_update, steps);
  const std::vector<log_row> naive = train(false, clip_update, steps);

  // Per interval: mean loss, loss scale, clip fraction, mean norm, norms that were not finite (for naive: FP16
  // overflows of its sum of squares, each zeroing a finite gradient), skipped steps (overflowed elements).
  std::printf("\n%5s | %9s %9s %5s %8s %3s %4s | %9s %9s %5s %8s %3s %4s\n", "step", "robust", "scale", "clip", "norm",
              "inf", "skip", "naive", "scale", "clip", "norm", "inf", "skip");
  std::ofstream csv(csv_path);
  csv << "run,step,loss,loss_scale,clip_fraction,mean_norm,max_norm,nonfinite_steps,skipped_steps\n";
  for (std::size_t i = 0; i < robust.size(); ++i) {
    const log_row& r = robust[i];
    const log_row& n = naive[i];
    std::printf("%5d | %9.4g %9.4g %5.2f %8.4g %3zu %4zu | %9.4g %9.4g %5.2f %8.4g %3zu %4zu\n", r.step, r.loss,
                r.scale, r.clip_fraction, r.mean_norm, r.nonfinite, r.skipped, n.loss, n.scale, n.clip_fraction,
                n.mean_norm, n.nonfinite, n.skipped);
  }
  for (const auto* run : {&robust, &naive})
    for (const log_row& row : *run)
      csv << (run == &robust ? "robust" : "naive") << ',' << row.step << ',' << row.loss << ',' << row.scale << ','
          << row.clip_fraction << ',' << row.mean_norm << ',' << row.max_norm << ',' << row.nonfinite << ','
          << row.skipped << '\n';
  std::printf("log written to %s\n", csv_path.c_str());

  const double first = robust.front().loss;
  const bool robust_converged = robust.back().loss < 0.05 * first;
  const bool naive_stalled = naive.back().loss > 0.5 * naive.front().loss;
  std::printf("robust %s (loss %.4g -> %.4g), naive %s (loss %.4g -> %.4g)\n",
              robust_converged ? "converged" : "did not converge", first, robust.back().loss,
              naive_stalled ? "stalled" : "converged", naive.front().loss, naive.back().loss);
  return robust_converged && (clip_update || naive_stalled) ? 0 : 1;
}
