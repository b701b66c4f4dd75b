// Reading an OpenAI request body: the body as one JSON object (UTF-8, keys unique within each
// object), and its fields with the error messages the API gives ("FIELD: what is wrong").
// Every error is INVALID_ARGUMENT (HTTP 400) whose message starts with the field's name, which
// ErrorParam (openai_api.h) turns into the error's `param`.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve::json_fields {

// Parses `body` into `*out`, a JSON object. Errors: "request body is not valid UTF-8 (first bad
// byte at offset N)" (RFC 8259 §8.1); "K: appears more than once in its JSON object" for a key
// repeated within one object, at any depth, K its path (e.g. messages[0].role; RFC 8259 §4 —
// nlohmann::json would keep the last, so a proxy reading the first would see another request);
// "PATH: number N is beyond a double" (1e400, named by where it stands, e.g. prompt[2]);
// "malformed JSON: …" (syntax); "request body must be a JSON object"; "request body: arrays and
// objects nested deeper than kMaxJsonDepth levels (at PATH)". One pass: each event is checked,
// then handed to nlohmann's document builder, so a refused key or level stops the parse where it
// stands. Linear in the body's size.
absl::Status ParseJsonObject(std::string_view body, nlohmann::json* out);

// The status payload (absl::Status::GetPayload) that carries the field an error names, whatever
// characters the field holds (a client's key may hold spaces or ": "); see FieldOf.
inline constexpr std::string_view kFieldPayload = "dgserve.openai/field";

// "FIELD: WHAT", with FIELD in the kFieldPayload payload.
absl::Status Invalid(std::string_view field, std::string_view what);
// "unsupported field: FIELD" (+ " (HINT)"), with FIELD in the kFieldPayload payload.
absl::Status Unsupported(std::string_view field, std::string_view hint = {});
// The field set by Invalid or Unsupported, or "" when `status` carries none.
std::string FieldOf(const absl::Status& status);

// How deeply arrays and objects may nest in a request body: a request needs 5 levels
// (messages[i].content[j], canvas_template.holes[i].allowed_token_ids); 4 MB of '[' nested a
// million deep cost a second of an I/O thread and hundreds of MB to parse.
inline constexpr int kMaxJsonDepth = 32;
// "FIELD: must be RANGE (got VALUE)", VALUE as parsed and re-serialized (1e3 prints as 1000.0).
absl::Status OutOfRange(const nlohmann::json& v, std::string_view field, std::string_view range);

// A JSON number read as a whole number whatever its notation: the parser keeps 5 and
// 18446744073709551615 as uint64, -5 as int64, and 5.0, 1e3 or 18446744073709551616 as double.
// Whole doubles are integers (as vLLM's request models take them: 5.0 is 5, 5.5 is refused).
struct WholeNumber {
  enum Kind { kValue, kBelowInt64, kAboveInt64, kNotWhole } kind = kNotWhole;
  int64_t value = 0;  // with kValue
};
WholeNumber ReadWhole(const nlohmann::json& v);

// A whole number in [lo, hi]: "FIELD: must be an integer" for anything that is not a whole
// number, OutOfRange(range) for one outside [lo, hi], however large.
absl::StatusOr<int64_t> GetIntIn(const nlohmann::json& v, std::string_view field, int64_t lo,
                                 int64_t hi, std::string_view range);
// GetIntIn over the int32 range.
absl::StatusOr<int32_t> GetInt32(const nlohmann::json& v, std::string_view field);
// A whole number in [0, 2^64) (a seed): beyond int64, so read apart from GetIntIn.
absl::StatusOr<uint64_t> GetUint64(const nlohmann::json& v, std::string_view field);
// A number that float32 holds: one that rounds to a finite float32 (magnitude at most FLT_MAX
// once rounded to nearest, so 3.4028235e38, FLT_MAX's shortest decimal, is accepted), and not a
// nonzero value that rounds to 0 (it would reach the sampler as 0).
absl::StatusOr<float> GetFloat(const nlohmann::json& v, std::string_view field);
absl::StatusOr<bool> GetBool(const nlohmann::json& v, std::string_view field);
absl::StatusOr<std::string> GetString(const nlohmann::json& v, std::string_view field);

}  // namespace dgserve::json_fields
