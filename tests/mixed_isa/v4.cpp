// The other unit of the mixed-ISA program, built with -march=x86-64-v4 (AVX-512): the same gradclip
// calls, so the same templates and inline functions, compiled for AVX-512. Nothing calls it.
#include "workload.hpp"

void mixed_isa_v4(std::FILE* out) { workload(out); }
