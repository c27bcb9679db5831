// What gradclip::mpi adds to a local norm: the same shard's norm with and without the two all-reduces,
// beside the cost of one all-reduce of a double (the floor of any distributed norm) and of gradclip's
// reduction on an empty shard. Run on several ranks:
//
//     mpiexec -n 2 ./bench_mpi
//
// Collectives need every rank in step, so each case runs a fixed number of iterations (Google Benchmark
// would otherwise pick a count per rank from its own timings) and starts after a barrier. Only rank 0
// reports. On a busy machine add --benchmark_repetitions=7 and read the `_min` rows.
#include <gradclip/clip.hpp>
#include <gradclip/mpi.hpp>
#include <gradclip/norm.hpp>

#include <benchmark/benchmark.h>

#include <mpi.h>
#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

template <class T>
std::vector<std::vector<T>> random_shard(std::size_t n) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::mt19937_64 rng(20261202u + static_cast<unsigned>(rank));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(normal(rng));
  return {v};
}

template <class T>
void set_bytes(benchmark::State& state, std::size_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(n * sizeof(T)));
}

// The local norm of this rank's shard: what the reduction is compared to.
template <class T>
void local_norm(benchmark::State& state) {
  const auto shard = random_shard<T>(static_cast<std::size_t>(state.range(0)));
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::global_norm(shard));
  set_bytes<T>(state, shard[0].size());
}

// The global norm over every rank's shard: the local norm plus two all-reduces.
template <class T>
void mpi_global_norm(benchmark::State& state) {
  const auto shard = random_shard<T>(static_cast<std::size_t>(state.range(0)));
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::mpi::global_norm(MPI_COMM_WORLD, shard));
  set_bytes<T>(state, shard[0].size());
}

// The distributed clip when it does not bind (no write pass), against its local counterpart.
template <class T>
void local_clip(benchmark::State& state) {
  auto shard = random_shard<T>(static_cast<std::size_t>(state.range(0)));
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state)
    benchmark::DoNotOptimize(gradclip::clip_by_global_norm(shard, std::numeric_limits<double>::infinity()));
  set_bytes<T>(state, shard[0].size());
}

template <class T>
void mpi_clip(benchmark::State& state) {
  auto shard = random_shard<T>(static_cast<std::size_t>(state.range(0)));
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state)
    benchmark::DoNotOptimize(
        gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, shard, std::numeric_limits<double>::infinity()));
  set_bytes<T>(state, shard[0].size());
}

// The floor: one all-reduce of one double, as a naive distributed norm would do.
void allreduce_one_double(benchmark::State& state) {
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) {
    double local = 1.0, total = 0.0;
    MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    benchmark::DoNotOptimize(total);
  }
}

// gradclip's reduction alone: an empty shard, so only the two all-reduces remain.
void mpi_reduction_only(benchmark::State& state) {
  const std::vector<std::vector<float>> empty;
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) benchmark::DoNotOptimize(gradclip::mpi::global_norm(MPI_COMM_WORLD, empty));
}

// With --benchmark_repetitions, the fastest repetition: on a shared machine a rank that is descheduled
// makes the others wait in the all-reduce, so the median overstates the cost of communication.
double fastest(const std::vector<double>& times) { return *std::min_element(times.begin(), times.end()); }

// Every rank runs the same number of iterations: about 2^25 elements' worth per case.
benchmark::IterationCount iterations_for(std::int64_t n) {
  return std::clamp<std::int64_t>((std::int64_t{1} << 25) / n, 20, 20000);
}

template <class T>
void register_sizes(const char* type) {
  using case_function = void (*)(benchmark::State&);
  const std::pair<const char*, case_function> cases[] = {{"local_norm", local_norm<T>},
                                                         {"mpi_global_norm", mpi_global_norm<T>},
                                                         {"local_clip", local_clip<T>},
                                                         {"mpi_clip", mpi_clip<T>}};
  for (std::int64_t n : {std::int64_t{1} << 10, std::int64_t{1} << 14, std::int64_t{1} << 18, std::int64_t{1} << 22})
    for (const auto& [name, function] : cases)
      benchmark::RegisterBenchmark((std::string(name) + "<" + type + ">").c_str(), function)
          ->Arg(n)
          ->Iterations(iterations_for(n))
          ->ComputeStatistics("min", fastest);
}

class silent_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  benchmark::Initialize(&argc, argv);
  benchmark::RegisterBenchmark("allreduce_one_double", allreduce_one_double)
      ->Iterations(20000)
      ->ComputeStatistics("min", fastest);
  benchmark::RegisterBenchmark("mpi_reduction_only", mpi_reduction_only)
      ->Iterations(20000)
      ->ComputeStatistics("min", fastest);
  register_sizes<Eigen::half>("half");
  register_sizes<float>("float");
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    silent_reporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  MPI_Finalize();
}
