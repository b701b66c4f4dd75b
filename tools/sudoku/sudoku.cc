// Sudoku parsing, solving, generation and verification (see sudoku.h).
#include "tools/sudoku/sudoku.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dgserve::sudoku {
namespace {

constexpr uint16_t kAllDigits = 0x1FF;  // bit d-1 stands for digit d

constexpr int RowOf(int cell) { return cell / 9; }
constexpr int ColOf(int cell) { return cell % 9; }
constexpr int BoxOf(int cell) { return (cell / 27) * 3 + (cell % 9) / 3; }

// SplitMix64: a small, fully specified generator, so that Generate gives the same puzzle for a
// seed on every standard library and platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  // Uniform in [0, n), n >= 1, without modulo bias (values below 2^64 mod n are rejected).
  uint64_t Below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = Next();
      if (r >= threshold) return r % n;
    }
  }

  // Fisher-Yates shuffle of data[0..n).
  template <typename T>
  void Shuffle(T* data, int n) {
    for (int i = n - 1; i > 0; --i) {
      const int j = static_cast<int>(Below(static_cast<uint64_t>(i) + 1));
      std::swap(data[i], data[j]);
    }
  }

 private:
  uint64_t state_;
};

// Exact backtracking search: per-unit bitmasks of used digits and, at every step, the blank cell
// with the fewest candidates. With an Rng, the candidates of each cell are tried in random order.
class Solver {
 public:
  // Loads `grid`; false if a cell is above 9 or two givens conflict.
  bool Load(const Grid& grid) {
    cells_ = grid;
    std::fill(std::begin(rows_), std::end(rows_), 0);
    std::fill(std::begin(cols_), std::end(cols_), 0);
    std::fill(std::begin(boxes_), std::end(boxes_), 0);
    num_empty_ = 0;
    for (int cell = 0; cell < 81; ++cell) {
      const int v = grid[cell];
      if (v == 0) {
        empties_[num_empty_++] = static_cast<uint8_t>(cell);
        continue;
      }
      if (v > 9) return false;
      const uint16_t bit = static_cast<uint16_t>(1u << (v - 1));
      const int r = RowOf(cell), c = ColOf(cell), b = BoxOf(cell);
      if ((rows_[r] | cols_[c] | boxes_[b]) & bit) return false;
      rows_[r] |= bit;
      cols_[c] |= bit;
      boxes_[b] |= bit;
    }
    return true;
  }

  // Counts solutions up to `limit`; the first one found goes to `first` when non-null.
  int Count(int limit, Grid* first, Rng* rng) {
    limit_ = std::max(limit, 1);
    found_ = 0;
    first_ = first;
    rng_ = rng;
    Search();
    return found_;
  }

 private:
  // Returns true when the search should stop (the limit is reached).
  bool Search() {
    if (num_empty_ == 0) {
      if (++found_ == 1 && first_ != nullptr) *first_ = cells_;
      return found_ >= limit_;
    }
    // Most-constrained blank cell.
    int best_index = 0;
    int best_count = 10;
    uint16_t best_free = 0;
    for (int i = 0; i < num_empty_; ++i) {
      const int cell = empties_[i];
      const uint16_t free = static_cast<uint16_t>(
          ~(rows_[RowOf(cell)] | cols_[ColOf(cell)] | boxes_[BoxOf(cell)]) & kAllDigits);
      const int count = std::popcount(free);
      if (count < best_count) {
        best_count = count;
        best_index = i;
        best_free = free;
        if (count <= 1) break;
      }
    }
    if (best_count == 0) return false;

    const int last = num_empty_ - 1;
    std::swap(empties_[best_index], empties_[last]);
    const int cell = empties_[last];
    --num_empty_;
    const int r = RowOf(cell), c = ColOf(cell), b = BoxOf(cell);

    uint8_t digits[9];
    int n = 0;
    for (uint16_t f = best_free; f != 0; f &= static_cast<uint16_t>(f - 1)) {
      digits[n++] = static_cast<uint8_t>(std::countr_zero(f) + 1);
    }
    if (rng_ != nullptr) rng_->Shuffle(digits, n);

    bool stop = false;
    for (int k = 0; k < n && !stop; ++k) {
      const uint16_t bit = static_cast<uint16_t>(1u << (digits[k] - 1));
      cells_[cell] = digits[k];
      rows_[r] |= bit;
      cols_[c] |= bit;
      boxes_[b] |= bit;
      stop = Search();
      rows_[r] &= static_cast<uint16_t>(~bit);
      cols_[c] &= static_cast<uint16_t>(~bit);
      boxes_[b] &= static_cast<uint16_t>(~bit);
    }
    cells_[cell] = 0;
    ++num_empty_;
    std::swap(empties_[best_index], empties_[last]);
    return stop;
  }

  Grid cells_{};
  uint16_t rows_[9] = {};
  uint16_t cols_[9] = {};
  uint16_t boxes_[9] = {};
  uint8_t empties_[81] = {};
  int num_empty_ = 0;
  int limit_ = 1;
  int found_ = 0;
  Grid* first_ = nullptr;
  Rng* rng_ = nullptr;
};

// "r2c5" (1-based).
std::string CellName(int cell) { return absl::StrFormat("r%dc%d", RowOf(cell) + 1, ColOf(cell) + 1); }

// The first digit seen twice among `cells` of `answer`, or 0.
int FirstDuplicate(const Grid& answer, const int (&cells)[9]) {
  uint16_t seen = 0;
  for (int cell : cells) {
    const uint16_t bit = static_cast<uint16_t>(1u << (answer[cell] - 1));
    if (seen & bit) return answer[cell];
    seen |= bit;
  }
  return 0;
}

}  // namespace

absl::StatusOr<Grid> ParseGrid(std::string_view text) {
  Grid grid{};
  size_t cells = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(text[i]);
    if (std::isspace(ch) || ch == '|' || ch == '-' || ch == '+') continue;
    int value;
    if (ch >= '1' && ch <= '9') {
      value = ch - '0';
    } else if (ch == '.' || ch == '0') {
      value = 0;
    } else {
      const std::string shown = std::isprint(ch) ? absl::StrFormat("'%c'", static_cast<char>(ch))
                                                 : absl::StrFormat("byte 0x%02x", ch);
      return absl::InvalidArgumentError(absl::StrFormat(
          "sudoku grid: unexpected character %s at position %d (0-based); expected 1-9, '.' or "
          "'0'",
          shown, i));
    }
    if (cells < 81) grid[cells] = static_cast<uint8_t>(value);
    ++cells;
  }
  if (cells != 81) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sudoku grid: %d cells, expected 81", cells));
  }
  return grid;
}

std::string ToLine(const Grid& grid) {
  std::string out(81, '.');
  for (int cell = 0; cell < 81; ++cell) {
    if (grid[cell] >= 1 && grid[cell] <= 9) out[cell] = static_cast<char>('0' + grid[cell]);
  }
  return out;
}

std::string ToRows(const Grid& grid) {
  const std::string line = ToLine(grid);
  std::string out;
  out.reserve(90);
  for (int r = 0; r < 9; ++r) {
    out.append(line, r * 9, 9);
    out.push_back('\n');
  }
  return out;
}

int CountGivens(const Grid& grid) {
  return static_cast<int>(std::count_if(grid.begin(), grid.end(), [](uint8_t v) { return v != 0; }));
}

bool HasConflict(const Grid& grid) {
  Solver solver;
  return !solver.Load(grid);
}

std::array<uint16_t, 81> CandidateMasks(const Grid& puzzle) {
  uint16_t row[9] = {}, col[9] = {}, box[9] = {};  // digits given in each unit (bit d)
  for (int cell = 0; cell < 81; ++cell) {
    const int v = puzzle[cell];
    if (v < 1 || v > 9) continue;
    row[RowOf(cell)] |= uint16_t(1u << v);
    col[ColOf(cell)] |= uint16_t(1u << v);
    box[BoxOf(cell)] |= uint16_t(1u << v);
  }
  constexpr uint16_t kAll = 0x3FE;  // bits 1..9
  std::array<uint16_t, 81> masks{};
  for (int cell = 0; cell < 81; ++cell) {
    const int v = puzzle[cell];
    masks[cell] = v >= 1 && v <= 9 ? uint16_t(1u << v)
                                   : uint16_t(kAll & ~(row[RowOf(cell)] | col[ColOf(cell)] |
                                                       box[BoxOf(cell)]));
  }
  return masks;
}

int CountSolutions(const Grid& puzzle, int limit, Grid* first) {
  Solver solver;
  if (!solver.Load(puzzle)) return 0;
  return solver.Count(limit, first, nullptr);
}

Puzzle Generate(uint64_t seed, int target_givens) {
  const int target = std::clamp(target_givens, 17, 81);
  Rng rng(seed);

  Puzzle result;
  Solver solver;
  solver.Load(Grid{});
  solver.Count(1, &result.solution, &rng);  // an empty grid always has a solution

  Grid puzzle = result.solution;
  int givens = 81;
  uint8_t order[81];
  for (int i = 0; i < 81; ++i) order[i] = static_cast<uint8_t>(i);
  rng.Shuffle(order, 81);
  // One pass suffices: a cell whose removal broke uniqueness can never be removed later (clearing
  // more cells only adds solutions).
  for (int k = 0; k < 81 && givens > target; ++k) {
    const int cell = order[k];
    const uint8_t value = puzzle[cell];
    puzzle[cell] = 0;
    if (solver.Load(puzzle) && solver.Count(2, nullptr, nullptr) == 1) {
      --givens;
    } else {
      puzzle[cell] = value;
    }
  }
  result.puzzle = puzzle;
  result.givens = givens;
  return result;
}

absl::Status Verify(const Grid& puzzle, const Grid& answer) {
  for (int cell = 0; cell < 81; ++cell) {
    const int v = answer[cell];
    if (v == 0) {
      return absl::FailedPreconditionError(absl::StrCat("cell ", CellName(cell), " is blank"));
    }
    if (v > 9) {
      return absl::FailedPreconditionError(
          absl::StrFormat("cell %s holds %d, not a digit 1-9", CellName(cell), v));
    }
    if (puzzle[cell] != 0 && puzzle[cell] != v) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "given at %s (%d) changed to %d", CellName(cell), puzzle[cell], v));
    }
  }
  int unit[9];
  for (int r = 0; r < 9; ++r) {
    for (int i = 0; i < 9; ++i) unit[i] = r * 9 + i;
    if (int d = FirstDuplicate(answer, unit)) {
      return absl::FailedPreconditionError(absl::StrFormat("row %d has two %ds", r + 1, d));
    }
  }
  for (int c = 0; c < 9; ++c) {
    for (int i = 0; i < 9; ++i) unit[i] = i * 9 + c;
    if (int d = FirstDuplicate(answer, unit)) {
      return absl::FailedPreconditionError(absl::StrFormat("column %d has two %ds", c + 1, d));
    }
  }
  for (int b = 0; b < 9; ++b) {
    const int top = (b / 3) * 3, left = (b % 3) * 3;
    for (int i = 0; i < 9; ++i) unit[i] = (top + i / 3) * 9 + left + i % 3;
    if (int d = FirstDuplicate(answer, unit)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "box %d (rows %d-%d, columns %d-%d) has two %ds", b + 1, top + 1, top + 3, left + 1,
          left + 3, d));
    }
  }
  return absl::OkStatus();
}

int CorrectBlanks(const Grid& puzzle, const Grid& solution, const Grid& answer) {
  int correct = 0;
  for (int cell = 0; cell < 81; ++cell) {
    if (puzzle[cell] == 0 && answer[cell] != 0 && answer[cell] == solution[cell]) ++correct;
  }
  return correct;
}

}  // namespace dgserve::sudoku
