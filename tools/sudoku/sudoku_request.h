// The GenerateRequest of a Sudoku puzzle, shared by `dgserve sudoku` and dgserve-sudoku-eval:
// the plain prompt, the givens as a canvas template (text form, every blank restricted to
// 1-9), or the candidates template (token form, each blank restricted to its own digits).
//
// The model's layout (see sudoku.h): the prompt is ToRows(puzzle) (9 lines of 9 characters,
// '.' blanks), the answer one canvas of 91 tokens: the solution in the same layout, then <eos>.
// Canvas position r*10 + c holds cell (r, c); r*10 + 9 is the line's '\n'; 90 is <eos>.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "common/limits.h"
#include "dgserve/v1/generation.pb.h"
#include "engine/tokenizer/tokenizer.h"
#include "tools/sudoku/sudoku.h"
#include "tools/sudoku/sudoku_tokens.h"

namespace dgserve::sudoku {

// How a puzzle is sent.
// The sample_temperature_spread `dgserve sudoku --samples N` sends unless told otherwise (issue 36
// item 8): sample i of n runs the model's schedule (t_max 2.0 → t_min 0.4) times 1 − 0.75·i/(n −
// 1), so the last sample runs 0.5 → 0.1. At one schedule the samples of a puzzle the model gets
// wrong converge to the same few grids; lower schedules in the later samples give other answers
// (measured in tools/sudoku/README.md, "Best of n").
inline constexpr float kSampleTemperatureSpread = -0.75f;

struct SudokuMode {
  // The givens as a canvas template (infilling): the canvas is ToRows(puzzle) + "<eos>" with
  // every '.' a hole restricted to the digits "1".."9"; given digits, line ends and <eos> fixed.
  bool use_template = true;
  // With use_template: send CandidatesTemplate instead (each hole restricted to the digits not
  // among the givens of its row, column and box). Needs the token ids (SudokuTokens).
  bool candidates = false;
  // n parallel samples from one prefill (seeds seed .. seed + n − 1), at most kMaxSamplesPerRequest
  // (common/limits.h); a gateway's --max_n may be lower, and then it answers INVALID_ARGUMENT.
  int samples = 1;
};

// The canvas template of `puzzle` in the API's text form (see SudokuMode::use_template).
void SetSudokuTemplate(const Grid& puzzle, v1::CanvasTemplate* t);

// The candidates template of `puzzle` in the API's token form: token_ids has the 91 canvas
// positions, a given's digit token, '\n' at r*10 + 9 and <eos> at 90 fixed, -1 at each blank;
// one TemplateHole per blank (in position order) whose allowed ids are the digit tokens of
// CandidateMasks(puzzle) for that cell, in increasing digit order. One elimination pass over the
// givens; the model still solves. INVALID_ARGUMENT naming the cell when a blank has no candidate
// (the givens leave it no digit: the puzzle has no solution).
absl::StatusOr<v1::CanvasTemplate> CandidatesTemplate(const Grid& puzzle,
                                                      const SudokuTokens& tokens);

// The request for `puzzle`: text prompt ToRows(puzzle) (the gateway adds <bos>), max_tokens 91,
// `seed`, the diffusion controls, and the mode's template and sample count. `tokens` is needed
// (non-null) with mode.candidates; INVALID_ARGUMENT without it, with mode.candidates but not
// mode.use_template, or when CandidatesTemplate fails.
absl::StatusOr<v1::GenerateRequest> SudokuRequest(const Grid& puzzle, uint64_t seed,
                                                  const v1::DiffusionControls& diffusion,
                                                  const SudokuMode& mode = {},
                                                  const SudokuTokens* tokens = nullptr);

}  // namespace dgserve::sudoku
