// JSONL files read line by line (see jsonl.h).
#include "common/jsonl.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace dgserve {

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
      return absl::Status(s.code(), absl::StrCat(path, ":", line, ": ", s.message()));
    }
  }
  if (in.bad()) return absl::InternalError(absl::StrCat("error reading ", path));
  return absl::OkStatus();
}

}  // namespace dgserve
