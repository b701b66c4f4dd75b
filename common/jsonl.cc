// JSONL files read line by line (see jsonl.h).
#include "common/jsonl.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/excerpt.h"

namespace dgserve {
namespace {

// nlohmann's message for `text`, which does not parse, without its "[json.exception...] " tag:
// e.g. "parse error at line 1, column 2: syntax error while parsing value - invalid literal;
// last read: 'no'" (line and column within `text`).
std::string ParseError(const std::string& text) {
  try {
    const nlohmann::json parsed = nlohmann::json::parse(text);  // throws: `text` does not parse
    (void)parsed;
  } catch (const nlohmann::json::exception& e) {
    const std::string what = e.what();
    const size_t tag_end = what.find("] ");
    return what[0] == '[' && tag_end != std::string::npos ? what.substr(tag_end + 2) : what;
  }
  return "unknown parse error";
}

// `text` parsed as JSON (discarded when it does not parse), with *duplicate set to the first key
// that one of its objects names twice, quoted as JSON ("" when none): nlohmann keeps the last
// value of such a key silently.
nlohmann::json ParseNoticingDuplicateKeys(const std::string& text, std::string* duplicate) {
  std::vector<std::set<std::string>> keys;  // one per object open at this point of the parse
  duplicate->clear();
  const nlohmann::json::parser_callback_t note_keys =
      [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        using Event = nlohmann::json::parse_event_t;
        if (event == Event::object_start) {
          keys.emplace_back();
        } else if (event == Event::object_end) {
          if (!keys.empty()) keys.pop_back();
        } else if (event == Event::key && !keys.empty() && duplicate->empty() &&
                   !keys.back().insert(parsed.get<std::string>()).second) {
          *duplicate = parsed.dump();
        }
        return true;  // keep every value
      };
  return nlohmann::json::parse(text, note_keys, /*allow_exceptions=*/false);
}

}  // namespace

absl::Status ForEachJsonLine(
    const std::string& path, int64_t limit,
    absl::FunctionRef<absl::Status(const nlohmann::json& value, int line)> fn) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  }
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string text;
  int64_t calls = 0;
  for (int line = 1; (limit == 0 || calls < limit) && std::getline(in, text); ++line) {
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    ++calls;
    std::string duplicate;
    const nlohmann::json value = ParseNoticingDuplicateKeys(text, &duplicate);
    if (!value.is_discarded() && !duplicate.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": duplicate key ",
                                                     EscapedForTerminal(duplicate),
                                                     " (an object names each key once)"));
    }
    if (absl::Status s = fn(value, line); !s.ok()) {
      std::string parse_error;
      if (value.is_discarded()) {
        parse_error = absl::StrCat(" (not valid JSON: ", ParseError(text), ")");
      }
      // The parser's message quotes the line's bytes as read (an invalid UTF-8 byte, raw): they
      // and whatever fn quoted are escaped.
      return absl::Status(s.code(), absl::StrCat(path, ":", line, ": ",
                                                 EscapedForTerminal(std::string(s.message())),
                                                 EscapedForTerminal(parse_error)));
    }
  }
  if (in.bad()) return absl::InternalError(absl::StrCat("error reading ", path));
  return absl::OkStatus();
}

}  // namespace dgserve
