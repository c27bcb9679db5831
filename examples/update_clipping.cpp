// Clipping the gradient before Adam, or the update after it: the feedback loop the seed describes, measured.
// A ReLU MLP (16-24-24-1, six tensors) learns a teacher network with Adam in FP32. Steps 1000-1499 are a
// sustained high-gradient phase (the labels' noise 100 times larger: a bad data shard), the rest calm.
// Six runs see the same data: Adam alone; the global gradient norm clipped before Adam; Adam's update
// clipped per tensor by its RMS (Adafactor's rule) or by its global norm; StableAdamW's per-tensor
// learning-rate factor; AdaGC's per-tensor thresholds before Adam.
//
// Usage: update_clipping [log.csv]. Prints, for seed 1, the second-moment estimate at the end of the phase
// and the update norm in a window after it (once gradient clipping has stopped binding), each against Adam
// alone's, and the final loss of every method over 3 seeds; with a path, writes every run's trace
// (method,seed,step,loss,v_mean,update_norm,grad_norm,clipped; scripts/plot_update_clipping.py draws it).
// Exit status 0 when gradient clipping bound through the phase and not in the window, and every loss is
// finite, so CTest asserts it. The network is written as plain loops (no matrix products, no libm
// function but sqrt), so the digits do not depend on the CPU.
#ifndef EIGEN_FAST_MATH
#define EIGEN_FAST_MATH 0
#endif
#include <gradclip/adagc.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/update_clip.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

// The network's arithmetic rounds every product, also where -march allows FMA contraction.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int inputs = 16, hidden = 24, batch = 32, steps = 3000, phase_begin = 1000, phase_end = 1500;
constexpr int eval_every = 10, final_steps = 500, window = 200, seeds = 3;
constexpr float calm_noise = 0.05f, phase_noise = 5.0f;  // the label noise's standard deviation
constexpr float learning_rate = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, adam_epsilon = 1e-8f;
constexpr double max_grad_norm = 2.0, max_update_rms = 1.0, max_update_norm = 20.0;

// W1 [hidden x inputs], b1, W2 [hidden x hidden], b2, W3 [1 x hidden], b3, row-major.
constexpr int tensor_count = 6;
constexpr std::array<int, tensor_count> tensor_sizes{hidden * inputs, hidden, hidden* hidden, hidden, hidden, 1};
using tensors = std::array<std::vector<float>, tensor_count>;

tensors zeros() {
  tensors t;
  for (int k = 0; k < tensor_count; ++k) t[k].assign(static_cast<std::size_t>(tensor_sizes[k]), 0.0f);
  return t;
}

// Uniform in [0, 1) from 24 bits of mt19937 (exact, the same on every platform), and an approximate
// normal (four uniforms: no libm call, so no CPU-dependent rounding).
float uniform(std::mt19937& rng) { return static_cast<float>(rng() >> 8) * 0x1p-24f; }
float normal(std::mt19937& rng) {
  return (uniform(rng) + uniform(rng) + uniform(rng) + uniform(rng) - 2.0f) * 1.7320508f;
}

tensors random_network(std::mt19937& rng) {
  tensors w = zeros();
  const float scales[tensor_count] = {std::sqrt(6.0f / inputs), 0.0f, std::sqrt(6.0f / hidden), 0.0f,
                                      std::sqrt(3.0f / hidden), 0.0f};
  for (int k = 0; k < tensor_count; ++k)
    for (float& x : w[k]) x = scales[k] * (2 * uniform(rng) - 1);
  return w;
}

struct activations {
  float h1[hidden], h2[hidden], y;
};

void forward(const tensors& w, const float* x, activations& a) {
  for (int i = 0; i < hidden; ++i) {
    float s = w[1][i];
    for (int j = 0; j < inputs; ++j) s += w[0][i * inputs + j] * x[j];
    a.h1[i] = s > 0 ? s : 0;
  }
  for (int i = 0; i < hidden; ++i) {
    float s = w[3][i];
    for (int j = 0; j < hidden; ++j) s += w[2][i * hidden + j] * a.h1[j];
    a.h2[i] = s > 0 ? s : 0;
  }
  float s = w[5][0];
  for (int j = 0; j < hidden; ++j) s += w[4][j] * a.h2[j];
  a.y = s;
}

// Mean of (y - target)^2 / 2 over the batch, and its gradients.
float loss_and_gradients(const tensors& w, const std::vector<float>& x, const std::vector<float>& target, tensors& g) {
  for (auto& t : g) std::fill(t.begin(), t.end(), 0.0f);
  float loss = 0;
  for (int n = 0; n < batch; ++n) {
    const float* xn = &x[static_cast<std::size_t>(n * inputs)];
    activations a;
    forward(w, xn, a);
    const float dy = (a.y - target[static_cast<std::size_t>(n)]) / batch;
    loss += 0.5f * (a.y - target[static_cast<std::size_t>(n)]) * (a.y - target[static_cast<std::size_t>(n)]) / batch;
    float dh2[hidden], dh1[hidden] = {};
    g[5][0] += dy;
    for (int j = 0; j < hidden; ++j) {
      g[4][j] += dy * a.h2[j];
      dh2[j] = a.h2[j] > 0 ? dy * w[4][j] : 0.0f;
    }
    for (int i = 0; i < hidden; ++i) {
      g[3][i] += dh2[i];
      for (int j = 0; j < hidden; ++j) {
        g[2][i * hidden + j] += dh2[i] * a.h1[j];
        dh1[j] += dh2[i] * w[2][i * hidden + j];
      }
    }
    for (int i = 0; i < hidden; ++i) {
      const float d = a.h1[i] > 0 ? dh1[i] : 0.0f;
      g[1][i] += d;
      for (int j = 0; j < inputs; ++j) g[0][i * inputs + j] += d * xn[j];
    }
  }
  return loss;
}

enum class method { adam, grad_clip, update_rms, update_norm, stable_adamw, adagc };
constexpr std::array<method, 6> methods{method::adam,        method::grad_clip,    method::update_rms,
                                        method::update_norm, method::stable_adamw, method::adagc};
const char* name_of(method m) {
  switch (m) {
    case method::adam:
      return "adam";
    case method::grad_clip:
      return "grad_clip";
    case method::update_rms:
      return "update_rms";
    case method::update_norm:
      return "update_norm";
    case method::stable_adamw:
      return "stable_adamw";
    case method::adagc:
      break;
  }
  return "adagc";
}

struct trace {
  std::vector<double> loss, v_mean, update_norm, grad_norm;  // loss: every eval_every steps
  std::vector<int> clipped;
  double final_loss = 0;
  bool finite = true;
};

trace train(method m, int seed) {
  std::mt19937 teacher_rng(7), rng(static_cast<std::mt19937::result_type>(seed));
  const tensors teacher = random_network(teacher_rng);
  tensors w = random_network(rng), g = zeros(), mom = zeros(), sec = zeros(), update = zeros(), vhat = zeros();
  std::mt19937 test_rng(99);
  std::vector<float> test_x(256 * inputs), test_y(256);
  for (float& x : test_x) x = normal(test_rng);
  for (int n = 0; n < 256; ++n) {
    activations a;
    forward(teacher, &test_x[static_cast<std::size_t>(n * inputs)], a);
    test_y[static_cast<std::size_t>(n)] = a.y;
  }
  gradclip::adagc_config config;
  config.lambda_abs = max_grad_norm;
  gradclip::adagc controller(config);
  std::vector<float> x(batch * inputs), y(batch);
  double power1 = 1, power2 = 1;
  trace t;
  for (int step = 0; step < steps; ++step) {
    const float noise = step >= phase_begin && step < phase_end ? phase_noise : calm_noise;
    for (float& v : x) v = normal(rng);
    for (int n = 0; n < batch; ++n) {
      activations a;
      forward(teacher, &x[static_cast<std::size_t>(n * inputs)], a);
      y[static_cast<std::size_t>(n)] = a.y + noise * normal(rng);
    }
    (void)loss_and_gradients(w, x, y, g);
    const double grad_norm = gradclip::global_norm(g);
    bool clipped = false;
    if (m == method::grad_clip) clipped = gradclip::clip_by_global_norm(g, max_grad_norm).clipped;
    if (m == method::adagc)
      for (const auto& r : gradclip::clip_per_tensor(g, controller)) clipped = clipped || r.clipped;
    power1 *= beta1;
    power2 *= beta2;
    const float c1 = static_cast<float>(1 - power1), c2 = static_cast<float>(1 - power2);
    double v_sum = 0;
    std::size_t v_count = 0;
    for (int k = 0; k < tensor_count; ++k)
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        mom[k][i] = beta1 * mom[k][i] + (1 - beta1) * g[k][i];
        sec[k][i] = beta2 * sec[k][i] + (1 - beta2) * g[k][i] * g[k][i];
        vhat[k][i] = sec[k][i] / c2;
        update[k][i] = (mom[k][i] / c1) / (std::sqrt(vhat[k][i]) + adam_epsilon);
        v_sum += vhat[k][i];
        ++v_count;
      }
    if (m == method::update_rms)
      for (const auto& r : gradclip::clip_updates_by_rms(update, max_update_rms)) clipped = clipped || r.clipped;
    if (m == method::update_norm) clipped = gradclip::clip_by_global_norm(update, max_update_norm).clipped;
    double step_squares = 0;
    for (int k = 0; k < tensor_count; ++k) {
      // StableAdamW: the tensor's learning rate times 1 / max(1, RMS(g / sqrt(max(v^, eps^2)))).
      const double factor =
          m == method::stable_adamw ? gradclip::stable_adamw_factor(g[k], vhat[k], adam_epsilon) : 1.0;
      clipped = clipped || factor < 1;
      const float lr = static_cast<float>(learning_rate * factor);
      for (std::size_t i = 0; i < w[k].size(); ++i) {
        const float delta = lr * update[k][i];
        w[k][i] -= delta;
        step_squares += static_cast<double>(delta) * delta;
      }
    }
    t.v_mean.push_back(v_sum / static_cast<double>(v_count));
    t.update_norm.push_back(std::sqrt(step_squares));
    t.grad_norm.push_back(grad_norm);
    t.clipped.push_back(clipped);
    if (step % eval_every == 0 || step >= steps - final_steps) {
      double test_loss = 0;
      for (int n = 0; n < 256; ++n) {
        activations a;
        forward(w, &test_x[static_cast<std::size_t>(n * inputs)], a);
        const double e = a.y - test_y[static_cast<std::size_t>(n)];
        test_loss += 0.5 * e * e / 256;
      }
      t.finite = t.finite && std::isfinite(test_loss);
      if (step % eval_every == 0) t.loss.push_back(test_loss);
      if (step >= steps - final_steps) t.final_loss += test_loss / final_steps;
    }
  }
  return t;
}

double mean(const std::vector<double>& v, int first, int count) {
  double s = 0;
  for (int i = first; i < first + count; ++i) s += v[static_cast<std::size_t>(i)];
  return s / count;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::array<trace, seeds>> runs(methods.size());
  for (std::size_t k = 0; k < methods.size(); ++k)
    for (int s = 0; s < seeds; ++s) runs[k][static_cast<std::size_t>(s)] = train(methods[k], s + 1);
  const trace& adam = runs[0][0];
  const trace& clipping = runs[1][0];

  // The window: from the first step after the phase at which gradient clipping has not bound for 20 steps.
  int start = phase_end;
  for (int quiet = 0; start < steps && quiet < 20; ++start)
    quiet = clipping.clipped[static_cast<std::size_t>(start)] ? 0 : quiet + 1;
  int binds_in_window = 0, binds_in_phase = 0;
  for (int i = start; i < start + window; ++i) binds_in_window += clipping.clipped[static_cast<std::size_t>(i)];
  for (int i = phase_begin; i < phase_end; ++i) binds_in_phase += clipping.clipped[static_cast<std::size_t>(i)];

  std::printf("MLP %d-%d-%d-1, Adam (lr %g), %d steps; label noise %g, x%g in steps %d-%d\n", inputs, hidden, hidden,
              learning_rate, steps, calm_noise, phase_noise / calm_noise, phase_begin, phase_end - 1);
  std::printf("thresholds: gradient norm %g (grad_clip, adagc's warm-up), update RMS %g, update norm %g\n",
              max_grad_norm, max_update_rms, max_update_norm);
  std::printf("gradient clipping binds on %d of the phase's %d steps; window: steps %d-%d (%d binds)\n\n",
              binds_in_phase, phase_end - phase_begin, start, start + window - 1, binds_in_window);
  // Seed 1: steps where the method clipped (any tensor) in the phase and after it, the mean second moment
  // at the phase's end and the mean update norm in the window, each over Adam alone's; final losses.
  std::printf("%-13s %6s %6s %11s %11s | %8s %8s %8s %8s\n", "", "clips", "clips", "v, phase", "update,", "final",
              "loss", "", "");
  std::printf("%-13s %6s %6s %11s %11s | %8s %8s %8s %8s\n", "method", "phase", "after", "end / adam", "window/adam",
              "seed 1", "seed 2", "seed 3", "mean");
  bool ok = binds_in_phase > (phase_end - phase_begin) / 2 && binds_in_window == 0;
  for (std::size_t k = 0; k < methods.size(); ++k) {
    const trace& r = runs[k][0];
    int in_phase = 0, after = 0;
    for (int i = phase_begin; i < steps; ++i)
      (i < phase_end ? in_phase : after) += r.clipped[static_cast<std::size_t>(i)];
    const double v_ratio = r.v_mean[phase_end - 1] / adam.v_mean[phase_end - 1];
    const double update_ratio = mean(r.update_norm, start, window) / mean(adam.update_norm, start, window);
    double sum = 0;
    for (const trace& s : runs[k]) {
      sum += s.final_loss;
      ok = ok && s.finite;
    }
    std::printf("%-13s %6d %6d %11.3f %11.3f | %8.4f %8.4f %8.4f %8.4f\n", name_of(methods[k]), in_phase, after,
                v_ratio, update_ratio, runs[k][0].final_loss, runs[k][1].final_loss, runs[k][2].final_loss,
                sum / seeds);
  }

  if (argc > 1) {
    std::ofstream csv(argv[1]);
    csv << "method,seed,step,loss,v_mean,update_norm,grad_norm,clipped\n";
    csv.precision(9);
    for (std::size_t k = 0; k < methods.size(); ++k)
      for (int s = 0; s < seeds; ++s) {
        const trace& r = runs[k][static_cast<std::size_t>(s)];
        for (int i = 0; i < steps; ++i) {
          const auto u = static_cast<std::size_t>(i);
          csv << name_of(methods[k]) << ',' << s + 1 << ',' << i << ',';
          if (i % eval_every == 0) csv << r.loss[u / eval_every];
          csv << ',' << r.v_mean[u] << ',' << r.update_norm[u] << ',' << r.grad_norm[u] << ',' << r.clipped[u] << '\n';
        }
      }
    if (!csv) {
      std::fprintf(stderr, "cannot write %s\n", argv[1]);
      return 2;
    }
  }
  if (!ok)
    std::printf(
        "FAILED: gradient clipping did not bind through the phase and stop after it, or a loss is not finite\n");
  return ok ? 0 : 1;
}
