// Exact text round trips for checkpointed state: doubles as their bit patterns (so NaN, infinities,
// -0 and every last bit come back), sizes as decimals, and a leading tag that names the type.
#pragma once

#include <gradclip/detail/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ios>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// Writes x as "0x" and the 16 hex digits of its IEEE-754 bit pattern; the stream's flags are kept.
inline void write_exact(std::ostream& out, double x) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const std::ios_base::fmtflags flags = out.flags();
  const char fill = out.fill();
  out << " 0x" << std::hex << std::noshowbase << std::nouppercase;
  out.width(16);
  out.fill('0');
  out << bits;
  out.flags(flags);
  out.fill(fill);
}

inline void write_exact(std::ostream& out, std::size_t n) {
  const std::ios_base::fmtflags flags = out.flags();
  out << ' ' << std::dec << n;
  out.flags(flags);
}

inline void write_exact(std::ostream& out, int n) {
  const std::ios_base::fmtflags flags = out.flags();
  out << ' ' << std::dec << std::noshowpos << n;
  out.flags(flags);
}

inline void write_exact(std::ostream& out, bool b) { write_exact(out, static_cast<std::size_t>(b ? 1 : 0)); }

inline void write_exact(std::ostream& out, const std::vector<double>& values) {
  write_exact(out, values.size());
  for (double x : values) write_exact(out, x);
}

/// Reads what write_exact wrote; on malformed input sets failbit and leaves x unspecified.
inline bool read_exact(std::istream& in, double& x) {
  std::string token;
  if (!(in >> token)) return false;
  std::uint64_t bits = 0;
  bool valid = token.size() == 18 && token[0] == '0' && token[1] == 'x';
  for (std::size_t i = 2; valid && i < token.size(); ++i) {
    const char c = token[i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    valid = digit >= 0;
    bits = (bits << 4) | static_cast<std::uint64_t>(digit);
  }
  if (!valid) {
    in.setstate(std::ios_base::failbit);
    return false;
  }
  std::memcpy(&x, &bits, sizeof x);
  return true;
}

inline bool read_exact(std::istream& in, std::size_t& n) {
  const std::ios_base::fmtflags flags = in.flags();
  in >> std::dec >> n;
  in.flags(flags);
  return static_cast<bool>(in);
}

inline bool read_exact(std::istream& in, int& n) {
  const std::ios_base::fmtflags flags = in.flags();
  in >> std::dec >> n;
  in.flags(flags);
  return static_cast<bool>(in);
}

inline bool read_exact(std::istream& in, bool& b) {
  std::size_t n = 0;
  if (!read_exact(in, n)) return false;
  if (n > 1) in.setstate(std::ios_base::failbit);
  b = n == 1;
  return static_cast<bool>(in);
}

/// Reads a vector written by write_exact, refusing more than `max_size` elements.
inline bool read_exact(std::istream& in, std::vector<double>& values, std::size_t max_size) {
  std::size_t n = 0;
  if (!read_exact(in, n)) return false;
  if (n > max_size) {
    in.setstate(std::ios_base::failbit);
    return false;
  }
  values.assign(n, 0.0);
  for (double& x : values)
    if (!read_exact(in, x)) return false;
  return true;
}

/// The first word of a saved state: which type wrote it, so that loading another type's state fails.
inline void write_tag(std::ostream& out, const char* tag) { out << tag; }

inline bool read_tag(std::istream& in, const char* tag) {
  std::string word;
  if (!(in >> word)) return false;
  if (word != tag) in.setstate(std::ios_base::failbit);
  return static_cast<bool>(in);
}

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
