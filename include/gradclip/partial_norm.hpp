// partial_norm: a mergeable piece of a norm, kept as a power-of-two scale and a scaled sum (or maximum),
// so that no merge overflows or underflows; threads and ranks each compute one and merge them. The type is
// defined beside the kernels that produce it (detail/partial_norm.hpp, which documents it); this is the
// header to include.
#pragma once

#include <gradclip/detail/config.hpp>
#include <gradclip/detail/partial_norm.hpp>  // IWYU pragma: export
