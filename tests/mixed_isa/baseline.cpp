// The baseline unit of the mixed-ISA program (built without -m flags), and its main: it calls only this
// unit's functions, so any AVX-512 instruction it runs came from the other unit's copy of shared code.
#include "workload.hpp"

void mixed_isa_baseline(std::FILE* out) { workload(out); }

int main() { mixed_isa_baseline(stdout); }
