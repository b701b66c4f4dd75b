// The requests of sudoku_request.h: the default template, the plain prompt and the candidates
// template, with the token ids of models/sudoku/tokenizer.json.
#include "tools/sudoku/sudoku_request.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dgserve::sudoku {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// The guide's 23-given puzzle (Arto Inkala's) and its solution.
constexpr char kInkala[] =
    "..53.....8......2..7..1.5..4....53...1..7...6..32...8..6.5....9..4....3......97..";
constexpr char kInkalaSolution[] =
    "145327698839654127672918543496185372218473956753296481367542819984761235521839764";

// The ids of models/sudoku/tokenizer.json (tools/sudoku/train/sudoku_vocab.py): <eos> 1,
// "\n" 107, "1".."9" 110..118.
constexpr int32_t kEos = 1, kNewline = 107;
constexpr int32_t Digit(int d) { return 109 + d; }

std::string SourceDir() {
  const char* d = std::getenv("DGSERVE_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

Tokenizer SudokuTokenizer() {
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(SourceDir() + "/models/sudoku/tokenizer.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return *std::move(tok);
}

Grid MustParse(const std::string& text) {
  absl::StatusOr<Grid> grid = ParseGrid(text);
  EXPECT_TRUE(grid.ok()) << grid.status();
  return grid.ok() ? *grid : Grid{};
}

// The allowed ids of the hole at canvas `position` (empty when there is none).
std::vector<int32_t> AllowedAt(const v1::CanvasTemplate& t, int position) {
  for (const v1::TemplateHole& h : t.holes()) {
    if (h.position() == position)
      return {h.allowed_token_ids().begin(), h.allowed_token_ids().end()};
  }
  return {};
}

TEST(CandidateMasksTest, OneEliminationPassOverTheGivens) {
  const Grid p = MustParse(kInkala);
  const std::array<uint16_t, 81> m = CandidateMasks(p);
  auto digits = [&](int r, int c) {
    std::vector<int> out;
    for (int d = 1; d <= 9; ++d) {
      if (m[(r - 1) * 9 + (c - 1)] & (1u << d)) out.push_back(d);
    }
    return out;
  };
  // By hand: r1c1 sees 5 3 (row), 8 4 (column), 5 3 8 7 (box) → 1 2 6 9.
  EXPECT_THAT(digits(1, 1), ElementsAre(1, 2, 6, 9));
  // r1c2: 5 3 (row), 7 1 6 (column), 5 3 8 7 (box) → 2 4 9.
  EXPECT_THAT(digits(1, 2), ElementsAre(2, 4, 9));
  // r5c1: 1 7 6 (row), 8 4 (column), 4 1 3 (box) → 2 5 9.
  EXPECT_THAT(digits(5, 1), ElementsAre(2, 5, 9));
  // r9c9: 9 7 (row), 6 9 (column), 9 3 7 (box) → 1 2 4 5 8.
  EXPECT_THAT(digits(9, 9), ElementsAre(1, 2, 4, 5, 8));
  // A given: its own digit only (r1c3 is 5).
  EXPECT_THAT(digits(1, 3), ElementsAre(5));
  // No propagation: r1c1's neighbours' masks do not narrow it, and the solution's digit is
  // always allowed.
  const Grid solution = MustParse(kInkalaSolution);
  for (int cell = 0; cell < 81; ++cell) {
    EXPECT_TRUE(m[cell] & (1u << solution[cell])) << "cell " << cell;
    EXPECT_EQ(m[cell] & 1u, 0) << "bit 0 (blank) is never set";
  }
}

TEST(CandidatesTemplateTest, PerHoleSetsAndFixedLayoutOfTheGuidePuzzle) {
  const Tokenizer tok = SudokuTokenizer();
  absl::StatusOr<SudokuTokens> tokens = LoadSudokuTokens(tok);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  const Grid p = MustParse(kInkala);
  absl::StatusOr<v1::CanvasTemplate> t = CandidatesTemplate(p, *tokens);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->text().empty());
  EXPECT_TRUE(t->hole().empty());
  EXPECT_EQ(t->allowed_size(), 0);
  EXPECT_FALSE(t->every_canvas());
  ASSERT_EQ(t->token_ids_size(), 91);
  ASSERT_EQ(t->holes_size(), 81 - 23);

  // Fixed positions: the givens' digits, '\n' at r*10 + 9, <eos> at 90; -1 at each blank.
  for (int r = 0; r < 9; ++r) {
    for (int c = 0; c < 9; ++c) {
      const int v = p[r * 9 + c];
      EXPECT_EQ(t->token_ids(r * 10 + c), v == 0 ? -1 : Digit(v)) << "r" << r + 1 << "c" << c + 1;
    }
    EXPECT_EQ(t->token_ids(r * 10 + 9), kNewline);
  }
  EXPECT_EQ(t->token_ids(90), kEos);
  EXPECT_EQ(t->token_ids(2), Digit(5));   // r1c3
  EXPECT_EQ(t->token_ids(3), Digit(3));   // r1c4
  EXPECT_EQ(t->token_ids(85), Digit(9));  // r9c6
  EXPECT_EQ(t->token_ids(86), Digit(7));  // r9c7

  // The same canvas as the text form the gateway resolves (each piece between '.' holes
  // encoded on its own, gateway.cc ResolveTemplate): only the holes' sets differ.
  std::vector<int32_t> text_form;
  const std::string text = ToRows(p) + "<eos>";
  size_t start = 0;
  for (;;) {
    const size_t at = text.find('.', start);
    const std::string piece =
        text.substr(start, at == std::string::npos ? std::string::npos : at - start);
    for (int32_t id : tok.Encode(piece, /*add_bos=*/false)) text_form.push_back(id);
    if (at == std::string::npos) break;
    text_form.push_back(-1);
    start = at + 1;
  }
  EXPECT_THAT(t->token_ids(), ElementsAreArray(text_form));

  // Holes in position order, one per blank, each with its own set (hand-derived above).
  int previous = -1;
  for (const v1::TemplateHole& h : t->holes()) {
    EXPECT_GT(h.position(), previous);
    previous = h.position();
    EXPECT_EQ(t->token_ids(h.position()), -1);
  }
  EXPECT_THAT(AllowedAt(*t, 0), ElementsAre(Digit(1), Digit(2), Digit(6), Digit(9)));  // r1c1
  EXPECT_THAT(AllowedAt(*t, 1), ElementsAre(Digit(2), Digit(4), Digit(9)));            // r1c2
  EXPECT_THAT(AllowedAt(*t, 40), ElementsAre(Digit(2), Digit(5), Digit(9)));           // r5c1
  EXPECT_THAT(AllowedAt(*t, 88),
              ElementsAre(Digit(1), Digit(2), Digit(4), Digit(5), Digit(8)));  // r9c9
  // 217 allowed digits over the 58 blanks (of 522 with 1-9), counted by a separate script.
  int allowed = 0;
  for (const v1::TemplateHole& h : t->holes()) allowed += h.allowed_token_ids_size();
  EXPECT_EQ(allowed, 217);
}

TEST(CandidatesTemplateTest, ABlankWithoutCandidateIsAnErrorNamingTheCell) {
  SudokuTokens tokens;
  for (int d = 1; d <= 9; ++d) tokens.digit[d] = Digit(d);
  tokens.newline = kNewline;
  tokens.eos = kEos;
  // r1c9: 1-8 in its row, 9 in its column; the givens do not conflict.
  const Grid p = MustParse(
      "12345678.........9...............................................................");
  absl::StatusOr<v1::CanvasTemplate> t = CandidatesTemplate(p, tokens);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("cell r1c9 has no candidate digit"));
  // SudokuRequest reports it too instead of building a request.
  SudokuMode mode;
  mode.candidates = true;
  absl::StatusOr<v1::GenerateRequest> req = SudokuRequest(p, 0, {}, mode, &tokens);
  ASSERT_FALSE(req.ok());
  EXPECT_THAT(std::string(req.status().message()), HasSubstr("r1c9"));
}

TEST(SudokuRequestTest, DefaultIsTheTextTemplateUnchanged) {
  const Grid p = MustParse(kInkala);
  v1::DiffusionControls diffusion;
  diffusion.set_max_denoising_steps(12);
  absl::StatusOr<v1::GenerateRequest> req = SudokuRequest(p, 7, diffusion);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->text(), ToRows(p));
  EXPECT_EQ(req->max_tokens(), 91);
  EXPECT_EQ(req->seed(), 7u);
  EXPECT_EQ(req->diffusion().max_denoising_steps(), 12);
  EXPECT_EQ(req->n(), 0);
  const v1::CanvasTemplate& t = req->canvas_template();
  EXPECT_EQ(t.text(), ToRows(p) + "<eos>");
  EXPECT_EQ(t.hole(), ".");
  EXPECT_THAT(t.allowed(), ElementsAre("1", "2", "3", "4", "5", "6", "7", "8", "9"));
  EXPECT_EQ(t.token_ids_size(), 0);
  EXPECT_EQ(t.holes_size(), 0);

  // The plain prompt: no template.
  SudokuMode plain;
  plain.use_template = false;
  absl::StatusOr<v1::GenerateRequest> p_req = SudokuRequest(p, 7, diffusion, plain);
  ASSERT_TRUE(p_req.ok());
  EXPECT_FALSE(p_req->has_canvas_template());
  EXPECT_EQ(p_req->text(), ToRows(p));
}

TEST(SudokuRequestTest, CandidatesModeSendsTheTokenForm) {
  absl::StatusOr<SudokuTokens> tokens = LoadSudokuTokens(SudokuTokenizer());
  ASSERT_TRUE(tokens.ok());
  const Grid p = MustParse(kInkala);
  SudokuMode mode;
  mode.candidates = true;
  mode.samples = 8;
  absl::StatusOr<v1::GenerateRequest> req = SudokuRequest(p, 3, {}, mode, &*tokens);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->text(), ToRows(p));  // the prompt is the same
  EXPECT_EQ(req->n(), 8);
  absl::StatusOr<v1::CanvasTemplate> want = CandidatesTemplate(p, *tokens);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(req->canvas_template().SerializeAsString(), want->SerializeAsString());

  // Without the ids, or with the plain prompt: an error, not a request.
  EXPECT_EQ(SudokuRequest(p, 3, {}, mode).status().code(), absl::StatusCode::kInvalidArgument);
  mode.use_template = false;
  EXPECT_EQ(SudokuRequest(p, 3, {}, mode, &*tokens).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dgserve::sudoku
