// libFuzzer target: every input goes through the checks in fuzz_checks.hpp; a mismatch throws, which
// terminates the process and makes libFuzzer save the input. See scripts/fuzz.sh.
#include "fuzz_checks.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gradclip_fuzz::check_input(data, size);
  return 0;
}
