// Runs gradclip's threaded calls on an Eigen thread pool the caller already has: an Eigen::ThreadPool
// (or any Eigen::ThreadPoolInterface) or an Eigen::ThreadPoolDevice. Not included by gradclip.hpp.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/thread_pool.hpp>
#include <gradclip/options.hpp>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include <exception>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// An executor (options::pool) over an Eigen pool; `Pool` is Eigen::ThreadPoolDevice or an
/// Eigen::ThreadPoolInterface. The pool must outlive the calls that use it.
///
///     // with EIGEN_USE_THREADS defined and <unsupported/Eigen/CXX11/Tensor> included:
///     Eigen::ThreadPool threads(4);
///     Eigen::ThreadPoolDevice device(&threads, 4);
///     gradclip::eigen_executor<Eigen::ThreadPoolDevice> on_device(device);
///     gradclip::options opt;
///     opt.threads = 4;
///     opt.pool = &on_device;
///     auto result = gradclip::clip_by_global_norm(grads, 1.0, opt);
template <class Pool>
class eigen_executor final : public executor {
 public:
  explicit eigen_executor(Pool& pool) noexcept : pool_(pool) {}

  /// Runs job(k) for every k in [0, count) on the pool's threads and on the caller, and returns when all
  /// have run. The caller runs every job no pool thread has started and waits only for started ones, so a
  /// call made from the pool's own threads (a task that clips, with this pool as options::pool) never
  /// deadlocks, even with every thread making one: tasks that start late find nothing left to do. If the
  /// pool throws while scheduling, the caller runs every job, then rethrows.
  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    if (count <= 1) {
      if (count == 1) job(0);
      return;
    }
    const auto jobs = std::make_shared<detail::job_set>(count, job);
    std::exception_ptr failure;
    try {
      for (unsigned k = 1; k < count; ++k) schedule([jobs] { jobs->run_all(); });
    } catch (...) {
      failure = std::current_exception();
    }
    jobs->finish(failure);
  }

 private:
  template <class F>
  void schedule(F&& f) const {
    if constexpr (std::is_base_of_v<Eigen::ThreadPoolInterface, Pool>)
      pool_.Schedule(std::forward<F>(f));
    else
      pool_.enqueueNoNotification(std::forward<F>(f));
  }

  Pool& pool_;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
