// The instruction-set dispatcher a front-end calls kernels through, best_isa(), column_dot_isa() and
// with_isa(isa, f): simd.hpp's, whose kernels compile into the unit (header-only), or compiled.hpp's, whose
// kernels are the library's (compiled mode, GRADCLIP_COMPILED).
#pragma once

#include <gradclip/detail/config.hpp>
#if defined(GRADCLIP_COMPILED)
#include <gradclip/detail/compiled.hpp>
#else
#include <gradclip/detail/simd.hpp>
#endif
