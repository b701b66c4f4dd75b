// CoveringTokens (gateway/request_run.h): the token count usage gives the completion text
// streamed so far, with stream_options.continuous_usage_stats and after a stop sequence.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "gateway/request_run.h"

namespace dgserve {
namespace {

using gateway_internal::CoveringTokens;

std::string SourceDir() {
  const char* dir = std::getenv("DGSERVE_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

// "▁a" (" a") then "é" as its two byte-fallback tokens <0xC3> <0xA9>. The prefix that ends inside
// the character decodes (Tokenizer::Decode) to "a" + U+FFFD, 3 bytes longer than its text, and
// longer than the text "aé" of all three tokens: it covers none of "é", so "aé" takes all 3.
TEST(CoveringTokensTest, AnUnfinishedCharacterCoversNothingOfIt) {
  absl::StatusOr<Tokenizer> tokenizer =
      Tokenizer::Load(SourceDir() + "/engine/tokenizer/testdata/tiny_v512_tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::optional<int32_t> a = tokenizer->PieceToId("▁a");
  const std::optional<int32_t> c3 = tokenizer->PieceToId("<0xC3>");
  const std::optional<int32_t> a9 = tokenizer->PieceToId("<0xA9>");
  ASSERT_TRUE(a && c3 && a9);
  const std::vector<int32_t> ids = {*a, *c3, *a9};
  const std::string all = tokenizer->Decode(ids, true);
  const std::string first = tokenizer->Decode(std::vector<int32_t>{*a}, true);
  ASSERT_EQ(all, first + "é");
  // The whole text "aé": all three tokens (it read 2: "a" + U+FFFD is as long).
  EXPECT_EQ(CoveringTokens(*tokenizer, ids, all.size(), 0, ids.size()), 3);
  // The text before "é": the first token alone; none: no token.
  EXPECT_EQ(CoveringTokens(*tokenizer, ids, first.size(), 0, ids.size()), 1);
  EXPECT_EQ(CoveringTokens(*tokenizer, ids, 0, 0, ids.size()), 0);
  // Searched from an earlier count (continuous usage never goes back).
  EXPECT_EQ(CoveringTokens(*tokenizer, ids, all.size(), 1, ids.size()), 3);
}

}  // namespace
}  // namespace dgserve
