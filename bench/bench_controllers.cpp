// What a threshold controller costs per step on top of the clip: clip_by_global_norm with each controller
// against the same call with a fixed threshold, on gradients that never clip (both then make one read
// pass), and each controller's decide + update alone.
#include <gradclip/autoclip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/spike_skip.hpp>
#include <gradclip/zclip.hpp>

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <cstddef>
#include <limits>
#include <random>
#include <vector>

namespace {

std::vector<Eigen::half> gradient(std::size_t n) {
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal(0.0, 1e-3);
  std::vector<Eigen::half> g(n);
  for (auto& x : g) x = Eigen::half(normal(rng));
  return g;
}

gradclip::zclip uncapped_zclip() {
  gradclip::zclip_config c;
  c.max_norm = std::numeric_limits<double>::infinity();
  return gradclip::zclip(c);
}

// Same gradient every step: the controllers see a constant norm and never clip, so the gradient stays.
void fixed_threshold(benchmark::State& state) {
  auto g = gradient(static_cast<std::size_t>(state.range(0)));
  std::vector<gradclip::grad_view> group{gradclip::grad_view(g)};
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, 1e9));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0) * 2);
}

template <class Controller>
void with_controller(benchmark::State& state, Controller controller) {
  auto g = gradient(static_cast<std::size_t>(state.range(0)));
  std::vector<gradclip::grad_view> group{gradclip::grad_view(g)};
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, controller));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0) * 2);
}

// decide + update alone, on a stream of varying norms (the history sorts and the windows move).
template <class Controller>
void decide_update(benchmark::State& state, Controller controller) {
  std::mt19937_64 rng(2);
  std::lognormal_distribution<double> noise(0.0, 0.2);
  std::vector<double> norms(4096);
  for (auto& x : norms) x = noise(rng);
  std::size_t t = 0;
  for (auto _ : state) {
    const double norm = norms[t++ % norms.size()];
    const gradclip::threshold_decision d = controller.decide(norm);
    const bool clipped = !d.skip && norm > d.threshold;
    controller.update({norm, clipped ? d.threshold / norm : 1.0, clipped, true, d.threshold, d.skip});
    benchmark::DoNotOptimize(d);
  }
}

}  // namespace

BENCHMARK(fixed_threshold)->RangeMultiplier(32)->Range(1 << 10, 1 << 25);
BENCHMARK_CAPTURE(with_controller, zclip, uncapped_zclip())->RangeMultiplier(32)->Range(1 << 10, 1 << 25);
BENCHMARK_CAPTURE(with_controller, autoclip, gradclip::autoclip())->RangeMultiplier(32)->Range(1 << 10, 1 << 25);
BENCHMARK_CAPTURE(with_controller, spike_skip, gradclip::spike_skip())->RangeMultiplier(32)->Range(1 << 10, 1 << 25);
BENCHMARK_CAPTURE(decide_update, zclip, uncapped_zclip());
BENCHMARK_CAPTURE(decide_update, autoclip, gradclip::autoclip());
BENCHMARK_CAPTURE(decide_update, spike_skip, gradclip::spike_skip());

BENCHMARK_MAIN();
