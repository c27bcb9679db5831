// Sharded data-parallel training with global-norm clipping across MPI ranks.
//
//     mpiexec -n 4 ./mpi_data_parallel
//
// Every rank holds its own batch of a least-squares problem and, ZeRO-style, owns one slice of the
// parameters: it all-gathers the parameters, computes its batch's gradient, and a reduce-scatter leaves it
// the summed gradient of its own slice only. No rank has the whole gradient, so the clipping norm comes
// from gradclip::mpi::clip_by_global_norm, which combines every rank's share in two small all-reduces.
// Beside it, the replicated alternative: an all-reduce gives every rank the whole gradient, and the
// plain gradclip::clip_by_global_norm needs no communication at all. Both norms are printed side by side.
#include <gradclip/gradclip.hpp>
#include <gradclip/mpi.hpp>

#include <mpi.h>
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int parameters = 96;
constexpr int samples_per_rank = 256;
constexpr double max_norm = 100.0;
constexpr float learning_rate = 0.7f;

std::uint64_t bits_of(double x) {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  // Slice r of the parameters: [offsets[r], offsets[r] + counts[r]).
  std::vector<int> counts(static_cast<std::size_t>(ranks)), offsets(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    counts[static_cast<std::size_t>(r)] = parameters / ranks + (r < parameters % ranks ? 1 : 0);
    offsets[static_cast<std::size_t>(r)] =
        r == 0 ? 0 : offsets[static_cast<std::size_t>(r) - 1] + counts[static_cast<std::size_t>(r) - 1];
  }
  const int mine = counts[static_cast<std::size_t>(rank)];

  // This rank's batch: targets of a hidden linear model, scaled so that the first gradients have norms
  // in the thousands and clipping binds.
  std::mt19937 rng(1234u + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Eigen::MatrixXf x(samples_per_rank, parameters);
  for (int i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
  std::mt19937 shared_rng(99u);  // the same hidden model on every rank
  Eigen::VectorXf hidden(parameters);
  for (int i = 0; i < parameters; ++i) hidden[i] = 100.0f * normal(shared_rng);
  const Eigen::VectorXf y = x * hidden;
  const float total_samples = static_cast<float>(samples_per_rank * ranks);

  Eigen::VectorXf slice = Eigen::VectorXf::Zero(mine);  // the parameters this rank owns
  std::vector<Eigen::VectorXf> slice_grad{Eigen::VectorXf(mine)};
  Eigen::VectorXf weights(parameters), local_grad(parameters);
  std::vector<Eigen::VectorXf> full_grad{Eigen::VectorXf(parameters)};

  if (rank == 0)
    std::printf("%d ranks, %d parameters in slices of %d to %d\n%5s %12s %12s %12s %12s\n", ranks, parameters,
                *std::min_element(counts.begin(), counts.end()), *std::max_element(counts.begin(), counts.end()),
                "step", "loss", "norm", "replicated", "coefficient");
  int disagreements = 0;
  double first_loss = 0, loss = 0;
  for (int step = 1; step <= 100; ++step) {
    MPI_Allgatherv(slice.data(), mine, MPI_FLOAT, weights.data(), counts.data(), offsets.data(), MPI_FLOAT,
                   MPI_COMM_WORLD);
    const Eigen::VectorXf residual = x * weights - y;
    const double local_loss = 0.5 * static_cast<double>(residual.squaredNorm());
    MPI_Allreduce(&local_loss, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    loss /= total_samples;
    if (step == 1) first_loss = loss;
    local_grad = x.transpose() * residual / total_samples;

    // Sharded: each rank receives the summed gradient of its own slice and clips with the global norm.
    MPI_Reduce_scatter(local_grad.data(), slice_grad[0].data(), counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, slice_grad, max_norm);
    slice -= learning_rate * slice_grad[0];

    // Replicated: every rank holds the whole gradient, which already has the global norm.
    MPI_Allreduce(local_grad.data(), full_grad[0].data(), parameters, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const auto replicated = gradclip::clip_by_global_norm(full_grad, max_norm);

    // Every rank must have applied the same coefficient, bit for bit.
    const std::uint64_t coefficient_bits = bits_of(result.coefficient);
    std::uint64_t lowest = 0, highest = 0;
    MPI_Allreduce(&coefficient_bits, &lowest, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&coefficient_bits, &highest, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    disagreements += lowest != highest;

    if (rank == 0 && (step == 1 || step % 10 == 0))
      std::printf("%5d %12.5g %12.5g %12.5g %12.4g\n", step, loss, result.norm, replicated.norm, result.coefficient);
  }

  const bool converged = loss < 1e-6 * first_loss;
  if (rank == 0)
    std::printf("%s; ranks disagreed on the coefficient in %d steps\n", converged ? "converged" : "did not converge",
                disagreements);
  MPI_Finalize();
  return converged && disagreements == 0 ? 0 : 1;
}
