// Per-group thresholds: several named groups clipped in one call, each by its own global norm.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
#include <gradclip/pipeline.hpp>
#include <gradclip/policies.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {

/// A named group of gradients (any element types) and the threshold of its own global norm. The views
/// do not own the gradients, which must outlive the call and belong to one group only.
struct param_group {
  std::string name;
  std::vector<grad_view> grads;
  double max_norm;
};

/// One group's outcome: the same clip_result clip_by_global_norm would have returned for it.
struct group_clip_result {
  std::string name;
  clip_result result;
};

/// Clips each group by its own threshold: group k is multiplied by c_k = max_norm_k / (||group k|| +
/// epsilon) when c_k < 1, the norm being options::norm. Each result equals what
/// clip_by_global_norm<Policy>(group k, max_norm_k, opt) returns, in the order of `groups`; non-finite
/// groups follow opt.nonfinite one by one (skip leaves that group alone and reports finite = false),
/// except that with on_nonfinite::error the call throws before any group is modified. Direction is kept
/// within each group; between groups the relative scale is set by the ratio of thresholds. Throws
/// std::invalid_argument, naming the group and before anything is read, for a negative or NaN max_norm.
///
///     auto results = gradclip::clip_by_group_norms({{"embeddings", {embedding_grad}, 10.0},
///                                                   {"rest", {w1, b1, w2, b2}, 1.0}});
namespace detail {

/// Each named group one unit.
struct group_units {
  const std::vector<param_group>& groups;

  std::size_t units() const noexcept { return groups.size(); }
  template <class F>
  void for_each_piece(F&& f) const {
    std::size_t k = 0;
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (const grad_view& view : groups[g].grads)
        view.visit([&](const auto& typed) { cut_into_pieces(typed, g, k++, f); });
  }
};

}  // namespace detail

template <class Policy = robust>
std::vector<group_clip_result> clip_by_group_norms(const std::vector<param_group>& groups, const options& opt = {}) {
  constexpr const char* function = "gradclip::clip_by_group_norms";
  const detail::group_units layout{groups};
  std::vector<double> max_norms;
  max_norms.reserve(groups.size());
  for (const auto& group : groups) max_norms.push_back(group.max_norm);
  const auto where = [&](std::size_t g) { return "group \"" + groups[g].name + "\""; };
  const detail::unit_thresholds<decltype(where)> source{max_norms.data(), max_norms.size(), where};
  const auto plans = detail::run_units(
      function, layout, source, opt, [&] { return detail::reduce_units<Policy>(layout, opt); },
      [&](const auto& unit_plans) { detail::apply_units<Policy>(layout, unit_plans, opt); });
  std::vector<group_clip_result> results;
  results.reserve(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) results.push_back({groups[g].name, plans[g].result});
  return results;
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
