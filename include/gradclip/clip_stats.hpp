// Clip statistics over a logging interval: how often clipping binds, how often steps overflow or are
// skipped, how large the norms and thresholds are, their quantiles, and which tensors carry the squared
// norm. The clip fraction per interval tells which regime training is in.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/exact_io.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/report.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// The number of elements of one gradient or of a group (any range of gradients): the n in the
/// threshold's natural sqrt(n) growth.
template <class Grads>
std::size_t element_count(const Grads& grads) {
  const auto size = [](const auto& view) { return view.size(); };
  if constexpr (detail::is_gradient_v<Grads>) {
    return detail::visit_gradient(grads, size);
  } else {
    static_assert(detail::is_gradient_range_v<const Grads&>,
                  "element_count takes one gradient or a range (std::vector, std::array, ...) of gradients.");
    std::size_t total = 0;
    for (const auto& g : grads) total += detail::visit_gradient(g, size);
    return total;
  }
}

namespace detail {

// clip_stats' arithmetic, never contracted into FMAs, so that its results do not depend on the target:
// torch.quantile's rank and torch.lerp round each product before the sum (libtorch's AVX2 kernel fuses
// the lerp and differs in the last bit), and the shares' scaled squares round as ldexp does.
GRADCLIP_FP_CONTRACT_OFF_BEGIN
/// torch.quantile's position of q among n >= 1 sorted values: rank q * (n - 1), its truncation and
/// ceiling (clamped to n - 1 where q * (n - 1) rounds up past it), and the weight between them.
struct quantile_rank {
  std::size_t below;
  std::size_t above;
  double weight;
};
inline quantile_rank torch_rank(double q, std::size_t n) noexcept {
  const double rank = q * static_cast<double>(n - 1);
  const auto below = std::min(static_cast<std::size_t>(rank), n - 1);
  return {below, std::min(static_cast<std::size_t>(std::ceil(rank)), n - 1), rank - static_cast<double>(below)};
}

/// torch.lerp(a, b, w) for 0 <= w <= 1: the two-sided form, exact at both ends.
inline double torch_lerp(double a, double b, double w) noexcept {
  return w < 0.5 ? a + rounded(w * (b - a)) : b - rounded((b - a) * (1 - w));
}

/// sums[i] += (min(norm_i, DBL_MAX) * 2^-g)^2 * 2^shift for the report's tensors (shift <= 0). A power of
/// two that is a normal double multiplies in one rounding, as ldexp does, and costs less.
inline void add_scaled_squares(std::vector<double>& sums, const tensor_report& report, int g, int shift) noexcept {
  const double down = g >= -1022 ? std::ldexp(1.0, -g) : 0.0;
  const double weight = shift >= -1022 ? std::ldexp(1.0, shift) : 0.0;
  for (std::size_t i = 0; i < sums.size(); ++i) {
    const double norm = std::min(report[i].norm, std::numeric_limits<double>::max());
    const double scaled = down != 0.0 ? norm * down : std::ldexp(norm, -g);
    const double square = scaled * scaled;
    sums[i] += weight != 0.0 ? square * weight : std::ldexp(square, shift);
  }
}
GRADCLIP_FP_CONTRACT_OFF_END

}  // namespace detail

/// Counts, norm and threshold statistics of clip_results since the last reset(), the norms' quantiles,
/// and each tensor's share of the squared norm. Its whole state round-trips exactly through operator<< /
/// operator>> (for checkpoints); log_line() is for people.
///
///     gradclip::clip_stats stats(gradclip::element_count(grads));
///     stats.record(scaler.unscale_and_clip(grads, 1.0));    // every step
///     if (step % 100 == 0) { std::cout << stats.log_line() << '\n'; stats.reset(); }
///
/// Quantiles: the first `exact_capacity` finite norms of an interval are kept exactly (sorted), and
/// norm_quantile(q) is torch.quantile's default (linear) interpolation of them, bit for bit. Past that
/// the interval continues in a sketch of at most `sketch_buckets` buckets: a norm falls in the bucket of
/// its sign, exponent and first k mantissa bits (k = sketch_bits = 7 to start with), stands for its
/// bucket's midpoint clamped to the interval's [min, max], and each order statistic is then within
/// quantile_error_bound() = 2^-(k+1) of itself, relatively (absolutely 2^-(k+1) * 2^-1022 below 2^-1022).
/// So is the interpolated quantile, up to its own few ulps of rounding. When a new bucket would exceed
/// sketch_buckets, k drops by one (pairs of buckets merge); that never happens while the nonzero finite
/// norms lie within a factor 2^30 of each other, and k >= 1 whatever the stream. 0 and +inf are exact.
/// Memory is reserved once, at the interval's first finite norm (exact_capacity doubles) and at the
/// switch to the sketch (sketch_buckets buckets of 16 bytes); reset() keeps it, so steady-state steps
/// allocate nothing.
///
/// Shares: record(result, report) also adds each tensor's squared norm over the interval; tensor_share(i)
/// is tensor i's sum of squared norms over the interval's sum of squared global norms (sums over the finite
/// steps recorded with a report), so a step counts by its squared norm, as the clip sees it. The sums are
/// kept as doubles beside one power-of-two exponent: no overflow even for FP64 norms near 1.8e308.
class clip_stats {
 public:
  /// Finite norms an interval keeps exactly before it switches to the sketch (the default).
  static constexpr std::size_t default_exact_capacity = 4096;
  /// The sketch's bound on its buckets.
  static constexpr std::size_t sketch_buckets = 4096;
  /// Mantissa bits of a bucket's key at the switch to the sketch: 2^-8 relative error.
  static constexpr int sketch_bits = 7;

  clip_stats() = default;

  /// With the element count of the clipped group, the statistics also report the norm per sqrt(n).
  explicit clip_stats(std::size_t element_count) noexcept : element_count_(element_count) {}

  /// ... and with another exact capacity: 0 sketches from the first step.
  clip_stats(std::size_t element_count, std::size_t exact_capacity) noexcept
      : element_count_(element_count), exact_capacity_(exact_capacity) {}

  /// Adds one step. Non-finite steps are counted but enter neither the norms, the thresholds nor the clip
  /// fraction. Finite thresholds (a fixed max_norm or a controller's) enter the threshold statistics. A
  /// finite step's norm must be >= 0 (+inf: an FP64 norm beyond double's range), else
  /// std::invalid_argument and nothing changes.
  void record(const clip_result& step) {
    check_norm(step);
    reserve_for(step);
    add(step);
  }

  /// Adds one step and, when it is finite, each tensor's squared norm from the call's report (a +inf
  /// tensor norm, beyond double's range, counts as the largest double). Every report of an interval
  /// has the size of its first non-empty one: a report of another size (another group: reset() first),
  /// or a finite step's report with a NaN or negative norm, throws std::invalid_argument and nothing
  /// changes.
  void record(const clip_result& step, const tensor_report& report) {
    check_norm(step);
    if (!share_sums_.empty() && report.size() != share_sums_.size())
      throw std::invalid_argument("gradclip::clip_stats::record: the report has " + std::to_string(report.size()) +
                                  " tensors, this interval's earlier reports " + std::to_string(share_sums_.size()) +
                                  " (reset() starts an interval with another group)");
    if (step.finite)
      for (const tensor_stats& t : report)
        if (!(t.norm >= 0))
          throw std::invalid_argument("gradclip::clip_stats::record: a finite step's report holds the norm " +
                                      std::to_string(t.norm) + " (must be >= 0)");
    reserve_for(step);
    if (share_sums_.empty()) share_sums_.resize(report.size());  // within the capacity a reset() kept
    add(step);
    if (step.finite && !report.empty()) add_shares(report);
  }

  std::size_t steps() const noexcept { return steps_; }
  /// Finite steps at which clipping bound.
  std::size_t clipped_steps() const noexcept { return clipped_steps_; }
  /// Steps whose gradient was not finite (skipped, with a loss scaler).
  std::size_t nonfinite_steps() const noexcept { return nonfinite_steps_; }
  std::size_t finite_steps() const noexcept { return steps_ - nonfinite_steps_; }
  /// Finite steps that a threshold controller said to skip (gradient untouched).
  std::size_t skipped_steps() const noexcept { return skipped_steps_; }

  /// clipped_steps() / finite_steps(); 0 when there was no finite step.
  double clip_fraction() const noexcept {
    return finite_steps() == 0 ? 0.0 : static_cast<double>(clipped_steps_) / static_cast<double>(finite_steps());
  }

  /// The mean norm (before clipping) over the finite steps; NaN when there was none.
  double mean_norm() const noexcept {
    return finite_steps() == 0 ? std::numeric_limits<double>::quiet_NaN()
                               : norm_sum_ / static_cast<double>(finite_steps());
  }

  /// The largest norm over the finite steps; NaN when there was none.
  double max_norm() const noexcept {
    return finite_steps() == 0 ? std::numeric_limits<double>::quiet_NaN() : max_norm_;
  }

  /// The q-quantile of the finite steps' norms, q in [0, 1]: torch.quantile(norms, q) (linear
  /// interpolation at position q * (n - 1)) while the interval is stored exactly, within
  /// quantile_error_bound() once it is sketched; q = 0 and 1 are the exact minimum and maximum either way.
  /// +inf norms sort last; a position between a finite norm and +inf gives +inf (torch: NaN). NaN when
  /// there was no finite step; q outside [0, 1] throws std::invalid_argument.
  double norm_quantile(double q) const {
    if (!(q >= 0 && q <= 1))
      throw std::invalid_argument("gradclip::clip_stats::norm_quantile: q must be in [0, 1], not " + std::to_string(q));
    const std::size_t n = finite_steps();
    if (n == 0) return std::numeric_limits<double>::quiet_NaN();
    const detail::quantile_rank rank = detail::torch_rank(q, n);
    const double a = buckets_.empty() ? exact_[rank.below] : sketched_order_statistic(rank.below);
    const double b = buckets_.empty() ? exact_[rank.above] : sketched_order_statistic(rank.above);
    if (b == std::numeric_limits<double>::infinity()) return rank.weight == 0 ? a : b;
    return detail::torch_lerp(a, b, rank.weight);
  }

  /// True while norm_quantile() is exact: the interval's finite steps fit in exact_capacity().
  bool quantiles_exact() const noexcept { return buckets_.empty(); }

  /// The relative error bound of every order statistic norm_quantile() interpolates: 0 while exact, else
  /// 2^-(k+1) for the sketch's current k (2^-8 at first).
  double quantile_error_bound() const noexcept { return buckets_.empty() ? 0.0 : std::ldexp(1.0, -bits_ - 1); }

  std::size_t exact_capacity() const noexcept { return exact_capacity_; }

  /// Tensors in this interval's reports (0 before the first non-empty one).
  std::size_t tensor_count() const noexcept { return share_sums_.size(); }
  /// Finite steps whose non-empty report entered the shares.
  std::size_t report_steps() const noexcept { return report_steps_; }

  /// Tensor i's share of the interval's squared norm, sum over steps of norm_i^2 / sum over steps of
  /// sum_j norm_j^2, in [0, 1]; NaN while that total is 0. i >= tensor_count() throws std::invalid_argument.
  double tensor_share(std::size_t i) const {
    if (i >= share_sums_.size())
      throw std::invalid_argument("gradclip::clip_stats::tensor_share: tensor " + std::to_string(i) + " of " +
                                  std::to_string(share_sums_.size()));
    return share_sums_[i] / share_total();
  }

  /// Every tensor_share(i), in the reports' order.
  std::vector<double> tensor_shares() const {
    const double total = share_total();
    std::vector<double> shares(share_sums_);
    for (double& s : shares) s /= total;
    return shares;
  }

  /// mean_norm() / sqrt(element count): the root-mean-square gradient element, comparable across model
  /// sizes, so a threshold can be carried over as max_norm = this * sqrt(n). NaN when the count is unknown.
  double mean_norm_per_sqrt_n() const noexcept {
    return element_count_ == 0 ? std::numeric_limits<double>::quiet_NaN()
                               : mean_norm() / std::sqrt(static_cast<double>(element_count_));
  }

  /// The mean of the finite thresholds of the finite steps; NaN when there was none.
  double mean_threshold() const noexcept {
    return threshold_steps_ == 0 ? std::numeric_limits<double>::quiet_NaN()
                                 : threshold_sum_ / static_cast<double>(threshold_steps_);
  }

  /// The finite threshold of the latest finite step that had one (a controller's current threshold);
  /// NaN when there was none.
  double last_threshold() const noexcept {
    return threshold_steps_ == 0 ? std::numeric_limits<double>::quiet_NaN() : last_threshold_;
  }

  std::size_t element_count() const noexcept { return element_count_; }

  /// Starts a new logging interval; the element count, the exact capacity and the memory are kept.
  void reset() noexcept {
    std::vector<double> exact = std::move(exact_), shares = std::move(share_sums_);
    std::vector<bucket> buckets = std::move(buckets_);
    *this = clip_stats(element_count_, exact_capacity_);
    exact.clear();
    shares.clear();
    buckets.clear();
    exact_ = std::move(exact);
    share_sums_ = std::move(shares);
    buckets_ = std::move(buckets);
  }

  /// One log line: `steps=100 clipped=23 clip_fraction=0.23 nonfinite=1 mean_norm=1.5 max_norm=4 p50=1.2
  /// p90=2.5 p99=3.9 norm_per_sqrt_n=0.002 skipped=2 mean_threshold=1.2 last_threshold=1.1`; the quantiles
  /// only when a step was finite, norm_per_sqrt_n only when the element count is known, skipped only when a
  /// step was, the thresholds only when a step had one.
  std::string log_line() const {
    std::ostringstream out;
    out << "steps=" << steps() << " clipped=" << clipped_steps() << " clip_fraction=" << clip_fraction()
        << " nonfinite=" << nonfinite_steps() << " mean_norm=" << mean_norm() << " max_norm=" << max_norm();
    if (finite_steps() != 0)
      out << " p50=" << norm_quantile(0.5) << " p90=" << norm_quantile(0.9) << " p99=" << norm_quantile(0.99);
    if (element_count_ != 0) out << " norm_per_sqrt_n=" << mean_norm_per_sqrt_n();
    if (skipped_steps_ != 0) out << " skipped=" << skipped_steps_;
    if (threshold_steps_ != 0) out << " mean_threshold=" << mean_threshold() << " last_threshold=" << last_threshold();
    return out.str();
  }

  friend bool operator==(const clip_stats& a, const clip_stats& b) noexcept {
    return a.element_count_ == b.element_count_ && a.exact_capacity_ == b.exact_capacity_ && a.steps_ == b.steps_ &&
           a.clipped_steps_ == b.clipped_steps_ && a.nonfinite_steps_ == b.nonfinite_steps_ &&
           a.skipped_steps_ == b.skipped_steps_ && a.threshold_steps_ == b.threshold_steps_ &&
           a.report_steps_ == b.report_steps_ && a.norm_sum_ == b.norm_sum_ && a.max_norm_ == b.max_norm_ &&
           a.min_norm_ == b.min_norm_ && a.threshold_sum_ == b.threshold_sum_ &&
           a.last_threshold_ == b.last_threshold_ && a.exact_ == b.exact_ && a.bits_ == b.bits_ &&
           a.buckets_ == b.buckets_ && a.share_exponent_ == b.share_exponent_ && a.share_sums_ == b.share_sums_;
  }
  friend bool operator!=(const clip_stats& a, const clip_stats& b) noexcept { return !(a == b); }

  /// Writes the whole state exactly (doubles as bit patterns), for checkpoints; see log_line() for people.
  friend std::ostream& operator<<(std::ostream& out, const clip_stats& s) {
    detail::write_tag(out, "gradclip::clip_stats");
    for (std::size_t n : {s.element_count_, s.exact_capacity_, s.steps_, s.clipped_steps_, s.nonfinite_steps_,
                          s.skipped_steps_, s.threshold_steps_, s.report_steps_})
      detail::write_exact(out, n);
    for (double x : {s.norm_sum_, s.max_norm_, s.min_norm_, s.threshold_sum_, s.last_threshold_})
      detail::write_exact(out, x);
    detail::write_exact(out, s.exact_);
    detail::write_exact(out, static_cast<std::size_t>(s.bits_));
    detail::write_exact(out, s.buckets_.size());
    for (const bucket& b : s.buckets_) {
      detail::write_exact(out, b.key);
      detail::write_exact(out, b.count);
    }
    detail::write_exact(out, s.share_exponent_);
    detail::write_exact(out, s.share_sums_);
    return out;
  }

  /// Reads a state written by operator<<; on malformed or inconsistent input sets failbit and leaves s
  /// unchanged.
  friend std::istream& operator>>(std::istream& in, clip_stats& s) {
    clip_stats r;
    std::size_t bits = 0, buckets = 0;
    if (!(detail::read_tag(in, "gradclip::clip_stats") && detail::read_exact(in, r.element_count_) &&
          detail::read_exact(in, r.exact_capacity_) && detail::read_exact(in, r.steps_) &&
          detail::read_exact(in, r.clipped_steps_) && detail::read_exact(in, r.nonfinite_steps_) &&
          detail::read_exact(in, r.skipped_steps_) && detail::read_exact(in, r.threshold_steps_) &&
          detail::read_exact(in, r.report_steps_) && detail::read_exact(in, r.norm_sum_) &&
          detail::read_exact(in, r.max_norm_) && detail::read_exact(in, r.min_norm_) &&
          detail::read_exact(in, r.threshold_sum_) && detail::read_exact(in, r.last_threshold_) &&
          read_values(in, r.exact_, r.exact_capacity_) && detail::read_exact(in, bits) &&
          detail::read_exact(in, buckets)))
      return in;
    if (bits > static_cast<std::size_t>(sketch_bits) || buckets > sketch_buckets) {
      in.setstate(std::ios_base::failbit);
      return in;
    }
    r.bits_ = static_cast<int>(bits);
    for (std::size_t i = 0; i < buckets; ++i) {
      bucket b;
      if (!(detail::read_exact(in, b.key) && detail::read_exact(in, b.count))) return in;
      r.buckets_.push_back(b);
    }
    if (!(detail::read_exact(in, r.share_exponent_) &&
          read_values(in, r.share_sums_, std::numeric_limits<std::size_t>::max())))
      return in;
    if (!r.consistent()) {
      in.setstate(std::ios_base::failbit);
      return in;
    }
    s = std::move(r);
    return in;
  }

 private:
  struct bucket {
    std::size_t key;    // bucket_key() of its norms
    std::size_t count;  // >= 1
    friend bool operator==(const bucket& a, const bucket& b) noexcept { return a.key == b.key && a.count == b.count; }
  };

  static std::uint64_t bits_of(double x) noexcept {
    std::uint64_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
  static double from_bits(std::uint64_t b) noexcept {
    double x = 0;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
  static constexpr std::uint64_t infinity_bits = std::uint64_t{0x7ff} << 52;

  // A norm's bucket: 0 for zero, else 1 + its bit pattern's top 12 + k bits (sign, exponent, k mantissa
  // bits). Monotone in the norm, so buckets sort as their norms; +inf has a bucket of its own.
  static std::size_t bucket_key(double x, int k) noexcept {
    return x == 0 ? 0 : static_cast<std::size_t>(bits_of(x) >> (52 - k)) + 1;
  }
  static std::size_t largest_key(int k) noexcept { return static_cast<std::size_t>(infinity_bits >> (52 - k)) + 1; }
  // The bucket's midpoint (its top bits, then a one): within 2^-(k+1) of every norm in it, relatively
  // (absolutely 2^-(k+1) * 2^-1022 among the subnormals).
  static double bucket_value(std::size_t key, int k) noexcept {
    if (key == 0) return 0.0;
    const std::uint64_t low = static_cast<std::uint64_t>(key - 1) << (52 - k);
    return low == infinity_bits ? from_bits(low) : from_bits(low | std::uint64_t{1} << (51 - k));
  }

  static void check_norm(const clip_result& step) {
    if (step.finite && !(step.norm >= 0))
      throw std::invalid_argument("gradclip::clip_stats::record: a finite step's norm must be >= 0, not " +
                                  std::to_string(step.norm));
  }

  // Every allocation a step can need, before anything changes: the exact norms' capacity at the
  // interval's first finite norm, the sketch's when the exact norms are full.
  void reserve_for(const clip_result& step) {
    if (!step.finite || !buckets_.empty()) return;
    if (exact_.size() < exact_capacity_) {
      exact_.reserve(exact_capacity_);
    } else {
      buckets_.reserve(sketch_buckets);
    }
  }

  void add(const clip_result& step) noexcept {
    ++steps_;
    if (!step.finite) {
      ++nonfinite_steps_;
      return;
    }
    const double norm = step.norm + 0.0;  // -0 counts as +0
    clipped_steps_ += step.clipped ? 1 : 0;
    skipped_steps_ += step.skip ? 1 : 0;
    norm_sum_ += norm;
    min_norm_ = finite_steps() == 1 ? norm : std::min(min_norm_, norm);
    max_norm_ = std::max(max_norm_, norm);
    if (std::isfinite(step.threshold)) {
      ++threshold_steps_;
      threshold_sum_ += step.threshold;
      last_threshold_ = step.threshold;
    }
    if (buckets_.empty() && exact_.size() < exact_capacity_) {
      exact_.insert(std::upper_bound(exact_.begin(), exact_.end(), norm), norm);
      return;
    }
    if (buckets_.empty()) {  // the switch to the sketch: the exact norms go into it, ascending
      bits_ = sketch_bits;
      for (double x : exact_) add_to_sketch(x);
      exact_.clear();
    }
    add_to_sketch(norm);
  }

  void add_to_sketch(double x) noexcept {
    for (;;) {
      const std::size_t key = bucket_key(x, bits_);
      const auto it = std::lower_bound(buckets_.begin(), buckets_.end(), key,
                                       [](const bucket& b, std::size_t k) { return b.key < k; });
      if (it != buckets_.end() && it->key == key) {
        ++it->count;
        return;
      }
      if (buckets_.size() < sketch_buckets) {
        buckets_.insert(it, bucket{key, 1});
        return;
      }
      coarsen();
    }
  }

  // One mantissa bit less: each pair of neighbouring buckets becomes one. At k = 0 there are at most
  // 2048 keys, fewer than sketch_buckets, so a new bucket always fits by then.
  void coarsen() noexcept {
    --bits_;
    std::size_t kept = 0;
    for (const bucket& b : buckets_) {
      const std::size_t key = b.key == 0 ? 0 : ((b.key - 1) >> 1) + 1;
      if (kept != 0 && buckets_[kept - 1].key == key) {
        buckets_[kept - 1].count += b.count;
      } else {
        buckets_[kept++] = bucket{key, b.count};
      }
    }
    buckets_.resize(kept);
  }

  // The rank-th smallest norm (from 0) as the sketch knows it: the exact minimum and maximum at the
  // ends, else its bucket's midpoint clamped to them, which only brings it closer.
  double sketched_order_statistic(std::size_t rank) const noexcept {
    if (rank == 0) return min_norm_;
    if (rank + 1 == finite_steps()) return max_norm_;
    auto it = buckets_.begin();
    for (std::size_t below = it->count; below <= rank; below += it->count) ++it;
    return std::clamp(bucket_value(it->key, bits_), min_norm_, max_norm_);
  }

  // Adds each tensor's squared norm, scaled by the step's largest: norms up to 2^1024 square to at most
  // 4 * 2^(2g) with 2g <= 2046, and share_sums_ hold the sums divided by 2^share_exponent_, the largest
  // 2g of the interval, so every sum stays below 4 * report_steps_.
  void add_shares(const tensor_report& report) noexcept {
    ++report_steps_;
    double largest = 0.0;
    for (const tensor_stats& t : report) largest = std::max(largest, std::min(t.norm, max_double));
    if (largest == 0.0) return;
    const int g = std::ilogb(largest);
    const bool first = std::all_of(share_sums_.begin(), share_sums_.end(), [](double s) { return s == 0.0; });
    if (first || 2 * g > share_exponent_) {
      for (double& s : share_sums_) s = std::ldexp(s, share_exponent_ - 2 * g);
      share_exponent_ = 2 * g;
    }
    detail::add_scaled_squares(share_sums_, report, g, 2 * g - share_exponent_);
  }

  double share_total() const noexcept {
    double total = 0.0;
    for (double s : share_sums_) total += s;
    return total == 0.0 ? std::numeric_limits<double>::quiet_NaN() : total;
  }

  // Reads a vector of doubles written by write_exact element by element, so that a corrupt length
  // fails at the end of the input instead of allocating it.
  static bool read_values(std::istream& in, std::vector<double>& values, std::size_t max_size) {
    std::size_t n = 0;
    if (!detail::read_exact(in, n)) return false;
    if (n > max_size) {
      in.setstate(std::ios_base::failbit);
      return false;
    }
    for (std::size_t i = 0; i < n; ++i) {
      double x = 0;
      if (!detail::read_exact(in, x)) return false;
      values.push_back(x);
    }
    return true;
  }

  // What operator>> accepts: a state that record() can reach.
  bool consistent() const noexcept {
    const std::size_t finite = finite_steps();
    const auto is_norm = [](double x) { return x >= 0 && !std::signbit(x); };  // not NaN, not -0
    if (nonfinite_steps_ > steps_ || clipped_steps_ > finite || skipped_steps_ > finite || threshold_steps_ > finite ||
        report_steps_ > finite || (report_steps_ != 0 && share_sums_.empty()))
      return false;
    if (finite == 0) {
      if (min_norm_ != 0 || max_norm_ != 0 || !exact_.empty() || !buckets_.empty()) return false;
    } else if (!is_norm(min_norm_) || !is_norm(max_norm_) || min_norm_ > max_norm_) {
      return false;
    }
    if (buckets_.empty()) {
      if (exact_.size() != finite || bits_ != sketch_bits || !std::all_of(exact_.begin(), exact_.end(), is_norm) ||
          !std::is_sorted(exact_.begin(), exact_.end()) ||
          (finite != 0 && (exact_.front() != min_norm_ || exact_.back() != max_norm_)))
        return false;
    } else {
      if (!exact_.empty() || finite <= exact_capacity_) return false;
      std::size_t left = finite;
      for (std::size_t i = 0; i < buckets_.size(); ++i) {
        const bucket& b = buckets_[i];
        if (b.count == 0 || b.count > left || b.key > largest_key(bits_) || (i != 0 && b.key <= buckets_[i - 1].key))
          return false;
        left -= b.count;
      }
      if (left != 0 || bucket_key(min_norm_, bits_) != buckets_.front().key ||
          bucket_key(max_norm_, bits_) != buckets_.back().key)
        return false;
    }
    // The shares: zeros with exponent 0 before any contribution; after one, the largest sum is >= 1
    // (the step's largest tensor adds at least 1 in its scale) and the exponent an even 2g.
    double largest = 0.0;
    for (double x : share_sums_) {
      if (!is_norm(x) || !std::isfinite(x)) return false;
      largest = std::max(largest, x);
    }
    if (largest == 0.0) return share_exponent_ == 0;
    return largest >= 1.0 && share_exponent_ % 2 == 0 && share_exponent_ >= 2 * -1074 && share_exponent_ <= 2 * 1023;
  }

  static constexpr double max_double = std::numeric_limits<double>::max();

  std::size_t element_count_ = 0;
  std::size_t exact_capacity_ = default_exact_capacity;
  std::size_t steps_ = 0;
  std::size_t clipped_steps_ = 0;
  std::size_t nonfinite_steps_ = 0;
  std::size_t skipped_steps_ = 0;
  std::size_t threshold_steps_ = 0;
  std::size_t report_steps_ = 0;
  double norm_sum_ = 0.0;
  double max_norm_ = 0.0;
  double min_norm_ = 0.0;
  double threshold_sum_ = 0.0;
  double last_threshold_ = 0.0;
  std::vector<double> exact_;    // the finite norms, ascending, while they fit in exact_capacity_
  int bits_ = sketch_bits;       // k: mantissa bits of the sketch's keys
  std::vector<bucket> buckets_;  // the sketch, ascending keys; empty while the norms are exact
  int share_exponent_ = 0;       // share_sums_[i] * 2^share_exponent_ is tensor i's sum of squared norms
  std::vector<double> share_sums_;
};

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
