// What options::report costs and what clip_coefficient saves (issue 24), each case paired so that the
// machine's drift reaches every part alike:
// - a binding clip_by_global_norm with and without a report on GPT-2 small's 148 tensors (FP32, BF16),
//   64 Mi FP16 and 2000 x 4 FP32: counter report_overhead = time with / time without - 1, and
//   overhead_of_fastest, the same of each part's fastest call (robust to other tenants' bursts);
// - an SGD step on a binding 64 Mi FP32 clip: clip_by_global_norm then w -= lr * g, against
//   clip_coefficient fused into the step (w -= lr * c * g): counter fused_speedup, and bytes_saved, the
//   fraction of bytes the fused form does not move (24 -> 16 bytes per element: 1/3).
#include <gradclip/gradclip.hpp>

#include "paired.hpp"
#include "workloads.hpp"

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using paired_timing::add_paired;
using paired_timing::part;
using paired_timing::total_of;
using workloads::gpt2_small_sizes;
using workloads::make_group;

/// A binding clip with and without a report. Every call clips (max_norm shrinks a little each time); the
/// group is restored before the norm falls far, untimed.
template <class T>
void report_overhead(benchmark::State& state, const std::vector<std::size_t>& sizes) {
  auto group = make_group<T>(sizes, 17);
  const auto pristine = group;
  const double norm = gradclip::global_norm(group);
  double max_norm = norm;
  gradclip::tensor_report report;
  gradclip::options with_report;
  with_report.report = &report;
  // Each part's fastest call as well: on a shared machine, the one least disturbed by other tenants.
  double fastest_plain = 1e300, fastest_report = 1e300;
  const auto timed = [](double& fastest, auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  std::vector<part> parts{
      {"clip",
       [&] {
         max_norm *= 0.999;
         timed(fastest_plain,
               [&] { benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, max_norm).coefficient); });
       }},
      {"clip_report",
       [&] {
         max_norm *= 0.999;
         timed(fastest_report, [&] {
           benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, max_norm, with_report).coefficient);
         });
       }},
  };
  paired_timing::run_parts(state, parts, [&] {
    if (max_norm < 0.5 * norm) {
      group = pristine;
      max_norm = norm;
    }
  });
  state.counters["report_overhead"] = total_of(parts, "clip_report") / total_of(parts, "clip") - 1;
  state.counters["overhead_of_fastest"] = fastest_report / fastest_plain - 1;
  state.counters["tensors"] = static_cast<double>(report.size());
}

/// w -= lr * g for every element, optionally with g scaled by c in the same pass (llm.c's fused step).
void sgd_step(std::vector<float>& w, const std::vector<float>& g, float lr) {
  float* __restrict wp = w.data();
  const float* __restrict gp = g.data();
  for (std::size_t i = 0; i < w.size(); ++i) wp[i] -= lr * gp[i];
}

void fused_step(benchmark::State& state) {
  const std::size_t n = std::size_t{64} << 20;
  auto grads = make_group<float>({n}, 19);
  auto weights = make_group<float>({n}, 23);
  const auto pristine = grads;
  const double norm = gradclip::global_norm(grads);
  double max_norm = norm;
  const float lr = 1e-3f;
  std::vector<part> parts{
      {"clip_then_step",
       [&] {  // reads g (norm), reads and writes g (clip), reads g and w, writes w (step): 24 bytes
         max_norm *= 0.999;
         benchmark::DoNotOptimize(gradclip::clip_by_global_norm(grads, max_norm).coefficient);
         sgd_step(weights[0], grads[0], lr);
         benchmark::ClobberMemory();
       }},
      {"coefficient_fused_step",
       [&] {  // reads g (norm), reads g and w, writes w: 16 bytes
         max_norm *= 0.999;
         const gradclip::clip_result plan = gradclip::clip_coefficient(grads, max_norm);
         sgd_step(weights[0], grads[0], lr * static_cast<float>(plan.clipped ? plan.coefficient : 1.0));
         benchmark::ClobberMemory();
       }},
  };
  paired_timing::run_parts(state, parts, [&] {
    if (max_norm < 0.5 * norm) {
      grads = pristine;
      max_norm = norm;
    }
  });
  state.counters["fused_speedup"] = total_of(parts, "clip_then_step") / total_of(parts, "coefficient_fused_step");
  state.counters["bytes_saved"] = 1.0 - 16.0 / 24.0;
}

}  // namespace

int main(int argc, char** argv) {
  add_paired("report/gpt2_small/float32", [](benchmark::State& s) { report_overhead<float>(s, gpt2_small_sizes()); });
  add_paired("report/gpt2_small/bfloat16",
             [](benchmark::State& s) { report_overhead<Eigen::bfloat16>(s, gpt2_small_sizes()); });
  add_paired("report/float16/67108864",
             [](benchmark::State& s) { report_overhead<Eigen::half>(s, {std::size_t{64} << 20}); });
  add_paired("report/tensors/float32/2000x4",
             [](benchmark::State& s) { report_overhead<float>(s, std::vector<std::size_t>(2000, 4)); });
  add_paired("report/fused_sgd/float32/67108864", fused_step);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
