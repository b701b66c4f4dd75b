// Quoting what a client sent inside an error message, bounded: a message that quoted a 4 MB
// model name whole was 4 MB (and the edge's cut, common/status_convert.h, would then drop what
// the message says after the quote).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dgserve {

// The length of the longest prefix of `s` of at most `max_bytes` bytes that does not end inside
// a UTF-8 character (for valid UTF-8 `s`).
inline size_t Utf8PrefixWithin(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s.size();
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<uint8_t>(s[cut]) & 0xC0) == 0x80) --cut;
  return cut;
}

// `s` in double quotes when it has at most `max_bytes` bytes; else its first `max_bytes` bytes
// (cut back to a UTF-8 character boundary), "…" and its size: "\"abc…\" (4000000 bytes)".
// (Built by appends: GCC 12 warned -Wrestrict at -O2 inside the "\"" + std::string(...)
// concatenations it inlined, a known false positive of its string operator+.)
inline std::string QuotedExcerpt(std::string_view s, size_t max_bytes = 64) {
  std::string out;
  if (s.size() <= max_bytes) {
    out.reserve(s.size() + 2);
    out += '"';
    out.append(s);
    out += '"';
    return out;
  }
  const size_t cut = Utf8PrefixWithin(s, max_bytes);
  out.reserve(cut + 32);
  out += '"';
  out.append(s.substr(0, cut));
  out += "…\" (";
  out += std::to_string(s.size());
  out += " bytes)";
  return out;
}

}  // namespace dgserve
