// The floating-point modes gradclip refuses to be compiled under. Every gradclip header includes this one.
#pragma once

#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__) || defined(__ASSOCIATIVE_MATH__)
#error \
    "gradclip: -ffast-math, -ffinite-math-only and -fassociative-math are not supported. Under them the compiler may assume no NaN or Inf exists (so a non-finite gradient would be clipped as if it were finite) and may reorder the compensated sums (so the documented error bounds would not hold). Compile the translation units that include gradclip without these flags (e.g. add -fno-fast-math after them)."
#endif
