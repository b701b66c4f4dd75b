// Quoting what a client sent inside an error message, bounded: a message that quoted a 4 MB
// model name whole was 4 MB (and the edge's cut, common/status_convert.h, would then drop what
// the message says after the quote); and escaped, so that its bytes cannot reach a terminal raw.
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

// Whether the valid UTF-8 character `ch` changes how the text around it is shown without showing
// itself: the bidirectional controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069,
// which can make a line read in another order, CVE-2021-42574), the line and paragraph
// separators (U+2028, U+2029) and the byte order mark (U+FEFF).
inline bool IsInvisibleReordering(std::string_view ch) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(ch[k]); };
  if (ch.size() == 2) return b(0) == 0xD8 && b(1) == 0x9C;  // U+061C
  if (ch.size() != 3) return false;
  if (b(0) == 0xEF) return b(1) == 0xBB && b(2) == 0xBF;  // U+FEFF
  if (b(0) != 0xE2) return false;
  if (b(1) == 0x80) {
    return b(2) == 0x8E || b(2) == 0x8F || (b(2) >= 0xA8 && b(2) <= 0xA9) ||
           (b(2) >= 0xAA && b(2) <= 0xAE);
  }
  return b(1) == 0x81 && b(2) >= 0xA6 && b(2) <= 0xA9;  // U+2066-U+2069
}

// `s` safe to print on a terminal inside an error message: printable ASCII and valid UTF-8
// characters other than controls kept as they are; every other byte (an invalid or truncated
// UTF-8 sequence, an overlong or surrogate encoding, a C0 or C1 control such as ESC, DEL, a
// bidirectional control or separator: IsInvisibleReordering) written
// as "\xNN" (lower-case hex), one escape per byte: "a\xffb" for the bytes 'a' 0xFF 'b'. A
// backslash is kept, so the result is for reading, not for decoding back.
inline std::string EscapedForTerminal(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    size_t len = 0;  // the length of a valid, non-control character at i; 0: escape s[i]
    if (c >= 0x20 && c < 0x7F) {
      len = 1;
    } else if (c >= 0xC2 && c <= 0xF4) {
      const size_t n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      // The second byte's range excludes overlongs (E0, F0), surrogates (ED) and code points
      // above U+10FFFF (F4); the others are 0x80-0xBF.
      const uint8_t lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
      const uint8_t hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
      bool ok = i + n <= s.size();
      for (size_t k = 1; ok && k < n; ++k) {
        const uint8_t b = static_cast<uint8_t>(s[i + k]);
        ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      }
      // U+0080-U+009F (C2 80 to C2 9F) are the C1 controls (0x9B is a terminal's CSI).
      if (ok && !(c == 0xC2 && static_cast<uint8_t>(s[i + 1]) <= 0x9F)) len = n;
      if (len > 0 && IsInvisibleReordering(s.substr(i, len))) len = 0;
    }
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
      ++i;
    }
  }
  return out;
}

}  // namespace dgserve
