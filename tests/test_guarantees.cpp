// The guarantees docs/reliability.md states: a throwing call modifies nothing (on_nonfinite::error and invalid
// arguments, for one gradient and for groups), concurrent calls on different buffers are safe, and the
// hot path of a single-gradient norm or clip allocates nothing. clip_by_value is held to the same.
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <unsupported/Eigen/CXX11/Tensor>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

// Every allocation of the process is counted, so a test can assert that a call made none.
namespace {
std::atomic<long> allocation_count{0};

void* counted_allocation(std::size_t size, std::size_t alignment) {
  allocation_count.fetch_add(1, std::memory_order_relaxed);
  const std::size_t bytes = size == 0 ? 1 : size;
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return counted_allocation(size, alignof(std::max_align_t)); }
void* operator new[](std::size_t size) { return counted_allocation(size, alignof(std::max_align_t)); }
void* operator new(std::size_t size, std::align_val_t alignment) {
  return counted_allocation(size, static_cast<std::size_t>(alignment));
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  return counted_allocation(size, static_cast<std::size_t>(alignment));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using namespace gradclip_test;
using gradclip::max_scale;
using gradclip::naive;
using gradclip::on_nonfinite;
using gradclip::promote;
using gradclip::robust;

template <class T>
class Guarantees : public ::testing::Test {};
TYPED_TEST_SUITE(Guarantees, element_types);

/// Allocations made by f.
template <class F>
long allocations_in(F&& f) {
  const long before = allocation_count.load();
  f();
  return allocation_count.load() - before;
}

/// n elements large enough to clip (norm far above 1), spanning several 1024-element blocks.
template <class T>
std::vector<T> big_gradient(std::size_t n, std::uint64_t salt) {
  std::mt19937_64 rng(seed + salt);
  return random_gradient<T>(n, rng, 100.0);
}

// --- Strong guarantee -----------------------------------------------------------------------------

TYPED_TEST(Guarantees, ErrorModeThrowsBeforeWritingAnyGradient) {
  using T = TypeParam;
  // The bad element sits first, in a later block and last, so every reduction order meets it.
  for (std::size_t position : {std::size_t{0}, std::size_t{2500}, std::size_t{4999}}) {
    for (T bad : {std::numeric_limits<T>::quiet_NaN(), -std::numeric_limits<T>::infinity()}) {
      auto g = big_gradient<T>(5000, position);
      g[position] = bad;
      const auto original = g;
      EXPECT_THROW((void)gradclip::clip_by_norm(g, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
      EXPECT_THROW((void)gradclip::clip_by_norm<max_scale>(g.data(), g.size(), 1.0, {on_nonfinite::error}),
                   gradclip::nonfinite_error);
      Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<2>> strided(g.data(), 2500);
      if (position % 2 == 0) {
        EXPECT_THROW((void)gradclip::clip_by_norm<promote>(strided, 1.0, {on_nonfinite::error}),
                     gradclip::nonfinite_error);
      }
      EXPECT_TRUE(same_bits(g, original)) << "position " << position;
    }
  }
}

TYPED_TEST(Guarantees, ErrorModeOnAGroupWritesNoMemberWhenTheLastIsBad) {
  using T = TypeParam;
  std::vector<std::vector<T>> group{big_gradient<T>(3000, 1), big_gradient<T>(10, 2), big_gradient<T>(2000, 3)};
  group.back()[1999] = std::numeric_limits<T>::infinity();
  const auto original = group;
  EXPECT_THROW((void)gradclip::clip_by_global_norm(group, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  for (std::size_t j = 0; j < group.size(); ++j) EXPECT_TRUE(same_bits(group[j], original[j])) << "member " << j;

  // A mixed-type group (FP32 first, this type last) and a braced list behave the same.
  std::vector<float> first = big_gradient<float>(1500, 4);
  const auto first_original = first;
  std::vector<T> last = group.back();
  EXPECT_THROW((void)gradclip::clip_by_global_norm<max_scale>(
                   std::vector<gradclip::grad_view>{gradclip::grad_view(first), gradclip::grad_view(last)}, 1.0,
                   {on_nonfinite::error}),
               gradclip::nonfinite_error);
  EXPECT_THROW((void)gradclip::clip_by_global_norm({gradclip::grad_view(first), gradclip::grad_view(last)}, 1.0,
                                                   {on_nonfinite::error}),
               gradclip::nonfinite_error);
  EXPECT_TRUE(same_bits(first, first_original));
  EXPECT_TRUE(same_bits(last, original.back()));
}

TYPED_TEST(Guarantees, OverflowOfNaiveAndPromoteIsNonFiniteToo) {
  using T = TypeParam;
  // Finite input whose sum of squares overflows the policy's accumulator: error throws, nothing changes.
  std::vector<T> g(4, std::numeric_limits<T>::max());
  const auto original = g;
  EXPECT_THROW((void)gradclip::clip_by_norm<naive>(g, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  if constexpr (!std::is_same_v<T, Eigen::half>) {  // FP16 squares always fit promote's FP32
    EXPECT_THROW((void)gradclip::clip_by_norm<promote>(g, 1.0, {on_nonfinite::error}), gradclip::nonfinite_error);
  }
  EXPECT_TRUE(same_bits(g, original));
}

TYPED_TEST(Guarantees, InvalidArgumentsThrowBeforeWritingAnyGradient) {
  using T = TypeParam;
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  constexpr double inf = std::numeric_limits<double>::infinity();
  auto g = big_gradient<T>(3000, 5);
  std::vector<std::vector<T>> group{big_gradient<T>(100, 6), big_gradient<T>(200, 7)};
  const auto original = g;
  const auto group_original = group;
  const gradclip::options bad_options[] = {{on_nonfinite::skip, -1.0},
                                           {on_nonfinite::skip, inf},
                                           {on_nonfinite::error, nan},
                                           {static_cast<on_nonfinite>(7), 0.0}};
  for (const auto& opt : bad_options) {
    EXPECT_THROW((void)gradclip::clip_by_norm(g, 1.0, opt), std::invalid_argument);
    EXPECT_THROW((void)gradclip::clip_by_global_norm(group, 1.0, opt), std::invalid_argument);
  }
  for (double max_norm : {nan, -1.0, -inf}) {
    EXPECT_THROW((void)gradclip::clip_by_norm<naive>(g, max_norm), std::invalid_argument);
    EXPECT_THROW((void)gradclip::clip_by_global_norm(group, max_norm), std::invalid_argument);
    EXPECT_THROW((void)gradclip::clip_by_global_norm({gradclip::grad_view(g)}, max_norm), std::invalid_argument);
    EXPECT_THROW(gradclip::clip_by_value(g, max_norm), std::invalid_argument);
  }
  EXPECT_TRUE(same_bits(g, original));
  for (std::size_t j = 0; j < group.size(); ++j) EXPECT_TRUE(same_bits(group[j], group_original[j]));
}

// --- Concurrency ------------------------------------------------------------------------------------

/// Every operation a thread runs on its own buffers, in a fixed order; the final bits are compared.
template <class T>
void run_workload(std::vector<std::vector<T>>& buffers) {
  for (int round = 0; round < 20; ++round) {
    for (auto& g : buffers) {
      (void)gradclip::clip_by_norm(g, 50.0);
      (void)gradclip::clip_by_norm<max_scale>(g, 40.0);
      (void)gradclip::clip_by_norm<promote>(g, 30.0, {on_nonfinite::propagate, 1e-6});
      gradclip::clip_by_value(g, 5.0);
    }
    (void)gradclip::clip_by_global_norm(buffers, 20.0);
    for (auto& g : buffers)
      for (auto& x : g) x = T(static_cast<float>(x) * 3.0f);  // grow again so the next round clips
  }
}

TYPED_TEST(Guarantees, ConcurrentCallsOnDifferentBuffersMatchSequentialOnes) {
  using T = TypeParam;
  constexpr int threads = 4;
  std::vector<std::vector<std::vector<T>>> sequential(threads), concurrent(threads);
  for (int t = 0; t < threads; ++t) {
    for (std::size_t n : {std::size_t{1}, std::size_t{777}, std::size_t{5000}})
      sequential[t].push_back(big_gradient<T>(n, 100 + static_cast<std::uint64_t>(t) * 10 + n));
    concurrent[t] = sequential[t];
  }
  for (auto& buffers : sequential) run_workload(buffers);
  std::vector<std::thread> workers;
  for (auto& buffers : concurrent) workers.emplace_back([&buffers] { run_workload(buffers); });
  for (auto& w : workers) w.join();
  for (int t = 0; t < threads; ++t)
    for (std::size_t j = 0; j < sequential[t].size(); ++j)
      EXPECT_TRUE(same_bits(concurrent[t][j], sequential[t][j])) << "thread " << t << " buffer " << j;
}

// --- Allocation ------------------------------------------------------------------------------------

template <class Policy, class T>
void expect_single_gradient_calls_do_not_allocate() {
  auto g = big_gradient<T>(5000, 8);
  Eigen::Tensor<T, 2> tensor(50, 100);
  std::copy(g.begin(), g.end(), tensor.data());
  Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<3>> strided(g.data(), 1666);
  double sink = 0;
  EXPECT_EQ(allocations_in([&] {
              sink += gradclip::norm<Policy>(g);
              sink += gradclip::norm<Policy>(static_cast<const T*>(g.data()), g.size());
              sink += gradclip::norm<Policy>(tensor);
              sink += gradclip::norm<Policy>(strided);
              sink += gradclip::clip_by_norm<Policy>(g, 1.0).coefficient;
              sink += gradclip::clip_by_norm<Policy>(g.data(), g.size(), 0.5, {on_nonfinite::propagate, 1e-6}).norm;
              sink += gradclip::clip_by_norm<Policy>(tensor, 1.0).coefficient;
              sink += gradclip::clip_by_norm<Policy>(strided, 0.25).coefficient;
              g[17] = std::numeric_limits<T>::quiet_NaN();
              sink += gradclip::clip_by_norm<Policy>(g, 1.0).norm;  // skip: non-finite, nothing written
            }),
            0)
      << type_name<T>();
  EXPECT_TRUE(std::isnan(sink));
}

TYPED_TEST(Guarantees, SingleGradientNormAndClipNeverAllocate) {
  using T = TypeParam;
  expect_single_gradient_calls_do_not_allocate<robust, T>();
  expect_single_gradient_calls_do_not_allocate<max_scale, T>();
  expect_single_gradient_calls_do_not_allocate<promote, T>();
  expect_single_gradient_calls_do_not_allocate<naive, T>();
}

TYPED_TEST(Guarantees, ClipByValueNeverAllocates) {
  using T = TypeParam;
  auto g = big_gradient<T>(5000, 9);
  Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<2>> strided(g.data(), 2500);
  EXPECT_EQ(allocations_in([&] {
              gradclip::clip_by_value(strided, 7.0);
              gradclip::clip_by_value(g, 3.0);
            }),
            0);
}

TYPED_TEST(Guarantees, GroupCallsAllocateNothingBeyondTheCallersGroup) {
  using T = TypeParam;
  std::vector<std::vector<T>> group{big_gradient<T>(3000, 10), big_gradient<T>(20, 11)};
  std::vector<float> bias = big_gradient<float>(64, 12);
  std::vector<gradclip::grad_view> mixed{gradclip::grad_view(group[0]), gradclip::grad_view(bias)};
  double sink = 0;
  EXPECT_EQ(
      allocations_in([&] {
        sink += gradclip::global_norm(group);
        sink += gradclip::partial_global_norm<max_scale>(mixed).sum;
        sink += gradclip::clip_by_global_norm(group, 1.0).coefficient;
        sink += gradclip::clip_by_global_norm<promote>(mixed, 0.5).coefficient;
        sink +=
            gradclip::clip_by_global_norm({gradclip::grad_view(group[1]), gradclip::grad_view(bias)}, 0.1).coefficient;
      }),
      0);
  EXPECT_GT(sink, 0);
}

}  // namespace
