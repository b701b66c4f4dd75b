// `dgserve sudoku PUZZLE`: sends a Sudoku puzzle to a running cluster serving the sudoku model
// (models/sudoku), shows the canvas as it is denoised, and verifies the committed answer.
//
// The request it sends: SudokuRequest (sudoku_request.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "dgserve/v1/generation.pb.h"
#include "tools/chat_client.h"
#include "tools/sudoku/sudoku.h"
#include "tools/sudoku/sudoku_request.h"

namespace dgserve::sudoku {

struct SudokuCliOptions {
  std::string puzzle;       // the PUZZLE argument(s), joined; empty when --puzzle_file is used
  std::string puzzle_file;  // read the puzzle from this file instead
  std::string model_dir = "models/sudoku";  // its tokenizer.json decodes the canvas steps
  uint64_t seed = 0;
  v1::DiffusionControls diffusion;  // sent as is (unset fields: the model's defaults)
  ChatClientOptions client;         // gateway address, API key, deadline
  bool tty = false;                 // stdout is a terminal: ANSI bold givens, redraw in place
  SudokuMode mode;  // template (default), candidates template or plain prompt; samples
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
