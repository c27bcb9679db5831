// Threshold controllers (zclip, autoclip, spike_skip) and the calls that consult them: decisions against
// long double transcriptions of the reference implementations, exact checkpoints, false clips on
// stationary norms, level shifts, FP16 norms beyond 65504, bad configurations, non-finite steps.
#include <gradclip/autoclip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/controller.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/spike_skip.hpp>
#include <gradclip/zclip.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using gradclip::clip_result;
using gradclip_test::exact_norm;
using gradclip_test::quad;
using real = long double;
constexpr real inf = std::numeric_limits<real>::infinity();

static_assert(gradclip::is_threshold_controller_v<gradclip::zclip>, "zclip is a controller.");
static_assert(gradclip::is_threshold_controller_v<gradclip::autoclip&>, "autoclip is a controller.");
static_assert(gradclip::is_threshold_controller_v<const gradclip::spike_skip>, "spike_skip is a controller.");
static_assert(!gradclip::is_threshold_controller_v<double>, "A number is not a controller.");
static_assert(!gradclip::is_threshold_controller_v<gradclip::clip_result>, "A result is not a controller.");

// ---------------------------------------------------------------------------------------------------
// The references, transcribed from the Python in long double. step(norm) returns the threshold the
// gradient was clipped to, or +inf when it was not clipped; `skipped` tells a skip.

// bluorion-com/ZClip, zclip/zclip.py: ZClip.step with _compute_clip_val and _apply_clipping.
struct zclip_reference {
  gradclip::zclip_config c;
  std::vector<real> buffer;
  bool initialized = false;
  real mean = 0, var = 0;

  real step(real norm) {
    const real cap = c.max_norm;
    if (!initialized) {
      buffer.push_back(norm);
      if (buffer.size() >= c.warmup_steps) {
        real sum = 0;
        for (real x : buffer) sum += x;
        mean = sum / buffer.size();
        real squares = 0;
        for (real x : buffer) squares += (x - mean) * (x - mean);
        var = squares / buffer.size();
        initialized = true;
        buffer.clear();
      }
      return norm > cap ? cap : inf;
    }
    const real sd = std::sqrt(var);
    bool spike = false;
    real clip_val = 0;
    if (c.mode == gradclip::zclip_mode::percentile) {
      const real threshold = mean + real(c.z_threshold) * sd;
      if (norm > threshold) spike = true, clip_val = threshold;
    } else {
      const real z = (norm - mean) / (sd + real(c.eps));
      if (z > real(c.z_threshold)) {
        spike = true;
        clip_val = c.clip_option == gradclip::zclip_option::mean
                       ? mean
                       : (mean + real(c.z_threshold) * sd / (z / real(c.z_threshold))) * real(c.clip_factor);
      }
    }
    const real effective = std::min(spike ? clip_val : norm, cap);
    if (!(spike && c.skip_update_on_spike)) {
      const real x = spike ? clip_val : norm;
      mean = real(c.alpha) * mean + (1 - real(c.alpha)) * x;
      var = real(c.alpha) * var + (1 - real(c.alpha)) * (x - mean) * (x - mean);
    }
    return norm > effective ? effective : inf;
  }
};

// pseeth/autoclip, autoclip/torch/quantile.py: QuantileClip._clip_global, with torch.quantile's linear rule.
struct autoclip_reference {
  gradclip::autoclip_config c;
  std::vector<real> history;

  real step(real norm) {
    real threshold = inf;
    if (!history.empty()) {
      std::vector<real> sorted = history;
      std::sort(sorted.begin(), sorted.end());
      const real rank = real(c.quantile) * (sorted.size() - 1);
      const real below = std::floor(rank), above = std::ceil(rank);
      const real a = sorted[static_cast<std::size_t>(below)], b = sorted[static_cast<std::size_t>(above)];
      threshold = a + (rank - below) * (b - a);
    }
    history.push_back(norm);
    if (history.size() > c.history) history.erase(history.begin());
    return norm > threshold ? threshold : inf;
  }
};

// allenai/OLMo-core, optim/skip_step_optimizer.py: latest_grad_norm's window and get_step_factor.
struct spike_skip_reference {
  gradclip::spike_skip_config c;
  std::vector<real> norms;  // the previous norms and the latest one
  bool skipped = false;

  real step(real norm) {
    norms.push_back(norm);
    while (norms.size() > c.window + 1) norms.erase(norms.begin());
    skipped = false;
    if (norms.size() >= c.min_norms) {
      const std::size_t n = norms.size() - 1;
      real sum = 0;
      for (std::size_t i = 0; i < n; ++i) sum += norms[i];
      const real mean = sum / n;
      real squares = 0;
      for (std::size_t i = 0; i < n; ++i) squares += (norms[i] - mean) * (norms[i] - mean);
      skipped = !(norm - mean <= real(c.sigma_factor) * std::sqrt(squares / (n - 1)));
    }
    return !skipped && norm > real(c.max_norm) ? real(c.max_norm) : inf;
  }
};

// ---------------------------------------------------------------------------------------------------

// What the clipping call does with a decision, without gradients: the result the controller is told.
template <class Controller>
clip_result step(Controller& controller, double norm) {
  const gradclip::threshold_decision d = controller.decide(norm);
  const bool clipped = !d.skip && norm > d.threshold;
  const clip_result result{norm, clipped ? d.threshold / norm : 1.0, clipped, true, d.threshold, d.skip};
  controller.update(result);
  return result;
}

// A scripted norm trace like a training run's: a decaying trend, log-normal noise and rare spikes of 5x
// to 50x (2 % of the steps).
std::vector<double> norm_trace(std::uint64_t seed, std::size_t steps) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 0.15);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<double> norms(steps);
  for (std::size_t t = 0; t < steps; ++t) {
    double norm = (1.0 + 4.0 * std::exp(-static_cast<double>(t) / 300.0)) * std::exp(noise(rng));
    if (uniform(rng) < 0.02) norm *= 5.0 + 45.0 * uniform(rng);
    norms[t] = norm;
  }
  return norms;
}

// Stationary norms: |N(1, 0.1)|.
std::vector<double> stationary(std::uint64_t seed, std::size_t steps, double level = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(level, 0.1 * level);
  std::vector<double> norms(steps);
  for (auto& x : norms) x = std::abs(normal(rng));
  return norms;
}

// Runs the controller and the reference side by side; every decision must match.
template <class Controller, class Reference>
void expect_reference_decisions(Controller controller, Reference reference, const std::vector<double>& norms) {
  std::size_t clipped = 0, skipped = 0;
  for (std::size_t t = 0; t < norms.size(); ++t) {
    const clip_result got = step(controller, norms[t]);
    const real want = reference.step(norms[t]);
    bool want_skip = false;
    if constexpr (std::is_same_v<Reference, spike_skip_reference>) want_skip = reference.skipped;
    ASSERT_EQ(got.skip, want_skip) << "step " << t << " norm " << norms[t];
    ASSERT_EQ(got.clipped, want < inf) << "step " << t << " norm " << norms[t];
    // The references run in long double; the EMA contracts, so each threshold carries a few roundings
    // of double (~1e-15) amplified by at most 1 / (1 - alpha) ~ 33: 1e-12 is far above that.
    if (got.clipped) {
      ASSERT_LE(std::abs(static_cast<real>(got.threshold) - want) / want, 1e-12L) << "step " << t;
    }
    clipped += got.clipped ? 1 : 0;
    skipped += got.skip ? 1 : 0;
  }
  // The traces must exercise the decisions, not only agree on "never".
  if constexpr (std::is_same_v<Reference, spike_skip_reference>)
    EXPECT_GT(skipped, 0u);
  else
    EXPECT_GT(clipped, 0u);
}

TEST(ZClip, ReproducesTheReferenceDecisions) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  const auto norms = norm_trace(gradclip_test::seed, 3000);
  std::vector<gradclip::zclip_config> configs(6);
  configs[1].max_norm = std::numeric_limits<double>::infinity();
  configs[2].mode = gradclip::zclip_mode::percentile;
  configs[2].max_norm = 20;
  configs[3].clip_option = gradclip::zclip_option::mean;
  configs[3].max_norm = std::numeric_limits<double>::infinity();
  configs[4].clip_factor = 0.7;
  configs[4].skip_update_on_spike = true;
  configs[4].max_norm = std::numeric_limits<double>::infinity();
  configs[5].alpha = 0.9;
  configs[5].z_threshold = 2.0;
  configs[5].warmup_steps = 1;
  configs[5].eps = 0;
  configs[5].max_norm = 30;
  for (const auto& c : configs) {
    SCOPED_TRACE(::testing::Message() << "alpha " << c.alpha << " mode " << static_cast<int>(c.mode) << " option "
                                      << static_cast<int>(c.clip_option) << " max_norm " << c.max_norm);
    expect_reference_decisions(gradclip::zclip(c), zclip_reference{c, {}, false, 0, 0}, norms);
  }
}

TEST(AutoClip, ReproducesTheReferenceDecisions) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  const auto norms = norm_trace(gradclip_test::seed + 1, 3000);  // wraps the default history twice
  for (const gradclip::autoclip_config& c :
       {gradclip::autoclip_config{}, gradclip::autoclip_config{0.5, 7}, gradclip::autoclip_config{1.0, 100},
        gradclip::autoclip_config{0.0, 1}, gradclip::autoclip_config{0.95, 333}}) {
    SCOPED_TRACE(::testing::Message() << "quantile " << c.quantile << " history " << c.history);
    expect_reference_decisions(gradclip::autoclip(c), autoclip_reference{c, {}}, norms);
  }
  gradclip::autoclip first;
  EXPECT_EQ(first.decide(1e300).threshold, std::numeric_limits<double>::infinity());  // no clipping on step one
}

TEST(SpikeSkip, ReproducesTheReferenceDecisions) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  const auto norms = norm_trace(gradclip_test::seed + 2, 3000);
  for (const gradclip::spike_skip_config& c :
       {gradclip::spike_skip_config{}, gradclip::spike_skip_config{32, 3.0, 20, 8.0},
        gradclip::spike_skip_config{2, 1.0, 3, std::numeric_limits<double>::infinity()},
        gradclip::spike_skip_config{500, 6.0, 250, std::numeric_limits<double>::infinity()}}) {
    SCOPED_TRACE(::testing::Message() << "window " << c.window << " sigma " << c.sigma_factor);
    expect_reference_decisions(gradclip::spike_skip(c), spike_skip_reference{c, {}, false}, norms);
  }
}

TEST(SpikeSkip, DecidesFromTheSixtyFourthNormAndKeepsSkippedNormsInTheWindow) {
  gradclip::spike_skip controller;
  for (int t = 0; t < 62; ++t) (void)step(controller, t % 2 ? 1.1 : 0.9);
  EXPECT_FALSE(controller.decide(1e9).skip);  // the 63rd norm: no decision yet
  (void)step(controller, 1.0);
  EXPECT_TRUE(controller.decide(1e9).skip);  // the 64th
  EXPECT_EQ(controller.decide(1e9).threshold, controller.bound());
  const std::size_t before = controller.size();
  EXPECT_TRUE(step(controller, 1e9).skip);
  EXPECT_EQ(controller.size(), before + 1);   // OLMo-core keeps it, so the window widens:
  EXPECT_TRUE(step(controller, 1e9).skip);    // 6 sigma of 64 norms with one spike V is 0.75 V
  EXPECT_FALSE(controller.decide(1e9).skip);  // with two, 1.04 V
}

// ---------------------------------------------------------------------------------------------------
// Checkpoints: save after k steps, restore into a controller with another configuration, and the two
// make the same decisions bit for bit from then on.

template <class Controller>
struct checkpoint_case;
template <>
struct checkpoint_case<gradclip::zclip> {
  static gradclip::zclip make() {
    gradclip::zclip_config c;
    c.max_norm = 25;
    return gradclip::zclip(c);
  }
  static gradclip::zclip other() {
    gradclip::zclip_config c;
    c.mode = gradclip::zclip_mode::percentile;
    return gradclip::zclip(c);
  }
};
template <>
struct checkpoint_case<gradclip::autoclip> {
  static gradclip::autoclip make() { return gradclip::autoclip({0.8, 50}); }
  static gradclip::autoclip other() { return gradclip::autoclip(); }
};
template <>
struct checkpoint_case<gradclip::spike_skip> {
  static gradclip::spike_skip make() { return gradclip::spike_skip({40, 3.0, 20, 30.0}); }
  static gradclip::spike_skip other() { return gradclip::spike_skip(); }
};

template <class Controller>
class ControllerTyped : public ::testing::Test {};
using Controllers = ::testing::Types<gradclip::zclip, gradclip::autoclip, gradclip::spike_skip>;
TYPED_TEST_SUITE(ControllerTyped, Controllers);

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TYPED_TEST(ControllerTyped, CheckpointRoundTripsBitForBit) {
  const auto norms = norm_trace(gradclip_test::seed + 3, 400);
  // Mid-warm-up, just after it, mid-window and long after every buffer has wrapped.
  for (std::size_t k : {0u, 10u, 25u, 26u, 45u, 137u, 300u}) {
    TypeParam original = checkpoint_case<TypeParam>::make();
    for (std::size_t t = 0; t < k; ++t) (void)step(original, norms[t]);
    std::stringstream saved;
    saved << original;
    TypeParam restored = checkpoint_case<TypeParam>::other();
    ASSERT_TRUE(saved >> restored) << "k " << k << ": " << saved.str();
    EXPECT_TRUE(restored == original) << "k " << k;
    const TypeParam copy = original;  // regular: a copy is an equal, independent value
    std::size_t decisions = 0;
    for (std::size_t t = k; t < norms.size(); ++t) {
      const clip_result a = step(original, norms[t]);
      const clip_result b = step(restored, norms[t]);
      ASSERT_TRUE(same_bits(a.threshold, b.threshold) && a.skip == b.skip && a.clipped == b.clipped)
          << "k " << k << " step " << t;
      decisions += a.clipped || a.skip ? 1 : 0;
    }
    EXPECT_GT(decisions, 0u) << "k " << k;
    EXPECT_TRUE(restored == original);
    EXPECT_TRUE(k == norms.size() || copy != original);
  }
}

TYPED_TEST(ControllerTyped, MalformedCheckpointIsRejectedAndLeavesTheTargetUnchanged) {
  TypeParam original = checkpoint_case<TypeParam>::make();
  const auto norms = norm_trace(gradclip_test::seed + 4, 100);
  for (double x : norms) (void)step(original, x);
  std::stringstream saved;
  saved << original;
  const std::string text = saved.str();
  const std::string other_tag = std::is_same_v<TypeParam, gradclip::zclip> ? "gradclip::autoclip" : "gradclip::zclip";
  for (const std::string& input :
       {std::string(), text.substr(0, text.size() / 2), other_tag + text.substr(text.find(' ')),
        text.substr(0, text.find(' ')) + " 0xzz" + text.substr(text.find(' ') + 19)}) {
    TypeParam target = checkpoint_case<TypeParam>::other();
    const TypeParam before = target;
    std::istringstream in(input);
    in >> target;
    EXPECT_TRUE(in.fail()) << input;
    EXPECT_TRUE(target == before) << input;
  }
}

TYPED_TEST(ControllerTyped, NonFiniteStepsDoNotChangeTheState) {
  TypeParam controller = checkpoint_case<TypeParam>::make();
  for (double x : norm_trace(gradclip_test::seed + 5, 80)) (void)step(controller, x);
  const TypeParam before = controller;
  const double nan = std::numeric_limits<double>::quiet_NaN(), infinity = std::numeric_limits<double>::infinity();
  for (const clip_result& r : {clip_result{nan, 1.0, false, false}, clip_result{infinity, 1.0, false, false},
                               clip_result{infinity, 0.0, true, false, 1.0}, clip_result{1.0, 1.0, false, false}})
    controller.update(r);
  EXPECT_TRUE(controller == before);

  // Through the clipping call, for every on_nonfinite: the gradient is reported, the state unchanged.
  std::vector<float> g{1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  const std::vector<float> g0 = g;
  auto r = gradclip::clip_by_global_norm(std::vector<gradclip::grad_view>{gradclip::grad_view(g)}, controller);
  EXPECT_FALSE(r.finite);
  EXPECT_FALSE(r.clipped);
  EXPECT_FALSE(r.skip);
  EXPECT_EQ(r.threshold, infinity);
  EXPECT_TRUE(gradclip_test::same_bits(g, g0));
  EXPECT_THROW((void)gradclip::clip_by_norm(g, controller, {gradclip::on_nonfinite::error}), gradclip::nonfinite_error);
  EXPECT_TRUE(gradclip_test::same_bits(g, g0));
  r = gradclip::clip_by_norm(g, controller, {gradclip::on_nonfinite::propagate});
  EXPECT_FALSE(r.finite);
  EXPECT_TRUE(same_bits(r.threshold, controller.fallback_threshold()));
  EXPECT_TRUE(std::isnan(g[0]));  // PyTorch's arithmetic: NaN everywhere
  EXPECT_TRUE(controller == before);
}

TYPED_TEST(ControllerTyped, CopiesAreIndependentValues) {
  TypeParam a = checkpoint_case<TypeParam>::make();
  for (double x : norm_trace(gradclip_test::seed + 6, 70)) (void)step(a, x);
  TypeParam b = a;
  EXPECT_TRUE(a == b);
  (void)step(b, 2.0);
  EXPECT_TRUE(a != b);
  b = a;
  EXPECT_TRUE(a == b);
}

// ---------------------------------------------------------------------------------------------------
// Behaviour on norms without spikes: stationary, then a permanent shift to three times the level.

struct rates {
  std::size_t decisions = 0;  // clipped or skipped steps
  std::size_t first_run = 0;  // consecutive decisions from the first step on
};

template <class Controller>
rates run(Controller& controller, const std::vector<double>& norms) {
  rates r;
  bool in_run = true;
  for (double x : norms) {
    const clip_result s = step(controller, x);
    const bool acted = s.clipped || s.skip;
    r.decisions += acted ? 1 : 0;
    in_run = in_run && acted;
    r.first_run += in_run ? 1 : 0;
  }
  return r;
}

gradclip::zclip uncapped_zclip() {
  gradclip::zclip_config c;
  c.max_norm = std::numeric_limits<double>::infinity();
  return gradclip::zclip(c);
}

TEST(Controllers, StationaryNormsGiveFewFalseClips) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  const auto norms = stationary(gradclip_test::seed + 7, 20000);
  // zclip: z > 2.5 on Gaussian norms is 0.6 %; the EMA's own noise makes it about 1 %. Bound: 2 %.
  gradclip::zclip z = uncapped_zclip();
  const rates zr = run(z, norms);
  std::printf("zclip clips %zu of %zu stationary steps\n", zr.decisions, norms.size());
  EXPECT_LE(zr.decisions, norms.size() / 50);
  // autoclip clips by design the steps above its 90th percentile: 10 %, within [8 %, 12 %].
  gradclip::autoclip a;
  const rates ar = run(a, norms);
  std::printf("autoclip clips %zu of %zu stationary steps\n", ar.decisions, norms.size());
  EXPECT_GE(ar.decisions, norms.size() * 8 / 100);
  EXPECT_LE(ar.decisions, norms.size() * 12 / 100);
  // spike_skip: 6 sigma above the mean of Gaussian norms, once in 10^9 steps: none.
  gradclip::spike_skip s;
  EXPECT_EQ(run(s, norms).decisions, 0u);
}

// Norms that rise linearly from `level` to three times it over `ramp_steps` steps, then stay there.
std::vector<double> ramp(std::uint64_t seed, std::size_t steps, std::size_t ramp_steps) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.1);
  std::vector<double> norms(steps);
  for (std::size_t t = 0; t < steps; ++t) {
    const double level = 1.0 + 2.0 * static_cast<double>(std::min(t, ramp_steps)) / static_cast<double>(ramp_steps);
    norms[t] = std::abs(level * (1.0 + normal(rng)));
  }
  return norms;
}

TEST(Controllers, PermanentLevelShiftIsAbsorbed) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(gradclip_test::seed));
  const auto before = stationary(gradclip_test::seed + 8, 2000);
  const auto after = stationary(gradclip_test::seed + 9, 3000, 3.0);
  const std::vector<double> settle(after.begin(), after.begin() + 1000);
  const std::vector<double> later(after.begin() + 1000, after.end());
  // For each: steps in a row clipped (skipped) from the shift on, and the rate from 1000 steps after
  // it, which must be back within the stationary bounds above.

  // zclip's percentile mode: the threshold mean + 2.5 std it feeds the EMA widens the variance by ~7 %
  // a step, so the threshold catches up within 30 steps.
  gradclip::zclip_config percentile;
  percentile.mode = gradclip::zclip_mode::percentile;
  percentile.max_norm = std::numeric_limits<double>::infinity();
  gradclip::zclip zp(percentile);
  (void)run(zp, before);
  const std::size_t zp_run = run(zp, settle).first_run;
  std::printf("zclip percentile: %zu steps in a row clipped after the shift\n", zp_run);
  EXPECT_LE(zp_run, 30u);
  EXPECT_LE(run(zp, later).decisions, later.size() / 50);

  // zclip's zscore mode (the default) takes a sudden shift for a sustained spike, as the reference does:
  // its EMA absorbs only the clipped values, mean + 2.5^2 std / z, barely above the mean, so the
  // variance shrinks and every step stays clipped to about the old level.
  gradclip::zclip zs = uncapped_zclip();
  (void)run(zs, before);
  EXPECT_EQ(run(zs, after).first_run, after.size());
  EXPECT_LT(zs.mean(), 1.2);
  // It follows the same shift as a ramp over 100 steps: it clips some of the ramp, then nothing more
  // than on stationary norms.
  gradclip::zclip zr = uncapped_zclip();
  (void)run(zr, before);
  const auto ramped = ramp(gradclip_test::seed + 13, 3000, 100);
  const rates during = run(zr, std::vector<double>(ramped.begin(), ramped.begin() + 100));
  std::printf("zclip zscore: %zu of 100 ramp steps clipped\n", during.decisions);
  EXPECT_LE(during.decisions, 30u);
  EXPECT_LE(run(zr, std::vector<double>(ramped.begin() + 100, ramped.end())).decisions, 2900u / 50);

  // autoclip: the 90th percentile moves once 10 % of the last 1000 norms are new, after 100 steps
  // (101 and a few more of the new norms that fall below the lowest new ones so far).
  gradclip::autoclip a;
  (void)run(a, before);
  const std::size_t a_run = run(a, settle).first_run;
  std::printf("autoclip: %zu steps in a row clipped after the shift\n", a_run);
  EXPECT_LE(a_run, 110u);
  const std::size_t a_later = run(a, later).decisions;
  EXPECT_GE(a_later, later.size() * 8 / 100);
  EXPECT_LE(a_later, later.size() * 12 / 100);

  // spike_skip: skipped norms enter the window; with k of them among 128, 6 sigma exceeds the jump of
  // 2 (20 old sigmas) from k = 4 on.
  gradclip::spike_skip s;
  (void)run(s, before);
  const std::size_t s_run = run(s, settle).first_run;
  std::printf("spike_skip: %zu steps in a row skipped after the shift\n", s_run);
  EXPECT_LE(s_run, 5u);
  EXPECT_EQ(run(s, later).decisions, 0u);
}

// ---------------------------------------------------------------------------------------------------
// The clipping calls with real gradients.

template <class T>
class ClipWithControllerTyped : public ::testing::Test {};
using ElementTypes = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;
TYPED_TEST_SUITE(ClipWithControllerTyped, ElementTypes);

// Every step's norm is the binary128 norm of the gradients to the policy's bound, the decisions are
// the reference's, and a clipped group's norm is the threshold.
TYPED_TEST(ClipWithControllerTyped, NormsAndDecisionsMatchTheReference) {
  using T = TypeParam;
  std::printf("seed %llu, %s\n", static_cast<unsigned long long>(gradclip_test::seed),
              gradclip_test::type_name<T>().c_str());
  std::mt19937_64 rng(gradclip_test::seed + 10);
  const auto targets = norm_trace(gradclip_test::seed + 11, 120);
  gradclip::zclip_config config;
  config.max_norm = 40;
  gradclip::zclip controller(config);
  zclip_reference reference{config, {}, false, 0, 0};
  const double bound = gradclip_test::robust_norm_bound<T>();
  std::size_t clipped = 0;
  for (double target : targets) {
    std::vector<T> w = gradclip_test::random_gradient<T>(300, rng, target / std::sqrt(400.0));
    std::vector<T> b = gradclip_test::random_gradient<T>(100, rng, target / std::sqrt(400.0));
    const quad exact = gradclip_test::quad_sqrt(exact_norm(w) * exact_norm(w) + exact_norm(b) * exact_norm(b));
    const clip_result r = gradclip::clip_by_global_norm({gradclip::grad_view(w), gradclip::grad_view(b)}, controller);
    ASSERT_LE(gradclip_test::relative_error(r.norm, exact), bound);
    const real want = reference.step(static_cast<real>(r.norm));
    ASSERT_EQ(r.clipped, want < inf);
    if (!r.clipped) continue;
    ++clipped;
    ASSERT_LE(std::abs(static_cast<real>(r.threshold) - want) / want, 1e-12L);
    const quad after = gradclip_test::quad_sqrt(exact_norm(w) * exact_norm(w) + exact_norm(b) * exact_norm(b));
    // Each element within one ulp of T of its exact clipped value (FP64: plus the norm's rounding).
    EXPECT_LE(gradclip_test::relative_error(r.threshold, after), gradclip_test::epsilon_of<T>() + bound);
  }
  EXPECT_GT(clipped, 0u);
}

// The textbook FP16 sum of squares overflows beyond 65504; the controller must see the true norm.
TEST(ClipWithController, Fp16NormBeyond65504IsSeenCorrectly) {
  std::mt19937_64 rng(gradclip_test::seed + 12);
  gradclip::zclip_config config;
  config.max_norm = std::numeric_limits<double>::infinity();
  gradclip::zclip controller(config);
  zclip_reference reference{config, {}, false, 0, 0};
  for (int t = 0; t < 40; ++t) {
    std::vector<Eigen::half> g = gradclip_test::random_gradient<Eigen::half>(4096, rng, 0.02);
    (void)reference.step(static_cast<real>(gradclip::clip_by_norm(g, controller).norm));
  }
  // A spike: elements up to a few thousand (finite in FP16), norm about 1.3e5.
  std::vector<Eigen::half> spike = gradclip_test::random_gradient<Eigen::half>(4096, rng, 2000.0);
  const quad exact = exact_norm(spike);
  ASSERT_GT(exact, quad(65504));
  EXPECT_TRUE(std::isinf(gradclip::norm<gradclip::naive>(spike)));  // what the references would see
  const double level = controller.mean();
  const clip_result r = gradclip::clip_by_norm(spike, controller);
  EXPECT_TRUE(r.finite);
  EXPECT_LE(gradclip_test::relative_error(r.norm, exact), gradclip_test::robust_norm_bound<Eigen::half>());
  const real want = reference.step(static_cast<real>(exact));
  ASSERT_TRUE(r.clipped);
  EXPECT_LE(std::abs(static_cast<real>(r.threshold) - want) / want, 1e-12L);
  // z is about 1e7, so the threshold mean + 2.5^2 std / z is the mean of the previous norms (~1.3).
  EXPECT_GE(r.threshold, level);
  EXPECT_LT(r.threshold, level * 1.001);
  // Each clipped element within one FP16 ulp of its exact value.
  EXPECT_LE(gradclip_test::relative_error(r.threshold, exact_norm(spike)), gradclip_test::epsilon_of<Eigen::half>());
}

TEST(ClipWithController, SkippedStepLeavesTheGradientUntouched) {
  gradclip::spike_skip controller({8, 3.0, 5, 100.0});
  std::vector<double> g{3.0, 4.0};
  for (int t = 0; t < 8; ++t) {
    g = {3.0 + 0.1 * t, 4.0};
    const clip_result r = gradclip::clip_by_norm(g, controller);
    EXPECT_FALSE(r.skip);
    EXPECT_FALSE(r.clipped);
    EXPECT_EQ(r.threshold, 100.0);
  }
  std::vector<double> spike{300.0, 400.0};
  const std::vector<double> spike0 = spike;
  const gradclip::threshold_decision d = controller.decide(500.0);
  const clip_result r = gradclip::clip_by_norm(spike, controller);
  EXPECT_TRUE(r.skip);
  EXPECT_FALSE(r.clipped);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(r.norm, 500.0);
  EXPECT_EQ(r.coefficient, 1.0);
  EXPECT_EQ(r.threshold, d.threshold);  // the bound the norm was compared with
  EXPECT_TRUE(gradclip_test::same_bits(spike, spike0));
  // Steps it does not skip are capped at max_norm.
  gradclip::spike_skip capped({8, 1e6, 5, 1.0});
  for (int t = 0; t < 8; ++t) (void)gradclip::clip_by_norm(std::vector<double>{3.0, 4.0}, capped);
  std::vector<double> big{3.0, 4.0};
  const clip_result c = gradclip::clip_by_norm(big, capped);
  EXPECT_TRUE(c.clipped);
  EXPECT_EQ(c.threshold, 1.0);
  // robust clips each FP64 element to within one ulp of the exact projection 3 * 1 / 5 (numerics.md).
  EXPECT_LE(gradclip_test::ulps(big[0], quad(3) / quad(5)), 1.0);
  EXPECT_LE(gradclip_test::ulps(big[1], quad(4) / quad(5)), 1.0);
}

TEST(ClipWithController, GroupsOfEveryKindAndOptions) {
  gradclip::autoclip controller({0.5, 10});
  std::vector<float> w(8, 1.0f), b(2, 1.0f);
  std::vector<std::vector<float>> group{w, b};
  (void)gradclip::clip_by_global_norm(group, controller);                                             // lvalue group
  (void)gradclip::clip_by_global_norm({gradclip::grad_view(w), gradclip::grad_view(b)}, controller);  // braced
  (void)gradclip::clip_by_global_norm(std::vector<gradclip::grad_view>{w, b}, controller);            // temporary
  EXPECT_EQ(controller.size(), 3u);
  EXPECT_EQ(controller.threshold(), std::sqrt(10.0));
  Eigen::MatrixXf m = Eigen::MatrixXf::Constant(4, 4, 1.0f);  // norm 4 > sqrt(10)
  const clip_result r = gradclip::clip_by_norm(m, controller, {gradclip::on_nonfinite::skip, 0.0});
  EXPECT_TRUE(r.clipped);
  EXPECT_EQ(r.threshold, std::sqrt(10.0));
  // Each FP32 element within one ulp of the exact projection 1 * sqrt(10) / 4 (the norm 4 is exact;
  // numerics.md).
  const quad projection = gradclip_test::to_quad(std::sqrt(10.0)) / quad(4);
  for (Eigen::Index k = 0; k < m.size(); ++k) EXPECT_LE(gradclip_test::ulps(m.data()[k], projection), 1.0) << k;
  EXPECT_THROW((void)gradclip::clip_by_norm(m, controller, {gradclip::on_nonfinite::skip, -1.0}),
               std::invalid_argument);
  EXPECT_EQ(controller.size(), 4u);  // the rejected call told the controller nothing
}

// ---------------------------------------------------------------------------------------------------

template <class Controller, class Config>
void expect_rejected(const Config& config, const std::string& message) {
  try {
    Controller c(config);
    ADD_FAILURE() << "accepted; expected: " << message;
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(Controllers, BadConfigurationsAreRejectedNamingTheField) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), infinity = std::numeric_limits<double>::infinity();
  const auto z = [](auto change) {
    gradclip::zclip_config c;
    change(c);
    return c;
  };
  for (double alpha : {0.0, 1.0, -0.5, nan})
    expect_rejected<gradclip::zclip>(z([&](auto& c) { c.alpha = alpha; }),
                                     "gradclip::zclip_config: alpha must be in (0, 1)");
  for (double zt : {0.0, -1.0, nan, infinity})
    expect_rejected<gradclip::zclip>(z([&](auto& c) { c.z_threshold = zt; }),
                                     "gradclip::zclip_config: z_threshold must be finite and > 0");
  expect_rejected<gradclip::zclip>(z([](auto& c) { c.warmup_steps = 0; }),
                                   "gradclip::zclip_config: warmup_steps must be >= 1");
  for (double eps : {-1e-6, nan, infinity})
    expect_rejected<gradclip::zclip>(z([&](auto& c) { c.eps = eps; }),
                                     "gradclip::zclip_config: eps must be finite and >= 0");
  expect_rejected<gradclip::zclip>(z([](auto& c) { c.mode = static_cast<gradclip::zclip_mode>(7); }),
                                   "gradclip::zclip_config: mode is not a zclip_mode value");
  expect_rejected<gradclip::zclip>(z([](auto& c) { c.clip_option = static_cast<gradclip::zclip_option>(7); }),
                                   "gradclip::zclip_config: clip_option is not a zclip_option value");
  for (double f : {0.0, nan, infinity})
    expect_rejected<gradclip::zclip>(z([&](auto& c) { c.clip_factor = f; }),
                                     "gradclip::zclip_config: clip_factor must be finite and > 0");
  for (double m : {0.0, -1.0, nan})
    expect_rejected<gradclip::zclip>(z([&](auto& c) { c.max_norm = m; }),
                                     "gradclip::zclip_config: max_norm must be > 0 (+inf: no cap)");

  for (double q : {-0.1, 1.1, nan})
    expect_rejected<gradclip::autoclip>(gradclip::autoclip_config{q, 10},
                                        "gradclip::autoclip_config: quantile must be in [0, 1]");
  expect_rejected<gradclip::autoclip>(gradclip::autoclip_config{0.9, 0},
                                      "gradclip::autoclip_config: history must be >= 1");

  expect_rejected<gradclip::spike_skip>(gradclip::spike_skip_config{1, 6.0, 3, infinity},
                                        "gradclip::spike_skip_config: window must be >= 2");
  for (double sigma : {0.0, -1.0, nan, infinity})
    expect_rejected<gradclip::spike_skip>(gradclip::spike_skip_config{128, sigma, 64, infinity},
                                          "gradclip::spike_skip_config: sigma_factor must be finite and > 0");
  for (std::size_t m : {2u, 130u})
    expect_rejected<gradclip::spike_skip>(gradclip::spike_skip_config{128, 6.0, m, infinity},
                                          "gradclip::spike_skip_config: min_norms must be in [3, window + 1]");
  for (double m : {0.0, nan})
    expect_rejected<gradclip::spike_skip>(gradclip::spike_skip_config{128, 6.0, 64, m},
                                          "gradclip::spike_skip_config: max_norm must be > 0 (+inf: no cap)");
}

}  // namespace
