// Per-group thresholds: several named groups clipped in one call, each by its own global norm.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/p_norm.hpp>
#include <gradclip/policies.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace gradclip {

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

namespace detail {

/// norm_of(grads) -> partial_norm for each group; Policy's write kernel applies the coefficients.
template <class Policy, class NormOf>
std::vector<group_clip_result> clip_groups(const std::vector<param_group>& groups, const options& opt,
                                           const NormOf& norm_of) {
  const auto where = [](const param_group& group) {
    return "gradclip::clip_by_group_norms: group \"" + group.name + "\"";
  };
  for (const auto& group : groups) check_clip_arguments(where(group).c_str(), group.max_norm, opt);
  // Every norm and decision first: with on_nonfinite::error nothing is modified when one group throws.
  std::vector<clip_plan> plans;
  plans.reserve(groups.size());
  for (const auto& group : groups)
    plans.push_back(plan_clip(where(group).c_str(), norm_of(group.grads), group.max_norm, opt));
  std::vector<group_clip_result> results;
  results.reserve(groups.size());
  for (std::size_t i = 0; i < groups.size(); ++i) {
    if (plans[i].result.clipped)
      for (const auto& g : groups[i].grads)
        visit_gradient(g, [&](const auto& view) { apply_coefficient<Policy>(view, plans[i].coefficient); });
    results.push_back({groups[i].name, plans[i].result});
  }
  return results;
}

}  // namespace detail

/// Clips each group by its own threshold: group k is multiplied by max_norm_k / (||group k|| + epsilon)
/// when its global L2 norm exceeds max_norm_k. Each result equals what clip_by_global_norm<Policy>(group
/// k, max_norm_k, opt) returns, in the order of `groups`; non-finite groups follow opt.nonfinite one by
/// one (skip leaves that group alone and reports finite = false), except that with on_nonfinite::error
/// the call throws before any group is modified. Direction is kept within each group; between groups the
/// relative scale is set by the ratio of thresholds. Throws std::invalid_argument, naming the group and
/// before anything is read, for a negative or NaN max_norm.
///
///     auto results = gradclip::clip_by_group_norms({{"embeddings", {embedding_grad}, 10.0},
///                                                   {"rest", {w1, b1, w2, b2}, 1.0}});
template <class Policy = robust>
std::vector<group_clip_result> clip_by_group_norms(const std::vector<param_group>& groups, options opt = {}) {
  return detail::clip_groups<Policy>(
      groups, opt, [](const std::vector<grad_view>& grads) { return detail::partial_norm_of_group<Policy>(grads); });
}

/// The same with each group's global p-norm (for inf_norm its largest magnitude); see p_norm.hpp.
/// Throws std::invalid_argument for p <= 0 or NaN.
inline std::vector<group_clip_result> clip_by_group_norms(const std::vector<param_group>& groups, norm_type type,
                                                          options opt = {}) {
  detail::check_norm_type("gradclip::clip_by_group_norms", type);
  return detail::clip_groups<robust>(
      groups, opt, [&](const std::vector<grad_view>& grads) { return detail::p_norm_of_group(grads, type.p()); });
}

}  // namespace gradclip
