// JSONL files (one JSON value per line), read line by line: the calibration prompts
// (engine/generation/calibrate.h), dgserve-quantize's Sudoku calibration puzzles and
// dgserve-sudoku-eval's puzzle file.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace dgserve {

// Reads the file `path` line by line ('\n'-separated; a last line without '\n' counts too) and
// calls fn(value, line) for every line that is not blank (ASCII whitespace only, skipped):
// `line` is its 1-based number in the file, `value` the line parsed as JSON, or a discarded value
// (value.is_discarded()) when the line is not valid JSON, so that fn's own message for a line of
// the wrong shape covers it too. Stops after `limit` calls (0: no limit), reading no further.
// Returns OK when fn returned OK for every line; else fn's first error, its code kept and its
// message prefixed with "PATH:LINE: " and, for a line that is not valid JSON, followed by
// " (not valid JSON: " and the parser's message, e.g. "parse error at line 1, column 2: ...)".
// After the prefix, the message is EscapedForTerminal (common/excerpt.h): a byte of the line the
// parser quotes (or fn does) that is not valid, non-control UTF-8 reads "\xff", never raw.
// A line whose JSON names a key twice in one object (at any depth) is INVALID_ARGUMENT
// "PATH:LINE: duplicate key \"K\" ..." before fn sees it (a JSON parser keeps one of the values
// silently). NOT_FOUND "cannot open PATH" for a missing or unreadable file, INVALID_ARGUMENT for
// a directory or other non-regular file, INTERNAL for a read error.
absl::Status ForEachJsonLine(
    const std::string& path, int64_t limit,
    absl::FunctionRef<absl::Status(const nlohmann::json& value, int line)> fn);

}  // namespace dgserve
