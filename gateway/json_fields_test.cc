#include "gateway/json_fields.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"

namespace dgserve::json_fields {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::StartsWith;
using json = nlohmann::json;

// Expects ParseJsonObject to refuse `body` with INVALID_ARGUMENT starting with `prefix`.
void ExpectRefused(const std::string& body, const std::string& prefix) {
  json out;
  EXPECT_THAT(ParseJsonObject(body, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith(prefix)))
      << body;
}

// A number beyond a double is named by where it stands, in one pass with the document's build
// (it was "malformed JSON: … number overflow" with no field); a long one is quoted cut.
TEST(ParseJsonObjectTest, NumberBeyondADoubleNamesItsPath) {
  ExpectRefused(R"({"prompt": [1, 2, 1e400]})", "prompt[2]: number 1e400 is beyond a double");
  ExpectRefused(R"({"messages": [{"role": "user"}, {"x": -1e999}]})",
                "messages[1].x: number -1e999 is beyond a double");
  ExpectRefused(R"({"a": {"b": [[0], [0, 1e400]]}})", "a.b[1][1]: number 1e400");
  ExpectRefused("1e400", "request body: number 1e400 is beyond a double");
  const std::string huge = "1" + std::string(400, '0') + ".5";
  json out;
  const absl::Status s = ParseJsonObject(R"({"t_max": )" + huge + "}", &out);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          StartsWith("t_max: number " + huge.substr(0, 64) + "… is beyond")));
  EXPECT_EQ(FieldOf(s), "t_max");
  // Syntax errors after such checks are still reported as such; a clean body parses whole.
  ExpectRefused(R"({"a": [1, 2 3]})", "malformed JSON: ");
  ASSERT_TRUE(ParseJsonObject(R"({"a": [1e308, -1e308, {"b": null}], "c": "d"})", &out).ok());
  EXPECT_EQ(out["a"][2]["b"], nullptr);
  EXPECT_EQ(out["c"], "d");
}

TEST(ParseJsonObjectTest, AcceptsAnObject) {
  json out;
  ASSERT_THAT(ParseJsonObject(R"({"a": [1, {"b": 2}], "b": {"a": 3}})", &out), IsOk());
  EXPECT_EQ(out["a"][1]["b"], 2);
  EXPECT_EQ(out["b"]["a"], 3);  // the same key in different objects is fine
}

TEST(ParseJsonObjectTest, MalformedOrNotAnObject) {
  ExpectRefused(R"({"prompt": )", "malformed JSON: ");
  ExpectRefused("", "malformed JSON: ");
  ExpectRefused(R"({"prompt": "x"} trailing)", "malformed JSON: ");
  ExpectRefused(R"({"seed": 1e400})", "seed: number 1e400 is beyond a double");
  ExpectRefused(R"(["prompt"])", "request body must be a JSON object");
  ExpectRefused(R"("x")", "request body must be a JSON object");
  ExpectRefused("{\"a\": \"\xff\"}", "request body is not valid UTF-8 (first bad byte at offset 7)");
}

// A repeated key is named by its path, at any depth.
TEST(ParseJsonObjectTest, DuplicateKeysAreNamedByPath) {
  ExpectRefused(R"({"a": 1, "a": 1})", "a: appears more than once in its JSON object");
  ExpectRefused(R"({"m": [{}, [{"k": 1, "k": 2}]]})", "m[1][0].k: appears more than once");
  ExpectRefused(R"({"o": {"p": {"q": 1}, "p": 2}})", "o.p: appears more than once");
}

// Nesting beyond kMaxJsonDepth is refused by the SAX pass, before any document is built, naming
// where it happened; kMaxJsonDepth levels are fine. (A million '[' took 1.5 s and 440 MB.)
TEST(ParseJsonObjectTest, DeepNestingIsRefusedBeforeParsing) {
  auto nested = [](int depth) {
    return absl::StrCat(R"({"a": [{"b": )", std::string(depth - 3, '['), std::string(depth - 3, ']'),
                        "}]}");
  };
  json out;
  ASSERT_THAT(ParseJsonObject(nested(kMaxJsonDepth), &out), IsOk());
  ExpectRefused(nested(kMaxJsonDepth + 1),
                absl::StrCat("request body: arrays and objects nested deeper than ",
                             kMaxJsonDepth, " levels (at a[0].b"));
  ExpectRefused(nested(2000000), "request body: arrays and objects nested deeper than");
  // The param names where the level too many opened (it was null): the path in the message.
  const absl::Status s = ParseJsonObject(R"({"m": )" + std::string(40, '[') + "]}", &out);
  ASSERT_FALSE(s.ok());
  const std::string message(s.message());
  const size_t at = message.find("(at ");
  ASSERT_NE(at, std::string::npos) << message;
  EXPECT_EQ(FieldOf(s), message.substr(at + 4, message.size() - at - 5));
  EXPECT_THAT(FieldOf(s), StartsWith("m[0][0]"));
}

// Many objects in one body are checked in linear time: 700,000 empty objects (about 3 MB) in a
// few hundred milliseconds. (A parser callback made this quadratic: about 10^11 steps, a stalled
// I/O thread, before the first field was looked at; the test did not finish in 60 s.)
TEST(ParseJsonObjectTest, ManyObjectsParseInLinearTime) {
  std::string body = R"({"stop": [)";
  for (int i = 0; i < 700000; ++i) body += i == 0 ? "{}" : ",{}";
  body += "]}";
  json out;
  ASSERT_THAT(ParseJsonObject(body, &out), IsOk());
  EXPECT_EQ(out["stop"].size(), 700000u);
}

TEST(FieldsTest, WholeNumbersInAnyNotation) {
  for (const char* text : {"5", "5.0", "5e0", "0.5e1"}) {
    absl::StatusOr<int64_t> v = GetIntIn(json::parse(text), "f", 1, 10, "between 1 and 10");
    ASSERT_THAT(v, IsOk()) << text;
    EXPECT_EQ(*v, 5) << text;
  }
  EXPECT_THAT(GetIntIn(json::parse("5.5"), "f", 1, 10, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, "f: must be an integer"));
  EXPECT_THAT(GetIntIn(json::parse("\"5\""), "f", 1, 10, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, "f: must be an integer"));
  // Out of range however large, with the value as parsed.
  EXPECT_THAT(GetIntIn(json::parse("1e30"), "f", 1, 10, "between 1 and 10"),
              StatusIs(absl::StatusCode::kInvalidArgument, "f: must be between 1 and 10 (got 1e+30)"));
  EXPECT_THAT(GetIntIn(json::parse("-18446744073709551616"), "f", 1, 10, "R"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("f: must be R (got")));
  EXPECT_EQ(ReadWhole(json::parse("9223372036854775808")).kind, WholeNumber::kAboveInt64);
  EXPECT_EQ(ReadWhole(json::parse("-9223372036854775808")).value,
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(ReadWhole(json::parse("-9.3e18")).kind, WholeNumber::kBelowInt64);
  EXPECT_THAT(GetInt32(json::parse("2147483648"), "f"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("f: must be an integer in")));
}

TEST(FieldsTest, Uint64CoversTheWholeRange) {
  EXPECT_EQ(*GetUint64(json::parse("18446744073709551615"), "seed"), 18446744073709551615ull);
  EXPECT_EQ(*GetUint64(json::parse("1e19"), "seed"), 10000000000000000000ull);
  EXPECT_EQ(*GetUint64(json::parse("-0"), "seed"), 0u);
  EXPECT_THAT(GetUint64(json::parse("1.8446744073709552e19"), "seed"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       StartsWith("seed: must be an integer in [0, 2^64)")));
  EXPECT_THAT(GetUint64(json::parse("-1"), "seed"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("seed: must be an integer in")));
  EXPECT_THAT(GetUint64(json::parse("0.5"), "seed"),
              StatusIs(absl::StatusCode::kInvalidArgument, "seed: must be an integer"));
}

// The error names the field in a payload, whatever the field holds (ErrorParam reads it).
TEST(FieldsTest, ErrorsCarryTheirField) {
  EXPECT_EQ(FieldOf(Unsupported("foo bar", "hint")), "foo bar");
  EXPECT_EQ(FieldOf(Invalid("a: b", "must be x")), "a: b");
  EXPECT_EQ(FieldOf(absl::InvalidArgumentError("x: y")), "");
}

TEST(FieldsTest, FloatsMustBeFiniteFloat32) {
  EXPECT_EQ(*GetFloat(json::parse("0.25"), "t"), 0.25f);
  // The limit the message names is accepted: FLT_MAX's shortest decimal rounds to FLT_MAX.
  EXPECT_EQ(*GetFloat(json::parse("3.4028235e38"), "t"), std::numeric_limits<float>::max());
  EXPECT_EQ(*GetFloat(json::parse("-3.40282356e38"), "t"), -std::numeric_limits<float>::max());
  EXPECT_THAT(GetFloat(json::parse("3.4028235677973366e38"), "t"),  // 2^128 - 2^103: rounds to inf
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("t: must be a finite float32")));
  EXPECT_EQ(*GetFloat(json::parse("0"), "t"), 0.0f);
  EXPECT_THAT(GetFloat(json::parse("1e39"), "t"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("t: must be a finite float32")));
  EXPECT_THAT(GetFloat(json::parse("1e-50"), "t"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("t: 1e-50 rounds to 0")));
  EXPECT_THAT(GetFloat(json::parse("true"), "t"),
              StatusIs(absl::StatusCode::kInvalidArgument, "t: must be a number"));
}

}  // namespace
}  // namespace dgserve::json_fields
