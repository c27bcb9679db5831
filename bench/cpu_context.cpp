// Every benchmark's output names the CPU it ran on (the console header and the JSON context): figures
// from machines that differ in vendor, model and vector width are not comparable.
#include <benchmark/benchmark.h>

#include <fstream>
#include <sstream>
#include <string>

namespace {

// The value of the first /proc/cpuinfo line "key<tabs>: value", or "" (arm64 has no "model name").
std::string cpuinfo_field(const std::string& text, const std::string& key) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || line.compare(0, key.size(), key) != 0) continue;
    if (line.find_first_not_of(" \t", key.size()) != colon) continue;
    const auto value = line.find_first_not_of(' ', colon + 1);
    return value == std::string::npos ? std::string() : line.substr(value);
  }
  return {};
}

// As lscpu names it: the model name, and the family and model numbers that tell generations apart
// where the name does not ("AMD EPYC" is every EPYC a hypervisor hides).
std::string cpu_model(const std::string& cpuinfo) {
  std::string name = cpuinfo_field(cpuinfo, "model name");
  const std::string family = cpuinfo_field(cpuinfo, "cpu family"), model = cpuinfo_field(cpuinfo, "model");
  if (!family.empty() && !model.empty()) name += ", family " + family + " model " + model;
  if (name.empty()) name = "unknown (no model name in /proc/cpuinfo)";
  return name;
}

// The widest x86 vector extension the kernels can dispatch to on this CPU.
std::string cpu_vectors(const std::string& cpuinfo) {
  const std::string flags = " " + cpuinfo_field(cpuinfo, "flags") + " ";
  for (const char* flag : {"avx512f", "avx2", "sse4_2"}) {
    if (flags.find(std::string(" ") + flag + " ") != std::string::npos) return flag;
  }
  return "none of avx512f, avx2, sse4_2";
}

[[maybe_unused]] const bool cpu_context_added = [] {
  std::ifstream file("/proc/cpuinfo");
  std::ostringstream text;
  text << file.rdbuf();
  benchmark::AddCustomContext("cpu_model", cpu_model(text.str()));
  benchmark::AddCustomContext("cpu_vectors", cpu_vectors(text.str()));
  return true;
}();

}  // namespace
