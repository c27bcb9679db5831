// adagc.hpp: AdaGC against a long double transcription of its rule step by step, the warm-up against
// clip_by_global_norm, checkpoints, the tensor count, non-finite steps, the reduction hook and threads.
#include <gradclip/adagc.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/norm.hpp>

#include "element_types.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace gradclip_test;
using gradclip::on_nonfinite;

/// AdaGC as the issue and the paper state it, in long double: h for every tensor from the norms.
struct reference_adagc {
  long double lambda_rel, beta, lambda_abs;
  std::size_t warmup;
  std::size_t t = 0;
  std::vector<long double> gamma;

  std::vector<long double> step(const std::vector<long double>& norms) {
    ++t;
    gamma.resize(norms.size());
    std::vector<long double> h(norms.size(), 1);
    if (t <= warmup) {
      long double squares = 0;
      for (long double n : norms) squares += n * n;
      const long double global = std::sqrt(squares);
      const long double common = global == 0 ? 1 : std::min<long double>(1, lambda_abs / global);
      for (std::size_t i = 0; i < norms.size(); ++i) {
        h[i] = common;
        const long double hat = common * norms[i];
        gamma[i] = t == 1 ? hat : std::min(gamma[i], hat);
      }
    } else {
      for (std::size_t i = 0; i < norms.size(); ++i) {
        h[i] = norms[i] == 0 ? 1 : std::min<long double>(1, lambda_rel * gamma[i] / norms[i]);
        gamma[i] = beta * gamma[i] + (1 - beta) * h[i] * norms[i];
      }
    }
    return h;
  }
};

template <class T>
long double norm_of(const std::vector<T>& g) {
  long double sum = 0;
  for (const T x : g) sum += static_cast<long double>(static_cast<double>(x)) * static_cast<double>(x);
  return std::sqrt(sum);
}

// One step's gradients: tensor i at scale[i], a spike (x30) on 3 % of the tensors' steps.
std::vector<std::vector<float>> make_step(std::mt19937_64& rng, const std::vector<std::size_t>& sizes,
                                          std::size_t step) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<std::vector<float>> grads;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const double scale = (0.05 + 0.02 * static_cast<double>(i)) *
                         (1 + 0.5 * std::sin(static_cast<double>(step) / 40.0)) * (uniform(rng) < 0.03 ? 30.0 : 1.0);
    grads.emplace_back(sizes[i]);
    for (auto& x : grads.back()) x = static_cast<float>(normal(rng) * scale);
  }
  return grads;
}

TEST(Adagc, MatchesTheReferenceStepByStep) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::size_t> sizes{300, 40, 1000, 7};
  gradclip::adagc_config config;
  config.warmup_steps = 30;
  gradclip::adagc controller(config);
  reference_adagc reference{1.05L, 0.98L, 1.0L, 30, 0, {}};
  std::mt19937_64 rng(seed + 400);
  std::size_t clipped_steps = 0, per_tensor_clips = 0;
  for (std::size_t step = 1; step <= 600; ++step) {
    auto grads = make_step(rng, sizes, step);
    if (step == 200 || step == 201) std::fill(grads[3].begin(), grads[3].end(), 0.0f);  // a zero norm: h = 1
    const auto original = grads;
    std::vector<long double> norms;
    for (const auto& g : grads) norms.push_back(norm_of(g));
    // The ratio threshold / norm that h = min(1, ratio) takes, from the reference's state before the step.
    long double squares = 0;
    for (long double x : norms) squares += x * x;
    std::vector<long double> ratio(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i)
      ratio[i] = step <= 30 ? 1 / std::sqrt(squares)
                            : (norms[i] == 0 ? INFINITY : reference.lambda_rel * reference.gamma[i] / norms[i]);
    const std::vector<double> gamma_before = controller.gamma();
    const std::vector<long double> h = reference.step(norms);
    const auto results = gradclip::clip_per_tensor(grads, controller);
    ASSERT_EQ(results.size(), sizes.size());
    bool any = false;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto& r = results[i];
      SCOPED_TRACE("step " + std::to_string(step) + " tensor " + std::to_string(i));
      EXPECT_TRUE(r.finite);
      EXPECT_LE(relative_error(r.norm, static_cast<quad>(norms[i])), 1e-14);
      EXPECT_EQ(r.threshold, step <= 30 ? 1.0 : 1.05 * gamma_before[i]);
      // Coefficients within the roundings of the EMA over the run (about 1e-15); decisions away from 1.
      if (ratio[i] < 1 - 1e-12L) {
        ASSERT_TRUE(r.clipped);
        EXPECT_LE(relative_error(r.coefficient, static_cast<quad>(h[i])), 1e-12);
        for (std::size_t k = 0; k < grads[i].size(); ++k)
          ASSERT_LE(ulps(grads[i][k], to_quad(original[i][k]) * static_cast<quad>(h[i])), 1.0) << k;
        any = true;
        per_tensor_clips += step > 30;
      } else if (ratio[i] > 1 + 1e-12L) {
        EXPECT_FALSE(r.clipped);
        EXPECT_EQ(r.coefficient, 1.0);
        EXPECT_TRUE(same_bits(grads[i], original[i]));
      }
      EXPECT_LE(relative_error(controller.gamma()[i], static_cast<quad>(reference.gamma[i])), 1e-12);
    }
    clipped_steps += any;
    EXPECT_EQ(controller.steps(), step);
  }
  // The stream exercises both regimes: the warm-up clips by the global norm, later spikes per tensor.
  EXPECT_GT(clipped_steps, 40u);
  EXPECT_GT(per_tensor_clips, 60u);
}

TEST(Adagc, ThresholdsAreTheGlobalOneDuringWarmupThenPerTensor) {
  gradclip::adagc_config config;
  config.warmup_steps = 3;
  config.lambda_abs = 0.5;
  gradclip::adagc controller(config);
  std::mt19937_64 rng(seed + 401);
  for (std::size_t step = 1; step <= 6; ++step) {
    EXPECT_EQ(controller.warming_up(), step <= 3);
    auto grads = make_step(rng, {50, 60}, step);
    const std::vector<double> gamma_before = controller.gamma();
    const auto results = gradclip::clip_per_tensor(grads, controller);
    for (std::size_t i = 0; i < 2; ++i)
      EXPECT_EQ(results[i].threshold, step <= 3 ? 0.5 : 1.05 * gamma_before[i]) << step;
  }
}

TEST(Adagc, WarmupStepsAreClipByGlobalNormBitForBit) {
  std::mt19937_64 rng(seed + 402);
  for (unsigned threads : {1u, 3u}) {
    gradclip::options opt;
    opt.threads = threads;
    gradclip::adagc controller;
    for (std::size_t step = 1; step <= 6; ++step) {
      auto grads = make_step(rng, {(std::size_t{1} << 20) + 5, 3000, std::size_t{3} << 19, 1}, step);
      for (auto& g : grads)
        for (auto& x : g) x *= 10;  // global norms of ~100: every warm-up step clips
      auto copy = grads;
      const auto expected = gradclip::clip_by_global_norm(copy, 1.0, opt);
      const auto results = gradclip::clip_per_tensor(grads, controller, opt);
      ASSERT_TRUE(expected.clipped);
      for (std::size_t i = 0; i < grads.size(); ++i) {
        EXPECT_EQ(results[i].coefficient, expected.coefficient);
        EXPECT_EQ(results[i].threshold, 1.0);
        EXPECT_TRUE(same_bits(grads[i], copy[i])) << "threads " << threads << " tensor " << i;
      }
    }
  }
}

TEST(Adagc, MixedElementTypesThroughGradViews) {
  std::mt19937_64 rng(seed + 403);
  gradclip::adagc_config config;
  config.warmup_steps = 5;
  gradclip::adagc controller(config);
  reference_adagc reference{1.05L, 0.98L, 1.0L, 5, 0, {}};
  for (std::size_t step = 1; step <= 60; ++step) {
    auto a = random_gradient<Eigen::half>(700, rng, step % 17 == 0 ? 5.0 : 0.05);  // FP16 norms up to ~130
    auto b = random_gradient<Eigen::bfloat16>(90, rng, 0.1);
    auto c = random_gradient<double>(33, rng, step % 13 == 0 ? 8.0 : 0.2);
    const std::vector<long double> norms{norm_of(a), norm_of(b), norm_of(c)};
    const auto h = reference.step(norms);
    std::vector<gradclip::grad_view> group{a, b, c};
    const auto results = gradclip::clip_per_tensor(group, controller);
    // The 16-bit norms are robust's, within 16 * 2^-24 (policies.hpp), and the warm-up's global norm holds
    // them: gamma, an average of such norms, carries that error, and a coefficient, threshold / norm, twice it.
    const double bound[3] = {robust_norm_bound<Eigen::half>(), robust_norm_bound<Eigen::half>(),
                             robust_norm_bound<Eigen::half>()};
    for (std::size_t i = 0; i < 3; ++i) {
      if (h[i] < 1 - 1e-12L) {
        EXPECT_LE(relative_error(results[i].coefficient, static_cast<quad>(h[i])), 2 * bound[i]) << step << " " << i;
      }
      EXPECT_LE(relative_error(controller.gamma()[i], static_cast<quad>(reference.gamma[i])), bound[i]);
    }
  }
  std::vector<float> w(3, 1.0f), bias(2, 1.0f);
  gradclip::adagc fresh;
  EXPECT_EQ(gradclip::clip_per_tensor({w, bias}, fresh).size(), 2u);
}

TEST(Adagc, TheTensorCountIsFixedByTheFirstCall) {
  gradclip::adagc controller;
  std::vector<std::vector<float>> empty;
  EXPECT_TRUE(gradclip::clip_per_tensor(empty, controller).empty());
  EXPECT_EQ(controller.tensors(), 0u);  // an empty group fixes nothing
  std::vector<std::vector<float>> two{{1.0f, 2.0f}, {3.0f}};
  (void)gradclip::clip_per_tensor(two, controller);
  EXPECT_EQ(controller.tensors(), 2u);
  const gradclip::adagc before = controller;
  std::vector<std::vector<float>> three{{10.0f}, {20.0f}, {30.0f}};
  const auto original = three;
  try {
    (void)gradclip::clip_per_tensor(three, controller);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("gradclip::clip_per_tensor: adagc tracks 2 tensors", 0), 0u) << e.what();
  }
  EXPECT_EQ(three, original);
  EXPECT_TRUE(controller == before);
  EXPECT_THROW((void)gradclip::clip_per_tensor(empty, controller), std::invalid_argument);
}

TEST(Adagc, CheckpointsRoundTripExactlyAndDecideAsTheOriginal) {
  std::mt19937_64 rng(seed + 404);
  gradclip::adagc_config config;
  config.warmup_steps = 10;
  for (std::size_t checkpoint_at : {4u, 25u}) {
    gradclip::adagc original(config);
    for (std::size_t step = 1; step <= checkpoint_at; ++step) {
      auto grads = make_step(rng, {100, 20}, step);
      (void)gradclip::clip_per_tensor(grads, original);
    }
    std::stringstream saved;
    saved << original;
    gradclip::adagc_config other;
    other.beta = 0.5;
    gradclip::adagc restored(other);
    saved >> restored;
    ASSERT_TRUE(saved);
    EXPECT_TRUE(restored == original);
    for (std::size_t step = checkpoint_at + 1; step <= checkpoint_at + 40; ++step) {
      auto a = make_step(rng, {100, 20}, step);
      auto b = a;
      const auto ra = gradclip::clip_per_tensor(a, original);
      const auto rb = gradclip::clip_per_tensor(b, restored);
      for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(ra[i].coefficient, rb[i].coefficient);
      EXPECT_EQ(a, b);
    }
    EXPECT_TRUE(restored == original);
  }
  // Malformed or invalid states set failbit and leave the target unchanged.
  gradclip::adagc target;
  std::vector<std::vector<float>> g{{5.0f, 5.0f}};
  (void)gradclip::clip_per_tensor(g, target);
  const gradclip::adagc before = target;
  for (const std::string text :
       {"gradclip::zclip 0x0", "gradclip::adagc 0x3ff0cccccccccccd", "gradclip::adagc nonsense",
        "gradclip::adagc 0x3ff0cccccccccccd 0x3ff0000000000000 100 0x3ff0000000000000 0 0",  // beta = 1
        "gradclip::adagc 0x3ff0cccccccccccd 0x3fef5c28f5c28f5c 100 0x3ff0000000000000 1 1 0xbff0000000000000",
        "gradclip::adagc 0x3ff0cccccccccccd 0x3fef5c28f5c28f5c 0 0x3ff0000000000000 0 0",       // no warm-up
        "gradclip::adagc 0x3ff0cccccccccccd 0x3fef5c28f5c28f5c 100 0x3ff0000000000000 3 0"}) {  // steps, no tensors
    std::istringstream in(text);
    in >> target;
    EXPECT_TRUE(in.fail()) << text;
    EXPECT_TRUE(target == before) << text;
  }
}

TEST(Adagc, NonFiniteStepsLeaveTheControllerUnchanged) {
  for (std::size_t warmup : {100u, 2u}) {  // a warm-up step, then a per-tensor step
    gradclip::adagc_config config;
    config.warmup_steps = warmup;
    gradclip::adagc controller(config);
    std::mt19937_64 rng(seed + 405);
    for (std::size_t step = 1; step <= 3; ++step) {
      auto grads = make_step(rng, {40, 30}, step);
      (void)gradclip::clip_per_tensor(grads, controller);
    }
    const gradclip::adagc before = controller;
    auto grads = make_step(rng, {40, 30}, 4);
    for (auto& x : grads[0]) x *= 1000;  // tensor 0 clips, if the step counts
    grads[1][7] = std::numeric_limits<float>::quiet_NaN();
    const auto original = grads;
    const auto skipped = gradclip::clip_per_tensor(grads, controller);
    EXPECT_TRUE(skipped[0].finite);
    EXPECT_FALSE(skipped[1].finite);
    EXPECT_FALSE(skipped[0].clipped);
    EXPECT_TRUE(same_bits(grads[0], original[0]));
    EXPECT_TRUE(controller == before);
    EXPECT_THROW((void)gradclip::clip_per_tensor(grads, controller, {on_nonfinite::error}), gradclip::nonfinite_error);
    EXPECT_TRUE(same_bits(grads[0], original[0]));
    EXPECT_TRUE(controller == before);
    const auto propagated = gradclip::clip_per_tensor(grads, controller, {on_nonfinite::propagate});
    EXPECT_TRUE(controller == before);
    EXPECT_TRUE(std::isnan(propagated[1].coefficient));
    if (warmup == 100) {  // the global coefficient, NaN, for every tensor
      EXPECT_TRUE(std::isnan(propagated[0].coefficient));
    } else {  // tensor 0 by its own threshold
      EXPECT_TRUE(propagated[0].clipped);
      EXPECT_EQ(propagated[0].threshold, before.threshold(0));
      EXPECT_TRUE(std::isfinite(static_cast<double>(grads[0][0])));
    }
  }
}

TEST(Adagc, TheReductionHookRunsOnWarmupStepsOnly) {
  gradclip::adagc_config config;
  config.warmup_steps = 4;
  gradclip::adagc controller(config), local(config);
  std::mt19937_64 rng(seed + 406);
  std::size_t calls = 0;
  // As if a second rank held the same tensors: the reduced sum of squares is twice the local one.
  const auto twice = [&](const gradclip::partial_norm& part) {
    ++calls;
    gradclip::partial_norm total = part;
    total.merge(part);
    return total;
  };
  for (std::size_t step = 1; step <= 10; ++step) {
    auto grads = make_step(rng, {64, 64}, step);
    for (auto& g : grads)
      for (auto& x : g) x *= 5;
    auto copy = grads;
    const double global = gradclip::global_norm(grads);
    const auto results = gradclip::clip_per_tensor(grads, controller, twice);
    (void)gradclip::clip_per_tensor(copy, local);
    EXPECT_EQ(calls, std::min<std::size_t>(step, 4));
    if (step <= 4) {
      EXPECT_LE(relative_error(results[0].coefficient, 1 / (quad_sqrt(2) * static_cast<quad>(global))), 1e-14);
    }
  }
  const auto wrong_order = [](const gradclip::partial_norm&) { return gradclip::partial_norm{0, 1.0, true, 1.0}; };
  gradclip::adagc fresh;
  std::vector<std::vector<float>> g{{1.0f}};
  EXPECT_THROW((void)gradclip::clip_per_tensor(g, fresh, wrong_order), std::invalid_argument);
}

TEST(Adagc, BadConfigurationsThrowNamingTheField) {
  const auto expect_field = [](gradclip::adagc_config c, const std::string& field) {
    try {
      gradclip::adagc controller(c);
      ADD_FAILURE() << field;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("gradclip::adagc_config: " + field, 0), 0u) << e.what();
    }
  };
  gradclip::adagc_config c;
  c.lambda_rel = 0;
  expect_field(c, "lambda_rel");
  c.lambda_rel = std::numeric_limits<double>::infinity();
  expect_field(c, "lambda_rel");
  c = {};
  c.beta = 1;
  expect_field(c, "beta");
  c.beta = -0.1;
  expect_field(c, "beta");
  c = {};
  c.warmup_steps = 0;
  expect_field(c, "warmup_steps");
  c = {};
  c.lambda_abs = std::nan("");
  expect_field(c, "lambda_abs");
  c.lambda_abs = std::numeric_limits<double>::infinity();  // allowed: no warm-up clipping
  EXPECT_NO_THROW(gradclip::adagc{c});
}

}  // namespace
