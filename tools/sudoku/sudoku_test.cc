#include "tools/sudoku/sudoku.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace dgserve::sudoku {
namespace {

// Arto Inkala's 2012 "hardest sudoku" and its published solution (a known result, not the output
// of this solver; Verify below checks it against the puzzle independently of CountSolutions).
constexpr char kInkala[] =
    "..53.....8......2..7..1.5..4....53...1..7...6..32...8..6.5....9..4....3......97..";
constexpr char kInkalaSolution[] =
    "145327698839654127672918543496185372218473956753296481367542819984761235521839764";
constexpr int kInkalaGivens = 23;

Grid MustParse(const std::string& text) {
  absl::StatusOr<Grid> grid = ParseGrid(text);
  EXPECT_TRUE(grid.ok()) << grid.status();
  return grid.ok() ? *grid : Grid{};
}

TEST(ParseGridTest, AcceptsDotsZerosWhitespaceAndDrawing) {
  const Grid a = MustParse(kInkala);
  std::string zeros = kInkala;
  for (char& c : zeros) {
    if (c == '.') c = '0';
  }
  EXPECT_EQ(MustParse(zeros), a);
  // The same grid drawn with box borders and the model's row layout.
  std::string drawn;
  const std::string rows = ToRows(a);
  for (int r = 0; r < 9; ++r) {
    if (r % 3 == 0) drawn += "+-------+-------+-------+\n";
    for (int c = 0; c < 9; ++c) {
      if (c % 3 == 0) drawn += "| ";
      drawn += rows[r * 10 + c];
      drawn += ' ';
    }
    drawn += "|\n";
  }
  drawn += "+-------+-------+-------+\n";
  EXPECT_EQ(MustParse(drawn), a);
  EXPECT_EQ(MustParse(rows), a);
  EXPECT_EQ(ToLine(a), kInkala);
  EXPECT_EQ(a[2], 5);
  EXPECT_EQ(a[0], 0);
}

TEST(ParseGridTest, RejectsWrongCellCountsAndLetters) {
  const std::string line = kInkala;
  absl::StatusOr<Grid> short_grid = ParseGrid(line.substr(0, 80));
  ASSERT_FALSE(short_grid.ok());
  EXPECT_EQ(short_grid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_grid.status().message().find("80 cells"), std::string::npos);

  absl::StatusOr<Grid> long_grid = ParseGrid(line + "1");
  ASSERT_FALSE(long_grid.ok());
  EXPECT_EQ(long_grid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(long_grid.status().message().find("82 cells"), std::string::npos);

  std::string letter = line;
  letter[17] = 'x';
  absl::StatusOr<Grid> bad = ParseGrid(letter);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'x'"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("position 17"), std::string::npos) << bad.status();
}

TEST(LayoutTest, ToRowsIsNineLinesOfNine) {
  const Grid g = MustParse(kInkala);
  const std::string rows = ToRows(g);
  ASSERT_EQ(rows.size(), 90u);
  for (int r = 0; r < 9; ++r) {
    EXPECT_EQ(rows[r * 10 + 9], '\n');
    EXPECT_EQ(rows.substr(r * 10, 9), std::string(kInkala).substr(r * 9, 9));
  }
  EXPECT_EQ(CountGivens(g), kInkalaGivens);
  EXPECT_EQ(CountGivens(Grid{}), 0);
}

TEST(SolverTest, InkalaHasExactlyTheKnownSolution) {
  const Grid puzzle = MustParse(kInkala);
  const Grid known = MustParse(kInkalaSolution);
  EXPECT_TRUE(Verify(puzzle, known).ok()) << Verify(puzzle, known);
  EXPECT_FALSE(HasConflict(puzzle));

  Grid solution{};
  EXPECT_EQ(CountSolutions(puzzle, 2, &solution), 1);
  EXPECT_TRUE(Verify(puzzle, solution).ok()) << Verify(puzzle, solution);
  EXPECT_EQ(ToLine(solution), kInkalaSolution);
  EXPECT_EQ(CountSolutions(puzzle, 1), 1);
  EXPECT_EQ(CountSolutions(known, 5), 1);  // a full valid grid is its own single solution
}

TEST(SolverTest, DeadlyPatternHasTwoSolutions) {
  // Find an unavoidable rectangle in the known solution: rows r1, r2 of one band, columns c1, c2
  // of different stacks, with a b / b a in its corners. Blanking the four corners leaves
  // exactly two completions.
  const Grid full = MustParse(kInkalaSolution);
  bool found = false;
  Grid puzzle{};
  for (int r1 = 0; r1 < 9 && !found; ++r1) {
    for (int r2 = r1 + 1; r2 < 9 && !found; ++r2) {
      if (r1 / 3 != r2 / 3) continue;
      for (int c1 = 0; c1 < 9 && !found; ++c1) {
        for (int c2 = c1 + 1; c2 < 9 && !found; ++c2) {
          if (c1 / 3 == c2 / 3) continue;
          if (full[r1 * 9 + c1] == full[r2 * 9 + c2] && full[r1 * 9 + c2] == full[r2 * 9 + c1]) {
            found = true;
            puzzle = full;
            for (int cell : {r1 * 9 + c1, r1 * 9 + c2, r2 * 9 + c1, r2 * 9 + c2}) puzzle[cell] = 0;
          }
        }
      }
    }
  }
  ASSERT_TRUE(found);
  EXPECT_EQ(CountGivens(puzzle), 77);
  EXPECT_EQ(CountSolutions(puzzle, 2), 2);
  EXPECT_EQ(CountSolutions(puzzle, 10), 2);
  EXPECT_EQ(CountSolutions(puzzle, 1), 1);
  Grid first{};
  ASSERT_EQ(CountSolutions(puzzle, 2, &first), 2);
  EXPECT_TRUE(Verify(puzzle, first).ok());
}

TEST(SolverTest, ConflictingGivensHaveNoSolution) {
  Grid puzzle = MustParse(kInkala);
  EXPECT_FALSE(HasConflict(puzzle));
  puzzle[0] = 5;  // row 1 already has a 5 at r1c3
  EXPECT_TRUE(HasConflict(puzzle));
  Grid out{};
  EXPECT_EQ(CountSolutions(puzzle, 2, &out), 0);
  EXPECT_EQ(out, Grid{});

  Grid column{};
  column[0] = 4;
  column[72] = 4;  // r1c1 and r9c1
  EXPECT_TRUE(HasConflict(column));
  EXPECT_EQ(CountSolutions(column, 2), 0);
  Grid box{};
  box[0] = 7;
  box[20] = 7;  // r1c1 and r3c3
  EXPECT_TRUE(HasConflict(box));
  EXPECT_EQ(CountSolutions(box, 2), 0);
}

TEST(GenerateTest, DeterministicPerSeedAndDifferentAcrossSeeds) {
  const Puzzle a = Generate(42, 30);
  const Puzzle b = Generate(42, 30);
  EXPECT_EQ(a.puzzle, b.puzzle);
  EXPECT_EQ(a.solution, b.solution);
  EXPECT_EQ(a.givens, b.givens);
  std::set<std::string> solutions;
  std::set<std::string> puzzles;
  for (uint64_t seed = 0; seed < 10; ++seed) {
    const Puzzle p = Generate(seed, 30);
    solutions.insert(ToLine(p.solution));
    puzzles.insert(ToLine(p.puzzle));
  }
  EXPECT_EQ(solutions.size(), 10u);
  EXPECT_EQ(puzzles.size(), 10u);
}

TEST(GenerateTest, UniqueAndHitsTarget) {
  for (int target : {30, 40}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      SCOPED_TRACE(testing::Message() << "seed " << seed << " target " << target);
      const Puzzle p = Generate(seed, target);
      EXPECT_EQ(p.givens, target);
      EXPECT_EQ(CountGivens(p.puzzle), p.givens);
      EXPECT_FALSE(HasConflict(p.puzzle));
      Grid solved{};
      EXPECT_EQ(CountSolutions(p.puzzle, 2, &solved), 1);
      EXPECT_EQ(solved, p.solution);
      EXPECT_TRUE(Verify(p.puzzle, p.solution).ok()) << Verify(p.puzzle, p.solution);
      EXPECT_EQ(CountGivens(p.solution), 81);
    }
  }
}

TEST(GenerateTest, LowTargetsStopWhenNoCellCanBeCleared) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const Puzzle p = Generate(seed, 17);
    EXPECT_GE(p.givens, 17);
    EXPECT_EQ(CountGivens(p.puzzle), p.givens);
    EXPECT_EQ(CountSolutions(p.puzzle, 2), 1);
    // Minimal: clearing any remaining given breaks uniqueness.
    for (int cell = 0; cell < 81; ++cell) {
      if (p.puzzle[cell] == 0) continue;
      Grid less = p.puzzle;
      less[cell] = 0;
      EXPECT_EQ(CountSolutions(less, 2), 2) << "seed " << seed << " cell " << cell;
    }
  }
  // Targets are clamped to [17, 81].
  EXPECT_GE(Generate(3, 0).givens, 17);
  EXPECT_EQ(Generate(3, 90).givens, 81);
}

TEST(VerifyTest, NamesTheFault) {
  const Grid puzzle = MustParse(kInkala);
  const Grid known = MustParse(kInkalaSolution);

  Grid changed = known;
  changed[2] = 6;  // r1c3 is a given 5
  absl::Status s = Verify(puzzle, changed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("given at r1c3 (5) changed to 6"), std::string::npos) << s;

  Grid blank = known;
  blank[10] = 0;
  s = Verify(puzzle, blank);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("cell r2c2 is blank"), std::string::npos) << s;

  Grid row = known;
  ASSERT_EQ(puzzle[18], 0);
  row[18] = static_cast<uint8_t>(known[18] % 9 + 1);  // r3c1, not a given
  s = Verify(puzzle, row);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("row 3 has two"), std::string::npos) << s;

  // Swapping two cells of one box within a row keeps rows and boxes whole, breaks two columns.
  const Grid empty{};
  Grid column = known;
  std::swap(column[0], column[1]);
  s = Verify(empty, column);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("column 1 has two"), std::string::npos) << s;

  // A cyclic Latin square: every row and column a permutation, the boxes not.
  Grid latin{};
  for (int r = 0; r < 9; ++r) {
    for (int c = 0; c < 9; ++c) latin[r * 9 + c] = static_cast<uint8_t>((r + c) % 9 + 1);
  }
  s = Verify(empty, latin);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("box 1"), std::string::npos) << s;

  EXPECT_TRUE(Verify(empty, known).ok());
  EXPECT_TRUE(Verify(known, known).ok());
}

TEST(CorrectBlanksTest, CountsOnlyBlanks) {
  const Grid puzzle = MustParse(kInkala);
  const Grid known = MustParse(kInkalaSolution);
  EXPECT_EQ(CorrectBlanks(puzzle, known, known), 81 - kInkalaGivens);
  Grid answer = known;
  answer[0] = static_cast<uint8_t>(known[0] % 9 + 1);  // blank r1c1 wrong
  answer[1] = 0;                                       // blank r1c2 left blank
  answer[2] = 9;                                       // a given changed: not counted either way
  EXPECT_EQ(CorrectBlanks(puzzle, known, answer), 81 - kInkalaGivens - 2);
  EXPECT_EQ(CorrectBlanks(puzzle, known, puzzle), 0);
  EXPECT_EQ(CorrectBlanks(Grid{}, known, known), 81);
}

}  // namespace
}  // namespace dgserve::sudoku
