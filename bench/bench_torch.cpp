// gradclip::libtorch::clip_grad_norm_ (the drop-in: same arguments, same result) beside what a libtorch
// user has: torch::nn::utils::clip_grad_norm_ for FP32 and BF16, and for FP16 (which it cannot clip on the
// CPU) the cast-to-float version a user would write.
// A plain read of the same bytes, in the same binary, is the memory roofline.
//
// Names are `<case><dtype>/tensors:<count>/elements:<per tensor>`, so rows join with the main suite's
// by dtype and total size, and `<case><dtype>/gpt2_small` for GPT-2 small's 148 parameter tensors
// (124 M elements, the shapes of bench_sizes), in FP32 and BF16. Every clip binds: max_norm shrinks by
// 0.1% per iteration below the norm the previous iteration left, so each call reads the gradients twice
// and writes them once, as in training. libtorch runs on one thread, and so does the drop-in, which takes
// libtorch's thread count.
#include <gradclip/torch.hpp>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "paired.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

struct layout {
  std::string name;
  std::vector<std::int64_t> sizes;  // elements per tensor
  std::int64_t elements() const {
    std::int64_t total = 0;
    for (auto n : sizes) total += n;
    return total;
  }
};

layout uniform(std::int64_t tensors, std::int64_t elements) {
  return {"tensors:" + std::to_string(tensors) + "/elements:" + std::to_string(elements),
          std::vector<std::int64_t>(static_cast<std::size_t>(tensors), elements)};
}

/// GPT-2 small's parameters (bench_sizes.cpp has the same list): embeddings, 12 blocks, final layer norm.
layout gpt2_small() {
  constexpr std::int64_t d = 768, layers = 12, vocabulary = 50257, context = 1024;
  std::vector<std::int64_t> sizes{vocabulary * d, context * d};
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) sizes.push_back(n);
  sizes.push_back(d);
  sizes.push_back(d);
  return {"gpt2_small", sizes};
}

std::vector<torch::Tensor> random_grads(const layout& shape, torch::Dtype type) {
  torch::manual_seed(20261202);
  std::vector<torch::Tensor> grads;
  for (auto n : shape.sizes) grads.push_back(torch::randn({n}).to(type));
  return grads;
}

std::vector<torch::Tensor> parameters_with(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> parameters;
  for (const auto& g : grads) {
    auto p = torch::empty({0});
    p.mutable_grad() = g;  // clip_grad_norm_ only looks at .grad()
    parameters.push_back(p);
  }
  return parameters;
}

double global_norm(const std::vector<torch::Tensor>& grads) {
  double sum = 0;
  for (const auto& g : grads) sum += g.to(torch::kDouble).square().sum().item<double>();
  return std::sqrt(sum);
}

void set_bytes(benchmark::State& state, const layout& shape, torch::Dtype type) {
  state.SetBytesProcessed(state.iterations() * shape.elements() * static_cast<std::int64_t>(torch::elementSize(type)));
}

/// Runs clip(parameters, grads, max_norm) with a max_norm just below the current norm every iteration.
template <class Clip>
void run_clip(benchmark::State& state, const layout& shape, torch::Dtype type, Clip clip) {
  const auto grads = random_grads(shape, type);
  const auto parameters = parameters_with(grads);
  double max_norm = global_norm(grads);
  for (auto _ : state) {
    max_norm *= 0.999;
    clip(parameters, grads, max_norm);
  }
  set_bytes(state, shape, type);
}

void libtorch_native(benchmark::State& state, layout shape, torch::Dtype type) {
  run_clip(state, shape, type, [](const auto& parameters, const auto&, double max_norm) {
    benchmark::DoNotOptimize(torch::nn::utils::clip_grad_norm_(parameters, max_norm));
  });
}

/// What a user writes when libtorch refuses FP16: norms in FP32, then an in-place multiply.
double cast_float_clip(const std::vector<torch::Tensor>& grads, double max_norm) {
  std::vector<torch::Tensor> norms;
  for (const auto& g : grads) norms.push_back(g.to(torch::kFloat).norm());
  const auto total = torch::stack(norms).norm();
  const auto coefficient = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (const auto& g : grads) g.mul_(coefficient);
  return total.item<double>();
}

void libtorch_cast_float(benchmark::State& state, layout shape, torch::Dtype type) {
  run_clip(state, shape, type, [](const auto&, const auto& grads, double max_norm) {
    benchmark::DoNotOptimize(cast_float_clip(grads, max_norm));
  });
}

void gradclip_libtorch(benchmark::State& state, layout shape, torch::Dtype type) {
  run_clip(state, shape, type, [](const auto& parameters, const auto&, double max_norm) {
    benchmark::DoNotOptimize(gradclip::libtorch::clip_grad_norm_(parameters, max_norm));
  });
}

/// libtorch's clip (clip_grad_norm_ for FP32 and BF16, the cast-to-float code for FP16) and gradclip's, timed in
/// pairs (paired.hpp) on the same gradients. The counter libtorch_per_gradclip is the ratio of their total
/// times.
void paired(benchmark::State& state, layout shape, torch::Dtype type) {
  const auto grads = random_grads(shape, type);
  const auto parameters = parameters_with(grads);
  double max_norm = global_norm(grads);
  std::vector<paired_timing::part> parts = {
      {"libtorch",
       [&] {
         max_norm *= 0.999;
         if (type != torch::kHalf)
           benchmark::DoNotOptimize(torch::nn::utils::clip_grad_norm_(parameters, max_norm));
         else
           benchmark::DoNotOptimize(cast_float_clip(grads, max_norm));
       }},
      {"gradclip", [&] {
         max_norm *= 0.999;
         benchmark::DoNotOptimize(gradclip::libtorch::clip_grad_norm_(parameters, max_norm));
       }}};
  paired_timing::run_parts(state, parts, [] {});
  state.counters["libtorch_per_gradclip"] =
      paired_timing::total_of(parts, "libtorch") / paired_timing::total_of(parts, "gradclip");
  set_bytes(state, shape, type);
}

/// The roofline: every byte of the same tensors read once as 64-bit words, folded by XOR.
void plain_read(benchmark::State& state, layout shape, torch::Dtype type) {
  const auto grads = random_grads(shape, type);
  for (auto _ : state) {
    std::uint64_t folded = 0;
    for (const auto& g : grads) {
      const auto* words = static_cast<const std::uint64_t*>(g.data_ptr());
      const auto count = g.nbytes() / sizeof(std::uint64_t);
      for (std::size_t i = 0; i < count; ++i) folded ^= words[i];
    }
    benchmark::DoNotOptimize(folded);
  }
  set_bytes(state, shape, type);
}

void register_case(const char* name, void (*function)(benchmark::State&, layout, torch::Dtype), torch::Dtype type,
                   const char* dtype_name, const std::vector<layout>& shapes) {
  for (const auto& shape : shapes) {
    const std::string full = std::string(name) + "<" + dtype_name + ">/" + shape.name;
    benchmark::RegisterBenchmark(full.c_str(), function, shape, type)->Unit(benchmark::kMillisecond)->UseRealTime();
  }
}

/// One dtype's four cases: the read roofline, libtorch's clip (or what its user writes), gradclip's, and
/// the two timed in pairs.
void register_dtype(torch::Dtype type, const char* dtype_name, const char* libtorch_name,
                    void (*libtorch)(benchmark::State&, layout, torch::Dtype), const std::vector<layout>& shapes) {
  register_case("plain_read", plain_read, type, dtype_name, shapes);
  register_case(libtorch_name, libtorch, type, dtype_name, shapes);
  register_case("gradclip_libtorch_clip_grad_norm_", gradclip_libtorch, type, dtype_name, shapes);
  register_case("paired", paired, type, dtype_name, shapes);
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const std::vector<layout> sizes{uniform(1, std::int64_t{64} << 20), uniform(256, std::int64_t{16} << 10)};
  const std::vector<layout> all{sizes[0], sizes[1], gpt2_small()};
  const std::vector<layout> gpt2{gpt2_small()};
  register_dtype(torch::kFloat, "float32", "libtorch_clip_grad_norm_", libtorch_native, all);
  register_dtype(torch::kHalf, "float16", "libtorch_cast_float", libtorch_cast_float, sizes);
  register_dtype(torch::kBFloat16, "bfloat16", "libtorch_clip_grad_norm_", libtorch_native, gpt2);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
