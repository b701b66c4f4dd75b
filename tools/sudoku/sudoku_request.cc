// The request of a Sudoku puzzle (see sudoku_request.h).
#include "tools/sudoku/sudoku_request.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace dgserve::sudoku {

void SetSudokuTemplate(const Grid& puzzle, v1::CanvasTemplate* t) {
  t->set_text(ToRows(puzzle) + "<eos>");
  t->set_hole(".");
  for (char d = '1'; d <= '9'; ++d) t->add_allowed(std::string(1, d));
}

absl::StatusOr<v1::CanvasTemplate> CandidatesTemplate(const Grid& puzzle,
                                                      const SudokuTokens& tokens) {
  const std::array<uint16_t, 81> masks = CandidateMasks(puzzle);
  v1::CanvasTemplate t;
  for (int r = 0; r < 9; ++r) {
    for (int c = 0; c < 9; ++c) {
      const int cell = r * 9 + c;
      const int v = puzzle[cell];
      if (v >= 1 && v <= 9) {
        t.add_token_ids(tokens.digit[v]);
        continue;
      }
      if (masks[cell] == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "cell r%dc%d has no candidate digit: every digit 1-9 is already a given of its row, "
            "column or box (the puzzle has no solution)",
            r + 1, c + 1));
      }
      const int position = t.token_ids_size();
      t.add_token_ids(-1);
      v1::TemplateHole* hole = t.add_holes();
      hole->set_position(position);
      for (int d = 1; d <= 9; ++d) {
        if (masks[cell] & (1u << d)) hole->add_allowed_token_ids(tokens.digit[d]);
      }
    }
    t.add_token_ids(tokens.newline);
  }
  t.add_token_ids(tokens.eos);
  return t;
}

absl::StatusOr<v1::GenerateRequest> SudokuRequest(const Grid& puzzle, uint64_t seed,
                                                  const v1::DiffusionControls& diffusion,
                                                  const SudokuMode& mode,
                                                  const SudokuTokens* tokens) {
  v1::GenerateRequest req;
  req.set_text(ToRows(puzzle));
  req.set_max_tokens(kAnswerTokens);
  req.set_seed(seed);
  *req.mutable_diffusion() = diffusion;
  if (mode.candidates) {
    if (!mode.use_template) {
      return absl::InvalidArgumentError("--candidates needs the template (not --template=false)");
    }
    if (tokens == nullptr) {
      return absl::InvalidArgumentError("the candidates template needs the model's token ids");
    }
    absl::StatusOr<v1::CanvasTemplate> t = CandidatesTemplate(puzzle, *tokens);
    if (!t.ok()) return t.status();
    *req.mutable_canvas_template() = *std::move(t);
  } else if (mode.use_template) {
    SetSudokuTemplate(puzzle, req.mutable_canvas_template());
  }
  if (mode.samples > 1) req.set_n(mode.samples);
  return req;
}

}  // namespace dgserve::sudoku
