// gradclip: gradient clipping by norm, overflow-safe in every precision, at memory speed.
// This umbrella header includes the whole core; mpi.hpp and torch.hpp are included separately.
#pragma once

#include <gradclip/clip.hpp>
#include <gradclip/grad_view.hpp>
#include <gradclip/norm.hpp>
#include <gradclip/options.hpp>
#include <gradclip/partial_norm.hpp>
#include <gradclip/policies.hpp>
#include <gradclip/version.hpp>
