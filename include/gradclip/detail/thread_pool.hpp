// How threaded calls share their jobs: a job_set that the caller and any helping thread claim jobs from,
// and gradclip's persistent pool of helpers (started once, so a threaded call costs a wake-up). run_jobs
// (pipeline.hpp) hands a call's jobs to options::pool or to this pool.
#pragma once

#include <gradclip/detail/config.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define GRADCLIP_HAS_FORK 1
#else
#define GRADCLIP_HAS_FORK 0
#endif

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// The `count` jobs of one call, shared by the caller and the threads that help it. Each job is claimed
/// once through an atomic counter, so it runs exactly once however many threads try. The caller claims
/// too and then waits only for jobs another thread has started, never for unstarted ones: a call never
/// waits on a thread that is busy elsewhere (in a nested call, a full pool, or gone after fork()). Helpers
/// hold the set by shared_ptr: one that starts after the call has returned finds nothing left to claim,
/// and only a claimed job touches `job`, which lives in the caller's frame.
class job_set {
 public:
  job_set(unsigned count, const std::function<void(unsigned)>& job) noexcept : count_(count), job_(&job) {}

  /// Claims and runs one job that has not started; false when none is left. A job's exception is kept
  /// for finish(), so it never escapes into a helper thread.
  bool run_one() noexcept {
    const unsigned k = next_.fetch_add(1, std::memory_order_relaxed);
    if (k >= count_) return false;
    try {
      (*job_)(k);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!job_failure_) job_failure_ = std::current_exception();
    }
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_.notify_all();
    }
    return true;
  }

  void run_all() noexcept {
    while (run_one()) {
    }
  }

  bool exhausted() const noexcept { return next_.load(std::memory_order_relaxed) >= count_; }

  /// On the caller: runs every job not started yet, waits for the started ones, then rethrows `failure`
  /// (the executor's exception) if there is one, else the first exception a job threw.
  void finish(std::exception_ptr failure = nullptr) {
    run_all();
    if (done_.load(std::memory_order_acquire) != count_) {
      std::unique_lock<std::mutex> lock(mutex_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == count_; });
    }
    // job_failure_ was written before its job's done_ increment, which we acquired. Moved out, so that
    // the exception dies on this thread, not in a helper that drops the set last.
    if (!failure) failure = std::move(job_failure_);
    if (failure) std::rethrow_exception(failure);
  }

 private:
  const unsigned count_;
  const std::function<void(unsigned)>* const job_;
  std::atomic<unsigned> next_{0}, done_{0};
  std::mutex mutex_;
  std::condition_variable finished_;
  std::exception_ptr job_failure_;
};

class thread_pool {
 public:
  /// The process-wide pool; it starts threads on first demand and stops them at exit.
  static thread_pool& shared() {
    static thread_pool pool;
    return pool;
  }

  /// Runs job(k) for every k in [0, count) on the caller and on up to count - 1 workers, and returns when
  /// all have run; each job runs exactly once. The caller runs every job no worker has started, so calls
  /// from several threads at once, or from inside a job (a worker), share the workers and never wait for
  /// one that is busy; when no thread can be started the caller runs them all. A job's exception is
  /// rethrown once every job has run.
  void run(unsigned count, const std::function<void(unsigned)>& job) {
    if (count <= 1) {
      if (count == 1) job(0);
      return;
    }
    const auto jobs = std::make_shared<job_set>(count, job);
    try {
      offer(jobs, count - 1);
    } catch (const std::bad_alloc&) {  // the workers are only an optimization: the caller runs every job
    }
    jobs->finish();
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    workers* w = current_.exchange(nullptr);
    if (w == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(w->mutex);
      w->stopping = true;
    }
    w->wake.notify_all();
    for (auto& t : w->threads) t.join();
    delete w;
  }

 private:
  thread_pool() noexcept {
#if GRADCLIP_HAS_FORK
    pthread_atfork(nullptr, nullptr, &forget_workers);
#endif
  }

  struct workers {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<std::shared_ptr<job_set>> queue;  // calls with jobs left, oldest first
    std::vector<std::thread> threads;
    bool stopping = false;
    workers* abandoned = nullptr;  // the workers of the parent process, after fork()
  };

  // Queues the call and wakes up to `helpers` workers, starting them on first demand.
  void offer(const std::shared_ptr<job_set>& jobs, unsigned helpers) {
    workers& w = current();
    {
      std::lock_guard<std::mutex> lock(w.mutex);
      while (w.threads.size() < helpers) {
        try {
          w.threads.emplace_back([&w] { work(w); });
        } catch (const std::system_error&) {
          break;
        }
      }
      if (w.threads.empty()) return;
      w.queue.push_back(jobs);
    }
    for (unsigned k = 0; k < helpers; ++k) w.wake.notify_one();
  }

  static void work(workers& w) {
    std::unique_lock<std::mutex> lock(w.mutex);
    while (!w.stopping) {
      while (!w.queue.empty() && w.queue.front()->exhausted()) w.queue.pop_front();
      if (w.queue.empty()) {
        w.wake.wait(lock);
        continue;
      }
      std::shared_ptr<job_set> jobs = w.queue.front();
      lock.unlock();
      jobs->run_all();
      jobs.reset();
      lock.lock();
    }
  }

  workers& current() {
    workers* w = current_.load(std::memory_order_acquire);
    if (w != nullptr) return *w;
    auto fresh = std::make_unique<workers>();
    fresh->abandoned = abandoned_;
    if (current_.compare_exchange_strong(w, fresh.get(), std::memory_order_acq_rel)) return *fresh.release();
    return *w;  // another thread installed its own first
  }

  // In the child of fork() only the forking thread exists: the workers are gone, and their mutex (or a
  // call's) may stay locked forever by a thread that was mid-call in the parent. So the child forgets them
  // and starts new workers on its next threaded call. It leaks them on purpose: a std::thread of a thread that does
  // not exist can be neither joined nor destroyed (destroying a joinable one terminates). `abandoned_`
  // keeps them reachable, so leak checkers do not report them. Static members, so that the handler never
  // waits for shared()'s initialization, which a thread of the parent may have been running.
  static void forget_workers() noexcept {
    if (workers* w = current_.exchange(nullptr, std::memory_order_relaxed)) abandoned_ = w;
  }

  static inline std::atomic<workers*> current_{nullptr};
  static inline workers* abandoned_ = nullptr;
};

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
