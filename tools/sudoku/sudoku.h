// Sudoku puzzles for the DiffusionGemma demo (issue #6): parsing, exact solving with a
// solution count, seeded generation of unique-solution puzzles, verification of an answer, and
// the text layout the sudoku model reads and writes.
//
// The model's text layout (prompt and answer alike): 9 lines of 9 characters, each line ending
// in '\n' (90 characters). In a prompt a blank is '.'; an answer has digits only. The model's
// canvas is that answer followed by <eos> (91 tokens).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve::sudoku {

// 81 cells in row-major order; 0 is a blank, 1..9 a digit.
using Grid = std::array<uint8_t, 81>;

// Parses 81 cells from `text`: '1'..'9' are digits, '.' and '0' blanks; whitespace and the
// grid-drawing characters '|', '-', '+' are ignored. Errors (InvalidArgument): any other
// character (named with its position), or a cell count other than 81.
absl::StatusOr<Grid> ParseGrid(std::string_view text);

// The 81-character form: digits, '.' for blanks.
std::string ToLine(const Grid& grid);

// The model's layout: 9 lines of 9 characters each ending in '\n'; blanks are '.'.
std::string ToRows(const Grid& grid);

// Number of givens (non-blank cells).
int CountGivens(const Grid& grid);

// Whether the givens already break a rule (two equal digits in a row, column or box).
bool HasConflict(const Grid& grid);

// The digits each cell may hold after one elimination pass over the givens only: bit d (1..9)
// of result[cell] is set when d is not a given of the cell's row, column or 3x3 box. A given
// cell's mask is its own digit alone. No propagation and no search: one blank's mask does not
// depend on another's. A blank with mask 0 (every digit already in its units) means the puzzle
// has no solution.
std::array<uint16_t, 81> CandidateMasks(const Grid& puzzle);

// Counts the solutions of `puzzle`, stopping at `limit` (>= 1). When `first` is non-null and a
// solution exists, the first one found is stored there. A puzzle whose givens conflict has 0.
// Exact backtracking search with bitmasks and the most-constrained cell first.
int CountSolutions(const Grid& puzzle, int limit, Grid* first = nullptr);

// A puzzle with exactly one solution.
struct Puzzle {
  Grid puzzle;
  Grid solution;
  int givens = 0;
};

// Generates a unique-solution puzzle from `seed` (the same seed always gives the same puzzle):
// a random full grid, then cells cleared in a random order, each only if the solution stays
// unique, until `target_givens` remain or no further cell can be cleared (then `givens` is
// above the target). `target_givens` is clamped to [17, 81].
Puzzle Generate(uint64_t seed, int target_givens);

// Checks `answer` against `puzzle`: every cell a digit, every given kept, every row, column and
// box a permutation of 1..9. OK, or FailedPrecondition whose message names the first fault
// ("row 3 has two 7s", "given at r1c4 (5) changed to 6", "cell r2c2 is blank").
absl::Status Verify(const Grid& puzzle, const Grid& answer);

// Per-cell accuracy helper: how many of the blank cells of `puzzle` `answer` fills with the
// digit of `solution`.
int CorrectBlanks(const Grid& puzzle, const Grid& solution, const Grid& answer);

}  // namespace dgserve::sudoku
