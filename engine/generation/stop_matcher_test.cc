#include "engine/generation/stop_matcher.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dgserve {
namespace {

// Pushes every piece, then flushes if not stopped; returns everything emitted.
std::string RunAll(StopMatcher& m, const std::vector<std::string>& pieces, bool* stopped) {
  std::string out;
  *stopped = false;
  for (const std::string& p : pieces) {
    StopMatcher::Result r = m.Push(p);
    out += r.emit;
    if (r.stopped) *stopped = true;
  }
  if (!*stopped) out += m.Flush();
  return out;
}

TEST(StopMatcherTest, NoStopsEmitsImmediately) {
  StopMatcher m({});
  StopMatcher::Result r = m.Push("hello");
  EXPECT_EQ(r.emit, "hello");
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(m.held_bytes(), 0u);
  EXPECT_EQ(m.Push(" world").emit, " world");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, EmptyStopStringsAreIgnored) {
  StopMatcher m({"", ""});
  EXPECT_EQ(m.Push("abc").emit, "abc");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcherTest, TextThatCannotStartAStopIsEmittedAtOnce) {
  StopMatcher m({"END"});
  StopMatcher::Result r = m.Push("hello world");
  EXPECT_EQ(r.emit, "hello world");
  EXPECT_FALSE(r.stopped);
}

TEST(StopMatcherTest, MatchInOnePiece) {
  StopMatcher m({"END"});
  StopMatcher::Result r = m.Push("abcENDdef");
  EXPECT_EQ(r.emit, "abc");
  EXPECT_TRUE(r.stopped);
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcherTest, MatchAtTheVeryStart) {
  StopMatcher m({"stop"});
  StopMatcher::Result r = m.Push("stop and more");
  EXPECT_EQ(r.emit, "");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, MatchSpanningThreePushes) {
  StopMatcher m({"<end>"});
  StopMatcher::Result r1 = m.Push("abc<e");
  EXPECT_EQ(r1.emit, "abc");
  EXPECT_FALSE(r1.stopped);
  EXPECT_EQ(m.held_bytes(), 2u);
  StopMatcher::Result r2 = m.Push("n");
  EXPECT_EQ(r2.emit, "");
  EXPECT_FALSE(r2.stopped);
  EXPECT_EQ(m.held_bytes(), 3u);
  StopMatcher::Result r3 = m.Push("d>tail");
  EXPECT_EQ(r3.emit, "");
  EXPECT_TRUE(r3.stopped);
  // Further input is ignored.
  StopMatcher::Result r4 = m.Push("more text");
  EXPECT_EQ(r4.emit, "");
  EXPECT_TRUE(r4.stopped);
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, HeldPrefixReleasedWhenItDoesNotContinue) {
  StopMatcher m({"<end>"});
  EXPECT_EQ(m.Push("abc<en").emit, "abc");
  StopMatcher::Result r = m.Push("try");
  EXPECT_EQ(r.emit, "<entry");
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcherTest, FlushReturnsHeldTail) {
  StopMatcher m({"<end>"});
  EXPECT_EQ(m.Push("abc<en").emit, "abc");
  EXPECT_EQ(m.Flush(), "<en");
  EXPECT_EQ(m.held_bytes(), 0u);
}

TEST(StopMatcherTest, OverlappingPrefixes) {
  // "aab" inside "aaab": after "aa" is held, the third "a" shifts the candidate by one.
  StopMatcher m({"aab"});
  EXPECT_EQ(m.Push("a").emit, "");
  EXPECT_EQ(m.Push("a").emit, "");
  StopMatcher::Result r3 = m.Push("a");
  EXPECT_EQ(r3.emit, "a");
  EXPECT_FALSE(r3.stopped);
  StopMatcher::Result r4 = m.Push("b");
  EXPECT_EQ(r4.emit, "");
  EXPECT_TRUE(r4.stopped);

  bool stopped = false;
  StopMatcher m2({"aab"});
  EXPECT_EQ(RunAll(m2, {"xaaab"}, &stopped), "xa");
  EXPECT_TRUE(stopped);
}

TEST(StopMatcherTest, EarliestMatchWinsAmongSeveralStops) {
  bool stopped = false;
  StopMatcher m({"world", "lo w"});
  EXPECT_EQ(RunAll(m, {"hel", "lo wor", "ld"}, &stopped), "hel");
  EXPECT_TRUE(stopped);

  StopMatcher m2({"b", "ab"});
  EXPECT_EQ(RunAll(m2, {"xab"}, &stopped), "x");
  EXPECT_TRUE(stopped);
}

TEST(StopMatcherTest, LongestHeldSuffixAcrossStops) {
  StopMatcher m({"abcd", "cx"});
  // "abc" is a prefix of "abcd"; "c" alone is a prefix of "cx": hold the longer, "abc".
  StopMatcher::Result r = m.Push("zzabc");
  EXPECT_EQ(r.emit, "zz");
  EXPECT_EQ(m.held_bytes(), 3u);
  // "abcx" contains "cx": the text before it is "ab".
  StopMatcher::Result r2 = m.Push("x");
  EXPECT_EQ(r2.emit, "ab");
  EXPECT_TRUE(r2.stopped);
}

TEST(StopMatcherTest, Unicode) {
  bool stopped = false;
  StopMatcher m({"fin\xC3\xA9"});  // "finé"
  // "café fin" then "é!" — the stop spans the boundary; the held tail is whole characters.
  StopMatcher::Result r1 = m.Push("caf\xC3\xA9 fin");
  EXPECT_EQ(r1.emit, "caf\xC3\xA9 ");
  StopMatcher::Result r2 = m.Push("\xC3\xA9!");
  EXPECT_EQ(r2.emit, "");
  EXPECT_TRUE(r2.stopped);

  // A stop of multi-byte characters that does not complete.
  StopMatcher m2({"\xE2\x9C\x93\xE2\x9C\x93"});  // "✓✓"
  EXPECT_EQ(RunAll(m2, {"ok \xE2\x9C\x93", " done"}, &stopped), "ok \xE2\x9C\x93 done");
  EXPECT_FALSE(stopped);
}

TEST(StopMatcherTest, ManySmallPiecesMatchLongStop) {
  const std::string stop = "the end of it";
  StopMatcher m({stop});
  std::string text = "prefix text the end of it suffix";
  std::string out;
  bool stopped = false;
  for (char c : text) {
    StopMatcher::Result r = m.Push(std::string(1, c));
    out += r.emit;
    if (r.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "prefix text ");
}

}  // namespace
}  // namespace dgserve
