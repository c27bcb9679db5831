// Paired timing: the parts of a measurement (a roofline, the cases it judges) run once per benchmark
// iteration in an order that rotates, so the drift of a shared machine (other tenants, clock speed)
// reaches every part alike. The ratios of the parts' total times are the measurement.
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace paired_timing {

struct part {
  std::string name;
  std::function<void()> run;
  double total = 0;  // seconds
};

inline double seconds(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Runs every part once per iteration, in an order that rotates; `prepare` runs first, untimed.
template <class Prepare>
void run_parts(benchmark::State& state, std::vector<part>& parts, Prepare&& prepare) {
  std::size_t turn = 0;
  for (auto _ : state) {
    prepare();
    for (std::size_t k = 0; k < parts.size(); ++k) {
      part& p = parts[(turn + k) % parts.size()];
      p.total += seconds(p.run);
    }
    ++turn;
  }
}

/// Registers a paired case: each iteration runs every part, so half a second gives a few pairs per
/// repetition; wall time, in milliseconds.
template <class F>
void add_paired(const std::string& name, F&& f) {
  benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(f))
      ->MinTime(0.5)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

/// The total time of the part named `name`, 0 when there is none.
inline double total_of(const std::vector<part>& parts, const std::string& name) {
  for (const auto& p : parts)
    if (p.name == name) return p.total;
  return 0;
}

}  // namespace paired_timing
