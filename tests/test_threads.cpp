// Threads in any host program (docs/reliability.md, "Threads"): threaded calls in a child of fork(),
// also when another thread was mid-call; calls nested in gradclip's pool and in an Eigen pool passed as
// options::pool; concurrent callers; executors and jobs that throw. Every input is several MiB, so each
// call really threads (InputsAreLargeEnoughToThread), and a deadline turns a deadlock into a failure.
#define EIGEN_USE_THREADS  // Eigen::ThreadPoolDevice
#include <gradclip/eigen_executor.hpp>
#include <gradclip/gradclip.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define GRADCLIP_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRADCLIP_TEST_TSAN 1
#endif
#endif

#if defined(GRADCLIP_TEST_TSAN)
// ThreadSanitizer kills a child of a multithreaded fork() that starts a thread, unless told not to; the
// fork tests need the child's new pool.
extern "C" const char* __tsan_default_options() { return "die_after_fork=0"; }
#endif

namespace {

using namespace gradclip_test;

gradclip::options threaded(unsigned count, const gradclip::executor* pool = nullptr) {
  gradclip::options opt;
  opt.threads = count;
  opt.pool = pool;
  return opt;
}

// Ends the whole test program, with a message, when a call has not returned in time: a deadlock fails the
// test instead of hanging CTest.
class deadline {
 public:
  explicit deadline(unsigned seconds) {
    std::signal(SIGALRM, &expired);
    alarm(seconds);
  }
  ~deadline() { alarm(0); }
  deadline(const deadline&) = delete;
  deadline& operator=(const deadline&) = delete;

 private:
  static void expired(int) {
    static const char message[] = "test_threads: deadline passed, a threaded call deadlocked\n";
    if (write(STDERR_FILENO, message, sizeof message - 1) < 0) _exit(3);
    _exit(3);
  }
};

// Waits until `count` threads have arrived, so that they all make their calls at once.
void arrive_and_wait(std::atomic<unsigned>& arrived, unsigned count) {
  arrived.fetch_add(1);
  while (arrived.load() < count) std::this_thread::yield();
}

// Three and a half pieces: at least 2 MiB per thread for two threads in every element type.
constexpr std::size_t elements = 3 * gradclip::detail::piece_elements + gradclip::detail::piece_elements / 2 + 777;

// A gradient, its one-thread norm and clip (checked against binary128 when `exact` is set), and a
// threshold that binds.
template <class T>
struct reference {
  reference(std::uint64_t s, bool exact) {
    std::mt19937_64 rng(s);
    original = random_gradient<T>(elements, rng);
    norm = gradclip::norm(original.data(), original.size());
    max_norm = 0.25 * norm;
    clipped = original;
    EXPECT_TRUE(gradclip::clip_by_norm(clipped.data(), clipped.size(), max_norm).clipped) << "seed " << s;
    if (!exact) return;
    const quad exact_value = exact_norm(original);
    EXPECT_LE(relative_error(norm, exact_value), robust_norm_bound<T>()) << type_name<T>() << ", seed " << s;
    const quad c = static_cast<quad>(max_norm) / exact_value;
    double worst = 0;
    for (std::size_t i = 0; i < original.size(); ++i)
      worst = std::max(worst, ulps(clipped[i], to_quad(original[i]) * c));
    EXPECT_LE(worst, 1.0) << type_name<T>() << ", seed " << s;
  }

  // True when a norm and a clip with `opt` give the one-thread bits.
  bool matches(const gradclip::options& opt) const {
    if (gradclip::norm(original.data(), original.size(), opt) != norm) return false;
    auto work = original;
    const auto result = gradclip::clip_by_norm(work.data(), work.size(), max_norm, opt);
    return result.clipped && same_bits(work, clipped);
  }

  std::vector<T> original, clipped;
  double norm = 0, max_norm = 0;
};

template <class T>
const reference<T>& shared_reference() {
  static const reference<T> r(seed, true);
  return r;
}

// Runs every job on the caller, in order, and records what it was asked.
struct counting_executor final : gradclip::executor {
  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    ++calls;
    counts.push_back(count);
    for (unsigned k = 0; k < count; ++k) job(k);
  }
  mutable int calls = 0;
  mutable std::vector<unsigned> counts;
};

template <class T>
class Threads : public ::testing::Test {};
TYPED_TEST_SUITE(Threads, element_types);

TYPED_TEST(Threads, InputsAreLargeEnoughToThread) {
  using T = TypeParam;
  const auto& r = shared_reference<T>();
  for (unsigned count : {2u, 3u}) {
    const counting_executor counter;
    EXPECT_TRUE(r.matches(threaded(count, &counter)));
    EXPECT_EQ(counter.counts, (std::vector<unsigned>{count, count, count})) << "the norm, the clip's two passes";
  }
}

// The child reports through its exit status: 0 when its threaded calls gave the parent's bits.
template <class T>
int threaded_calls_in_child(const reference<T>& r) {
  std::signal(SIGALRM, SIG_DFL);  // a hang ends the child, which fails the parent's check
  alarm(60);
  for (unsigned count : {2u, 4u})
    if (!r.matches(threaded(count))) return 1;
  return 0;
}

::testing::AssertionResult exited_with_success(pid_t child) {
  if (child < 0) return ::testing::AssertionFailure() << "fork failed";
  int status = 0;
  if (waitpid(child, &status, 0) != child) return ::testing::AssertionFailure() << "waitpid failed";
  if (WIFSIGNALED(status))
    return ::testing::AssertionFailure() << "the child was killed by signal " << WTERMSIG(status)
                                         << (WTERMSIG(status) == SIGALRM ? " (SIGALRM: it hung)" : "");
  if (WEXITSTATUS(status) != 0)
    return ::testing::AssertionFailure() << "the child exited with status " << WEXITSTATUS(status);
  return ::testing::AssertionSuccess();
}

TYPED_TEST(Threads, ForkedChildGetsTheParentsBits) {
  using T = TypeParam;
  const auto& r = shared_reference<T>();
  ASSERT_TRUE(r.matches(threaded(2)));  // the pool has started its threads
  const pid_t child = fork();
  if (child == 0) {
    int status = threaded_calls_in_child(r);
    if (status == 0) {  // and in a grandchild, after the child's own pool has started
      const pid_t grandchild = fork();
      if (grandchild == 0) _exit(threaded_calls_in_child(r));
      status = exited_with_success(grandchild) ? 0 : 2;
    }
    _exit(status);
  }
  EXPECT_TRUE(exited_with_success(child));
  EXPECT_TRUE(r.matches(threaded(2))) << "the parent after fork()";
}

TEST(Threads, ForkWhileAnotherThreadIsMidCall) {
  const auto& r = shared_reference<float>();
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0}, wrong{0};
  std::thread busy([&] {
    while (!stop.load()) {
      if (!r.matches(threaded(4))) wrong.fetch_add(1);
      calls.fetch_add(1);
    }
  });
  for (int k = 0; k < 12; ++k) {
    const int before = calls.load();
    while (calls.load() == before) std::this_thread::yield();  // a new call is running now
    std::this_thread::sleep_for(std::chrono::microseconds(200 * k));
    const pid_t child = fork();
    if (child == 0) _exit(threaded_calls_in_child(r));
    EXPECT_TRUE(exited_with_success(child)) << "fork " << k;
  }
  stop.store(true);
  busy.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Threads, CallsNestedInGradclipsPoolThreads) {
  const auto& r = shared_reference<Eigen::bfloat16>();
  const deadline limit(300);
  constexpr unsigned jobs = 4;
  std::atomic<unsigned> arrived{0};
  std::atomic<int> wrong{0};
  const std::function<void(unsigned)> job = [&](unsigned) {
    arrive_and_wait(arrived, jobs);  // the caller and three workers, all making calls at once
    for (unsigned count : {2u, 3u})
      if (!r.matches(threaded(count))) wrong.fetch_add(1);
  };
  gradclip::detail::thread_pool::shared().run(jobs, job);
  EXPECT_EQ(wrong.load(), 0);
}

template <class Pool>
void expect_calls_nested_in_eigen_tasks_finish(Eigen::ThreadPool& threads, Pool& pool) {
  const auto& r = shared_reference<Eigen::half>();
  const gradclip::eigen_executor<Pool> executor(pool);
  const unsigned workers = static_cast<unsigned>(threads.NumThreads());
  std::atomic<unsigned> arrived{0};
  std::atomic<int> wrong{0};
  Eigen::Barrier finished(workers);
  for (unsigned w = 0; w < workers; ++w)
    threads.Schedule([&] {
      arrive_and_wait(arrived, workers);  // every worker inside a task: none is left to run the jobs
      for (unsigned count : {2u, 4u})
        if (!r.matches(threaded(count, &executor))) wrong.fetch_add(1);
      finished.Notify();
    });
  finished.Wait();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Threads, CallsNestedInEigenPoolTasksWithThatPool) {
  const deadline limit(300);
  Eigen::ThreadPool threads(3);
  Eigen::ThreadPoolDevice device(&threads, 3);
  expect_calls_nested_in_eigen_tasks_finish<Eigen::ThreadPoolInterface>(threads, threads);
  expect_calls_nested_in_eigen_tasks_finish<Eigen::ThreadPoolDevice>(threads, device);
}

TYPED_TEST(Threads, FourCallersWithTwoThreadsEachGetOneThreadsBits) {
  using T = TypeParam;
  const deadline limit(300);
  constexpr unsigned callers = 4;
  std::vector<std::unique_ptr<reference<T>>> references;
  for (unsigned t = 0; t < callers; ++t) references.push_back(std::make_unique<reference<T>>(seed + 10 + t, false));
  std::atomic<unsigned> arrived{0};
  std::vector<int> wrong(callers, 0);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < callers; ++t)
    threads.emplace_back([&, t] {
      arrive_and_wait(arrived, callers);
      for (int round = 0; round < 3; ++round)
        if (!references[t]->matches(threaded(2))) ++wrong[t];
    });
  for (auto& t : threads) t.join();
  for (unsigned t = 0; t < callers; ++t) EXPECT_EQ(wrong[t], 0) << "caller " << t;
}

// --- Executors and jobs that throw ----------------------------------------------------------------

struct executor_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What a misbehaving executor does on its `fail_on`-th run() (1: a clip's read pass, 2: its write pass);
// its other calls run every job on the caller.
enum class misbehaviour {
  throw_at_once,             // throws before running anything
  throw_after_one_job,       // runs one job, then throws
  throw_while_one_runs,      // starts a job on another thread and throws while it runs
  run_first_job_repeatedly,  // calls job(0) 2 * count times, returns
  run_nothing,               // returns without running anything
  run_late,                  // returns, then calls a copy of each job from another thread
};

constexpr misbehaviour every_misbehaviour[] = {
    misbehaviour::throw_at_once,        misbehaviour::throw_after_one_job,
    misbehaviour::throw_while_one_runs, misbehaviour::run_first_job_repeatedly,
    misbehaviour::run_nothing,          misbehaviour::run_late};

bool throws(misbehaviour m) {
  return m == misbehaviour::throw_at_once || m == misbehaviour::throw_after_one_job ||
         m == misbehaviour::throw_while_one_runs;
}

class misbehaving_executor final : public gradclip::executor {
 public:
  misbehaving_executor(misbehaviour m, int fail_on) : what_(m), fail_on_(fail_on) {}
  ~misbehaving_executor() override { join(); }
  misbehaving_executor(const misbehaving_executor&) = delete;
  misbehaving_executor& operator=(const misbehaving_executor&) = delete;

  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    if (++calls_ != fail_on_) {
      for (unsigned k = 0; k < count; ++k) job(k);
      return;
    }
    switch (what_) {
      case misbehaviour::throw_at_once:
        throw executor_failure("executor failed");
      case misbehaviour::throw_after_one_job:
        job(0);
        throw executor_failure("executor failed");
      case misbehaviour::throw_while_one_runs: {
        std::atomic<bool> started{false};
        thread_ = std::thread([&started, copy = job] {
          started.store(true);
          copy(1);
        });
        while (!started.load()) std::this_thread::yield();
        throw executor_failure("executor failed");
      }
      case misbehaviour::run_first_job_repeatedly:
        for (unsigned k = 0; k < 2 * count; ++k) job(0);
        return;
      case misbehaviour::run_nothing:
        return;
      case misbehaviour::run_late:
        thread_ = std::thread([count, copy = job] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          for (unsigned k = 0; k < count; ++k) copy(k);
        });
        return;
    }
  }

  void join() const {
    if (thread_.joinable()) thread_.join();
  }

 private:
  misbehaviour what_;
  int fail_on_;
  mutable int calls_ = 0;
  mutable std::thread thread_;
};

TEST(Threads, EachJobRunsOnceWhateverTheExecutorDoes) {
  constexpr unsigned count = 6;
  for (const misbehaviour m : every_misbehaviour) {
    const misbehaving_executor executor(m, 1);
    std::vector<std::atomic<int>> runs(count);
    const std::function<void(unsigned)> job = [&](unsigned k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a started job outlasts the executor's throw
      runs[k].fetch_add(1);
    };
    bool threw = false;
    try {
      gradclip::detail::run_jobs(&executor, count, job);
    } catch (const executor_failure& e) {
      threw = true;
      EXPECT_STREQ(e.what(), "executor failed");
    }
    // Every job has finished before run_jobs returns or throws, so nothing changes after it.
    std::vector<int> seen;
    for (auto& n : runs) seen.push_back(n.load());
    executor.join();
    EXPECT_EQ(threw, throws(m)) << static_cast<int>(m);
    for (unsigned k = 0; k < count; ++k) {
      EXPECT_EQ(seen[k], 1) << "job " << k << ", misbehaviour " << static_cast<int>(m);
      EXPECT_EQ(runs[k].load(), 1) << "job " << k << " ran again after the call, misbehaviour " << static_cast<int>(m);
    }
  }
}

TEST(Threads, AJobsExceptionReachesTheCallerAfterEveryJobRan) {
  const deadline limit(120);
  Eigen::ThreadPool threads(3);
  const gradclip::eigen_executor<Eigen::ThreadPoolInterface> on_eigen(threads);
  constexpr unsigned count = 4;
  for (const gradclip::executor* pool :
       {static_cast<const gradclip::executor*>(nullptr), static_cast<const gradclip::executor*>(&on_eigen)}) {
    for (unsigned failing = 0; failing < count; ++failing) {
      std::vector<std::atomic<int>> runs(count);
      const std::function<void(unsigned)> job = [&](unsigned k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        runs[k].fetch_add(1);
        if (k == failing) throw std::length_error("job " + std::to_string(k));
      };
      try {
        gradclip::detail::run_jobs(pool, count, job);
        ADD_FAILURE() << "no exception";
      } catch (const std::length_error& e) {
        EXPECT_EQ(e.what(), "job " + std::to_string(failing));
      }
      for (unsigned k = 0; k < count; ++k) EXPECT_EQ(runs[k].load(), 1) << "job " << k;
    }
  }
}

// A norm or a clip whose executor misbehaves on its first or second pass: a norm throws the executor's
// exception (and writes nothing); a clip that fails in its read pass leaves the gradient untouched (the
// strong guarantee), one that fails in its write pass leaves it completely clipped, as a call that
// returned would have. An executor that does not throw never changes a bit.
TYPED_TEST(Threads, ExecutorsThatMisbehaveKeepTheDocumentedGuarantees) {
  using T = TypeParam;
  const auto& r = shared_reference<T>();
  for (const misbehaviour m : every_misbehaviour) {
    SCOPED_TRACE("misbehaviour " + std::to_string(static_cast<int>(m)));
    {
      const misbehaving_executor executor(m, 1);
      if (throws(m))
        EXPECT_THROW((void)gradclip::norm(r.original.data(), r.original.size(), threaded(2, &executor)),
                     executor_failure);
      else
        EXPECT_EQ(gradclip::norm(r.original.data(), r.original.size(), threaded(2, &executor)), r.norm);
    }
    for (int fail_on : {1, 2}) {
      const misbehaving_executor executor(m, fail_on);
      auto work = r.original;
      std::vector<std::vector<T>> group{r.original};
      if (throws(m)) {
        EXPECT_THROW((void)gradclip::clip_by_norm(work.data(), work.size(), r.max_norm, threaded(2, &executor)),
                     executor_failure);
        EXPECT_TRUE(same_bits(work, fail_on == 1 ? r.original : r.clipped)) << "failed on pass " << fail_on;
      } else {
        const auto result = gradclip::clip_by_norm(work.data(), work.size(), r.max_norm, threaded(2, &executor));
        EXPECT_EQ(result.norm, r.norm);
        EXPECT_TRUE(same_bits(work, r.clipped)) << "misbehaved on pass " << fail_on;
      }
      executor.join();
      const misbehaving_executor for_group(m, fail_on);
      if (throws(m)) {
        EXPECT_THROW((void)gradclip::clip_by_global_norm(group, r.max_norm, threaded(3, &for_group)), executor_failure);
        EXPECT_TRUE(same_bits(group[0], fail_on == 1 ? r.original : r.clipped)) << "group, failed on pass " << fail_on;
      } else {
        (void)gradclip::clip_by_global_norm(group, r.max_norm, threaded(3, &for_group));
        EXPECT_TRUE(same_bits(group[0], r.clipped)) << "group, misbehaved on pass " << fail_on;
      }
    }
  }
}

// ---- The kept blocks of scratch.hpp: a call's per-unit arrays, reused by the thread's next call ----

using gradclip::detail::scratch_blocks;
constexpr std::size_t large = scratch_blocks::kept_from;

TEST(ScratchBlocks, ALargeBlockGivenBackServesTheNextRequestItHolds) {
  scratch_blocks blocks;
  void* first = blocks.take(4 * large);
  std::memset(first, 1, 4 * large);
  blocks.give(first);
  EXPECT_EQ(blocks.kept_bytes(), 4 * large);
  void* again = blocks.take(2 * large);  // smaller: the same block, kept again at its real size
  EXPECT_EQ(again, first);
  EXPECT_EQ(blocks.kept_bytes(), 0u);
  blocks.give(again);
  EXPECT_EQ(blocks.kept_bytes(), 4 * large);
  void* bigger = blocks.take(8 * large);  // too large for it: a new block, and the kept one stays
  EXPECT_NE(bigger, first);
  EXPECT_EQ(blocks.kept_bytes(), 4 * large);
  blocks.give(bigger);
  EXPECT_EQ(blocks.kept_bytes(), 12 * large);
}

TEST(ScratchBlocks, SmallBlocksGoStraightBack) {
  scratch_blocks blocks;
  blocks.give(blocks.take(large - 1));
  EXPECT_EQ(blocks.kept_bytes(), 0u);
}

TEST(ScratchBlocks, AFullSetKeepsTheLargestBlocks) {
  scratch_blocks blocks;
  std::vector<void*> taken;
  for (std::size_t k = 0; k < scratch_blocks::slots; ++k) taken.push_back(blocks.take((k + 2) * large));
  for (void* p : taken) blocks.give(p);
  const std::size_t full = blocks.kept_bytes();
  blocks.give(blocks.take(large));  // no larger than any kept block: not kept
  EXPECT_EQ(blocks.kept_bytes(), full);
  // Asked for more than any kept block holds: new memory, which then replaces the smallest (2 * large).
  blocks.give(blocks.take(20 * large));
  EXPECT_EQ(blocks.kept_bytes(), full - 2 * large + 20 * large);
}

TEST(ScratchBlocks, EachThreadKeepsWhatItReleasesAndFreesItOnExit) {
  // A block a helper takes and the caller releases stays with the caller. The helper's own blocks are
  // freed when it exits (the sanitize stage's leak check would report them).
  void* from_helper = nullptr;
  std::thread helper([&] {
    from_helper = gradclip::detail::scratch_allocator<double>().allocate(large);
    gradclip::detail::scratch_vector<double> own(large);
    own[0] = 1;
  });
  helper.join();
  scratch_blocks* mine = gradclip::detail::this_threads_blocks();
  ASSERT_NE(mine, nullptr);
  const std::size_t before = mine->kept_bytes();
  gradclip::detail::scratch_allocator<double>().deallocate(static_cast<double*>(from_helper), large);
  EXPECT_GT(mine->kept_bytes(), before);
}

}  // namespace
