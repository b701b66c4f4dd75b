// ForEachJsonLine (common/jsonl.h) on small files written here.
#include "common/jsonl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace dgserve {
namespace {

using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::StartsWith;

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/jsonl_test_" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The (line, dump) of every call, "discarded" for a line that is not JSON.
struct Calls {
  std::vector<std::pair<int, std::string>> seen;
  absl::Status operator()(const nlohmann::json& v, int line) {
    seen.emplace_back(line, v.is_discarded() ? "discarded" : v.dump());
    return absl::OkStatus();
  }
};

TEST(ForEachJsonLineTest, SkipsBlankLinesAndNumbersTheOthersAsInTheFile) {
  // Line 2 empty, line 4 whitespace only, line 5 not JSON, line 6 CRLF-terminated, line 7 with
  // no final '\n'.
  const std::string path =
      Write("blank.jsonl", "{\"a\": 1}\n\n[2, 3]\n \t\r\nhello\n\"x\"\r\n{\"b\": null}");
  Calls calls;
  ASSERT_TRUE(ForEachJsonLine(path, 0, std::ref(calls)).ok());
  EXPECT_THAT(calls.seen, ElementsAre(Pair(1, "{\"a\":1}"), Pair(3, "[2,3]"), Pair(5, "discarded"),
                                      Pair(6, "\"x\""), Pair(7, "{\"b\":null}")));
}

TEST(ForEachJsonLineTest, AnErrorNamesFileAndLineKeepsItsCodeAndStopsReading) {
  const std::string path = Write("bad.jsonl", "1\n\n2\n3\n");
  std::vector<int> lines;
  const absl::Status s = ForEachJsonLine(path, 0, [&](const nlohmann::json& v, int line) {
    lines.push_back(line);
    if (v == 2) return absl::FailedPreconditionError("two is refused");
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), path + ":3: two is refused");
  EXPECT_THAT(lines, ElementsAre(1, 3));
}

TEST(ForEachJsonLineTest, TheLimitCountsCallsAndReadsNoFurther) {
  // Two values (a blank line between them), then a line fn would refuse.
  const std::string path = Write("limit.jsonl", "1\n\n2\nnot json\n");
  auto refuse_discarded = [](const nlohmann::json& v, int) {
    return v.is_discarded() ? absl::InvalidArgumentError("not JSON") : absl::OkStatus();
  };
  EXPECT_TRUE(ForEachJsonLine(path, 2, refuse_discarded).ok());
  EXPECT_THAT(std::string(ForEachJsonLine(path, 3, refuse_discarded).message()),
              StartsWith(path + ":4: not JSON (not valid JSON: "));
  EXPECT_THAT(std::string(ForEachJsonLine(path, 0, refuse_discarded).message()),
              StartsWith(path + ":4: not JSON (not valid JSON: "));
  Calls calls;
  ASSERT_TRUE(ForEachJsonLine(path, 1, std::ref(calls)).ok());
  EXPECT_THAT(calls.seen, ElementsAre(Pair(1, "1")));
}

// fn's message for a line that does not parse is followed by the parser's (issue 48: a truncated
// line got only "expected a JSON object ..."); a line that parses to the wrong shape gets fn's
// message alone.
TEST(ForEachJsonLineTest, AMalformedLineGetsTheParsersMessageToo) {
  const std::string path = Write("malformed.jsonl", "[1]\n{\"puzzle\": \"1..\"\n");
  auto want_object = [](const nlohmann::json& v, int) {
    return v.is_object() ? absl::OkStatus() : absl::InvalidArgumentError("expected an object");
  };
  const absl::Status shape = ForEachJsonLine(path, 1, want_object);
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shape.message(), path + ":1: expected an object");
  const std::string path2 = Write("malformed2.jsonl", "{\"puzzle\": \"1..\"\n");
  const absl::Status s = ForEachJsonLine(path2, 0, want_object);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // The line is 16 characters: the input ends, the object unterminated, at column 17.
  EXPECT_THAT(std::string(s.message()),
              StartsWith(path2 + ":1: expected an object (not valid JSON: parse "
                                 "error at line 1, column 17: "));
  EXPECT_THAT(std::string(s.message()), HasSubstr("unexpected end of input"));
  EXPECT_THAT(std::string(s.message()), EndsWith(")"));
}

// A key named twice in one object is refused naming the line, before fn sees it (nlohmann kept
// the last value silently); the same key in different objects (nested or sibling) is not a
// duplicate.
TEST(ForEachJsonLineTest, AKeyTwiceInOneObjectIsRefused) {
  const std::string path = Write("duplicate.jsonl",
                                 "{\"a\": 1, \"b\": {\"a\": 2}}\n"
                                 "[{\"k\": 1}, {\"k\": 2}]\n"
                                 "{\"puzzle\": \"x\", \"n\": {\"m\": 1}, \"puzzle\": \"y\"}\n"
                                 "4\n");
  Calls calls;
  const absl::Status s = ForEachJsonLine(path, 0, std::ref(calls));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), path + ":3: duplicate key \"puzzle\" (an object names each key once)");
  EXPECT_THAT(calls.seen,
              ElementsAre(Pair(1, "{\"a\":1,\"b\":{\"a\":2}}"), Pair(2, "[{\"k\":1},{\"k\":2}]")));
  const std::string nested = Write("duplicate_nested.jsonl", "{\"o\": [{\"x\": 1, \"x\": 2}]}\n");
  EXPECT_EQ(ForEachJsonLine(nested, 0, std::ref(calls)).message(),
            nested + ":1: duplicate key \"x\" (an object names each key once)");
  EXPECT_EQ(calls.seen.size(), 2u);
}

TEST(ForEachJsonLineTest, AnEmptyFileCallsNothing) {
  Calls calls;
  EXPECT_TRUE(ForEachJsonLine(Write("empty.jsonl", "\n\n"), 0, std::ref(calls)).ok());
  EXPECT_TRUE(ForEachJsonLine(Write("none.jsonl", ""), 0, std::ref(calls)).ok());
  EXPECT_TRUE(calls.seen.empty());
}

TEST(ForEachJsonLineTest, MissingFileIsNotFoundAndADirectoryIsRefused) {
  Calls calls;
  const std::string missing = ::testing::TempDir() + "/jsonl_test_missing.jsonl";
  const absl::Status s = ForEachJsonLine(missing, 0, std::ref(calls));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "cannot open " + missing);
  EXPECT_EQ(ForEachJsonLine(::testing::TempDir(), 0, std::ref(calls)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(calls.seen.empty());
}

}  // namespace
}  // namespace dgserve
