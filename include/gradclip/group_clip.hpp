// Per-group thresholds: several named groups clipped in one call, each by its own global norm.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/pipeline.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/options.hpp>
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
template <class Policy = robust>
std::vector<group_clip_result> clip_by_group_norms(const std::vector<param_group>& groups, const options& opt = {}) {
  const auto where = [](const param_group& group) {
    return "gradclip::clip_by_group_norms: group \"" + group.name + "\"";
  };
  for (const auto& group : groups) detail::check_clip_arguments(where(group).c_str(), group.max_norm, opt);
  // Every norm and decision first: with on_nonfinite::error nothing is modified when one group throws.
  std::vector<detail::clip_plan> plans;
  plans.reserve(groups.size());
  for (const auto& group : groups)
    plans.push_back(
        detail::plan_clip(where(group).c_str(), detail::reduce<Policy>(group.grads, opt), group.max_norm, opt));
  std::vector<group_clip_result> results;
  results.reserve(groups.size());
  for (std::size_t i = 0; i < groups.size(); ++i) {
    if (plans[i].result.clipped) detail::apply<Policy>(groups[i].grads, plans[i].coefficient, opt);
    results.push_back({groups[i].name, plans[i].result});
  }
  return results;
}

}  // namespace GRADCLIP_ABI
}  // namespace gradclip
