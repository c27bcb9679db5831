// A persistent pool of worker threads shared by every gradclip call, so a threaded call costs a wake-up
// instead of starting threads.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/options.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

class thread_pool {
 public:
  /// The process-wide pool; it starts threads on first demand and stops them at exit.
  static thread_pool& shared() {
    static thread_pool pool;
    return pool;
  }

  /// Runs job(k) for every k in [0, count): k = 0 on the caller, the others on workers. Returns when all
  /// have run. While another call holds the pool, or when no thread can be started, the caller runs the
  /// jobs itself: each job runs exactly once either way.
  void run(unsigned count, const std::function<void(unsigned)>& job) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    const unsigned workers = busy.owns_lock() && count > 1 ? grow(count - 1) : 0;
    if (workers == 0) {
      for (unsigned k = 0; k < count; ++k) job(k);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      assigned_ = workers;
      pending_ = workers;
      ++generation_;
    }
    wake_.notify_all();
    job(0);
    for (unsigned k = workers + 1; k < count; ++k) job(k);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

  thread_pool() = default;
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  // Starts workers until `wanted` exist (or the system refuses one); returns how many there are.
  unsigned grow(unsigned wanted) {
    while (threads_.size() < wanted) {
      try {
        const auto index = static_cast<unsigned>(threads_.size()) + 1;
        threads_.emplace_back([this, index] { work(index); });
      } catch (const std::system_error&) {
        break;
      }
    }
    return std::min<unsigned>(wanted, static_cast<unsigned>(threads_.size()));
  }

  void work(unsigned index) {
    std::size_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (index > assigned_) continue;
      const auto* job = job_;
      lock.unlock();
      (*job)(index);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_;  // held by the call that owns the workers
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(unsigned)>* job_ = nullptr;
  unsigned assigned_ = 0, pending_ = 0;
  std::size_t generation_ = 0;
  bool stopping_ = false;
};

/// Runs job(k) for every k in [0, count) on `pool` (options::pool), or on gradclip's own pool when it is
/// null, and returns when all have run.
inline void run_jobs(const executor* pool, unsigned count, const std::function<void(unsigned)>& job) {
  if (pool != nullptr)
    pool->run(count, job);
  else
    thread_pool::shared().run(count, job);
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
