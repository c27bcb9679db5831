// FP16 gradients with a loss scale that starts too low, watched through options::report.
//
// A small MLP (16 -> 32 -> 32 -> 1, leaky ReLU) is fine-tuned towards a teacher it starts close to, so its
// gradients are small, as late in training. Its gradients are stored in FP16 as backward(loss * S) leaves
// them (g * S), then unscaled and clipped by gradclip::loss_scaler with options::report set. The scale starts
// at 1, i.e. no loss scaling, and doubles after every 10 finite steps. The report counts the stored FP16
// elements, so each tensor's zeros and subnormals are what the scale lost to underflow: the printed
// fraction falls as S grows, while the unscaled norms, which the underflowed elements hardly touch, stay
// where they were.
//
// Usage: loss_scale_underflow [--csv FILE]
// Prints one row per loss scale (the steps run at it); --csv writes every step's report, one row per tensor
// (plot with scripts/plot.py report). The figures are the same on every CPU: the model runs in plain double
// loops on a self-written random generator, so only roundings that every CPU shares decide the counts.
// Exit status 0 when the first scale lost more than a tenth of some tensor to underflow and the run ends
// with every tensor under 1 %, so CTest asserts it.
#include <gradclip/gradclip.hpp>

#include <Eigen/Core>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int inputs = 16, hidden = 32, batch = 64, steps = 200;
constexpr double leak = 0.125, learning_rate = 0.01, max_norm = 1.0, noise = 4e-3;

// splitmix64: the same numbers on every platform and standard library (std::normal_distribution's are not).
struct random_source {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1), exactly: a 53-bit integer times 2^-52, minus 1.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-52 - 1.0; }
};

// The tensors, in the group's order, with their shapes (rows x columns, row-major).
constexpr int tensor_count = 6;
constexpr std::array<const char*, tensor_count> names{"w1", "b1", "w2", "b2", "w3", "b3"};
constexpr std::array<int, tensor_count> rows{hidden, hidden, hidden, hidden, 1, 1};
constexpr std::array<int, tensor_count> columns{inputs, 1, hidden, 1, hidden, 1};

using parameters = std::array<std::vector<double>, tensor_count>;

parameters random_parameters(random_source& rng, double spread) {
  parameters w;
  for (int k = 0; k < tensor_count; ++k) {
    w[k].resize(static_cast<std::size_t>(rows[k] * columns[k]));
    const double fan_in_scale = spread / std::sqrt(static_cast<double>(columns[k]));
    for (double& x : w[k]) x = fan_in_scale * rng.uniform();
  }
  return w;
}

double leaky(double a) { return a > 0 ? a : leak * a; }
double leaky_slope(double a) { return a > 0 ? 1.0 : leak; }

// y = w3 leaky(w2 leaky(w1 x + b1) + b2) + b3, keeping the pre-activations for the backward pass.
struct forward_pass {
  std::array<double, hidden> a1, h1, a2, h2;
  double y;
};

forward_pass forward(const parameters& w, const std::array<double, inputs>& x) {
  forward_pass f;
  for (int i = 0; i < hidden; ++i) {
    double a = w[1][i];
    for (int j = 0; j < inputs; ++j) a += w[0][i * inputs + j] * x[j];
    f.a1[i] = a;
    f.h1[i] = leaky(a);
  }
  for (int i = 0; i < hidden; ++i) {
    double a = w[3][i];
    for (int j = 0; j < hidden; ++j) a += w[2][i * hidden + j] * f.h1[j];
    f.a2[i] = a;
    f.h2[i] = leaky(a);
  }
  f.y = w[5][0];
  for (int j = 0; j < hidden; ++j) f.y += w[4][j] * f.h2[j];
  return f;
}

// The gradients of scale * loss, the mean squared error over a batch against the teacher's noisy outputs,
// stored in FP16: what backward(loss * S) leaves in FP16 gradient buffers. The noise, which the student
// cannot fit, keeps the gradients at one level throughout the run.
void scaled_gradients(const parameters& w, const parameters& teacher, random_source& data, double scale,
                      std::vector<std::vector<Eigen::half>>& grads) {
  parameters g;
  for (int k = 0; k < tensor_count; ++k) g[k].assign(w[k].size(), 0.0);
  for (int b = 0; b < batch; ++b) {
    // Features of very different scales, from 1 down to 2^-6: their weights' gradients span the range.
    std::array<double, inputs> x;
    for (int j = 0; j < inputs; ++j) x[j] = data.uniform() / static_cast<double>(1 << (6 * j / (inputs - 1)));
    const forward_pass f = forward(w, x);
    const double error = f.y - forward(teacher, x).y - noise * data.uniform();
    const double dy = scale * error / batch;
    std::array<double, hidden> da2, da1;
    for (int j = 0; j < hidden; ++j) {
      g[4][j] += dy * f.h2[j];
      da2[j] = dy * w[4][j] * leaky_slope(f.a2[j]);
    }
    g[5][0] += dy;
    for (int i = 0; i < hidden; ++i) {
      for (int j = 0; j < hidden; ++j) g[2][i * hidden + j] += da2[i] * f.h1[j];
      g[3][i] += da2[i];
    }
    for (int j = 0; j < hidden; ++j) {
      double dh = 0;
      for (int i = 0; i < hidden; ++i) dh += w[2][i * hidden + j] * da2[i];
      da1[j] = dh * leaky_slope(f.a1[j]);
    }
    for (int i = 0; i < hidden; ++i) {
      for (int j = 0; j < inputs; ++j) g[0][i * inputs + j] += da1[i] * x[j];
      g[1][i] += da1[i];
    }
  }
  for (int k = 0; k < tensor_count; ++k)
    for (std::size_t i = 0; i < g[k].size(); ++i) grads[k][i] = Eigen::half(static_cast<float>(g[k][i]));
}

}  // namespace

int main(int argc, char** argv) {
  const char* csv_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
      csv_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--csv FILE]\n", argv[0]);
      return 2;
    }
  }
  std::FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv_path && !csv) {
    std::fprintf(stderr, "cannot write %s\n", csv_path);
    return 2;
  }
  if (csv) std::fprintf(csv, "step,loss_scale,tensor,size,norm,max_abs,zeros,subnormals,nan,inf\n");

  random_source init{1}, data{2};
  const parameters teacher = random_parameters(init, 2.0);
  parameters w = teacher;  // the student starts within 1e-3 of the teacher: fine-tuning
  const parameters offset = random_parameters(init, 1e-3);
  for (int k = 0; k < tensor_count; ++k)
    for (std::size_t i = 0; i < w[k].size(); ++i) w[k][i] += offset[k][i];

  std::vector<std::vector<Eigen::half>> grads(tensor_count);
  for (int k = 0; k < tensor_count; ++k) grads[k].resize(w[k].size());
  gradclip::loss_scaler_config config;
  config.init_scale = 1.0;      // too low: PyTorch starts at 65536
  config.growth_interval = 10;  // PyTorch's 2000 is longer than this whole run
  gradclip::loss_scaler scaler(config);
  gradclip::tensor_report report;
  gradclip::options opt;
  opt.report = &report;

  // One row per interval at one scale: the underflowed elements of each tensor over the interval's steps.
  std::printf("%9s %8s %9s | underflow (zeros + subnormals in FP16), %% of each tensor\n", "steps", "scale",
              "mean norm");
  std::printf("%9s %8s %9s |", "", "", "");
  for (const char* name : names) std::printf(" %5s", name);
  std::printf("\n");
  std::array<std::size_t, tensor_count> underflowed{}, read{};
  double norm_sum = 0, first_worst = 0;
  int first = 1, clean_from = 0;
  for (int step = 1; step <= steps; ++step) {
    const double scale = scaler.scale();
    scaled_gradients(w, teacher, data, scale, grads);
    const gradclip::clip_result result = scaler.unscale_and_clip(grads, max_norm, opt);
    if (result.finite)
      for (int k = 0; k < tensor_count; ++k)
        for (std::size_t i = 0; i < w[k].size(); ++i) w[k][i] -= learning_rate * static_cast<double>(grads[k][i]);
    scaler.update(result);

    norm_sum += result.norm;
    for (std::size_t k = 0; k < report.size(); ++k) {
      const gradclip::tensor_stats& t = report[k];
      underflowed[k] += t.zeros + t.subnormals;
      read[k] += t.size;
      if (csv)
        std::fprintf(csv, "%d,%.17g,%s,%zu,%.17g,%.17g,%zu,%zu,%zu,%zu\n", step, scale, names[k], t.size, t.norm,
                     t.max_abs, t.zeros, t.subnormals, t.nan, t.inf);
    }
    if (scaler.scale() == scale && step < steps) continue;
    std::printf("%4d-%-4d %8.0f %9.3g |", first, step, scale, norm_sum / (step - first + 1));
    double worst = 0;
    for (int k = 0; k < tensor_count; ++k) {
      const double fraction = static_cast<double>(underflowed[k]) / static_cast<double>(read[k]);
      worst = fraction > worst ? fraction : worst;
      std::printf(" %5.1f", 100 * fraction);
    }
    std::printf("%s\n", result.finite ? "" : "  (overflow: step skipped, S halved)");
    if (first == 1) first_worst = worst;
    if (worst >= 0.01)
      clean_from = 0;  // underflow is back
    else if (clean_from == 0)
      clean_from = first;
    underflowed = {};
    read = {};
    norm_sum = 0;
    first = step + 1;
  }
  if (csv) {
    std::fclose(csv);
    std::printf("report written to %s\n", csv_path);
  }
  const bool signalled = first_worst > 0.1 && clean_from > 0;
  if (signalled)
    std::printf("every tensor under 1 %% underflow from step %d on\n", clean_from);
  else
    std::printf("unexpected: check the run\n");
  return signalled ? 0 : 1;
}
