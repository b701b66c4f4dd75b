// Unit tests of the tokenizer building blocks: UTF-8 helpers, Split pre-tokenizer, added-token
// matching, and the decoder chain (HF ByteFallback semantics, streaming state).
#include "engine/tokenizer/pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/tokenizer/utf8.h"

namespace dgserve::tokenizer_internal {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

const std::string kFffd(kReplacementChar);

TEST(Utf8Test, DecodeAndValidate) {
  char32_t cp = 0;
  EXPECT_EQ(DecodeUtf8("é", 0, &cp), 2u);
  EXPECT_EQ(cp, 0xE9u);
  EXPECT_EQ(DecodeUtf8("\xF0\x9F\x8E\x89", 0, &cp), 4u);  // 🎉
  EXPECT_EQ(cp, 0x1F389u);
  EXPECT_EQ(DecodeUtf8("\xC0\x80", 0, &cp), 0u);          // overlong
  EXPECT_EQ(DecodeUtf8("\xED\xA0\x80", 0, &cp), 0u);      // surrogate
  EXPECT_EQ(DecodeUtf8("\xF4\x90\x80\x80", 0, &cp), 0u);  // above U+10FFFF
  EXPECT_EQ(DecodeUtf8("\xE2\x96", 0, &cp), 0u);          // truncated
  EXPECT_TRUE(IsValidUtf8("plain ▁ 日本 🎉"));
  EXPECT_FALSE(IsValidUtf8("a\xFF"));
  EXPECT_EQ(ValidUtf8PrefixLength("ab\xE2\x96"), 2u);
  EXPECT_EQ(Utf8CharLength("\xFF"
                           "a",
                           0),
            1u);
}

TEST(Utf8Test, IncompleteCharacters) {
  EXPECT_TRUE(IsIncompleteUtf8Char("\xE2"));
  EXPECT_TRUE(IsIncompleteUtf8Char("\xE2\x96"));
  EXPECT_TRUE(IsIncompleteUtf8Char("\xF0\x9F\x8E"));
  EXPECT_FALSE(IsIncompleteUtf8Char("\xE2\x96\x81"));  // complete
  EXPECT_FALSE(IsIncompleteUtf8Char("\x80"));          // continuation byte
  EXPECT_FALSE(IsIncompleteUtf8Char("\xE0\x80"));      // would be overlong
  EXPECT_FALSE(
      IsIncompleteUtf8Char("\xE2"
                           "a"));
  EXPECT_FALSE(IsIncompleteUtf8Char(""));
}

TEST(Utf8Test, EncodeAndTrim) {
  std::string s;
  for (char32_t cp : {0x41u, 0xE9u, 0x2581u, 0x1F389u}) AppendUtf8(cp, &s);
  EXPECT_EQ(s, "Aé▁🎉");
  EXPECT_EQ(TrimPythonWhitespace(" \t\n hi there \u3000\n"), "hi there");
  EXPECT_EQ(TrimPythonWhitespace("\x1c"
                                 "x"
                                 "\xC2\xA0"),
            "x");
  EXPECT_EQ(TrimPythonWhitespace("  "), "");
  EXPECT_EQ(TrimPythonWhitespace("▁x▁"), "▁x▁");  // U+2581 is not whitespace
}

std::vector<std::string> SplitWith(std::string_view text, SplitBehavior behavior,
                                   bool invert = false) {
  PreTokenizer pre;
  pre.AddStep({"-", behavior, invert});
  std::vector<std::string_view> words;
  pre.Split(text, &words);
  return std::vector<std::string>(words.begin(), words.end());
}

TEST(PreTokenizerTest, SplitBehaviorsMatchHf) {
  // The examples of HF tokenizers' NormalizedString::split tests, with '-' as delimiter.
  const std::string text = "the-final--countdown";
  EXPECT_THAT(SplitWith(text, SplitBehavior::kRemoved), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(SplitWith(text, SplitBehavior::kIsolated),
              ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(SplitWith(text, SplitBehavior::kMergedWithPrevious),
              ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(SplitWith(text, SplitBehavior::kMergedWithNext),
              ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(SplitWith(text, SplitBehavior::kContiguous),
              ElementsAre("the", "-", "final", "--", "countdown"));
  EXPECT_THAT(SplitWith("a-b", SplitBehavior::kRemoved, /*invert=*/true), ElementsAre("-"));
  EXPECT_THAT(SplitWith("", SplitBehavior::kIsolated), IsEmpty());
}

TEST(PreTokenizerTest, NoStepsKeepsText) {
  PreTokenizer pre;
  std::vector<std::string_view> words;
  pre.Split("▁a▁b", &words);
  EXPECT_THAT(words, ElementsAre("▁a▁b"));
}

TEST(NormalizerTest, ReplaceAndPrepend) {
  Normalizer n;
  n.AddStep({NormalizerStep::Kind::kReplace, " ", "▁"});
  EXPECT_EQ(n.Normalize(" a  b "), "▁a▁▁b▁");
  n.AddStep({NormalizerStep::Kind::kPrepend, "", "▁"});
  EXPECT_EQ(n.Normalize("a b"), "▁a▁b");
  EXPECT_EQ(n.Normalize(""), "");
}

TEST(AddedTokenMatcherTest, LeftmostLongest) {
  AddedTokenMatcher m;
  m.Add("\n", 0);
  m.Add("\n\n", 1);
  m.Add("<a>", 2);
  m.Add("<ab>", 3);
  std::vector<AddedTokenMatcher::Match> matches;
  m.FindAll("x\n\n\n<ab><a<a>", &matches);
  ASSERT_EQ(matches.size(), 4u);
  EXPECT_EQ(matches[0].index, 1);  // "\n\n" wins over "\n"
  EXPECT_EQ(matches[0].begin, 1u);
  EXPECT_EQ(matches[1].index, 0);  // the third "\n"
  EXPECT_EQ(matches[2].index, 3);
  EXPECT_EQ(matches[3].index, 2);
  EXPECT_EQ(matches[3].begin, 10u);  // "<a" without ">" is skipped
}

Decoder GemmaDecoder() {
  Decoder d;
  DecoderStep replace;
  replace.kind = DecoderStep::Kind::kReplace;
  replace.pattern = "▁";
  replace.content = " ";
  d.AddStep(replace);
  DecoderStep byte_fallback;
  byte_fallback.kind = DecoderStep::Kind::kByteFallback;
  d.AddStep(byte_fallback);
  DecoderStep fuse;
  fuse.kind = DecoderStep::Kind::kFuse;
  d.AddStep(fuse);
  return d;
}

std::string DecodeAll(const Decoder& d, std::vector<std::string> tokens) {
  ByteRunState state;
  return d.Run(std::move(tokens), &state, /*final=*/true);
}

TEST(DecoderTest, GemmaChain) {
  const Decoder d = GemmaDecoder();
  EXPECT_EQ(DecodeAll(d, {"▁Hello", ",", "▁world"}), " Hello, world");
  EXPECT_EQ(DecodeAll(d, {"a", "<0xC3>", "<0xA9>", "b"}), "aéb");
  EXPECT_EQ(DecodeAll(d, {"<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"}), "🎉");
  // HF ByteFallback: a run that is not valid UTF-8 becomes one U+FFFD per byte.
  EXPECT_EQ(DecodeAll(d, {"<0xE2>", "<0x96>", "x"}), kFffd + kFffd + "x");
  EXPECT_EQ(DecodeAll(d, {"<0x41>", "<0xE2>"}), kFffd + kFffd);
  EXPECT_EQ(DecodeAll(d, {"<0xFF>"}), kFffd);
  EXPECT_EQ(DecodeAll(d, {"<0xzz>", "<0x4>"}), "<0xzz><0x4>");  // not byte tokens
  EXPECT_EQ(DecodeAll(d, {}), "");
}

TEST(DecoderTest, StreamingHoldsIncompleteCharacter) {
  const Decoder d = GemmaDecoder();
  ByteRunState state;
  EXPECT_EQ(d.Run({"a", "<0xF0>", "<0x9F>"}, &state, /*final=*/false), "a");
  EXPECT_EQ(state.pending, "\xF0\x9F");
  EXPECT_EQ(d.Run({"<0x8E>"}, &state, false), "");
  EXPECT_EQ(d.Run({"<0x89>", "<0xC3>"}, &state, false), "🎉");
  EXPECT_EQ(d.Run({"<0xA9>", "▁b"}, &state, false), "é b");
  EXPECT_TRUE(state.pending.empty());
  // An incomplete character at the end becomes U+FFFD per byte when the stream ends.
  EXPECT_EQ(d.Run({"<0xE2>", "<0x96>"}, &state, false), "");
  EXPECT_EQ(d.Run({}, &state, /*final=*/true), kFffd + kFffd);
}

TEST(DecoderTest, StreamingInvalidRunStaysReplaced) {
  const Decoder d = GemmaDecoder();
  ByteRunState state;
  // 0xFF can never be valid: the run is replaced at once, and so are its later bytes (as HF
  // replaces the whole run).
  EXPECT_EQ(d.Run({"<0xFF>", "<0xC3>"}, &state, false), kFffd + kFffd);
  EXPECT_EQ(d.Run({"<0xA9>", "z"}, &state, false), kFffd + "z");
  EXPECT_EQ(d.Run({"<0xC3>", "<0xA9>"}, &state, true), "é");
}

TEST(DecoderTest, StripAndNoDecoder) {
  Decoder strip;
  DecoderStep step;
  step.kind = DecoderStep::Kind::kStrip;
  step.content = " ";
  step.start = 1;
  step.stop = 2;
  strip.AddStep(step);
  EXPECT_EQ(DecodeAll(strip, {"  a  ", " b", "c   "}), " abc ");
  Decoder none;
  EXPECT_EQ(DecodeAll(none, {"a", "b"}), "a b");
}

TEST(ParseByteTokenTest, Forms) {
  uint8_t b = 0;
  EXPECT_TRUE(ParseByteToken("<0x0A>", &b));
  EXPECT_EQ(b, 0x0A);
  EXPECT_TRUE(ParseByteToken("<0xff>", &b));
  EXPECT_EQ(b, 0xFF);
  EXPECT_FALSE(ParseByteToken("<0x0A", &b));
  EXPECT_FALSE(ParseByteToken("<0x0G>", &b));
  EXPECT_FALSE(ParseByteToken("0x0A>", &b));
}

}  // namespace
}  // namespace dgserve::tokenizer_internal
