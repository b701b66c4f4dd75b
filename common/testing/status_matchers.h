// IsOk() and StatusIs(code[, message matcher]) for GoogleTest (Debian's Abseil lacks them).
#pragma once

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status: " << s.ToString();
  return s.ok();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s.ToString();
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher, "has status code and message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status: " << s.ToString();
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace dgserve::testing
