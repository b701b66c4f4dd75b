// The token ids of the Sudoku canvas layout in a model's vocabulary (see sudoku_request.h for
// the layout). Proto-free: needs only the Tokenizer, so dgserve-quantize's --calibration_sudoku
// (which links neither protobuf nor gRPC) and the request library share one lookup.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve::sudoku {

// Completion tokens of one answer: one canvas (81 digits, 9 '\n', <eos>); the Sudoku model's
// canvas_length.
inline constexpr int kAnswerTokens = 91;

// The token ids of the canvas layout in a model's vocabulary.
struct SudokuTokens {
  std::array<int32_t, 10> digit{};  // digit[d] for d = 1..9 (digit[0] unused)
  int32_t newline = 0;              // "\n"
  int32_t eos = 0;                  // "<eos>"
};

// Looks the layout tokens up in `tok`: each of "1".."9" and "\n" must encode (without BOS) to
// exactly one token that is not <unk>, and "<eos>" must be a piece of the vocabulary.
// INVALID_ARGUMENT naming the string otherwise.
absl::StatusOr<SudokuTokens> LoadSudokuTokens(const Tokenizer& tok);

}  // namespace dgserve::sudoku
