// gradclip::mpi on however many ranks mpiexec starts: every rank rebuilds the same random group of
// gradients, keeps its own shards, and checks that the distributed clip equals the single-process clip
// of the whole group and agrees bit for bit with every other rank.
//
// Every test makes the same collective calls on every rank whatever fails (EXPECT, never ASSERT, before a
// collective), so a failure is reported instead of leaving ranks waiting.
#include <gradclip/gradclip.hpp>
#include <gradclip/mpi.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;

int rank_of(MPI_Comm comm = MPI_COMM_WORLD) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}
int size_of(MPI_Comm comm = MPI_COMM_WORLD) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  return n;
}

std::uint64_t bits_of(double x) {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// True on every rank when every rank passed the same bits.
bool same_on_every_rank(const gradclip::clip_result& r, MPI_Comm comm = MPI_COMM_WORLD) {
  const std::uint64_t mine[4] = {bits_of(r.norm), bits_of(r.coefficient), r.clipped, r.finite};
  std::vector<std::uint64_t> all(4 * static_cast<std::size_t>(size_of(comm)));
  MPI_Allgather(mine, 4, MPI_UINT64_T, all.data(), 4, MPI_UINT64_T, comm);
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i] != all[i % 4]) return false;
  return true;
}
bool same_on_every_rank(double x, MPI_Comm comm = MPI_COMM_WORLD) {
  return same_on_every_rank(gradclip::clip_result{x, 0.0, false, false}, comm);
}

/// True on every rank when `ok` is true on every rank.
bool on_every_rank(bool ok) {
  int mine = ok, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
  return all != 0;
}

/// The distance between two values of T in units in the last place (0 when equal, 1 for neighbours).
template <class T>
std::int64_t ulp_distance(T a, T b) {
  using bits =
      std::conditional_t<sizeof(T) == 2, std::int16_t, std::conditional_t<sizeof(T) == 4, std::int32_t, std::int64_t>>;
  const auto ordered = [](T x) {
    bits raw;
    std::memcpy(&raw, &x, sizeof raw);
    const std::int64_t v = raw;
    return v < 0 ? std::numeric_limits<bits>::min() - v : v;  // negative values count down from -0
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

/// A group every rank builds identically, each member owned by one rank.
template <class T>
struct sharded_group {
  std::vector<std::vector<T>> members;
  std::vector<int> owners;

  std::vector<std::vector<T>> local(int rank) const {
    std::vector<std::vector<T>> mine;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (owners[i] == rank) mine.push_back(members[i]);
    return mine;
  }
  std::vector<T> concatenation() const {
    std::vector<T> all;
    for (const auto& m : members) all.insert(all.end(), m.begin(), m.end());
    return all;
  }
};

/// Random members of random sizes (some empty) and scales, on random ranks (so some ranks may own none).
template <class T>
sharded_group<T> random_group(std::mt19937_64& rng, int ranks, int max_scale_exponent) {
  sharded_group<T> g;
  const int count = 1 + static_cast<int>(rng() % (3 * static_cast<unsigned>(ranks)));
  for (int i = 0; i < count; ++i) {
    const std::size_t n = rng() % 7 == 0 ? 0 : rng() % 5000;
    const int e = static_cast<int>(rng() % (2 * static_cast<unsigned>(max_scale_exponent) + 1)) - max_scale_exponent;
    g.members.push_back(random_gradient<T>(n, rng, std::ldexp(1.0, e)));
    g.owners.push_back(static_cast<int>(rng() % static_cast<unsigned>(ranks)));
  }
  return g;
}

/// Clips the group on every rank through gradclip::mpi and, on the whole group, in one process, and
/// checks that the two agree: the norm within one rounding per member merged, every element within one
/// unit in the last place, and every rank's result bit for bit the same.
template <class Policy = gradclip::robust, class T>
void expect_matches_single_process(const sharded_group<T>& group, double max_norm, gradclip::options opt = {}) {
  const int rank = rank_of();
  auto reference = group.members;
  const auto expected = gradclip::clip_by_global_norm<Policy>(reference, max_norm, opt);
  const double expected_norm = gradclip::global_norm<Policy>(group.members, opt);

  auto mine = group.local(rank);
  const double norm = gradclip::mpi::global_norm<Policy>(MPI_COMM_WORLD, mine, opt);
  const auto result = gradclip::mpi::clip_by_global_norm<Policy>(MPI_COMM_WORLD, mine, max_norm, opt);

  EXPECT_TRUE(same_on_every_rank(result));
  EXPECT_TRUE(same_on_every_rank(norm));
  const double rounding = static_cast<double>(group.members.size() + 1) * 0x1p-53;
  const auto close = [&](double got, double want) {
    if (std::isinf(want) || std::isnan(want) || want == 0) return bits_of(got) == bits_of(want);
    return std::abs(got - want) <= rounding * want;
  };
  EXPECT_TRUE(close(norm, expected_norm)) << norm << " vs " << expected_norm;
  EXPECT_TRUE(close(result.norm, expected.norm)) << result.norm << " vs " << expected.norm;
  EXPECT_TRUE(close(result.coefficient, expected.coefficient)) << result.coefficient << " vs " << expected.coefficient;
  EXPECT_EQ(result.clipped, expected.clipped);
  EXPECT_EQ(result.finite, expected.finite);

  // Elements: one rounding of T apart, plus what the coefficients' own difference (a few roundings of
  // double, from merging the members in another order) can move a double element. With the robust
  // policy each element is also within one unit in the last place of the exact g * max_norm / ||g||,
  // or (FP64, whose coefficient takes a few roundings of its own) no further from it than on one process.
  const double coefficient_difference =
      result.coefficient == expected.coefficient ? 0.0 : std::abs(result.coefficient / expected.coefficient - 1);
  const auto allowed = 1 + static_cast<std::int64_t>(2 * coefficient_difference / epsilon_of<T>());
  const bool check_exact = std::is_same_v<Policy, gradclip::robust> && result.clipped && result.finite &&
                           opt.epsilon == 0 && opt.norm == gradclip::l2_norm;
  const quad exact_coefficient = check_exact ? quad(max_norm) / exact_norm(group.concatenation()) : quad(1);
  std::size_t k = 0;
  std::int64_t worst = 0;
  double worst_exact = 0;
  double reference_exact = 0;
  for (std::size_t i = 0; i < group.members.size(); ++i) {
    if (group.owners[i] != rank) continue;
    for (std::size_t j = 0; j < group.members[i].size(); ++j) {
      worst = std::max(worst, ulp_distance(mine[k][j], reference[i][j]));
      if (check_exact) {
        worst_exact = std::max(worst_exact, ulps(mine[k][j], to_quad(group.members[i][j]) * exact_coefficient));
        reference_exact =
            std::max(reference_exact, ulps(reference[i][j], to_quad(group.members[i][j]) * exact_coefficient));
      }
    }
    ++k;
  }
  EXPECT_LE(worst, allowed) << "on rank " << rank;
  EXPECT_LE(worst_exact, std::max(1.0, reference_exact + 0.5)) << "on rank " << rank;
}

template <class T>
class MpiTyped : public ::testing::Test {};
TYPED_TEST_SUITE(MpiTyped, element_types);

TYPED_TEST(MpiTyped, RandomShardsMatchTheSingleProcessClip) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>() + ", " + std::to_string(size_of()) + " ranks");
  std::mt19937_64 rng(seed + 100);  // the same stream on every rank, so the same group
  const int spread = std::is_same_v<T, Eigen::half> ? 6 : (std::is_same_v<T, double> ? 500 : 60);
  for (int round = 0; round < 8; ++round) {
    const auto group = random_group<T>(rng, size_of(), spread);
    const double norm = gradclip::global_norm(group.members);
    expect_matches_single_process(group, norm / 3);  // binds
    expect_matches_single_process(group, norm * 2);  // does not bind: untouched
    expect_matches_single_process(group, norm / 3, {gradclip::on_nonfinite::skip, 1e-6});

    // Against the exact norm of the concatenation, in binary128.
    auto mine = group.local(rank_of());
    const double distributed = gradclip::mpi::global_norm(MPI_COMM_WORLD, mine);
    const auto all = group.concatenation();
    EXPECT_LE(relative_error(distributed, exact_norm(all)), robust_norm_bound<T>());
  }
}

// The matrix test's MPI column: every norm on 1-4 ranks, against binary128 and one process.
TYPED_TEST(MpiTyped, EveryNormMatchesTheExactNormAndOneProcess) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>() + ", " + std::to_string(size_of()) + " ranks");
  std::mt19937_64 rng(seed + 102);
  const auto group = random_group<T>(rng, size_of(), 4);
  std::vector<quad> truth;
  for (const auto x : group.concatenation()) truth.push_back(to_quad(x));
  for (const double p : {1.0, 2.0, 3.0, std::numeric_limits<double>::infinity()}) {
    const gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, gradclip::norm_type{p}};
    auto mine = group.local(rank_of());
    const double distributed = gradclip::mpi::global_norm(MPI_COMM_WORLD, mine, opt);
    EXPECT_TRUE(same_on_every_rank(distributed));
    EXPECT_LE(relative_error(distributed, exact_p_norm(truth, p)), p == 2.0 ? robust_norm_bound<T>() : 1e-12)
        << "p = " << p;
    expect_matches_single_process(group, distributed / 3, opt);
  }
}

// The RMS norm over the ranks: the exact SUM carries each rank's element count, so the norm is that of
// the concatenation (binary128), the same bits on every rank, and the clip is the single-process one.
TYPED_TEST(MpiTyped, RmsNormIsTheRmsOfTheConcatenation) {
  using T = TypeParam;
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + type_name<T>() + ", " + std::to_string(size_of()) + " ranks");
  std::mt19937_64 rng(seed + 103);
  const auto group = random_group<T>(rng, size_of(), 4);
  quad sum = 0;
  std::size_t n = 0;
  for (const auto x : group.concatenation()) sum += to_quad(x) * to_quad(x), ++n;
  const gradclip::options opt{gradclip::on_nonfinite::skip, 0.0, gradclip::rms_norm};
  auto mine = group.local(rank_of());
  const double distributed = gradclip::mpi::global_norm(MPI_COMM_WORLD, mine, opt);
  EXPECT_TRUE(same_on_every_rank(distributed));
  EXPECT_LE(relative_error(distributed, n == 0 ? quad(0) : quad_sqrt(sum / quad(n))), robust_norm_bound<T>());
  expect_matches_single_process(group, distributed / 3, opt);
}

TYPED_TEST(MpiTyped, EveryPolicyMatchesItsSingleProcessClip) {
  using T = TypeParam;
  std::mt19937_64 rng(seed + 101);
  const auto group = random_group<T>(rng, size_of(), 4);
  const double norm = gradclip::global_norm(group.members);
  expect_matches_single_process<gradclip::promote>(group, norm / 2);
  expect_matches_single_process<gradclip::max_scale>(group, norm / 2);
}

TEST(Mpi, Fp64Near1e300OnOneRankOnly) {
  const int last = size_of() - 1;
  sharded_group<double> group;
  for (int r = 0; r < size_of(); ++r) {
    group.members.push_back({0.5, -0.25, 1e-3});
    group.owners.push_back(r);
  }
  group.members.push_back({1e300, -1e300, 3e299});
  group.owners.push_back(last);
  expect_matches_single_process(group, 1.0);

  // Beyond double's range: the norm is +inf, still finite input, and every clipped element is right.
  group.members.back() = {1.5e308, 1.5e308};
  auto mine = group.local(rank_of());
  const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0);
  EXPECT_TRUE(same_on_every_rank(result));
  EXPECT_EQ(result.norm, INFINITY);
  EXPECT_TRUE(result.finite);
  EXPECT_TRUE(result.clipped);
  if (rank_of() == last) {
    // robust's one ulp of the exact projection (numerics.md), against the exact norm of the whole group.
    const quad exact = to_quad(1.5e308) / exact_norm(group.concatenation());
    EXPECT_LE(ulps(mine.back()[0], exact), 1.0);
    EXPECT_LE(ulps(mine.back()[1], exact), 1.0);
  }
  expect_matches_single_process(group, 1.0);
}

TEST(Mpi, Bf16NearItsMaximumOnOneRank) {
  const double bf16_max = static_cast<double>(std::numeric_limits<Eigen::bfloat16>::max());
  sharded_group<Eigen::bfloat16> group;
  for (int r = 0; r < size_of(); ++r) {
    group.members.push_back({Eigen::bfloat16(1.0f), Eigen::bfloat16(-2.0f)});
    group.owners.push_back(r);
  }
  group.members.push_back({Eigen::bfloat16(bf16_max), Eigen::bfloat16(-bf16_max), Eigen::bfloat16(bf16_max / 2)});
  group.owners.push_back(size_of() - 1);
  auto mine = group.local(rank_of());
  const double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, mine);
  EXPECT_TRUE(std::isfinite(norm));
  EXPECT_NEAR(norm / bf16_max, 1.5, 1e-12);
  expect_matches_single_process(group, 1.0);
  expect_matches_single_process(group, bf16_max);
}

TEST(Mpi, NaNOnOneRankMakesEveryRankSkipOrThrow) {
  const int last = size_of() - 1;
  std::vector<std::vector<float>> mine{{3.0f, 4.0f}};
  if (rank_of() == last) mine.push_back({1.0f, NAN});
  const auto before = mine;

  const auto skipped = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0);
  EXPECT_TRUE(same_on_every_rank(skipped));
  EXPECT_TRUE(std::isnan(skipped.norm));
  EXPECT_FALSE(skipped.finite);
  EXPECT_FALSE(skipped.clipped);
  EXPECT_EQ(skipped.coefficient, 1.0);
  EXPECT_EQ(std::memcmp(mine[0].data(), before[0].data(), 2 * sizeof(float)), 0);

  bool threw = false;
  try {
    (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0, {gradclip::on_nonfinite::error});
  } catch (const gradclip::nonfinite_error& e) {
    threw = std::isnan(e.norm);
    // Each rank names its own first non-finite gradient, or none.
    EXPECT_EQ(e.tensor, rank_of() == last ? 1u : gradclip::nonfinite_error::no_tensor);
  }
  EXPECT_TRUE(on_every_rank(threw));

  // Each rank's report describes its local gradients.
  gradclip::tensor_report report;
  gradclip::options reported;
  reported.report = &report;
  (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0, reported);
  EXPECT_EQ(report.size(), mine.size());
  EXPECT_EQ(report.first_nonfinite(), rank_of() == last ? 1u : mine.size());
  if (!report.empty()) {
    EXPECT_EQ(report[0].norm, 5.0);
  }
  EXPECT_TRUE(std::isnan(gradclip::mpi::global_norm(MPI_COMM_WORLD, mine, reported)));
  EXPECT_EQ(report.size(), mine.size());
  EXPECT_EQ(std::memcmp(mine[0].data(), before[0].data(), 2 * sizeof(float)), 0);

  const auto propagated =
      gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0, {gradclip::on_nonfinite::propagate});
  EXPECT_TRUE(same_on_every_rank(propagated));
  EXPECT_TRUE(std::isnan(mine[0][0]));

  // An Inf on rank 0 and a NaN on the last rank: NaN everywhere, as when merging on one process.
  std::vector<std::vector<double>> mixed{{rank_of() == 0 ? INFINITY : 1.0}};
  if (rank_of() == last) mixed[0].push_back(NAN);
  const double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, mixed);
  EXPECT_TRUE(same_on_every_rank(norm));
  EXPECT_TRUE(std::isnan(norm));
}

TEST(Mpi, InfOnOneRankGivesAnInfiniteNormEverywhere) {
  std::vector<std::vector<Eigen::half>> mine{{Eigen::half(1.0f)}};
  if (rank_of() == 0) mine[0].push_back(std::numeric_limits<Eigen::half>::infinity());
  const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0);
  EXPECT_TRUE(same_on_every_rank(result));
  EXPECT_EQ(result.norm, INFINITY);
  EXPECT_FALSE(result.finite);
}

TEST(Mpi, EmptyRanksTakePart) {
  std::vector<std::vector<float>> nothing;
  const auto empty = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, nothing, 1.0);
  EXPECT_TRUE(same_on_every_rank(empty));
  EXPECT_EQ(empty.norm, 0.0);
  EXPECT_EQ(empty.coefficient, 1.0);
  EXPECT_FALSE(empty.clipped);

  sharded_group<float> group;  // only rank 0 has gradients, one of them empty
  group.members = {{3.0f, 4.0f}, {}, {12.0f}};
  group.owners = {0, 0, 0};
  expect_matches_single_process(group, 1.0);

  // Ranks may hold different kinds of groups: Eigen vectors here, nothing there.
  std::vector<Eigen::VectorXd> vectors;
  if (rank_of() % 2 == 1) vectors.push_back(Eigen::VectorXd::Constant(4, 1.0));
  const double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, vectors);
  EXPECT_EQ(norm, 2.0 * std::sqrt(static_cast<double>(size_of() / 2)));
}

// The global part counts every rank's elements, exactly and the same on every rank, for the kinds that
// sum (in the exact SUM's extra word) and those that gather (in each rank's gathered words), with NaN on
// one rank and with empty ranks.
TEST(Mpi, TheGlobalPartCountsEveryRanksElements) {
  const int rank = rank_of(), ranks = size_of();
  for (const double p : {2.0, 1.0, 3.0}) {
    for (const bool nan : {false, true}) {
      std::vector<std::vector<float>> mine;
      if (rank % 2 == 0) mine.assign(static_cast<std::size_t>(rank) + 1, std::vector<float>(1000 + rank, 0.5f));
      if (nan && rank == ranks - 1) mine.push_back({NAN, 1.0f});
      std::uint64_t expected = 0;
      for (int r = 0; r < ranks; ++r) {
        if (r % 2 == 0) expected += static_cast<std::uint64_t>(r + 1) * static_cast<std::uint64_t>(1000 + r);
        if (nan && r == ranks - 1) expected += 2;
      }
      const gradclip::options opt{gradclip::on_nonfinite::propagate, 0.0, gradclip::norm_type{p}};
      const char* function = "test";
      const MPI_Comm own = gradclip::mpi::detail::library_comm(function, MPI_COMM_WORLD);
      const auto a = gradclip::mpi::detail::agree<gradclip::robust>(function, own, mine, 0.0, opt);
      const gradclip::partial_norm global = gradclip::mpi::detail::combine(function, own, a);
      EXPECT_EQ(global.elements, expected) << "p = " << p << ", rank " << rank;
      EXPECT_EQ(global.finite, !nan);
      EXPECT_TRUE(same_on_every_rank(static_cast<double>(global.elements)));
    }
  }
}

TEST(Mpi, MixedElementTypesOnEveryRank) {
  std::mt19937_64 rng(seed + 102);
  auto weights = random_gradient<Eigen::half>(700 + static_cast<std::size_t>(rank_of()), rng, 30.0);
  auto bias = random_gradient<float>(50, rng, 1e3);
  std::vector<gradclip::grad_view> mine{gradclip::grad_view(weights), gradclip::grad_view(bias)};
  const double norm = gradclip::mpi::global_norm(MPI_COMM_WORLD, mine);
  // The same group on one process: gather every rank's buffers.
  double local_squares = 0;
  for (auto w : weights) local_squares += static_cast<double>(w) * static_cast<double>(w);
  for (auto b : bias) local_squares += static_cast<double>(b) * static_cast<double>(b);
  double squares = 0;
  MPI_Allreduce(&local_squares, &squares, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  // A group with FP16 members has their bound (the FP64 reference's own rounding is far below it).
  EXPECT_NEAR(norm, std::sqrt(squares), robust_norm_bound<Eigen::half>() * norm);
  const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, norm / 2);
  EXPECT_TRUE(same_on_every_rank(result));
  // Each element within one ulp plus b = 16 * 2^-24 relative of the exact projection (a group with an FP16
  // member; numerics.md), whose norm is norm / 2; one FP16 ulp is at most 2^-10 relative (FP32's far less),
  // and the computed norm is within b of the clipped elements' exact norm.
  const double b = robust_norm_bound<Eigen::half>();
  EXPECT_LE(relative_error(gradclip::mpi::global_norm(MPI_COMM_WORLD, mine), static_cast<quad>(norm / 2)),
            (0x1p-10 + 2 * b) * 1.01);
}

TEST(Mpi, BadArgumentsOnOneRankThrowOnEveryRank) {
  const int last = size_of() - 1;
  std::vector<std::vector<float>> mine{{3.0f, 4.0f}};
  std::string message;
  try {
    (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, rank_of() == last ? -1.0 : 1.0);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  // Every rank's message names the offending rank; its own also says what is wrong.
  const bool named = message.rfind("gradclip::mpi::clip_by_global_norm: ", 0) == 0 &&
                     message.find("rank " + std::to_string(last)) != std::string::npos &&
                     (rank_of() != last || message.find("max_norm") != std::string::npos);
  EXPECT_TRUE(on_every_rank(named)) << message;
  EXPECT_EQ(mine[0][0], 3.0f);

  message.clear();
  try {
    (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0, {gradclip::on_nonfinite::skip, -1.0});
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  EXPECT_TRUE(on_every_rank(message.find("epsilon") != std::string::npos)) << message;

  // Arguments that differ between ranks would give ranks different coefficients: refused everywhere.
  if (size_of() > 1) {
    const auto differing = [&](double max_norm, gradclip::options opt) {
      try {
        (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, max_norm, opt);
      } catch (const std::invalid_argument& e) {
        return std::string(e.what()).find("same on every rank") != std::string::npos;
      }
      return false;
    };
    const bool odd = rank_of() % 2 == 1;
    EXPECT_TRUE(on_every_rank(differing(odd ? 2.0 : 1.0, {})));
    EXPECT_TRUE(on_every_rank(differing(1.0, {odd ? gradclip::on_nonfinite::error : gradclip::on_nonfinite::skip, 0})));
    EXPECT_TRUE(on_every_rank(differing(1.0, {gradclip::on_nonfinite::skip, odd ? 1e-6 : 0.0})));
  }
  EXPECT_EQ(mine[0][0], 3.0f);

  // No rank was left inside a collective: the next call works everywhere.
  const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, 1.0);
  EXPECT_TRUE(same_on_every_rank(result));
  EXPECT_LE(relative_error(result.norm, quad(5) * quad_sqrt(size_of())), robust_norm_bound<float>());
}

// A controller that clips to a threshold of its own; ranks given different thresholds disagree.
struct fixed_controller {
  double threshold;
  int updates = 0;
  gradclip::threshold_decision decide(double) const { return {threshold, false}; }
  double fallback_threshold() const { return threshold; }
  void update(const gradclip::clip_result&) { ++updates; }
};

TEST(Mpi, ControllersDecideAlikeOnEveryRankOrEveryRankThrows) {
  std::vector<std::vector<float>> mine{{3.0f, 4.0f}};
  fixed_controller same{1.0};
  const auto result = gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, same);
  EXPECT_TRUE(same_on_every_rank(result));
  EXPECT_EQ(result.threshold, 1.0);
  EXPECT_TRUE(result.clipped);
  EXPECT_EQ(same.updates, 1);
  // robust's one ulp of the exact projection 3 / (5 sqrt(ranks)) (numerics.md).
  EXPECT_LE(ulps(mine[0][0], quad(3) / (quad(5) * quad_sqrt(size_of()))), 1.0);
  EXPECT_LE(ulps(mine[0][1], quad(4) / (quad(5) * quad_sqrt(size_of()))), 1.0);
  if (size_of() > 1) {
    fixed_controller differing{rank_of() == 0 ? 1.0 : 2.0};
    const auto before = mine;
    bool threw = false;
    try {
      (void)gradclip::mpi::clip_by_global_norm(MPI_COMM_WORLD, mine, differing);
    } catch (const std::logic_error& e) {
      threw = std::string(e.what()).find("decided differently") != std::string::npos;
    }
    EXPECT_TRUE(on_every_rank(threw));
    EXPECT_EQ(mine, before);
  }
}

TEST(Mpi, BadCommunicatorsThrowBeforeAnyCommunication) {
  std::vector<std::vector<float>> mine{{1.0f}};
  EXPECT_THROW((void)gradclip::mpi::global_norm(MPI_COMM_NULL, mine), std::invalid_argument);
  EXPECT_THROW((void)gradclip::mpi::clip_by_global_norm(MPI_COMM_NULL, mine, 1.0), std::invalid_argument);
  EXPECT_EQ(gradclip::mpi::global_norm(MPI_COMM_SELF, mine), 1.0);  // a communicator of one rank
}

TEST(Mpi, SubCommunicatorsReduceSeparately) {
  for (int repeat = 0; repeat < 3; ++repeat) {  // a fresh communicator each time: its cached duplicate too
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, rank_of() % 2, rank_of(), &half);
    std::vector<std::vector<double>> mine{{static_cast<double>(rank_of() % 2 + 1)}};
    const double norm = gradclip::mpi::global_norm(half, mine);
    EXPECT_TRUE(same_on_every_rank(norm, half));
    EXPECT_EQ(norm, (rank_of() % 2 + 1) * std::sqrt(static_cast<double>(size_of(half))));
    MPI_Comm_free(&half);
  }
}

TEST(Mpi, MpiErrorsAreExceptions) {
  // gradclip's duplicate returns errors instead of aborting...
  const MPI_Comm own = gradclip::mpi::detail::library_comm("test", MPI_COMM_WORLD);
  EXPECT_NE(own, MPI_COMM_WORLD);
  EXPECT_EQ(own, gradclip::mpi::detail::library_comm("test", MPI_COMM_WORLD));  // cached, not duplicated again
  MPI_Errhandler handler;
  MPI_Comm_get_errhandler(own, &handler);
  EXPECT_TRUE(handler == MPI_ERRORS_RETURN);
  MPI_Errhandler_free(&handler);
  // ...and every returned error is thrown as mpi_error, with MPI's description.
  try {
    gradclip::mpi::detail::check(MPI_ERR_COUNT, "gradclip::mpi::global_norm", "MPI_Allreduce");
    ADD_FAILURE() << "no exception";
  } catch (const gradclip::mpi::mpi_error& e) {
    EXPECT_EQ(e.code, MPI_ERR_COUNT);
    EXPECT_EQ(std::string(e.what()).rfind("gradclip::mpi::global_norm: MPI_Allreduce failed: ", 0), 0u) << e.what();
  }
}

// Ranks other than 0 print only their failures, prefixed with their rank.
class rank_failure_printer : public ::testing::EmptyTestEventListener {
 public:
  explicit rank_failure_printer(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = rank_of();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new rank_failure_printer(rank));
  }
  const int failed = RUN_ALL_TESTS() != 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
