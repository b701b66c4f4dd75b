// `dgserve sudoku` (see sudoku_cli.h).
#include "tools/sudoku/sudoku_cli.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve::sudoku {
namespace {

constexpr char kBold[] = "\x1b[1m";
constexpr char kRed[] = "\x1b[1;31m";
constexpr char kReset[] = "\x1b[0m";
constexpr char kClearLine[] = "\x1b[2K";

// The 27 units (9 rows, 9 columns, 9 boxes) as cell indices.
const std::array<std::array<int, 9>, 27>& Units() {
  static const auto units = [] {
    std::array<std::array<int, 9>, 27> u{};
    for (int i = 0; i < 9; ++i) {
      for (int j = 0; j < 9; ++j) {
        u[i][j] = i * 9 + j;                                          // row i
        u[9 + i][j] = j * 9 + i;                                      // column i
        u[18 + i][j] = ((i / 3) * 3 + j / 3) * 9 + (i % 3) * 3 + j % 3;  // box i
      }
    }
    return u;
  }();
  return units;
}

// The first digit that occurs twice in unit `u` of `grid` (blanks ignored), or 0.
int RepeatedDigit(const Grid& grid, int u) {
  unsigned seen = 0;
  for (int cell : Units()[u]) {
    const int v = grid[cell];
    if (v < 1 || v > 9) continue;
    if (seen & (1u << v)) return v;
    seen |= 1u << v;
  }
  return 0;
}

std::string UnitName(int u) {
  static constexpr const char* kKinds[] = {"row", "column", "box"};
  return absl::StrCat(kKinds[u / 9], " ", u % 9 + 1);
}

// Summary of one canvas for the one-line progress report.
struct CanvasStats {
  int digits = 0;        // cells holding a digit
  int givens = 0;        // givens of the puzzle
  int givens_kept = 0;   // givens the canvas repeats
  int repeat_units = 0;  // units with a digit twice
};

CanvasStats Stats(const Grid& puzzle, const Grid& cells) {
  CanvasStats s;
  for (int i = 0; i < 81; ++i) {
    if (cells[i] != 0) ++s.digits;
    if (puzzle[i] != 0) {
      ++s.givens;
      if (cells[i] == puzzle[i]) ++s.givens_kept;
    }
  }
  for (int u = 0; u < 27; ++u) s.repeat_units += RepeatedDigit(cells, u) != 0;
  return s;
}

std::string StepLine(int step, int total_steps, const CanvasStats& s) {
  return absl::StrFormat("step %d%s: %d/81 cells are digits, %d/%d givens kept, %d/27 units with "
                         "a repeated digit",
                         step, total_steps > 0 ? absl::StrCat("/", total_steps) : "", s.digits,
                         s.givens_kept, s.givens, s.repeat_units);
}

// Prints the grid plus one status line; on a TTY, later calls overwrite the previous block.
class Display {
 public:
  Display(const Grid& puzzle, bool tty) : puzzle_(puzzle), tty_(tty) {}

  // Draws `cells` with `status` below it (in place on a TTY).
  void Draw(const Grid& cells, const std::string& status) {
    std::string out;
    if (tty_ && drawn_lines_ > 0) out += absl::StrFormat("\x1b[%dA", drawn_lines_);
    const std::string grid = RenderGrid(puzzle_, cells, tty_);
    size_t start = 0;
    drawn_lines_ = 0;
    while (start < grid.size()) {
      const size_t end = grid.find('\n', start);
      if (tty_) out += kClearLine;
      out.append(grid, start, end - start + 1);
      start = end + 1;
      ++drawn_lines_;
    }
    if (tty_) out += kClearLine;
    out += status + "\n";
    ++drawn_lines_;
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }

 private:
  const Grid& puzzle_;
  bool tty_;
  int drawn_lines_ = 0;
};

}  // namespace

std::string RenderGrid(const Grid& puzzle, const Grid& cells, bool ansi) {
  static constexpr char kRule[] = "+-------+-------+-------+\n";
  std::string out;
  for (int r = 0; r < 9; ++r) {
    if (r % 3 == 0) out += kRule;
    for (int c = 0; c < 9; ++c) {
      if (c % 3 == 0) out += c == 0 ? "| " : " | ";
      if (c % 3 != 0) out += ' ';
      const int cell = r * 9 + c;
      const int v = cells[cell];
      const std::string shown = v >= 1 && v <= 9 ? std::string(1, char('0' + v)) : "\u00b7";
      if (ansi && puzzle[cell] != 0 && v != 0) {
        absl::StrAppend(&out, v == puzzle[cell] ? kBold : kRed, shown, kReset);
      } else {
        out += shown;
      }
    }
    out += " |\n";
  }
  out += kRule;
  return out;
}

absl::StatusOr<Grid> LoadPuzzle(const SudokuCliOptions& options, bool* several_solutions) {
  std::string text = options.puzzle;
  if (!options.puzzle_file.empty()) {
    if (!text.empty()) {
      return absl::InvalidArgumentError("give the puzzle as an argument or --puzzle-file, not both");
    }
    constexpr size_t kMaxBytes = 64 << 10;  // a grid is 81 cells; allow drawings and comments
    // A file, a pipe or "-" (standard input), read up to one byte past the bound.
    absl::StatusOr<std::string> read = ReadInputToString(options.puzzle_file, kMaxBytes + 1);
    if (!read.ok()) {
      return absl::Status(read.status().code(),
                          absl::StrCat("--puzzle-file: ", read.status().message()));
    }
    text = *std::move(read);
    if (text.empty()) {  // named as the file's fault, not as a missing puzzle
      return absl::InvalidArgumentError(absl::StrCat(
          "--puzzle-file ", options.puzzle_file == "-" ? "- (standard input)" : options.puzzle_file,
          " is empty: no puzzle in it"));
    }
    if (text.size() > kMaxBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--puzzle-file ", options.puzzle_file, " is over 64 KiB: not a puzzle"));
    }
    // A UTF-8 byte order mark (editors on Windows write one) is not part of the puzzle.
    if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);
  }
  if (text.empty()) {
    return absl::InvalidArgumentError(
        "no puzzle: give 81 cells (1-9, '.' or '0' for blanks) as the argument, or "
        "--puzzle-file FILE");
  }
  absl::StatusOr<Grid> grid = ParseGrid(text);
  if (!grid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad puzzle: ", grid.status().message()));
  }
  for (int u = 0; u < 27; ++u) {
    if (int d = RepeatedDigit(*grid, u)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bad puzzle: conflicting givens: %s has two %ds", UnitName(u), d));
    }
  }
  const std::array<uint16_t, 81> candidates = CandidateMasks(*grid);
  for (int cell = 0; cell < 81; ++cell) {
    if (candidates[cell] == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bad puzzle: it has no solution: cell r%dc%d can hold no digit (each of 1-9 is already "
          "a given of its row, column or box)",
          cell / 9 + 1, cell % 9 + 1));
    }
  }
  const int solutions = CountSolutions(*grid, 2);
  if (solutions == 0) return absl::InvalidArgumentError("bad puzzle: it has no solution");
  if (several_solutions != nullptr) *several_solutions = solutions > 1;
  return grid;
}

absl::StatusOr<bool> RunSudokuCli(const SudokuCliOptions& options) {
  bool several = false;
  DGSERVE_ASSIGN_OR_RETURN(const Grid puzzle, LoadPuzzle(options, &several));
  const std::string tokenizer_path = options.model_dir + "/tokenizer.json";
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(tokenizer_path);
  if (!tok.ok()) {
    return absl::Status(tok.status().code(),
                        absl::StrCat(tok.status().message(),
                                     " (--model names the sudoku model's directory)"));
  }
  // The step count shown as "step k/N": the request's limit, else the model's default.
  int total_steps = 0;
  if (options.diffusion.has_max_denoising_steps()) {
    total_steps = options.diffusion.max_denoising_steps();
  } else if (auto gen = LoadGenerationConfig(options.model_dir + "/generation_config.json");
             gen.ok()) {
    total_steps = gen->max_denoising_steps;
  }

  if (several) {
    std::printf("note: this puzzle has more than one solution; any valid one counts\n");
    std::fflush(stdout);
  }
  // The gateway must serve a model of the Sudoku shape (the canvas is one answer).
  absl::StatusOr<ModelConfig> local = LoadModelConfig(options.model_dir + "/config.json");
  if (!local.ok()) return local.status();
  DGSERVE_ASSIGN_OR_RETURN(const v1::ListModelsResponse served, ListServedModels(options.client));
  if (served.models_size() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("gateway ", options.client.gateway, " lists no served model"));
  }
  const v1::ModelInfo& m = served.models(0);
  if (m.canvas_length() != local->canvas_length || m.vocab_size() != local->vocab_size) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "gateway %s serves model '%s' (canvas %d, vocabulary %d), not the Sudoku model of %s "
        "(canvas %d, vocabulary %d): start the cluster with --model %s",
        options.client.gateway, m.id(), m.canvas_length(), m.vocab_size(), options.model_dir,
        local->canvas_length, local->vocab_size, options.model_dir));
  }
  Display display(puzzle, options.tty);
  std::string intro = absl::StrCat("puzzle: ", CountGivens(puzzle), " givens");
  if (options.mode.candidates) {
    int allowed = 0;
    for (const uint16_t m : CandidateMasks(puzzle)) allowed += std::popcount(m);
    const int blanks = 81 - CountGivens(puzzle);
    // Given cells count one digit each in CandidateMasks.
    absl::StrAppend(&intro, "; candidates template: ", allowed - CountGivens(puzzle),
                    " digits allowed over ", blanks, " blanks (", 9 * blanks,
                    " with 1-9; one elimination pass over the givens)");
  }
  if (options.tty) {
    display.Draw(puzzle, absl::StrCat(intro, "; waiting for the gateway ", options.client.gateway));
  } else {
    std::printf("%s:\n", intro.c_str());
    std::fputs(RenderGrid(puzzle, puzzle, /*ansi=*/false).c_str(), stdout);
    std::fflush(stdout);
  }

  // A canvas id's digit (0 when it does not decode to one character '1'..'9').
  std::unordered_map<int32_t, uint8_t> digit_cache;
  auto digit_of = [&](int32_t id) -> uint8_t {
    auto [it, inserted] = digit_cache.try_emplace(id, 0);
    if (inserted) {
      const std::string s = tok->Decode(std::span<const int32_t>(&id, 1), /*skip_special=*/true);
      if (s.size() == 1 && s[0] >= '1' && s[0] <= '9') it->second = uint8_t(s[0] - '0');
    }
    return it->second;
  };

  const int samples = std::max(1, options.mode.samples);
  std::optional<SudokuTokens> tokens;
  if (options.mode.candidates) {
    absl::StatusOr<SudokuTokens> t = LoadSudokuTokens(*tok);
    if (!t.ok()) {
      return absl::Status(t.status().code(),
                          absl::StrCat(tokenizer_path, ": ", t.status().message()));
    }
    tokens = *t;
  }
  DGSERVE_ASSIGN_OR_RETURN(
      v1::GenerateRequest req,
      SudokuRequest(puzzle, options.seed, options.diffusion, options.mode,
                    tokens ? &*tokens : nullptr));
  req.mutable_stream_options()->set_canvas_step_interval(1);
  std::vector<std::string> answer_texts(samples);
  // With several samples the winner is known only at the end: each sample's step lines are
  // kept and the chosen sample's are printed then, labelled with it (a terminal shows sample 0
  // live, labelled so).
  std::vector<std::vector<std::string>> step_lines(samples);
  int block_steps = 0;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::Finished> finished =
      StreamGeneration(req, options.client, [&](const v1::GenerateEvent& ev) {
        if (ev.index() < 0 || ev.index() >= samples) return;
        if (ev.has_canvas_step() && ev.canvas_step().canvas() == 0) {
          const v1::CanvasStep& s = ev.canvas_step();
          Grid cells{};
          for (int r = 0; r < 9; ++r) {
            for (int c = 0; c < 9; ++c) {
              const int pos = r * 10 + c;
              if (pos < s.token_ids_size()) cells[r * 9 + c] = digit_of(s.token_ids(pos));
            }
          }
          std::string line = StepLine(s.step() + 1, total_steps, Stats(puzzle, cells));
          if (samples > 1) {
            line = absl::StrCat("sample ", ev.index(), ": ", line);
            step_lines[ev.index()].push_back(line);
          }
          if (options.tty) {
            if (ev.index() == 0) display.Draw(cells, line);
          } else if (samples == 1) {
            std::printf("%s\n", line.c_str());
            std::fflush(stdout);
          }
        } else if (ev.has_block()) {
          answer_texts[ev.index()] += ev.block().text();
          block_steps += ev.block().steps();
        }
      });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!finished.ok()) return finished.status();

  // The first sample that solves the puzzle, else sample 0.
  int chosen = 0;
  for (int i = 0; i < samples; ++i) {
    if (Verify(puzzle, ParseAnswer(answer_texts[i])).ok()) {
      chosen = i;
      break;
    }
  }
  if (samples > 1 && !options.tty) {
    for (const std::string& line : step_lines[chosen]) std::printf("%s\n", line.c_str());
  }
  const Grid answer = ParseAnswer(answer_texts[chosen]);
  const int steps = finished->usage().denoising_steps() > 0 ? finished->usage().denoising_steps()
                                                            : block_steps;
  const std::string answer_line =
      samples > 1 ? absl::StrCat("answer of sample ", chosen, " of ", samples, " after ", steps,
                                 " denoising steps (all samples)")
                  : absl::StrCat("answer after ", steps, " denoising steps");
  if (options.tty) {
    display.Draw(answer, answer_line);
  } else {
    std::printf("%s:\n", answer_line.c_str());
    std::fputs(RenderGrid(puzzle, answer, /*ansi=*/false).c_str(), stdout);
  }
  const absl::Status verdict = Verify(puzzle, answer);
  if (verdict.ok()) {
    std::printf("solved in %d denoising steps (%.2f s)\n", steps, seconds);
  } else {
    std::printf("not solved: %s\n", std::string(verdict.message()).c_str());
  }
  std::fflush(stdout);
  if (std::ferror(stdout)) return absl::DataLossError("could not write to standard output");
  return verdict.ok();
}

}  // namespace dgserve::sudoku
