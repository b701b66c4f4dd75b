// Small UTF-8 helpers shared by the tokenizer components (strict RFC 3629 validation: no
// overlongs, no surrogates, nothing above U+10FFFF).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dgserve::tokenizer_internal {

// U+FFFD REPLACEMENT CHARACTER, UTF-8 encoded.
inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// Decodes the character at `pos`. Returns its byte length (1–4) and stores the code point in
// `*cp`; for an invalid or truncated sequence returns 0 (and leaves `*cp` unspecified).
size_t DecodeUtf8(std::string_view s, size_t pos, char32_t* cp);

// Byte length of the character at `pos`: the sequence length when valid, else 1 (an invalid
// byte is treated as a one-byte unit, so iteration always advances).
size_t Utf8CharLength(std::string_view s, size_t pos);

// True when `s` is entirely valid UTF-8.
bool IsValidUtf8(std::string_view s);

// Length of the longest prefix of `s` made only of complete, valid characters.
size_t ValidUtf8PrefixLength(std::string_view s);

// True when `s` (1–3 bytes) is a proper prefix of some valid multi-byte character, i.e. more
// bytes could still complete it.
bool IsIncompleteUtf8Char(std::string_view s);

// Appends the UTF-8 encoding of `cp` to `out`.
void AppendUtf8(char32_t cp, std::string* out);

// The Unicode White_Space property (what Rust's char::is_whitespace tests).
bool IsUnicodeWhitespace(char32_t cp);

// Whitespace as Python's str.strip() (and so Jinja's `trim`) sees it: White_Space plus the
// information separators U+001C–U+001F.
bool IsPythonWhitespace(char32_t cp);

// A "word" character for single_word added tokens: ASCII letters, digits and '_', and any
// non-ASCII character that is not whitespace (an approximation of Unicode alphanumerics).
bool IsWordChar(char32_t cp);

// `s` without leading and trailing Python whitespace (Jinja's `trim`).
std::string_view TrimPythonWhitespace(std::string_view s);

}  // namespace dgserve::tokenizer_internal
