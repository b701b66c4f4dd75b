// LoadSudokuTokens (sudoku_tokens.h), linked without protobuf as dgserve-quantize links it: the
// ids of models/sudoku/tokenizer.json, and tokenizers that lack the layout refused by name.
#include "tools/sudoku/sudoku_tokens.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dgserve::sudoku {
namespace {

using ::testing::HasSubstr;

// The ids of models/sudoku/tokenizer.json (tools/sudoku/train/sudoku_vocab.py): <eos> 1,
// "\n" 107, "1".."9" 110..118.
constexpr int32_t kEos = 1, kNewline = 107;
constexpr int32_t Digit(int d) { return 109 + d; }

std::string SourceDir() {
  const char* d = std::getenv("DGSERVE_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

TEST(SudokuTokensTest, FromTheSudokuTokenizer) {
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(SourceDir() + "/models/sudoku/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<SudokuTokens> t = LoadSudokuTokens(*tok);
  ASSERT_TRUE(t.ok()) << t.status();
  for (int d = 1; d <= 9; ++d) EXPECT_EQ(t->digit[d], Digit(d)) << d;
  EXPECT_EQ(t->newline, kNewline);
  EXPECT_EQ(t->eos, kEos);
}

// A word-level vocabulary of `pieces` (ids in order) with <unk> 0.
Tokenizer TinyTokenizer(const std::string& pieces) {
  std::string vocab = "\"<unk>\": 0";
  int id = 1;
  for (const std::string& p :
       {std::string("1"), std::string("2"), std::string("3"), std::string("4"), std::string("5"),
        std::string("6"), std::string("7"), std::string("8"), std::string("9"), std::string("\\n"),
        std::string("<eos>")}) {
    if (pieces.find(p) == std::string::npos) continue;
    vocab += ", \"" + p + "\": " + std::to_string(id++);
  }
  const std::string json = "{\"model\": {\"type\": \"BPE\", \"vocab\": {" + vocab +
                           "}, \"merges\": [], \"unk_token\": \"<unk>\"}}";
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromJson(json, "tiny");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return *std::move(tok);
}

TEST(SudokuTokensTest, RefusesATokenizerWithoutTheLayout) {
  // All of the layout: digits 1..9 are ids 1..9, "\n" 10, <eos> 11.
  absl::StatusOr<SudokuTokens> t = LoadSudokuTokens(TinyTokenizer("123456789 \\n <eos>"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->digit[5], 5);
  EXPECT_EQ(t->newline, 10);
  EXPECT_EQ(t->eos, 11);
  // "5" is <unk>.
  t = LoadSudokuTokens(TinyTokenizer("12346789 \\n <eos>"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("does not encode \"5\" as one token"));
  // No <eos>.
  t = LoadSudokuTokens(TinyTokenizer("123456789 \\n"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("no <eos> token"));
}

}  // namespace
}  // namespace dgserve::sudoku
