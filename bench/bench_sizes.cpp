// gradclip at every size (issue 16), each case paired so that the machine's drift reaches every part alike:
// - many small tensors (2000 x 4 and 1000 x 1 Ki FP32) against a scalar double loop over the same vectors,
//   with nanoseconds per tensor;
// - a transformer-shaped parameter list (GPT-2 small: 148 tensors, 124 M elements) in FP32 and BF16
//   against a plain read of the same bytes;
// - 1, 2 and all threads against plain reads on as many threads.
#include <gradclip/gradclip.hpp>

#include "paired.hpp"
#include "workloads.hpp"

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using paired_timing::add_paired;
using paired_timing::part;
using paired_timing::total_of;
using workloads::gpt2_small_sizes;
using workloads::make_group;

/// A plain read of every byte (the memory roofline of a norm).
template <class T>
std::uint64_t read_all(const std::vector<std::vector<T>>& group) {
  std::uint64_t folded = 0;
  for (const auto& t : group) folded ^= workloads::plain_read(t.data(), t.size() * sizeof(T));
  return folded;
}

// ---- Many small tensors against the loop a user would write.

void small_tensors(benchmark::State& state, std::size_t count, std::size_t n) {
  auto group = make_group<float>(std::vector<std::size_t>(count, n), 7);
  const auto pristine = group;
  const double norm = gradclip::global_norm(group);
  double max_norm = norm;
  std::vector<part> parts{
      {"loop_norm",
       [&] {
         double sum = 0;
         for (const auto& t : group)
           for (const float x : t) sum += static_cast<double>(x) * x;
         benchmark::DoNotOptimize(sum);
       }},
      {"norm", [&] { benchmark::DoNotOptimize(gradclip::global_norm(group)); }},
      {"loop_clip",
       [&] {  // the loop's clip that binds: its norm pass, then every element times the coefficient
         double sum = 0;
         for (const auto& t : group)
           for (const float x : t) sum += static_cast<double>(x) * x;
         const double c = 0.9999999 * max_norm / std::sqrt(sum);
         for (auto& t : group)
           for (float& x : t) x = static_cast<float>(x * c);
         benchmark::ClobberMemory();
       }},
      {"clip",
       [&] {
         max_norm *= 0.999;
         benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, max_norm).coefficient);
       }},
  };
  paired_timing::run_parts(state, parts, [&] {
    if (max_norm < 0.5 * norm) {
      group = pristine;
      max_norm = norm;
    }
  });
  const double iterations = static_cast<double>(state.iterations());
  const double tensors = static_cast<double>(count);
  state.counters["norm_per_loop"] = total_of(parts, "norm") / total_of(parts, "loop_norm");
  state.counters["clip_per_loop"] = total_of(parts, "clip") / total_of(parts, "loop_clip");
  state.counters["norm_ns_per_tensor"] = 1e9 * total_of(parts, "norm") / iterations / tensors;
  state.counters["clip_ns_per_tensor"] = 1e9 * total_of(parts, "clip") / iterations / tensors;
  state.counters["loop_ns_per_tensor"] = 1e9 * total_of(parts, "loop_norm") / iterations / tensors;
}

template <class T>
void gpt2_small(benchmark::State& state) {
  auto group = make_group<T>(gpt2_small_sizes(), 11);
  const double norm = gradclip::global_norm(group);
  double max_norm = norm;
  std::vector<part> parts{
      {"read", [&] { benchmark::DoNotOptimize(read_all(group)); }},
      {"norm", [&] { benchmark::DoNotOptimize(gradclip::global_norm(group)); }},
      {"clip",
       [&] {
         max_norm *= 0.999;
         benchmark::DoNotOptimize(gradclip::clip_by_global_norm(group, max_norm).coefficient);
       }},
  };
  paired_timing::run_parts(state, parts, [] {});
  state.counters["tensors"] = static_cast<double>(group.size());
  state.counters["norm_x_read"] = total_of(parts, "read") / total_of(parts, "norm");
}

// ---- Threads: the gain of 2 and of all threads over one, against the gain of plain reads.

template <class T>
void thread_scaling(benchmark::State& state) {
  const unsigned all = std::max(2u, std::thread::hardware_concurrency());
  const std::size_t n = std::size_t{64} << 20;
  auto group = make_group<T>({n}, 13);
  const auto read_on = [&](unsigned threads) {
    std::vector<std::uint64_t> sums(threads);
    std::vector<std::thread> started;
    const std::size_t share = (n + threads - 1) / threads;
    const auto read_share = [&](unsigned k) {
      const std::size_t first = std::min(n, k * share), last = std::min(n, first + share);
      const auto* p = reinterpret_cast<const unsigned char*>(group[0].data() + first);
      std::uint64_t sum = 0;
      for (std::size_t i = 0; i + 8 <= (last - first) * sizeof(T); i += 8) {
        std::uint64_t w;
        std::memcpy(&w, p + i, 8);
        sum += w;
      }
      sums[k] = sum;
    };
    for (unsigned k = 1; k < threads; ++k) started.emplace_back(read_share, k);
    read_share(0);
    for (auto& t : started) t.join();
    benchmark::DoNotOptimize(sums.data());
  };
  std::vector<part> parts;
  for (unsigned threads : {1u, 2u, all}) {
    const std::string t = std::to_string(threads);
    parts.push_back({"read/" + t, [=] { read_on(threads); }});
    parts.push_back({"norm/" + t, [&group, threads] {
                       gradclip::options opt;
                       opt.threads = threads;
                       benchmark::DoNotOptimize(gradclip::global_norm(group, opt));
                     }});
  }
  paired_timing::run_parts(state, parts, [] {});
  const auto gain = [&](const char* what, unsigned threads) {
    return total_of(parts, std::string(what) + "/1") /
           total_of(parts, std::string(what) + "/" + std::to_string(threads));
  };
  state.counters["norm_gain_2"] = gain("norm", 2);
  state.counters["read_gain_2"] = gain("read", 2);
  state.counters["gain_2_per_read_gain"] = gain("norm", 2) / gain("read", 2);
  state.counters["norm_gain_all"] = gain("norm", all);
  state.counters["threads_all"] = all;
}

}  // namespace

int main(int argc, char** argv) {
  add_paired("sizes/tensors/float32/2000x4", [](benchmark::State& s) { small_tensors(s, 2000, 4); });
  add_paired("sizes/tensors/float32/1000x1024", [](benchmark::State& s) { small_tensors(s, 1000, 1024); });
  add_paired("sizes/gpt2_small/float32", [](benchmark::State& s) { gpt2_small<float>(s); });
  add_paired("sizes/gpt2_small/bfloat16", [](benchmark::State& s) { gpt2_small<Eigen::bfloat16>(s); });
  add_paired("sizes/threads/float16", [](benchmark::State& s) { thread_scaling<Eigen::half>(s); });
  add_paired("sizes/threads/float32", [](benchmark::State& s) { thread_scaling<float>(s); });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
