// The checks the fuzzer runs: arbitrary bytes become gradients of every element type, and every result of
// norm, clip_by_norm, clip_by_global_norm and clip_by_value is compared with a binary128 reference and
// with the documented semantics. Shared by the libFuzzer target (clang) and the corpus replay test.
//
// Input layout (missing bytes read as 0):
//   byte 0  bits 0-1 element type (half, bfloat16, float, double); bits 2-3 stride 1, 2, 3 (3 means 1);
//           bit 4 start offset 3 instead of 1 element; bit 5 group mode (several gradients, global norm)
//   byte 1  max_norm: see pick_max_norm     byte 2  epsilon: see pick_epsilon
//   byte 3  clip_by_value limit             byte 4  group: number of gradients - 1 (low 2 bits)
//   byte 5  group: element type of gradient j in bits 2j, 2j+1
//   then    element bits; in group mode each gradient but the last starts with a byte giving its length.
// A failed check throws gradclip_fuzz::mismatch, which libFuzzer reports as a crash.
#pragma once

#include <gradclip/gradclip.hpp>

#include "../reference.hpp"

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define GRADCLIP_FUZZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRADCLIP_FUZZ_ASAN 1
#endif
#endif
#ifdef GRADCLIP_FUZZ_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace gradclip_fuzz {

using gradclip_test::quad;

struct mismatch : std::logic_error {
  using std::logic_error::logic_error;
};

/// Builds a message from its arguments and throws it as a mismatch unless `ok`.
template <class... Args>
void check(bool ok, const Args&... what) {
  if (ok) return;
  std::ostringstream message;
  message.precision(17);
  (message << ... << what);
  throw mismatch(message.str());
}

template <class T>
using bits_t =
    std::conditional_t<sizeof(T) == 2, std::uint16_t, std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;

template <class T>
bits_t<T> bits_of(T x) {
  return Eigen::numext::bit_cast<bits_t<T>>(x);
}
template <class T>
T from_bits(bits_t<T> b) {
  return Eigen::numext::bit_cast<T>(b);
}

/// Reads the input front to back; past the end it yields zeros.
class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return position_ < size_ ? data_[position_++] : 0; }
  double raw_double() {
    std::uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits |= static_cast<std::uint64_t>(byte()) << (8 * i);
    return from_bits<double>(bits);
  }
  std::size_t remaining() const { return size_ - position_; }
  /// `count` elements of T from their raw bits (any pattern: NaN payloads, subnormals, infinities).
  template <class T>
  std::vector<T> elements(std::size_t count) {
    std::vector<T> v(count);
    for (auto& x : v) {
      bits_t<T> bits = 0;
      for (std::size_t i = 0; i < sizeof(T); ++i)
        bits |= static_cast<bits_t<T>>(static_cast<bits_t<T>>(byte()) << (8 * i));
      x = from_bits<T>(bits);
    }
    return v;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

/// What the reference knows about a set of elements: binary128 sum of squares and the facts that decide
/// which policy may overflow or underflow.
struct stats {
  quad sum_squares = 0;
  quad max_square = 0;
  quad min_nonzero_square = std::numeric_limits<double>::infinity();
  bool any_nan = false;
  bool any_inf = false;
  bool any_narrow = false;  // an element narrower than FP64: robust's and max_scale's bounds are then FP32's
  bool any_16bit = false;   // an FP16 or BF16 element: robust sums it in FP32 chains
  std::size_t count = 0;

  template <class T>
  void add(T x) {
    const double d = static_cast<double>(x);
    ++count;
    if (!std::is_same_v<T, double>) any_narrow = true;
    if (sizeof(T) == 2) any_16bit = true;
    if (std::isnan(d)) any_nan = true;
    if (std::isinf(d)) any_inf = true;
    if (!std::isfinite(d)) return;
    const quad square = static_cast<quad>(d) * static_cast<quad>(d);
    sum_squares += square;
    if (square > max_square) max_square = square;
    if (square != 0 && square < min_nonzero_square) min_nonzero_square = square;
  }
  bool finite() const { return !any_nan && !any_inf; }
  quad exact_norm() const { return gradclip_test::quad_sqrt(sum_squares); }
};

template <class T>
quad quad_max() {
  return static_cast<quad>(static_cast<double>(std::numeric_limits<T>::max()));
}
template <class T>
quad quad_min_normal() {
  return static_cast<quad>(static_cast<double>(std::numeric_limits<T>::min()));
}

/// The relative error bound docs/numerics.md documents for a policy on these elements of type T, or a negative
/// number when the policy documents no bound for them (naive and promote outside the range they handle).
template <class Policy, class T>
double norm_bound(const stats& s) {
  const bool fp64 = !s.any_narrow;
  if constexpr (std::is_same_v<Policy, gradclip::robust>) {
    // The loosest bound among the element types present: FP16/BF16's, then FP32's, then FP64's.
    return s.any_16bit    ? gradclip_test::robust_norm_bound<Eigen::half>()
           : s.any_narrow ? gradclip_test::robust_norm_bound<float>()
                          : gradclip_test::robust_norm_bound<double>();
  } else if constexpr (std::is_same_v<Policy, gradclip::max_scale>) {
    return fp64 ? 80 * 0x1p-53 : s.any_16bit ? 16 * 0x1p-24 : 8 * 0x1p-24;
  } else if constexpr (std::is_same_v<Policy, gradclip::promote>) {
    using acc = gradclip::detail::promoted_t<T>;
    const quad block = static_cast<quad>(s.count < 1024 ? s.count : 1024);
    const bool fits = s.max_square * block <= quad_max<acc>() / 2 &&
                      (s.sum_squares == 0 || s.min_nonzero_square >= quad_min_normal<acc>());
    return fits ? gradclip_test::chain_norm_bound<T>() : -1.0;
  } else {
    const double eps = gradclip_test::epsilon_of<T>();
    const double n = static_cast<double>(s.count);
    const bool fits = s.sum_squares * static_cast<quad>(1 + 2 * n * eps) <= quad_max<T>() &&
                      (s.sum_squares == 0 || s.min_nonzero_square >= quad_min_normal<T>());
    return fits ? (n < 1 ? 1 : n) * eps : -1.0;
  }
}

/// True when the documented overflow must happen: one square alone exceeds the accumulator's range.
template <class Policy, class T>
bool must_overflow(const stats& s) {
  if constexpr (std::is_same_v<Policy, gradclip::naive>)
    return s.max_square > quad_max<T>() * quad(1.01);
  else if constexpr (std::is_same_v<Policy, gradclip::promote>)
    return s.max_square > quad_max<gradclip::detail::promoted_t<T>>() * quad(1.01);
  else
    return false;
}

template <class Policy>
constexpr bool is_scaling_policy =
    std::is_same_v<Policy, gradclip::robust> || std::is_same_v<Policy, gradclip::max_scale>;

template <class Policy>
const char* policy_name() {
  if constexpr (std::is_same_v<Policy, gradclip::naive>)
    return "naive";
  else if constexpr (std::is_same_v<Policy, gradclip::promote>)
    return "promote";
  else if constexpr (std::is_same_v<Policy, gradclip::max_scale>)
    return "max_scale";
  else
    return "robust";
}

/// A policy's norm against the reference: NaN for a NaN element, +inf for an infinite one, within the
/// documented bound where one is documented, +inf where the documented overflow must occur.
template <class Policy, class T>
void check_norm(double got, const stats& s, const char* what) {
  const std::string where =
      std::string(what) + "<" + policy_name<Policy>() + ", " + gradclip_test::type_name<T>() + ">";
  if (s.any_nan) return check(std::isnan(got), where, ": a NaN element must give a NaN norm, got ", got);
  if (s.any_inf) return check(std::isinf(got) && got > 0, where, ": an infinite element must give +inf, got ", got);
  const double bound = norm_bound<Policy, T>(s);
  if (bound >= 0) {
    const double error = gradclip_test::relative_error(got, s.exact_norm());
    check(error <= bound, where, ": norm ", got, " exact ", static_cast<double>(s.exact_norm()), " relative error ",
          error, " > bound ", bound, " (", s.count, " elements)");
  } else if (must_overflow<Policy, T>(s)) {
    check(std::isinf(got) && got > 0, where, ": a square beyond the accumulator's range must give +inf, got ", got);
  }
}

/// The distance from the element got to the exact value, allowed: one ulp of T plus `relative` times the
/// exact value (a norm's error carried into the coefficient).
template <class T>
bool within_projection_tolerance(T got, quad exact, double relative) {
  const double ulps = gradclip_test::ulps(got, exact);
  if (ulps <= 1.0) return true;
  // In binary128: the spacing of T near a subnormal FP64 result is below 1/DBL_MAX.
  const quad distance = gradclip_test::quad_abs(gradclip_test::to_quad(got) - exact);
  const quad spacing = distance / static_cast<quad>(ulps);
  return distance <= spacing + static_cast<quad>(relative) * gradclip_test::quad_abs(exact);
}

/// One gradient in the fuzzer's memory: its elements `stride` apart, starting an odd number of elements
/// into a buffer, with guard elements before, between and after that must never change. Under
/// AddressSanitizer the guards before and after are poisoned, so even reading them is reported.
class part_base {
 public:
  virtual ~part_base() = default;
  virtual void reset() = 0;                 ///< restores the original bits everywhere
  virtual bool untouched() const = 0;       ///< every bit as after reset()
  virtual void check_guards() const = 0;    ///< guard and gap elements as after reset()
  virtual gradclip::grad_view view() = 0;   ///< the gradient, as a grad_view
  virtual void add_to(stats& s) const = 0;  ///< the original elements
  /// Every element within tolerance of x * max_norm / (norm + epsilon).
  virtual void check_projection(quad norm, double max_norm, double epsilon, double relative) const = 0;
  /// The result of propagate with coefficient 0 or NaN.
  virtual void check_propagated(double coefficient) const = 0;
  /// clip_by_value against an independent reference.
  virtual void check_clip_by_value(double limit) const = 0;
};

/// limit (>= 0) rounded to nearest in T, ties to even, +inf from half an ulp past T's largest value: by
/// bisection over the ordered bit patterns of the non-negative values, then the midpoint in binary128 (an
/// independent reference for clip_by_value's nearest_bound).
template <class T>
T reference_value_bound(double limit) {
  using bits = bits_t<T>;
  bits low = 0;                                             // value 0 <= limit
  bits high = bits_of(std::numeric_limits<T>::infinity());  // largest candidate
  if (static_cast<double>(from_bits<T>(high)) <= limit) return from_bits<T>(high);
  while (high - low > 1) {
    const bits middle = static_cast<bits>(low + (high - low) / 2);
    if (static_cast<double>(from_bits<T>(middle)) <= limit)
      low = middle;
    else
      high = middle;
  }
  // value(low) <= limit < value(high); beyond the largest finite value, the next value is one ulp on.
  const quad below = gradclip_test::to_quad(from_bits<T>(low));
  if (below == static_cast<quad>(limit)) return from_bits<T>(low);
  const quad above = std::isinf(static_cast<double>(from_bits<T>(high)))
                         ? 2 * below - gradclip_test::to_quad(from_bits<T>(static_cast<bits>(low - 1)))
                         : gradclip_test::to_quad(from_bits<T>(high));
  const quad middle = (below + above) / 2;  // exact in binary128 for every T
  if (static_cast<quad>(limit) != middle) return from_bits<T>(static_cast<quad>(limit) < middle ? low : high);
  return from_bits<T>((low & 1) == 0 ? low : high);
}

template <class T>
class part final : public part_base {
 public:
  part(std::vector<T> values, std::size_t stride, std::size_t offset)
      : values_(std::move(values)), stride_(stride), offset_(offset) {
    const std::size_t span = values_.empty() ? 0 : (values_.size() - 1) * stride_ + 1;
    original_.resize(offset_ + span + 1);
    // Guards and gaps hold a recognisable pattern (0x5a bytes) that clipping would change.
    bits_t<T> guard_bits;
    std::memset(&guard_bits, 0x5a, sizeof guard_bits);
    for (auto& x : original_) x = from_bits<T>(guard_bits);
    for (std::size_t i = 0; i < values_.size(); ++i) original_[offset_ + i * stride_] = values_[i];
    memory_ = std::make_unique<T[]>(original_.size());
    reset();
  }
  ~part() override { unpoison(); }

  T* data() { return memory_.get() + offset_; }
  std::size_t size() const { return values_.size(); }
  std::size_t stride() const { return stride_; }

  void reset() override {
    unpoison();
    std::memcpy(static_cast<void*>(memory_.get()), original_.data(), original_.size() * sizeof(T));
    poison();
  }
  bool untouched() const override {
    unpoison();
    const bool same = std::memcmp(memory_.get(), original_.data(), original_.size() * sizeof(T)) == 0;
    poison();
    return same;
  }
  void check_guards() const override {
    unpoison();
    for (std::size_t i = 0; i < original_.size(); ++i) {
      const bool element = i >= offset_ && (i - offset_) % stride_ == 0 && (i - offset_) / stride_ < values_.size();
      if (!element) {
        const bool same = bits_of(memory_[i]) == bits_of(original_[i]);
        poison();
        check(same, gradclip_test::type_name<T>(), ": guard or gap element ", i, " was written");
        unpoison();
      }
    }
    poison();
  }
  gradclip::grad_view view() override {
    auto map = strided_map();
    return gradclip::grad_view(map);
  }
  Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, Eigen::Unaligned, Eigen::InnerStride<>> strided_map() {
    return {data(), static_cast<Eigen::Index>(size()), Eigen::InnerStride<>(static_cast<Eigen::Index>(stride_))};
  }
  void add_to(stats& s) const override {
    for (const T& x : values_) s.add(x);
  }
  T element(std::size_t i) const { return memory_[offset_ + i * stride_]; }

  void check_projection(quad norm, double max_norm, double epsilon, double relative) const override {
    for (std::size_t i = 0; i < values_.size(); ++i) {
      const quad exact =
          gradclip_test::to_quad(values_[i]) * static_cast<quad>(max_norm) / (norm + static_cast<quad>(epsilon));
      const T got = element(i);
      check(within_projection_tolerance(got, exact, relative), gradclip_test::type_name<T>(), " element ", i, ": ",
            static_cast<double>(values_[i]), " clipped to ", static_cast<double>(got), ", exact ",
            static_cast<double>(exact), " (", gradclip_test::ulps(got, exact), " ulps; norm ",
            static_cast<double>(norm), ", max_norm ", max_norm, ", epsilon ", epsilon, ")");
    }
    check_guards();
  }
  void check_propagated(double coefficient) const override {
    for (std::size_t i = 0; i < values_.size(); ++i) {
      const double x = static_cast<double>(values_[i]);
      const double got = static_cast<double>(element(i));
      if (std::isnan(coefficient) || !std::isfinite(x))
        check(std::isnan(got), "propagate with coefficient ", coefficient, ": element ", x, " became ", got);
      else
        check(got == 0, "propagate with coefficient 0: element ", x, " became ", got);
    }
    check_guards();
  }
  void check_clip_by_value(double limit) const override {
    const T upper = reference_value_bound<T>(limit);
    for (std::size_t i = 0; i < values_.size(); ++i) {
      const double x = static_cast<double>(values_[i]);
      const T expected = x > limit ? upper : (x < -limit ? T(-upper) : values_[i]);
      check(bits_of(element(i)) == bits_of(expected), "clip_by_value<", gradclip_test::type_name<T>(), ">(limit ",
            limit, "): element ", i, " ", x, " became ", static_cast<double>(element(i)), ", expected ",
            static_cast<double>(expected));
    }
    check_guards();
  }

 private:
  // The guard elements before the first element and after the last one.
  void poison() const {
#ifdef GRADCLIP_FUZZ_ASAN
    ASAN_POISON_MEMORY_REGION(memory_.get(), offset_ * sizeof(T));
    ASAN_POISON_MEMORY_REGION(memory_.get() + original_.size() - 1, sizeof(T));
#endif
  }
  void unpoison() const {
#ifdef GRADCLIP_FUZZ_ASAN
    ASAN_UNPOISON_MEMORY_REGION(memory_.get(), original_.size() * sizeof(T));
#endif
  }

  std::vector<T> values_;
  std::size_t stride_;
  std::size_t offset_;
  std::vector<T> original_;
  std::unique_ptr<T[]> memory_;
};

/// max_norm from its selector byte: raw bits (anything, including invalid values), special values, or a
/// fraction of the exact norm between 0 and 2, so that most inputs clip and some do not.
inline double pick_max_norm(std::uint8_t selector, double raw, quad exact_norm) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  switch (selector) {
    case 0:
      return raw;
    case 1:
      return 0.0;
    case 2:
      return inf;
    case 3:
      return std::numeric_limits<double>::quiet_NaN();
    case 4:
      return -1.0;
    case 5:
      return std::numeric_limits<double>::denorm_min();
    case 6:
      return std::numeric_limits<double>::max();
    case 7:
      return 1.0;
    default:
      break;
  }
  const quad fraction = static_cast<quad>(selector) / 128;
  const bool usable = exact_norm > 0 && exact_norm < quad(std::numeric_limits<double>::max());
  return static_cast<double>(usable ? exact_norm * fraction : fraction);
}

inline double pick_epsilon(std::uint8_t selector, byte_reader& in) {
  switch (selector % 4) {
    case 0:
      return 0.0;
    case 1:
      return 1e-6;
    case 2:
      return in.raw_double();
    default:
      return std::ldexp(1.0, selector / 4 - 40);
  }
}

/// The clip_by_value limit: raw bits, special values, or a fraction (0 to 2) of the largest magnitude.
inline double pick_limit(std::uint8_t selector, double raw, quad max_square) {
  switch (selector) {
    case 0:
      return raw;
    case 1:
      return 0.0;
    case 2:
      return std::numeric_limits<double>::infinity();
    case 3:
      return std::numeric_limits<double>::quiet_NaN();
    case 4:
      return -0.5;
    default:
      break;
  }
  const double largest = static_cast<double>(gradclip_test::quad_sqrt(max_square));
  return largest * selector / 128;
}

/// The documented outcome of a clip call on `parts` whose policy norm was `policy_norm`: invalid arguments
/// throw std::invalid_argument and modify nothing; a non-finite norm is skipped, thrown (nothing modified)
/// or propagated; a finite one clips exactly when the norm exceeds max_norm, to the exact projection.
template <class Policy, class Call>
void check_clip(const std::vector<part_base*>& parts, const stats& s, double policy_norm, double max_norm,
                double epsilon, gradclip::on_nonfinite mode, const char* function, double bound, double slack,
                Call&& call) {
  for (auto* p : parts) p->reset();
  const auto all_untouched = [&] {
    for (auto* p : parts)
      if (!p->untouched()) return false;
    return true;
  };
  const std::string where = std::string(function) + "<" + policy_name<Policy>() + ">(max_norm " +
                            std::to_string(max_norm) + ", epsilon " + std::to_string(epsilon) + ", mode " +
                            std::to_string(static_cast<int>(mode)) + ")";
  const bool valid = max_norm >= 0 && epsilon >= 0 && std::isfinite(epsilon);
  if (!valid) {
    try {
      (void)call();
      check(false, where, ": invalid arguments must throw std::invalid_argument");
    } catch (const std::invalid_argument& e) {
      check(std::string(e.what()).rfind(function, 0) == 0, where,
            ": message must start with the function name: ", e.what());
    }
    check(all_untouched(), where, ": invalid arguments must leave every bit untouched");
    return;
  }
  // Scaling policies report every finite input as finite; the others may overflow (finite = false).
  const bool finite = is_scaling_policy<Policy> ? s.finite() : std::isfinite(policy_norm);
  if (!finite && mode == gradclip::on_nonfinite::error) {
    try {
      (void)call();
      check(false, where, ": a non-finite norm must throw gradclip::nonfinite_error");
    } catch (const gradclip::nonfinite_error& e) {
      check(std::isnan(e.norm) == std::isnan(policy_norm), where, ": nonfinite_error::norm ", e.norm, " vs norm ",
            policy_norm);
    }
    check(all_untouched(), where, ": nonfinite_error must leave every bit untouched");
    return;
  }
  const gradclip::clip_result r = call();
  check(r.finite == finite, where, ": finite ", r.finite, " expected ", finite);
  check(bits_of(r.norm) == bits_of(policy_norm) || (std::isnan(r.norm) && std::isnan(policy_norm)), where,
        ": clip reported norm ", r.norm, " but the norm function gives ", policy_norm);
  if (!finite) {
    if (mode == gradclip::on_nonfinite::skip) {
      check(!r.clipped && r.coefficient == 1.0, where, ": skip must report coefficient 1, not clipped");
      check(all_untouched(), where, ": skip must leave every bit untouched");
    } else {
      const double expected = std::isnan(policy_norm) || std::isinf(max_norm) ? std::nan("") : 0.0;
      // == rather than bits: max_norm = -0.0 is valid and gives a coefficient of -0.0.
      check(r.coefficient == expected || (std::isnan(r.coefficient) && std::isnan(expected)), where,
            ": propagate coefficient ", r.coefficient, " expected ", expected);
      for (auto* p : parts) p->check_propagated(r.coefficient);
    }
    return;
  }
  const quad exact = s.exact_norm();
  if (bound >= 0) {  // PyTorch's rule: clip when max_norm / (norm + epsilon) < 1
    const quad denominator = exact + static_cast<quad>(epsilon);
    const quad margin = static_cast<quad>(max_norm) * static_cast<quad>(bound) + denominator * quad(0x1p-52);
    if (denominator > static_cast<quad>(max_norm) + margin)
      check(r.clipped, where, ": norm + epsilon ", static_cast<double>(denominator), " > max_norm must clip");
    if (denominator < static_cast<quad>(max_norm) - margin)
      check(!r.clipped, where, ": norm + epsilon ", static_cast<double>(denominator), " < max_norm must not clip");
  }
  if (!r.clipped) {
    check(r.coefficient == 1.0, where, ": an unclipped result must report coefficient 1, got ", r.coefficient);
    check(all_untouched(), where, ": an unclipped gradient must be left bit for bit untouched");
    return;
  }
  for (auto* p : parts) {
    if (slack >= 0)
      p->check_projection(exact, max_norm, epsilon, slack);
    else
      p->check_guards();
  }
}

/// Relative tolerance beyond one ulp for each clipped element. robust: none, as documented (the FP64 sum
/// is compensated and the coefficient a double-double, so even FP64 elements are within one ulp), except
/// its norm's documented error once an FP16 or BF16 element is in the group. max_scale adds its documented
/// norm error. Negative for naive and promote, which round their coefficient
/// to a narrow type: only their decisions and untouched bits are checked.
template <class Policy>
double projection_slack(const stats& s) {
  if constexpr (std::is_same_v<Policy, gradclip::robust>)
    return s.any_16bit ? gradclip_test::robust_norm_bound<Eigen::half>() : 0.0;
  else if constexpr (std::is_same_v<Policy, gradclip::max_scale>)
    return s.any_16bit ? 16 * 0x1p-24 : s.any_narrow ? 8 * 0x1p-24 : 80 * 0x1p-53;
  else
    return -1.0;
}

template <class Policy, class T>
void check_single_policy(part<T>& g, const stats& s, double max_norm, double epsilon) {
  g.reset();  // the previous policy's clip wrote
  const bool contiguous = g.stride() == 1;
  auto map = g.strided_map();
  const double n =
      contiguous ? gradclip::norm<Policy>(static_cast<const T*>(g.data()), g.size()) : gradclip::norm<Policy>(map);
  check_norm<Policy, T>(n, s, "norm");
  check(g.untouched(), "norm must not write");
  const double bound = is_scaling_policy<Policy> ? norm_bound<Policy, T>(s) : -1.0;
  for (auto mode : {gradclip::on_nonfinite::skip, gradclip::on_nonfinite::error, gradclip::on_nonfinite::propagate}) {
    const gradclip::options opt{mode, epsilon};
    check_clip<Policy>({&g}, s, n, max_norm, epsilon, mode, "gradclip::clip_by_norm", bound,
                       projection_slack<Policy>(s), [&] {
                         return contiguous ? gradclip::clip_by_norm<Policy>(g.data(), g.size(), max_norm, opt)
                                           : gradclip::clip_by_norm<Policy>(map, max_norm, opt);
                       });
  }
}

template <class T>
void check_single(byte_reader& in, std::uint8_t head, std::uint8_t max_norm_selector, std::uint8_t epsilon_selector,
                  std::uint8_t limit_selector) {
  const std::size_t stride = ((head >> 2) & 3) % 3 + 1;
  const std::size_t offset = (head & 0x10) ? 3 : 1;
  const double epsilon = pick_epsilon(epsilon_selector, in);
  // max_norm and limit may take raw bytes first; the rest are elements.
  const double raw_max_norm = max_norm_selector == 0 ? in.raw_double() : 0.0;
  const double raw_limit = limit_selector == 0 ? in.raw_double() : 0.0;
  part<T> g(in.elements<T>(in.remaining() / sizeof(T)), stride, offset);
  stats s;
  g.add_to(s);
  const double max_norm = pick_max_norm(max_norm_selector, raw_max_norm, s.exact_norm());
  const double limit = pick_limit(limit_selector, raw_limit, s.max_square);

  check_single_policy<gradclip::robust>(g, s, max_norm, epsilon);
  check_single_policy<gradclip::max_scale>(g, s, max_norm, epsilon);
  check_single_policy<gradclip::promote>(g, s, max_norm, epsilon);
  check_single_policy<gradclip::naive>(g, s, max_norm, epsilon);

  g.reset();
  auto map = g.strided_map();
  if (!(limit >= 0)) {
    try {
      gradclip::clip_by_value(map, limit);
      check(false, "clip_by_value(", limit, ") must throw std::invalid_argument");
    } catch (const std::invalid_argument& e) {
      check(std::string(e.what()).rfind("gradclip::clip_by_value", 0) == 0, "clip_by_value message: ", e.what());
    }
    check(g.untouched(), "clip_by_value with an invalid limit must leave every bit untouched");
  } else {
    if (stride == 1)
      gradclip::clip_by_value(gradclip::grad_view(g.data(), g.size()), limit);
    else
      gradclip::clip_by_value(map, limit);
    g.check_clip_by_value(limit);
  }
}

template <class Policy>
void check_group_policy(const std::vector<part_base*>& parts, const stats& s, double max_norm, double epsilon,
                        double bound) {
  std::vector<gradclip::grad_view> group;
  for (auto* p : parts) {
    p->reset();  // the previous policy's clip wrote
    group.push_back(p->view());
  }
  const double n = gradclip::global_norm<Policy>(group);
  const std::string what = "global_norm";
  if (s.any_nan)
    check(std::isnan(n), what, "<", policy_name<Policy>(), ">: a NaN element must give NaN, got ", n);
  else if (s.any_inf)
    check(std::isinf(n) && n > 0, what, "<", policy_name<Policy>(), ">: an infinite element must give +inf, got ", n);
  else if (bound >= 0)
    check(gradclip_test::relative_error(n, s.exact_norm()) <= bound, what, "<", policy_name<Policy>(), ">: ", n,
          " exact ", static_cast<double>(s.exact_norm()));
  for (auto mode : {gradclip::on_nonfinite::skip, gradclip::on_nonfinite::error, gradclip::on_nonfinite::propagate})
    check_clip<Policy>(parts, s, n, max_norm, epsilon, mode, "gradclip::clip_by_global_norm", bound,
                       projection_slack<Policy>(s), [&] {
                         return gradclip::clip_by_global_norm<Policy>(group, max_norm, {mode, epsilon});
                       });
}

inline std::unique_ptr<part_base> make_part(int type, byte_reader& in, std::size_t count, std::size_t offset) {
  switch (type) {
    case 0:
      return std::make_unique<part<Eigen::half>>(in.elements<Eigen::half>(count), 1, offset);
    case 1:
      return std::make_unique<part<Eigen::bfloat16>>(in.elements<Eigen::bfloat16>(count), 1, offset);
    case 2:
      return std::make_unique<part<float>>(in.elements<float>(count), 1, offset);
    default:
      return std::make_unique<part<double>>(in.elements<double>(count), 1, offset);
  }
}

inline std::size_t element_size(int type) { return type < 2 ? 2 : (type == 2 ? 4 : 8); }

inline void check_group(byte_reader& in, std::uint8_t head, std::uint8_t max_norm_selector,
                        std::uint8_t epsilon_selector, std::uint8_t count_byte, std::uint8_t types) {
  const std::size_t offset = (head & 0x10) ? 3 : 1;
  const double epsilon = pick_epsilon(epsilon_selector, in);
  const double raw_max_norm = max_norm_selector == 0 ? in.raw_double() : 0.0;
  const int count = (count_byte & 3) + 1;
  std::vector<std::unique_ptr<part_base>> owned;
  for (int j = 0; j < count; ++j) {
    const int type = (types >> (2 * j)) & 3;
    const std::size_t length = j + 1 < count ? in.byte() : in.remaining() / element_size(type);
    owned.push_back(make_part(type, in, length, offset));
  }
  std::vector<part_base*> parts;
  stats s;
  for (auto& p : owned) {
    parts.push_back(p.get());
    p->add_to(s);
  }
  const double max_norm = pick_max_norm(max_norm_selector, raw_max_norm, s.exact_norm());
  // Groups mix element types: the bounds depend only on which types are present (T is unused).
  check_group_policy<gradclip::robust>(parts, s, max_norm, epsilon, norm_bound<gradclip::robust, double>(s));
  check_group_policy<gradclip::max_scale>(parts, s, max_norm, epsilon, norm_bound<gradclip::max_scale, double>(s));
  check_group_policy<gradclip::promote>(parts, s, max_norm, epsilon, -1.0);
  check_group_policy<gradclip::naive>(parts, s, max_norm, epsilon, -1.0);
}

/// Runs every check on one input; throws mismatch on the first failure.
inline void check_input(const std::uint8_t* data, std::size_t size) {
  byte_reader in(data, size);
  const std::uint8_t head = in.byte();
  const std::uint8_t max_norm_selector = in.byte();
  const std::uint8_t epsilon_selector = in.byte();
  const std::uint8_t limit_selector = in.byte();
  const std::uint8_t count_byte = in.byte();
  const std::uint8_t types = in.byte();
  if (head & 0x20) return check_group(in, head, max_norm_selector, epsilon_selector, count_byte, types);
  switch (head & 3) {
    case 0:
      return check_single<Eigen::half>(in, head, max_norm_selector, epsilon_selector, limit_selector);
    case 1:
      return check_single<Eigen::bfloat16>(in, head, max_norm_selector, epsilon_selector, limit_selector);
    case 2:
      return check_single<float>(in, head, max_norm_selector, epsilon_selector, limit_selector);
    default:
      return check_single<double>(in, head, max_norm_selector, epsilon_selector, limit_selector);
  }
}

}  // namespace gradclip_fuzz
