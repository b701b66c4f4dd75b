#include "engine/tokenizer/utf8.h"

#include <cstdint>

namespace dgserve::tokenizer_internal {
namespace {

// Expected total length of a sequence starting with `lead`, 0 for an invalid lead byte.
int SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Valid range of the second byte given the lead byte (excludes overlongs, surrogates and
// code points above U+10FFFF).
bool SecondByteOk(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return b >= 0x80 && b <= 0xBF;
  }
}

bool IsContinuation(uint8_t b) { return (b & 0xC0) == 0x80; }

}  // namespace

size_t DecodeUtf8(std::string_view s, size_t pos, char32_t* cp) {
  if (pos >= s.size()) return 0;
  const uint8_t lead = static_cast<uint8_t>(s[pos]);
  const int len = SequenceLength(lead);
  if (len == 0 || pos + len > s.size()) return 0;
  if (len == 1) {
    *cp = lead;
    return 1;
  }
  if (!SecondByteOk(lead, static_cast<uint8_t>(s[pos + 1]))) return 0;
  char32_t value = lead & (0xFF >> (len + 1));
  for (int i = 1; i < len; ++i) {
    const uint8_t b = static_cast<uint8_t>(s[pos + i]);
    if (!IsContinuation(b)) return 0;
    value = (value << 6) | (b & 0x3F);
  }
  *cp = value;
  return static_cast<size_t>(len);
}

size_t Utf8CharLength(std::string_view s, size_t pos) {
  char32_t cp;
  const size_t len = DecodeUtf8(s, pos, &cp);
  return len == 0 ? 1 : len;
}

size_t ValidUtf8PrefixLength(std::string_view s) {
  size_t pos = 0;
  char32_t cp;
  while (pos < s.size()) {
    // ASCII fast path.
    if (static_cast<uint8_t>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const size_t len = DecodeUtf8(s, pos, &cp);
    if (len == 0) break;
    pos += len;
  }
  return pos;
}

bool IsValidUtf8(std::string_view s) { return ValidUtf8PrefixLength(s) == s.size(); }

bool IsIncompleteUtf8Char(std::string_view s) {
  if (s.empty()) return false;
  const uint8_t lead = static_cast<uint8_t>(s[0]);
  const size_t len = static_cast<size_t>(SequenceLength(lead));
  if (len < 2 || s.size() >= len) return false;
  if (s.size() >= 2 && !SecondByteOk(lead, static_cast<uint8_t>(s[1]))) return false;
  for (size_t i = 2; i < s.size(); ++i) {
    if (!IsContinuation(static_cast<uint8_t>(s[i]))) return false;
  }
  return true;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsUnicodeWhitespace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool IsPythonWhitespace(char32_t cp) {
  return IsUnicodeWhitespace(cp) || (cp >= 0x1C && cp <= 0x1F);
}

bool IsWordChar(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  return !IsUnicodeWhitespace(cp);
}

std::string_view TrimPythonWhitespace(std::string_view s) {
  size_t begin = 0;
  char32_t cp;
  while (begin < s.size()) {
    const size_t len = DecodeUtf8(s, begin, &cp);
    if (len == 0 || !IsPythonWhitespace(cp)) break;
    begin += len;
  }
  size_t end = s.size();
  while (end > begin) {
    // Step back to the start of the last character.
    size_t start = end - 1;
    while (start > begin && IsContinuation(static_cast<uint8_t>(s[start]))) --start;
    const size_t len = DecodeUtf8(s, start, &cp);
    if (len != end - start || !IsPythonWhitespace(cp)) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

}  // namespace dgserve::tokenizer_internal
