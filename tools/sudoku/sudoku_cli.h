// `dgserve sudoku PUZZLE`: sends a Sudoku puzzle to a running cluster serving the sudoku model
// (models/sudoku), shows the canvas as it is denoised, and verifies the committed answer.
//
// The model's layout (see sudoku.h): the prompt is ToRows(puzzle) (9 lines of 9 characters,
// '.' blanks), the answer one canvas of 91 tokens: the solution in the same layout, then <eos>.
// Canvas position r*10 + c holds cell (r, c); r*10 + 9 is the line's '\n'.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "dgserve/v1/generation.pb.h"
#include "tools/chat_client.h"
#include "tools/sudoku/sudoku.h"

namespace dgserve::sudoku {

// Completion tokens of one answer: one canvas (81 digits, 9 '\n', <eos>).
inline constexpr int kAnswerTokens = 91;

// How a puzzle is sent.
struct SudokuMode {
  // The givens as a canvas template (infilling): the canvas is ToRows(puzzle) + "<eos>" with
  // every '.' a hole restricted to the digits "1".."9"; given digits, line ends and <eos> fixed.
  bool use_template = true;
  int samples = 1;  // n parallel samples from one prefill (seeds seed .. seed + n − 1)
};

struct SudokuCliOptions {
  std::string puzzle;       // the PUZZLE argument(s), joined; empty when --puzzle_file is used
  std::string puzzle_file;  // read the puzzle from this file instead
  std::string model_dir = "models/sudoku";  // its tokenizer.json decodes the canvas steps
  uint64_t seed = 0;
  v1::DiffusionControls diffusion;  // sent as is (unset fields: the model's defaults)
  ChatClientOptions client;         // gateway address, API key, deadline
  bool tty = false;                 // stdout is a terminal: ANSI bold givens, redraw in place
  SudokuMode mode;                  // template (default) or plain prompt; samples
};

// Reads the puzzle of `options` (the argument or --puzzle_file, exactly one of them) and checks
// it before anything connects: 81 cells (ParseGrid), givens without a conflict, at least one
// solution. INVALID_ARGUMENT with a message naming the problem otherwise. `several_solutions`
// (optional) is set when the puzzle has more than one solution.
absl::StatusOr<Grid> LoadPuzzle(const SudokuCliOptions& options, bool* several_solutions);

// Runs the command: validates the puzzle (LoadPuzzle), loads the tokenizer of
// options.model_dir, streams the request (GenerateStream, a CanvasStep every step), renders the
// grid per step of sample 0 (redrawn in place on a TTY, one line per step otherwise) and verifies
// the committed answers, taking the first sample (by index) that solves the puzzle, printing "solved in N denoising steps (X.XX s)" or "not solved: <why>".
// Returns whether the answer solves the puzzle; an error for bad input, a missing tokenizer or
// a failed RPC (the gRPC status message, prefixed "gateway HOST:PORT: ").
absl::StatusOr<bool> RunSudokuCli(const SudokuCliOptions& options);

// Renders `cells` (0 = not a digit, shown '·') as a 9×9 grid with box separators: 13 lines,
// each ending in '\n'. With `ansi`, a given cell of `puzzle` that holds the given digit is bold,
// one that holds another digit red.
std::string RenderGrid(const Grid& puzzle, const Grid& cells, bool ansi);


// The canvas template of `puzzle` in the API's text form (see SudokuMode::use_template).
inline void SetSudokuTemplate(const Grid& puzzle, v1::CanvasTemplate* t) {
  t->set_text(ToRows(puzzle) + "<eos>");
  t->set_hole(".");
  for (char d = '1'; d <= '9'; ++d) t->add_allowed(std::string(1, d));
}

// The request for `puzzle`: text prompt ToRows(puzzle) (the gateway adds <bos>), max_tokens 91,
// `seed`, the diffusion controls, and the mode's template and sample count. Shared by
// `dgserve sudoku` and dgserve-sudoku-eval.
inline v1::GenerateRequest SudokuRequest(const Grid& puzzle, uint64_t seed,
                                         const v1::DiffusionControls& diffusion,
                                         const SudokuMode& mode = {}) {
  v1::GenerateRequest req;
  req.set_text(ToRows(puzzle));
  req.set_max_tokens(kAnswerTokens);
  req.set_seed(seed);
  *req.mutable_diffusion() = diffusion;
  if (mode.use_template) SetSudokuTemplate(puzzle, req.mutable_canvas_template());
  if (mode.samples > 1) req.set_n(mode.samples);
  return req;
}

// Reads the grid of an answer text; never fails. Text that ParseGrid accepts (81 cells of digits
// or blanks, layout characters ignored) is read as ParseGrid reads it. Anything else is read by
// position in the model's layout: cell (r, c) is character c of line r, 0 (blank) where that is
// missing or not a digit '1'..'9', so a short or garbled answer fails sudoku::Verify with a
// message instead of breaking the reader.
inline Grid ParseAnswer(std::string_view text) {
  if (absl::StatusOr<Grid> strict = ParseGrid(text); strict.ok()) return *strict;
  Grid grid{};
  size_t line_start = 0;
  for (int r = 0; r < 9 && line_start <= text.size(); ++r) {
    size_t line_end = text.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = text.size();
    const std::string_view line = text.substr(line_start, line_end - line_start);
    for (int c = 0; c < 9 && c < int(line.size()); ++c) {
      if (line[c] >= '1' && line[c] <= '9') grid[r * 9 + c] = uint8_t(line[c] - '0');
    }
    line_start = line_end + 1;
  }
  return grid;
}

}  // namespace dgserve::sudoku
