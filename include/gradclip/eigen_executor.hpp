// Runs gradclip's threaded calls on an Eigen thread pool the caller already has: an Eigen::ThreadPool
// (or any Eigen::ThreadPoolInterface) or an Eigen::ThreadPoolDevice. Not included by gradclip.hpp.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/options.hpp>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include <functional>
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

  /// Runs job(0) on the caller and the other jobs on the pool, then waits for them.
  void run(unsigned count, const std::function<void(unsigned)>& job) const override {
    if (count == 0) return;
    Eigen::Barrier barrier(count - 1);
    for (unsigned k = 1; k < count; ++k)
      schedule([&job, &barrier, k] {
        job(k);
        barrier.Notify();
      });
    job(0);
    barrier.Wait();
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
