// gradclip: gradient clipping by norm, overflow-safe in every precision, at memory speed.
// This umbrella header includes the whole core; mpi.hpp and torch.hpp are included separately.
#pragma once

// IWYU pragma: begin_exports
#include <gradclip/adagc.hpp>
#include <gradclip/adaptive_bound.hpp>
#include <gradclip/adaptive_clip.hpp>
#include <gradclip/autoclip.hpp>
#include <gradclip/clip.hpp>
#include <gradclip/clip_stats.hpp>
#include <gradclip/controller.hpp>
#include <gradclip/ghost_norm.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/group_clip.hpp>
#include <gradclip/loss_scaler.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/per_example.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/spike_skip.hpp>
#include <gradclip/update_clip.hpp>
#include <gradclip/version.hpp>
#include <gradclip/zclip.hpp>
// IWYU pragma: end_exports
