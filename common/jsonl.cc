// JSONL files read line by line (see jsonl.h).
#include "common/jsonl.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

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
    const nlohmann::json value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (absl::Status s = fn(value, line); !s.ok()) {
      std::string parse_error;
      if (value.is_discarded()) {
        parse_error = absl::StrCat(" (not valid JSON: ", ParseError(text), ")");
      }
      return absl::Status(s.code(), absl::StrCat(path, ":", line, ": ", s.message(), parse_error));
    }
  }
  if (in.bad()) return absl::InternalError(absl::StrCat("error reading ", path));
  return absl::OkStatus();
}

}  // namespace dgserve
