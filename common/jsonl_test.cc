// ForEachJsonLine (common/jsonl.h) on small files written here.
#include "common/jsonl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/excerpt.h"

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

// A line whose string holds a byte that is not UTF-8: the parser's message quotes the bytes it
// read, and the 0xFF is shown as "\xff" (it reached the terminal raw); fn's message is escaped
// too, valid UTF-8 kept.
TEST(ForEachJsonLineTest, ABadByteInTheMessageIsEscaped) {
  const std::string path = Write("bad_utf8.jsonl", "{\"prompt\": \"caf\xc3\xa9 \xff\"}\n");
  auto want_object = [](const nlohmann::json& v, int) {
    return v.is_object() ? absl::OkStatus() : absl::InvalidArgumentError("expected an object");
  };
  const absl::Status s = ForEachJsonLine(path, 0, want_object);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              StartsWith(path + ":1: expected an object (not valid JSON: parse error at line 1, "
                                "column 19: syntax error while parsing value - invalid string: "
                                "ill-formed UTF-8 byte; last read: '\"caf\xc3\xa9 \\xff'"));
  EXPECT_EQ(std::string(s.message()).find('\xff'), std::string::npos) << s.message();
  const std::string ok = Write("escape_fn.jsonl", "\"x\"\n");
  const absl::Status quoted = ForEachJsonLine(ok, 0, [](const nlohmann::json&, int) {
    return absl::InvalidArgumentError("bad \x1b[31m\xc2\x9b\x7f\xe2\x89\xa5 \\x");
  });
  EXPECT_EQ(quoted.message(), ok + ":1: bad \\x1b[31m\\xc2\\x9b\\x7f\xe2\x89\xa5 \\x");
}

// The escaping ForEachJsonLine applies (common/excerpt.h): valid UTF-8 other than controls kept,
// every other byte as \xNN.
TEST(EscapedForTerminalTest, KeepsValidTextEscapesEveryOtherByte) {
  EXPECT_EQ(EscapedForTerminal("plain ASCII, caf\xc3\xa9 \xe2\x89\xa5 \xf0\x9f\x98\x80"),
            "plain ASCII, caf\xc3\xa9 \xe2\x89\xa5 \xf0\x9f\x98\x80");
  EXPECT_EQ(EscapedForTerminal("a\xff"
                               "b\t\n\x7f"),
            "a\\xffb\\x09\\x0a\\x7f");
  // C1 controls (U+009B, a terminal's CSI); U+00A0 kept.
  EXPECT_EQ(EscapedForTerminal("\xc2\x9b\xc2\xa0"), "\\xc2\\x9b\xc2\xa0");
  // Overlong, surrogate, above U+10FFFF, truncated: each byte escaped.
  EXPECT_EQ(EscapedForTerminal("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(EscapedForTerminal("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");
  EXPECT_EQ(EscapedForTerminal("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(EscapedForTerminal("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");
  EXPECT_EQ(EscapedForTerminal("x\xe2\x89"), "x\\xe2\\x89");
  EXPECT_EQ(EscapedForTerminal(std::string("\0z", 2)), "\\x00z");
  // Bidirectional controls (an RLO U+202E makes "txt.exe" show as "exe.txt"), LRM, RLM, the
  // isolates, ALM, the line separator, the BOM: escaped byte by byte. Neighbours kept: U+202F
  // (narrow no-break space), U+2065 (unassigned but not a control here), U+200D (ZWJ).
  EXPECT_EQ(EscapedForTerminal("a\xe2\x80\xae"
                               "b"),
            "a\\xe2\\x80\\xaeb");
  EXPECT_EQ(EscapedForTerminal("\xe2\x80\x8e\xe2\x80\x8f\xe2\x81\xa6\xe2\x81\xa9"),
            "\\xe2\\x80\\x8e\\xe2\\x80\\x8f\\xe2\\x81\\xa6\\xe2\\x81\\xa9");
  EXPECT_EQ(EscapedForTerminal("\xd8\x9c\xe2\x80\xa8\xef\xbb\xbf"),
            "\\xd8\\x9c\\xe2\\x80\\xa8\\xef\\xbb\\xbf");
  EXPECT_EQ(EscapedForTerminal("\xe2\x80\xaa\xe2\x80\xac"), "\\xe2\\x80\\xaa\\xe2\\x80\\xac");
  EXPECT_EQ(EscapedForTerminal("\xe2\x80\xaf\xe2\x81\xa5\xe2\x80\x8d\xd8\x9b"),
            "\xe2\x80\xaf\xe2\x81\xa5\xe2\x80\x8d\xd8\x9b");
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
