// The token ids of the Sudoku canvas layout (see sudoku_tokens.h).
#include "tools/sudoku/sudoku_tokens.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dgserve::sudoku {

absl::StatusOr<SudokuTokens> LoadSudokuTokens(const Tokenizer& tok) {
  const std::optional<int32_t> unk = tok.PieceToId("<unk>");
  auto one_token = [&](const std::string& s, const char* shown) -> absl::StatusOr<int32_t> {
    const std::vector<int32_t> ids = tok.Encode(s, /*add_bos=*/false);
    if (ids.size() != 1 || (unk && ids[0] == *unk)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the tokenizer does not encode %s as one token of its vocabulary (%d ids): not the "
          "sudoku model's tokenizer",
          shown, ids.size()));
    }
    return ids[0];
  };
  SudokuTokens t;
  for (int d = 1; d <= 9; ++d) {
    const std::string s(1, char('0' + d));
    absl::StatusOr<int32_t> id = one_token(s, absl::StrCat("\"", s, "\"").c_str());
    if (!id.ok()) return id.status();
    t.digit[d] = *id;
  }
  absl::StatusOr<int32_t> nl = one_token("\n", "\"\\n\"");
  if (!nl.ok()) return nl.status();
  t.newline = *nl;
  const std::optional<int32_t> eos = tok.PieceToId("<eos>");
  if (!eos) return absl::InvalidArgumentError("the tokenizer has no <eos> token");
  t.eos = *eos;
  return t;
}

}  // namespace dgserve::sudoku
