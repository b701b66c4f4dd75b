// Tokenizer tests on small data: the tiny Gemma 3 cut (ids < 512, testdata/) and synthetic
// tokenizer.json documents built here. Expected ids marked "transformers.js" were produced with
// npm @lenml/tokenizers 3.7.2 (a port of transformers.js) loading the same tiny tokenizer.json,
// `encode(text, {add_special_tokens: false})`, under node 20.
#include "engine/tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Json = nlohmann::json;

const std::string kFffd(tokenizer_internal::kReplacementChar);

std::string TinyPath() {
  const char* dir = std::getenv("DGSERVE_SOURCE_DIR");
  return std::string(dir != nullptr ? dir : ".") +
         "/engine/tokenizer/testdata/tiny_v512_tokenizer.json";
}

class TinyTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<Tokenizer> tok = Tokenizer::Load(TinyPath());
    ASSERT_THAT(tok, IsOk());
    tokenizer_ = new Tokenizer(*std::move(tok));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(tokenizer_, nullptr) << "cannot load " << TinyPath(); }
  const Tokenizer& tok() const { return *tokenizer_; }
  // Id of the byte-fallback token of `b` (the Gemma vocabulary has <0x00> at 238).
  static int32_t Byte(int b) { return 238 + b; }

  static Tokenizer* tokenizer_;
};
Tokenizer* TinyTokenizerTest::tokenizer_ = nullptr;

TEST_F(TinyTokenizerTest, Vocabulary) {
  EXPECT_EQ(tok().vocab_size(), 512);
  EXPECT_EQ(tok().PieceToId("<bos>"), 2);
  EXPECT_EQ(tok().PieceToId("<0x41>"), Byte(0x41));
  EXPECT_EQ(tok().PieceToId("▁the"), 506);
  EXPECT_EQ(tok().PieceToId("nope"), std::nullopt);
  EXPECT_EQ(tok().IdToPiece(105), "<start_of_turn>");
  EXPECT_EQ(tok().IdToPiece(107), "\n");
  EXPECT_EQ(tok().IdToPiece(-1), "");
  EXPECT_EQ(tok().IdToPiece(512), "");
  EXPECT_TRUE(tok().IsSpecial(2));
  EXPECT_TRUE(tok().IsSpecial(106));
  EXPECT_FALSE(tok().IsSpecial(4));    // <mask> is an added token but not special
  EXPECT_FALSE(tok().IsSpecial(107));  // "\n"
  EXPECT_FALSE(tok().IsSpecial(512));
}

TEST_F(TinyTokenizerTest, ByteFallbackForCharactersNotInVocab) {
  // transformers.js: "é" -> [433, 407]; "日本" -> [468, 389, 403, 468, 394, 410].
  EXPECT_THAT(tok().Encode("é", false), ElementsAre(Byte(0xC3), Byte(0xA9)));
  EXPECT_THAT(tok().Encode("日本", false), ElementsAre(468, 389, 403, 468, 394, 410));
  EXPECT_THAT(tok().Encode("é", true), ElementsAre(2, Byte(0xC3), Byte(0xA9)));
  EXPECT_THAT(tok().Encode("", false), IsEmpty());
  EXPECT_THAT(tok().Encode("", true), ElementsAre(2));
  // " the": the normalizer makes "▁the"; "▁", "t", "h", "e" are not in this vocabulary, so the
  // "▁t"+"he" merge cannot fire and everything falls back to bytes (transformers.js agrees).
  EXPECT_THAT(tok().Encode(" the", false), ElementsAre(464, 388, 367, 354, 342, 339));
}

TEST_F(TinyTokenizerTest, AddedTokensAreSplitFirstLongestMatch) {
  // transformers.js: [105, 355, 353, 339, 352, 107, 342, 343, 106, 109].
  EXPECT_THAT(tok().Encode("<start_of_turn>user\nhi<end_of_turn>\n\n\n", false),
              ElementsAre(105, 355, 353, 339, 352, 107, 342, 343, 106, 109));
  // "\n\n\n\n" is one added token (110), not four "\n" (transformers.js: [335, 110, 336]).
  EXPECT_THAT(tok().Encode("a\n\n\n\nb", false), ElementsAre(335, 110, 336));
  // Added tokens are matched on the raw text: "<bos>" in the input is the special token.
  EXPECT_THAT(tok().Encode("<bos><bos", false), ElementsAre(2, 298, 336, 349, 353));
}

TEST_F(TinyTokenizerTest, DecodeRoundTripAndSpecials) {
  for (const std::string text :
       {"é日本\n<start_of_turn>🎉", "\n\n\n\n", "<end_of_turn>x", "Ωmega\t", ""}) {
    EXPECT_EQ(tok().Decode(tok().Encode(text, false), false), text);
  }
  EXPECT_EQ(tok().Decode(tok().Encode("<bos>hi<end_of_turn>\n", true), true), "hi\n");
  EXPECT_EQ(tok().Decode(tok().Encode("<bos>hi", true), false), "<bos><bos>hi");
  // HF quirk kept: a "▁" that was byte-encoded comes back as "▁", not as a space (the Replace
  // decoder runs before ByteFallback). transformers.js decodes "x  y" to "x▁▁y" too.
  EXPECT_EQ(tok().Decode(tok().Encode("x  y", false), false), "x▁▁y");
}

TEST_F(TinyTokenizerTest, DecodeInvalidBytesLikeHf) {
  const std::vector<int32_t> truncated = {Byte(0xE2), Byte(0x96), 107};
  EXPECT_EQ(tok().Decode(truncated, false), kFffd + kFffd + "\n");
  const std::vector<int32_t> bad_tail = {Byte(0xC3), Byte(0xA9), Byte(0xFF)};
  EXPECT_EQ(tok().Decode(bad_tail, false), kFffd + kFffd + kFffd);
  const std::vector<int32_t> out_of_range = {-5, Byte(0x41), 512, 100000};
  EXPECT_EQ(tok().Decode(out_of_range, false), "A");
}

TEST_F(TinyTokenizerTest, StreamDecoderHoldsSplitCharacter) {
  const std::vector<int32_t> ids = tok().Encode("é日", false);
  ASSERT_THAT(ids, ElementsAre(Byte(0xC3), Byte(0xA9), 468, 389, 403));
  StreamDecoder stream(tok());
  EXPECT_EQ(stream.Push(std::span(ids).subspan(0, 1)), "");
  EXPECT_EQ(stream.held_bytes(), 1u);
  EXPECT_EQ(stream.Push(std::span(ids).subspan(1, 2)), "é");
  EXPECT_EQ(stream.held_bytes(), 1u);
  EXPECT_EQ(stream.Push(std::span(ids).subspan(3, 1)), "");
  EXPECT_EQ(stream.Push(std::span(ids).subspan(4, 1)), "日");
  EXPECT_EQ(stream.held_bytes(), 0u);
  EXPECT_EQ(stream.Finish(), "");
}

TEST_F(TinyTokenizerTest, StreamDecoderFinishFlushesIncompleteAndResets) {
  StreamDecoder stream(tok());
  const std::vector<int32_t> partial = {Byte(0x41), Byte(0xF0), Byte(0x9F)};
  EXPECT_EQ(stream.Push(partial), "A");
  EXPECT_EQ(stream.Finish(), kFffd + kFffd);
  EXPECT_EQ(stream.held_bytes(), 0u);
  const std::vector<int32_t> next = {Byte(0xC3), Byte(0xA9)};
  EXPECT_EQ(stream.Push(next), "é");
}

TEST_F(TinyTokenizerTest, StreamDecoderSkipsSpecialsByDefault) {
  const std::vector<int32_t> ids = tok().Encode("<start_of_turn>\nhi<end_of_turn>", true);
  StreamDecoder skip(tok());
  EXPECT_EQ(skip.Push(ids) + skip.Finish(), "\nhi");
  StreamDecoder keep(tok(), /*skip_special=*/false);
  EXPECT_EQ(keep.Push(ids) + keep.Finish(), "<bos><start_of_turn>\nhi<end_of_turn>");
}

TEST_F(TinyTokenizerTest, StreamDecoderAnyChunkingEqualsDecode) {
  const std::string text = "Olá 🎉 日本語\n\n<end_of_turn>ǅ𝔘 ok";
  const std::vector<int32_t> ids = tok().Encode(text, false);
  const std::string whole = tok().Decode(ids, true);
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    StreamDecoder stream(tok());
    std::string joined;
    size_t pos = 0;
    while (pos < ids.size()) {
      const size_t len = std::min<size_t>(ids.size() - pos, rng() % 4);
      const std::string piece = stream.Push(std::span(ids).subspan(pos, len));
      EXPECT_TRUE(tokenizer_internal::IsValidUtf8(piece)) << "trial " << trial;
      joined += piece;
      pos += len;
    }
    joined += stream.Finish();
    EXPECT_EQ(joined, whole) << "trial " << trial;
  }
}

// Merges in the ["a", "b"] pair form (a plain initializer list would become a JSON object).
Json Pairs(std::vector<std::pair<std::string, std::string>> pairs) {
  Json out = Json::array();
  for (const auto& [a, b] : pairs) out.push_back(Json::array({a, b}));
  return out;
}

TEST_F(TinyTokenizerTest, ArbitraryInputIsSafe) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes(rng() % 40, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 256);  // often invalid UTF-8
    for (int32_t id : tok().Encode(bytes, true)) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, tok().vocab_size());
    }
    std::vector<int32_t> ids(rng() % 20);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 600) - 20;
    // Decoding never yields invalid UTF-8, whatever the ids.
    EXPECT_TRUE(tokenizer_internal::IsValidUtf8(tok().Decode(ids, false)));
    StreamDecoder stream(tok());
    EXPECT_TRUE(tokenizer_internal::IsValidUtf8(stream.Push(ids) + stream.Finish()));
  }
  // Valid UTF-8 always survives the round trip (this vocabulary has no "▁": avoid spaces).
  EXPECT_EQ(
      tok().Decode(tok().Encode("\x01\x7f\xc2\x80\xef\xbf\xbf\xf4\x8f\xbf\xbf", false), false),
      "\x01\x7f\xc2\x80\xef\xbf\xbf\xf4\x8f\xbf\xbf");
  // Invalid input bytes go through byte fallback and come back as U+FFFD; as in HF the whole
  // byte run is replaced ("a" is a byte token in this vocabulary too).
  EXPECT_EQ(tok().Decode(tok().Encode("\n\xff", false), false), "\n" + kFffd);
  EXPECT_EQ(tok().Decode(tok().Encode("a\xff", false), false), kFffd + kFffd);
}

// A synthetic BPE tokenizer.json: vocab a b c ab bc abc aa, some byte tokens, <unk>.
Json SyntheticJson() {
  Json j;
  j["version"] = "1.0";
  j["added_tokens"] =
      Json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}, {"normalized", false}},
                   {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = nullptr;
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", "<unk>"},
                {"fuse_unk", true},
                {"byte_fallback", true},
                {"vocab",
                 {{"<unk>", 0},
                  {"<s>", 1},
                  {"a", 2},
                  {"b", 3},
                  {"c", 4},
                  {"ab", 5},
                  {"bc", 6},
                  {"abc", 7},
                  {"aa", 8},
                  {"<0xC3>", 9},
                  {"<0xA9>", 10}}},
                {"merges", Pairs({{"a", "b"}, {"b", "c"}, {"ab", "c"}, {"a", "a"}})}};
  return j;
}

absl::StatusOr<Tokenizer> FromJson(const Json& j) { return Tokenizer::FromJson(j.dump(), "test"); }

TEST(SyntheticBpeTest, MergesFollowRankThenPosition) {
  absl::StatusOr<Tokenizer> tok = FromJson(SyntheticJson());
  ASSERT_THAT(tok, IsOk());
  EXPECT_THAT(tok->Encode("abc", false), ElementsAre(7));      // ab, then ab+c
  EXPECT_THAT(tok->Encode("bcab", false), ElementsAre(6, 5));  // ab (rank 0) before bc
  EXPECT_THAT(tok->Encode("aaa", false), ElementsAre(8, 2));   // tie: leftmost pair first
  EXPECT_THAT(tok->Encode("aaaa", false), ElementsAre(8, 8));
  EXPECT_THAT(tok->Encode("abc", true), ElementsAre(1, 7));
  EXPECT_THAT(tok->Encode("<s>abc<unk>", false), ElementsAre(1, 7, 0));
}

TEST(SyntheticBpeTest, StringMergesAndRankOrder) {
  Json j = SyntheticJson();
  // Same merges as "a b" strings, with "b c" ranked first: "abc" -> a + bc, no "a"+"bc" merge.
  j["model"]["merges"] = {"b c", "a b", "ab c", "a a"};
  absl::StatusOr<Tokenizer> tok = FromJson(j);
  ASSERT_THAT(tok, IsOk());
  EXPECT_THAT(tok->Encode("abc", false), ElementsAre(2, 6));
  EXPECT_THAT(tok->Encode("abbc", false), ElementsAre(5, 6));
}

TEST(SyntheticBpeTest, ByteFallbackAndUnknown) {
  Json j = SyntheticJson();
  absl::StatusOr<Tokenizer> tok = FromJson(j);
  ASSERT_THAT(tok, IsOk());
  EXPECT_THAT(tok->Encode("aé", false), ElementsAre(2, 9, 10));
  // "x" and "y" have no byte tokens here: one fused <unk>.
  EXPECT_THAT(tok->Encode("axyb", false), ElementsAre(2, 0, 3));
  EXPECT_EQ(tok->Decode(tok->Encode("aéb", false), false), "aéb");

  j["model"]["fuse_unk"] = false;
  j["model"]["byte_fallback"] = false;
  tok = FromJson(j);
  ASSERT_THAT(tok, IsOk());
  EXPECT_THAT(tok->Encode("axyb", false), ElementsAre(2, 0, 0, 3));
  EXPECT_THAT(tok->Encode("é", false), ElementsAre(0));
}

TEST(SyntheticBpeTest, IgnoreMergesTakesWholeWord) {
  Json j = SyntheticJson();
  j["model"]["merges"] = Json::array();
  absl::StatusOr<Tokenizer> plain = FromJson(j);
  ASSERT_THAT(plain, IsOk());
  EXPECT_THAT(plain->Encode("abc", false), ElementsAre(2, 3, 4));
  j["model"]["ignore_merges"] = true;
  absl::StatusOr<Tokenizer> ignoring = FromJson(j);
  ASSERT_THAT(ignoring, IsOk());
  EXPECT_THAT(ignoring->Encode("abc", false), ElementsAre(7));
}

TEST(SyntheticBpeTest, NormalizerPreTokenizerAndAddedTokenFlags) {
  Json j = SyntheticJson();
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers", {{{"type", "Replace"}, {"pattern", {{"String", "c"}}}, {"content", "ab"}}}}};
  j["pre_tokenizer"] = {{"type", "Split"},
                        {"pattern", {{"String", "a"}}},
                        {"behavior", "Isolated"},
                        {"invert", false}};
  // A normalized added token: matched after normalization ("c" -> "ab" makes "ab").
  j["added_tokens"].push_back(
      {{"id", 11}, {"content", "ab"}, {"special", false}, {"normalized", true}});
  j["model"]["vocab"].erase("ab");
  j["model"]["merges"] = Pairs({{"b", "c"}});
  absl::StatusOr<Tokenizer> tok = FromJson(j);
  ASSERT_THAT(tok, IsOk());
  // "bcb": no "c" survives normalization ("babb"); "ab" is the added token; the rest is split on
  // "a" (isolated): "b" | [ab] | "b".
  EXPECT_THAT(tok->Encode("bcb", false), ElementsAre(3, 11, 3));
  EXPECT_THAT(tok->Encode("ba", false), ElementsAre(3, 2));
}

TEST(SyntheticBpeTest, AddedTokenStripAndSingleWord) {
  Json j = SyntheticJson();
  j["added_tokens"].push_back({{"id", 11},
                               {"content", "<m>"},
                               {"special", true},
                               {"normalized", false},
                               {"lstrip", true},
                               {"rstrip", true}});
  j["added_tokens"].push_back({{"id", 12},
                               {"content", "bb"},
                               {"special", false},
                               {"normalized", false},
                               {"single_word", true}});
  j["model"]["vocab"][" "] = 13;
  absl::StatusOr<Tokenizer> tok = FromJson(j);
  ASSERT_THAT(tok, IsOk());
  EXPECT_THAT(tok->Encode("a  <m>  b", false), ElementsAre(2, 11, 3));
  EXPECT_THAT(tok->Encode("a bb c", false), ElementsAre(2, 13, 12, 13, 4));
  EXPECT_THAT(tok->Encode("abb", false), ElementsAre(5, 3));  // not a single word
}

TEST(TokenizerLoadTest, MissingFileIsNotFound) {
  EXPECT_THAT(Tokenizer::Load("/nonexistent/dir/tokenizer.json"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/dir/tokenizer.json")));
}

TEST(TokenizerLoadTest, MalformedJsonNamesTheFile) {
  const std::string path = ::testing::TempDir() + "/malformed_tokenizer.json";
  std::ofstream(path) << "{\"model\": {\"type\": \"BPE\", ";
  EXPECT_THAT(Tokenizer::Load(path), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(path)));
  EXPECT_THAT(Tokenizer::FromJson("[1, 2]", "x.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x.json")));
  EXPECT_THAT(Tokenizer::FromJson("{}", "x.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model")));
}

TEST(TokenizerLoadTest, RejectsUnsupportedComponentsByName) {
  struct Case {
    std::string field;
    Json value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "NFKC"}}, "NFKC"},
      {"normalizer",
       {{"type", "Replace"}, {"pattern", {{"Regex", "\\s"}}}, {"content", "x"}},
       "Regex"},
      {"pre_tokenizer", {{"type", "Metaspace"}}, "Metaspace"},
      {"decoder", {{"type", "WordPiece"}}, "WordPiece"},
      {"post_processor", {{"type", "RobertaProcessing"}}, "RobertaProcessing"},
  };
  for (const Case& c : cases) {
    Json j = SyntheticJson();
    j[c.field] = c.value;
    EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expected)))
        << c.field;
  }
  Json unigram = SyntheticJson();
  unigram["model"] = {{"type", "Unigram"}, {"vocab", Json::array({Json::array({"a", -1.5})})}};
  EXPECT_THAT(FromJson(unigram),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Unigram")));
  // The model type is reported even when its vocabulary is not BPE-shaped.
  Json odd = SyntheticJson();
  odd["model"] = {{"vocab", {{"a", 0.5}, {"b", {1, 2}}}}, {"type", "WordLevel"}};
  EXPECT_THAT(FromJson(odd), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("WordLevel")));
}

TEST(TokenizerLoadTest, RejectsInconsistentModel) {
  Json j = SyntheticJson();
  j["model"]["merges"] = Pairs({{"a", "zz"}});
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("merge #0")));
  j["model"]["merges"] = {{"a", "b"}};  // an object
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("merges")));
  j["model"]["merges"] = Json::array({Json::array({"a", "b", "c"})});
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("merges[0]")));
  j = SyntheticJson();
  j["model"]["merges"] = {"a b c"};
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("merges[0]")));
  j = SyntheticJson();
  j["model"]["vocab"]["q"] = "seven";
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'q'")));
  j = SyntheticJson();
  j["model"]["vocab"]["q"] = 2;  // id of "a"
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("id 2")));
  j = SyntheticJson();
  j["model"]["unk_token"] = "<nope>";
  EXPECT_THAT(FromJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("<nope>")));
}

// Issue #15 item 6: a special token that is not an object threw json::type_error (the gateway
// aborted at start), and one without "ids" dereferenced an end iterator. Every malformed
// post_processor is an error naming the file and the field now.
TEST(TokenizerLoadTest, MalformedPostProcessorNamesFileAndField) {
  auto expect = [](const Json& j, const std::string& field) {
    absl::StatusOr<Tokenizer> t = Tokenizer::FromJson(j.dump(), "dir/tokenizer.json");
    EXPECT_THAT(t, StatusIs(absl::StatusCode::kInvalidArgument,
                            AllOf(HasSubstr("dir/tokenizer.json"), HasSubstr(field))))
        << j["post_processor"].dump();
  };
  Json j = SyntheticJson();
  j["post_processor"]["special_tokens"]["<s>"] = "<s>";
  expect(j, "special_tokens['<s>'] must be an object");
  j = SyntheticJson();
  j["post_processor"]["special_tokens"]["<s>"].erase("ids");
  expect(j, "special_tokens['<s>']: 'ids' must be an array");
  j = SyntheticJson();
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = Json::array({-1});
  expect(j, "special_tokens['<s>'].ids: bad id -1");
  j = SyntheticJson();
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = Json::array({4294967297ull});
  expect(j, "special_tokens['<s>'].ids: bad id 4294967297");
  j = SyntheticJson();
  j["post_processor"]["special_tokens"] = Json::array({1});
  expect(j, "post_processor.special_tokens must be an object");
  j = SyntheticJson();
  j["post_processor"]["single"] = Json::array({7});
  expect(j, "post_processor.single[0] must be an object");
  j = SyntheticJson();
  j["post_processor"]["single"][0]["SpecialToken"] = "<s>";
  expect(j, "post_processor.single[0]");
}

// A budget bounds the work on one long piece too: the Sudoku model's tokenizer keeps a whole
// text as one BPE piece (it cannot cut before "▁"), and 1,000,000 digits were merged in full
// (1,000,001 ids counted) for a budget of a few thousand. Now only a prefix whose ids must pass
// the budget is merged; within the budget the encoding is unchanged.
TEST(TokenizerBudgetTest, OneLongPieceIsMergedOnlyPastTheBudget) {
  const char* dir = std::getenv("DGSERVE_SOURCE_DIR");
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(
      std::string(dir != nullptr ? dir : ".") + "/models/sudoku/tokenizer.json");
  ASSERT_THAT(tok, IsOk());
  std::string digits;
  for (int i = 0; i < 1000000; ++i) digits += char('1' + i % 9);
  for (const bool text_only : {true, false}) {
    SCOPED_TRACE(text_only);
    auto encode = [&](std::string_view text, size_t budget) {
      return text_only ? tok->EncodeText(text, false, budget) : tok->Encode(text, false, budget);
    };
    const std::vector<int32_t> cut = encode(digits, 4000);
    EXPECT_GT(cut.size(), 4000u);
    EXPECT_LE(cut.size(), 4000u * 4 + 8);  // (budget + 1) pieces of at most 4 bytes, and a char
    const std::string_view part = std::string_view(digits).substr(0, 3000);
    const std::vector<int32_t> whole = tok->EncodeText(part, false);
    EXPECT_EQ(encode(part, whole.size()), whole);
    // A long piece whose ids fit: 10,000 characters outside the vocabulary fuse into one <unk>.
    std::string unknown;
    for (int i = 0; i < 10000; ++i) unknown += "\xc3\xa9";
    unknown += "5";
    const std::vector<int32_t> two = tok->EncodeText(unknown, false);
    ASSERT_EQ(two.size(), 2u);
    EXPECT_EQ(encode(unknown, 2), two);
  }
}

// Without an unk token a character outside the vocabulary makes no id (as in HF), so it does not
// count toward the budget: 100 such characters and one known one fit a budget of 5, and with
// ten known ones the budget is passed.
TEST(TokenizerBudgetTest, CharactersThatMakeNoIdDoNotCount) {
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})", "no-unk");
  ASSERT_THAT(tok, IsOk());
  std::string euros;
  for (int i = 0; i < 100; ++i) euros += "\xe2\x82\xac";
  EXPECT_THAT(tok->EncodeText(euros + "a", false, 5), ElementsAre(0));
  const std::vector<int32_t> ten = tok->EncodeText(euros + std::string(10, 'a'), false, 5);
  EXPECT_GT(ten.size(), 5u);
}

// Characters the Sudoku model's vocabulary has no piece for (it holds only "\n", "▁", "." and
// the digits; BPE with unk_token "<unk>", fuse_unk, no byte fallback) become <unk> (3), one per
// run of them, as in Hugging Face `tokenizers`: nothing is dropped. Expected ids from npm
// @lenml/tokenizers 3.7.2 (transformers.js), node 20, in third_party/npm:
//   TokenizerLoader.fromPreTrained({tokenizerJSON: <models/sudoku/tokenizer.json>,
//   tokenizerConfig: {}}).encode(text, {add_special_tokens: false})
TEST(TokenizerSudokuTest, CharactersOutsideTheVocabularyBecomeOneUnkPerRun) {
  const char* dir = std::getenv("DGSERVE_SOURCE_DIR");
  absl::StatusOr<Tokenizer> tok =
      Tokenizer::Load(std::string(dir != nullptr ? dir : ".") + "/models/sudoku/tokenizer.json");
  ASSERT_THAT(tok, IsOk());
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"\xc3\xa9", {3}},          // "é"
      {"\xe2\x88\x91", {3}},      // "∑"
      {"\xf0\x9f\x98\x80", {3}},  // an emoji
      {"q", {3}},                 // a letter
      {"1\xc3\xa9 2\xe2\x88\x91\xf0\x9f\x98\x80x\n", {110, 3, 108, 111, 3, 107}},
      {"\xce\xa9x. 9\n\n", {3, 109, 108, 118, 107, 107}},  // "Ωx. 9\n\n"
      {"h\xc3\xa9llo w\xc3\xb6rld 42.", {3, 108, 3, 108, 113, 111, 109}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_THAT(tok->Encode(text, /*add_bos=*/false), ElementsAreArray(ids)) << text;
    EXPECT_THAT(tok->EncodeText(text, /*add_bos=*/false), ElementsAreArray(ids)) << text;
    // The post-processor's <bos> (2) first, as encode(text) gives.
    std::vector<int32_t> with_bos = {2};
    with_bos.insert(with_bos.end(), ids.begin(), ids.end());
    EXPECT_THAT(tok->EncodeText(text, /*add_bos=*/true), ElementsAreArray(with_bos)) << text;
  }
  // transformers.js decodes "1é 2"'s ids to "1<unk> 2", and to "1 2" with skip_special_tokens
  // (<unk> is a special added token).
  const std::vector<int32_t> ids = {110, 3, 108, 111};
  EXPECT_EQ(tok->Decode(ids, /*skip_special=*/false), "1<unk> 2");
  EXPECT_EQ(tok->Decode(ids, /*skip_special=*/true), "1 2");
}

}  // namespace
}  // namespace dgserve
