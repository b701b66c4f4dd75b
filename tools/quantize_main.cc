// dgserve-quantize: writes a quantized checkpoint (compressed-tensors FP8 or W4A16, NVFP4 in
// ModelOpt's or compressed-tensors' layout) from a bf16 DiffusionGemma checkpoint; what it
// writes: engine/model/quantize_checkpoint.h.
//
//   dgserve-quantize --in DIR --out DIR --format fp8
//   dgserve-quantize --in DIR --out DIR --format w4a16 --group_size 128
//   dgserve-quantize --in DIR --out DIR --format nvfp4 [--nvfp4_layout modelopt]
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors
//                    --nvfp4_activations none
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --calibration PROMPTS.jsonl
//   dgserve-quantize --in models/sudoku --out DIR --format nvfp4
//                    --calibration_sudoku tools/sudoku/data/train.jsonl --calibration_limit 128
//   dgserve-quantize --in models/sudoku --out DIR --format w4a16 --group_size 32 --gptq
//                    --calibration_sudoku tools/sudoku/data/train.jsonl --calibration_limit 128
//                    [--gptq_sequential]   (layer by layer: one layer's Hessians at a time)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/cli.h"
#include "common/jsonl.h"
#include "common/status_macros.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/calibrate.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/tokenizer/tokenizer.h"
#include "tools/sudoku/sudoku.h"
#include "tools/sudoku/sudoku_tokens.h"

ABSL_FLAG(std::string, in, "", "bf16 checkpoint directory to read (required)");
ABSL_FLAG(std::string, out, "", "checkpoint directory to write (required; created if needed)");
ABSL_FLAG(std::string, format, "", "fp8, w4a16 or nvfp4 (required)");
ABSL_FLAG(std::optional<int32_t>, group_size, std::nullopt,
          "w4a16: inputs per scale group (0: one group per row; default 128); nvfp4: fixed at 16 "
          "(another value is refused)");
ABSL_FLAG(std::string, nvfp4_layout, "",
          "--format nvfp4 only: the checkpoint layout, named as vLLM's quantization methods: "
          "modelopt (default; quant_method \"modelopt\", M.weight / weight_scale_2 / "
          "input_scale, as TensorRT Model Optimizer exports) or compressed-tensors (format "
          "\"nvfp4-pack-quantized\", M.weight_packed / weight_global_scale / "
          "input_global_scale, as llm-compressor's NVFP4 scheme writes)");
ABSL_FLAG(std::string, nvfp4_activations, "",
          "--format nvfp4 only: nvfp4 (default; W4A4, the activations quantized to NVFP4 at run "
          "time) or none (weight-only NVFP4A16, as llm-compressor's NVFP4A16 preset writes: no "
          "input_global_scale, activations unquantized; needs --nvfp4_layout compressed-tensors)");
ABSL_FLAG(std::string, ignore, absl::StrJoin(dgserve::DefaultQuantizeIgnore(), ","),
          "comma-separated compressed-tensors ignore list (module names or re:REGEX, an ECMAScript "
          "regular expression): modules kept in bf16 (it replaces the default; ASCII whitespace "
          "around each entry is dropped, and an entry given twice is written once; an entry that "
          "names no module of the checkpoint is warned about before anything runs). Default: the "
          "LM head and embedding, the MoE router, the norms, and "
          "the self-conditioning MLP");
namespace dgserve {

// A calibration file flag that knows whether it was given: absl calls AbslParseFlag only for a
// value from the command line, so `--calibration_sudoku ""` (given, empty: refused) differs from
// leaving the flag out (the default, not given).
struct CalibrationFileFlag {
  std::string path;
  bool given = false;
};
bool AbslParseFlag(absl::string_view text, CalibrationFileFlag* f, std::string* /*error*/) {
  f->path = std::string(text);
  f->given = true;
  return true;
}
std::string AbslUnparseFlag(const CalibrationFileFlag& f) { return f.path; }

// A number flag that knows whether it was given; `--flag=` (empty, given) is refused by
// CheckCalibrationFlags (absl reads it as not given for a std::optional<double>, which would
// ignore it silently; and the default must parse from its string form, "").
struct GivenNumberFlag {
  double value = 0;
  bool given = false;
  bool empty = false;  // given as ""
  std::optional<double> get() const { return given ? std::optional<double>(value) : std::nullopt; }
};
bool AbslParseFlag(absl::string_view text, GivenNumberFlag* f, std::string* error) {
  f->given = true;
  f->empty = text.empty();
  if (!f->empty && !absl::SimpleAtod(text, &f->value)) {
    *error = "not a number";
    return false;
  }
  return true;
}
std::string AbslUnparseFlag(const GivenNumberFlag& f) {
  return f.given ? absl::StrCat(f.value) : "";
}

}  // namespace dgserve

ABSL_FLAG(dgserve::CalibrationFileFlag, calibration, {},
          "--format nvfp4 (W4A4), or w4a16 with --gptq: JSONL file of calibration prompts, one "
          "{\"prompt\": "
          "\"...\"} per line, tokenized with --in's tokenizer.json as the gateway does (<bos> "
          "first). The bf16 model runs each prompt's encoder pass and one canvas of denoising "
          "steps on the CPU backend (float32 GEMM mode) and every quantized Linear's "
          "input_scale (ModelOpt) / input_global_scale (compressed-tensors) is set from the "
          "amax(|x|) of its inputs: amax / (6 * 448) resp. 448 * 6 / amax (with --gptq: the "
          "input Hessians GPTQ rounds against). Without it (and without --calibration_sudoku) "
          "the data-free 1/6 resp. 6");
ABSL_FLAG(dgserve::CalibrationFileFlag, calibration_sudoku, {},
          "as --calibration, with the prompts and canvas templates of a Sudoku JSONL puzzle "
          "file (dgserve-sudoku-gen's {\"puzzle\": ...} lines; use the TRAIN split, "
          "tools/sudoku/make_splits.sh, never the test split): prompt ToRows(puzzle), the givens "
          "fixed in the canvas and every blank restricted to 1-9, as dgserve-sudoku-eval sends");
ABSL_FLAG(int32_t, calibration_limit, 0,
          "calibrate on the first N prompts / puzzles only (0: all; the file is read no "
          "further than the Nth)");
ABSL_FLAG(int32_t, calibration_steps, 0,
          "the sampler's max_denoising_steps for the calibration canvases, ≤ 1024 (0: --in's "
          "generation_config.json value). Not only a cap: the step count also sets the noise "
          "schedule, so the default calibrates on the schedule the model is served with");
ABSL_FLAG(bool, gptq, false,
          "--format w4a16 only, with --calibration or --calibration_sudoku: quantize each module "
          "by GPTQ (Frantar et al. 2022, no activation reordering; engine/model/gptq.h) against "
          "the input Hessian sum(x x^T) of its inputs over the calibration prompts' encoder "
          "passes and denoising steps of the bf16 model (with --gptq_sequential, of the model "
          "whose earlier layers are quantized), rather than round-to-nearest; an expert no "
          "calibration row reached is rounded to nearest");
ABSL_FLAG(bool, gptq_sequential, false,
          "--gptq only: GPTQ layer by layer (llm-compressor's sequential pipeline): each layer is "
          "calibrated on the model whose earlier layers are already quantized, then quantized, "
          "holding one layer's Hessians at a time instead of every layer's (what the real-width "
          "model needs); one calibration run per layer");
ABSL_FLAG(dgserve::GivenNumberFlag, gptq_dampening, {},
          "--gptq only: the dampening added to the Hessian's diagonal, as a fraction of its mean, "
          "in [0, 1e6] (default 0.01, llm-compressor's dampening_frac)");
ABSL_FLAG(dgserve::GivenNumberFlag, gptq_max_gb, {},
          "--gptq only: refuse before calibrating when the Hessians of every module and their "
          "factors (float64, held at once: twice the Hessians' bytes) take more than this many "
          "GiB (default 16); with --gptq_sequential, one layer's Hessians and a factor");
ABSL_FLAG(int64_t, max_shard_bytes, dgserve::kDefaultMaxShardBytes,
          "bytes of tensors per safetensors shard");

namespace dgserve {
namespace {

// The Sudoku layout's token ids, found by CheckSudokuLayout.
struct SudokuLayout {
  sudoku::SudokuTokens tokens;
  int32_t blank = 0;  // "."

  // The ids of `rows` (ToRows: '.', '1'..'9', '\n'), one per character.
  std::vector<int32_t> PerCharacter(const std::string& rows) const {
    std::vector<int32_t> ids;
    ids.reserve(rows.size());
    for (char ch : rows) {
      ids.push_back(ch == '.' ? blank : ch == '\n' ? tokens.newline : tokens.digit[ch - '0']);
    }
    return ids;
  }
};

// Whether --in can be the Sudoku model (the layout of tools/sudoku/sudoku_request.h), checked
// from its config and tokenizer alone, before any puzzle is read: the answer is one canvas of
// sudoku::kAnswerTokens (91: 81 digits, 9 "\n", <eos>), so config.canvas_length must be 91; the
// prompt is <bos> + ToRows(puzzle) at one token per character, so "1".."9", "\n" and "." must
// each be one token (sudoku::LoadSudokuTokens; "." here) and the rows of a board of blanks must
// encode to 90 tokens, not merged (Gemma's tokenizer merges runs of '.'). Each puzzle's prompt is
// checked again as it is read (SudokuPrompts). INVALID_ARGUMENT naming --calibration_sudoku and
// the property otherwise.
absl::StatusOr<SudokuLayout> CheckSudokuLayout(const Tokenizer& tok, const ModelConfig& config) {
  if (config.canvas_length != sudoku::kAnswerTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_sudoku: --in's canvas_length is ", config.canvas_length,
                     ", the Sudoku layout's answer is one canvas of ", sudoku::kAnswerTokens,
                     " tokens (81 digits, 9 \"\\n\", <eos>): not the Sudoku model"));
  }
  absl::StatusOr<sudoku::SudokuTokens> tokens = sudoku::LoadSudokuTokens(tok);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_sudoku: ", tokens.status().message()));
  }
  SudokuLayout layout;
  layout.tokens = *tokens;
  const std::optional<int32_t> unk = tok.PieceToId("<unk>");
  const std::vector<int32_t> blank = tok.Encode(".", /*add_bos=*/false);
  if (blank.size() != 1 || (unk && blank[0] == *unk)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--calibration_sudoku: the tokenizer does not encode \".\" (a blank) as one token of its "
        "vocabulary (",
        blank.size(), " ids): not the Sudoku model's tokenizer"));
  }
  layout.blank = blank[0];
  const std::string empty_rows = sudoku::ToRows(sudoku::Grid{});
  const std::vector<int32_t> ids = tok.Encode(empty_rows, /*add_bos=*/false);
  if (ids != layout.PerCharacter(empty_rows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_sudoku: the tokenizer encodes the ", empty_rows.size(),
                     " characters of an empty board's rows to ", ids.size(),
                     " tokens, not one token per character: not the Sudoku model's tokenizer"));
  }
  return layout;
}

// The calibration requests of a Sudoku puzzle file: prompt <bos> + ToRows(puzzle), and the
// canvas template ToRows(puzzle) + <eos> with every blank restricted to the digits 1-9 (the
// template dgserve-sudoku-eval sends, sudoku::SetSudokuTemplate), in the token ids of
// sudoku::LoadSudokuTokens; the first `limit` puzzles (0: all), read no further. Errors name
// FILE:LINE (a puzzle whose givens conflict or that has no solution included, a line with a
// key twice (ForEachJsonLine), or a puzzle whose prompt is not one token per character);
// INVALID_ARGUMENT before the file is read when `config` and `tok` cannot be the Sudoku layout
// (CheckSudokuLayout).
absl::StatusOr<std::vector<CalibrationPrompt>> SudokuPrompts(const std::string& path,
                                                             const Tokenizer& tok,
                                                             const ModelConfig& config, int limit) {
  DGSERVE_ASSIGN_OR_RETURN(const SudokuLayout layout, CheckSudokuLayout(tok, config));
  const sudoku::SudokuTokens& tokens = layout.tokens;
  const std::vector<int32_t> digits(tokens.digit.begin() + 1, tokens.digit.end());
  std::vector<CalibrationPrompt> out;
  auto add_puzzle = [&](const nlohmann::json& j, int) -> absl::Status {
    if (j.is_discarded() || !j.is_object() || !j.contains("puzzle") || !j["puzzle"].is_string()) {
      return absl::InvalidArgumentError("expected a JSON object with a string \"puzzle\"");
    }
    absl::StatusOr<sudoku::Grid> grid = sudoku::ParseGrid(j["puzzle"].get<std::string>());
    if (!grid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("\"puzzle\": ", grid.status().message()));
    }
    if (sudoku::HasConflict(*grid)) {
      return absl::InvalidArgumentError(
          "\"puzzle\": its givens conflict (a digit twice in a row, column or box)");
    }
    // Givens that do not conflict may still admit no solution (a blank with no digit left, or a
    // dead end deeper in): the exact search, stopped at the first solution.
    if (sudoku::CountSolutions(*grid, /*limit=*/1) == 0) {
      return absl::InvalidArgumentError(
          "\"puzzle\": it has no solution (its givens do not conflict, but no grid completes "
          "them)");
    }
    const std::string rows = sudoku::ToRows(*grid);
    CalibrationPrompt p;
    p.prompt = tok.EncodeText(rows, /*add_bos=*/true);
    // The layout's prompt: <bos>, then one token per character of the rows (a merge such as
    // "..." into one token would make it another prompt than the model was trained on).
    const std::vector<int32_t> per_char = layout.PerCharacter(rows);
    if (p.prompt.size() != per_char.size() + 1 ||
        !std::equal(per_char.begin(), per_char.end(), p.prompt.begin() + 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"puzzle\": the tokenizer encodes its prompt to ", p.prompt.size(),
                       " tokens, not <bos> and one token per character (", per_char.size() + 1,
                       "): not the Sudoku model's tokenizer"));
    }
    std::vector<int32_t> canvas;
    std::vector<TemplateHoleSpec> holes;
    for (char ch : rows) {  // '.', '1'..'9' or '\n' (ToRows)
      if (ch == '.') {
        holes.push_back({int(canvas.size()), digits});
        canvas.push_back(-1);
      } else {
        canvas.push_back(ch == '\n' ? tokens.newline : tokens.digit[ch - '0']);
      }
    }
    canvas.push_back(tokens.eos);
    DGSERVE_ASSIGN_OR_RETURN(
        p.canvas_template,
        CanvasTemplate::Create(canvas, holes, config.canvas_length, config.vocab_size));
    out.push_back(std::move(p));
    return absl::OkStatus();
  };
  DGSERVE_RETURN_IF_ERROR(ForEachJsonLine(path, limit, add_puzzle));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no puzzle"));
  return out;
}

// Warns on stderr of each --ignore entry that names no module of checkpoint `in`
// (UnmatchedIgnoreEntries, matched as the writer matches it: most likely a typo, whose modules
// would be quantized), before anything is calibrated or written; not of the default list's
// entries, meant for every checkpoint (a tied model has no lm_head). A checkpoint whose headers
// cannot be read gets no warning here: the run refuses it next.
void WarnUnmatchedIgnore(const std::string& in, const QuantizeOptions& options) {
  const absl::StatusOr<std::vector<std::string>> unmatched = UnmatchedIgnoreEntries(in, options);
  if (!unmatched.ok()) return;
  const std::vector<std::string> defaults = DefaultQuantizeIgnore();
  for (const std::string& e : *unmatched) {
    if (std::find(defaults.begin(), defaults.end(), e) != defaults.end()) continue;
    std::fprintf(stderr,
                 "warning: --ignore entry '%s' names no module of %s (a typo? the modules it "
                 "meant will be quantized)\n",
                 e.c_str(), in.c_str());
  }
}

// The --calibration / --calibration_sudoku amax per module (options->input_amax), or with --gptq
// the input Hessians (options->gptq_hessians), or with --gptq_sequential the modules quantized
// layer by layer (options->w4a16_modules); nothing without either flag. The flags were
// checked by CheckCalibrationFlags. The prompts (and, with --calibration_sudoku, the Sudoku
// layout) are checked from --in's config.json and tokenizer.json before its weights are read: a
// refused model or file fails without reading gigabytes; then the ignore list (CheckIgnoreList).
// *calibration_s: the seconds the calibration runs took (not the weight load).
absl::Status Calibrate(const std::string& in, QuantizeOptions* quantize, double* calibration_s) {
  const std::string prompts_file = absl::GetFlag(FLAGS_calibration).path;
  const std::string sudoku_file = absl::GetFlag(FLAGS_calibration_sudoku).path;
  if (prompts_file.empty() && sudoku_file.empty()) return absl::OkStatus();
  // The file LoadCheckpoint reads its config from.
  DGSERVE_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(in + "/config.json"));
  DGSERVE_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(in + "/tokenizer.json"));
  const int limit = absl::GetFlag(FLAGS_calibration_limit);
  // Every prompt checked before anything runs: one canvas follows it (the calibration's
  // request), so the context leaves max_position_embeddings − canvas_length positions.
  absl::StatusOr<std::vector<CalibrationPrompt>> read =
      !prompts_file.empty()
          ? ReadCalibrationPrompts(
                prompts_file, tok,
                std::max(1, config.max_position_embeddings - config.canvas_length), limit)
          : SudokuPrompts(sudoku_file, tok, config, limit);
  // Named by its flag (a file that could not be opened said only its path), unless the
  // message names it already.
  if (!read.ok() && !absl::StartsWith(read.status().message(), "--")) {
    return absl::Status(
        read.status().code(),
        absl::StrCat(!prompts_file.empty() ? "--calibration: " : "--calibration_sudoku: ",
                     read.status().message()));
  }
  if (!read.ok()) return read.status();
  std::vector<CalibrationPrompt> prompts = *std::move(read);
  if (limit > 0 && size_t(limit) < prompts.size()) prompts.resize(limit);
  // The ignore list against --in's modules (its safetensors headers), matched as the writer will
  // match it: a list the writer would refuse is refused before the calibration runs (minutes to
  // hours), not after. (After the prompts: a refused prompt file or Sudoku layout is named
  // without reading --in's weights, headers included.)
  const bool sequential = absl::GetFlag(FLAGS_gptq) && absl::GetFlag(FLAGS_gptq_sequential);
  // The denoising steps the amax calibration runs per canvas at most (none with --gptq): a list
  // whose quantized modules one step never observes is refused now, not after calibrating.
  int amax_steps = 0;
  if (!absl::GetFlag(FLAGS_gptq)) {
    amax_steps = absl::GetFlag(FLAGS_calibration_steps);
    std::error_code ec;
    const std::string gen = in + "/generation_config.json";
    if (amax_steps == 0 && std::filesystem::exists(gen, ec)) {  // as LoadCheckpoint reads it
      DGSERVE_ASSIGN_OR_RETURN(const GenerationConfig g, LoadGenerationConfig(gen));
      amax_steps = g.max_denoising_steps;
    } else if (amax_steps == 0) {
      amax_steps = GenerationConfig().max_denoising_steps;
    }
  }
  DGSERVE_RETURN_IF_ERROR(
      CheckIgnoreList(in, *quantize, /*layer_by_layer=*/sequential, amax_steps));
  WarnUnmatchedIgnore(in, *quantize);
  const double max_gb = absl::GetFlag(FLAGS_gptq_max_gb).get().value_or(16.0);
  const auto max_bytes = int64_t(max_gb * double(int64_t{1} << 30));
  // The Hessians, and QuantizeCheckpoint's factor of each beside them; layer by layer, one
  // layer's and the factor being made.
  const int64_t gptq_bytes = sequential ? LayerGptqBytes(config) : 2 * InputHessianBytes(config);
  if (absl::GetFlag(FLAGS_gptq) && gptq_bytes > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--gptq: the input Hessians of ", sequential ? "one layer's modules" : "every module",
        " of ", in, sequential ? " and a factor take " : " and their factors take ", gptq_bytes,
        " bytes (float64, held at once), more than --gptq_max_gb ", max_gb, " GiB",
        sequential ? "" : " (--gptq_sequential holds one layer's at a time)"));
  }
  DGSERVE_ASSIGN_OR_RETURN(Checkpoint ck, LoadCheckpoint(in));
  CalibrationOptions options;
  options.max_denoising_steps = absl::GetFlag(FLAGS_calibration_steps);
  const auto start = std::chrono::steady_clock::now();  // the calibration runs alone
  if (sequential) {
    LayerGptqOptions layer;
    layer.group_size = quantize->group_size;
    layer.dampening = quantize->gptq_dampening;
    layer.ignore = quantize->ignore;
    DGSERVE_ASSIGN_OR_RETURN(quantize->w4a16_modules,
                             QuantizeW4a16GptqByLayer(ck, prompts, options, layer));
  } else if (absl::GetFlag(FLAGS_gptq)) {
    DGSERVE_ASSIGN_OR_RETURN(quantize->gptq_hessians,
                             CalibrateInputHessians(ck, prompts, options, max_bytes / 2));
  } else {
    DGSERVE_ASSIGN_OR_RETURN(quantize->input_amax, CalibrateActivationAmax(ck, prompts, options));
  }
  *calibration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return absl::OkStatus();
}

// The calibration flags' own checks, before anything is read or run: no empty path given
// (`--calibration_sudoku ""`); one calibration source;
// --calibration_limit / --calibration_steps ≥ 0 and only with a source; a format with a static
// activation scale (W4A4 NVFP4). (Run checks --in and --out right after, before calibrating.)
absl::Status CheckCalibrationFlags(const QuantizeOptions& options, const std::string& format) {
  const CalibrationFileFlag prompts_flag = absl::GetFlag(FLAGS_calibration);
  const CalibrationFileFlag sudoku_flag = absl::GetFlag(FLAGS_calibration_sudoku);
  for (const auto& [f, name] : {std::pair(&prompts_flag, "--calibration"),
                                std::pair(&sudoku_flag, "--calibration_sudoku")}) {
    if (f->given && f->path.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       " \"\": an empty path (give a file, or leave the flag out to "
                       "quantize without calibration)"));
    }
  }
  const bool prompts = prompts_flag.given;
  const bool sudoku = sudoku_flag.given;
  const bool gptq = absl::GetFlag(FLAGS_gptq);
  for (const auto& [f, name] : {std::pair(absl::GetFlag(FLAGS_gptq_dampening), "--gptq_dampening"),
                                std::pair(absl::GetFlag(FLAGS_gptq_max_gb), "--gptq_max_gb")}) {
    if (f.empty) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " \"\": an empty value (give a number, or leave the flag out)"));
    }
  }
  const std::optional<double> dampening = absl::GetFlag(FLAGS_gptq_dampening).get();
  const std::optional<double> max_gb = absl::GetFlag(FLAGS_gptq_max_gb).get();
  if (!gptq && (dampening || max_gb || absl::GetFlag(FLAGS_gptq_sequential))) {
    return absl::InvalidArgumentError(absl::StrCat(dampening ? "--gptq_dampening"
                                                   : max_gb  ? "--gptq_max_gb"
                                                             : "--gptq_sequential",
                                                   " applies to --gptq only"));
  }
  if (dampening && !(*dampening >= 0.0 && *dampening <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gptq_dampening ", *dampening, ": must be a number in [0, 1e6]"));
  }
  if (max_gb && !(*max_gb > 0.0 && *max_gb <= 1e9)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gptq_max_gb ", *max_gb, ": must be a number of GiB in (0, 1e9]"));
  }
  if (gptq && options.format != WeightFormat::kW4A16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gptq applies to --format w4a16 only (--format is ", format,
                     "; fp8 and nvfp4 are rounded to nearest)"));
  }
  if (gptq && !prompts && !sudoku) {
    return absl::InvalidArgumentError(
        "--gptq needs calibration inputs: give --calibration PROMPTS.jsonl or "
        "--calibration_sudoku PUZZLES.jsonl");
  }
  const int limit = absl::GetFlag(FLAGS_calibration_limit);
  const int steps = absl::GetFlag(FLAGS_calibration_steps);
  if (limit < 0) return absl::InvalidArgumentError("--calibration_limit must be ≥ 0");
  if (steps < 0) return absl::InvalidArgumentError("--calibration_steps must be ≥ 0");
  if (steps > kMaxDenoisingStepsCap) {
    return absl::InvalidArgumentError(
        absl::StrCat("--calibration_steps must be ≤ ", kMaxDenoisingStepsCap, " (0: the model's)"));
  }
  if (!prompts && !sudoku) {
    if (limit != 0 || steps != 0) {
      return absl::InvalidArgumentError(
          "--calibration_limit and --calibration_steps need --calibration or "
          "--calibration_sudoku");
    }
    return absl::OkStatus();
  }
  if (prompts && sudoku) {
    return absl::InvalidArgumentError("give --calibration or --calibration_sudoku, not both");
  }
  if (gptq) return absl::OkStatus();
  if (options.format == WeightFormat::kW4A16) {
    return absl::InvalidArgumentError(absl::StrCat(
        sudoku ? "--calibration_sudoku" : "--calibration",
        " with --format w4a16 needs --gptq (GPTQ against the calibration inputs); w4a16 has no "
        "static activation scale"));
  }
  if (options.format != WeightFormat::kNvfp4 ||
      options.nvfp4_activations == Nvfp4Activations::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(
        sudoku ? "--calibration_sudoku" : "--calibration",
        " sets NVFP4's static activation scale: it needs --format nvfp4 with activations "
        "quantized (W4A4); ",
        options.format == WeightFormat::kNvfp4 ? "nvfp4a16 (--nvfp4_activations none)" : format,
        " has no static activation scale"));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const auto start = std::chrono::steady_clock::now();
  QuantizeOptions options;
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "fp8") {
    options.format = WeightFormat::kFp8;
  } else if (format == "w4a16") {
    options.format = WeightFormat::kW4A16;
  } else if (format == "nvfp4") {
    options.format = WeightFormat::kNvfp4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--format '", format, "': must be fp8, w4a16 or nvfp4"));
  }
  const std::optional<int32_t> group_size = absl::GetFlag(FLAGS_group_size);
  if (options.format == WeightFormat::kNvfp4) {
    if (group_size && *group_size != 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--group_size ", *group_size,
                       ": --format nvfp4 has 16-input blocks, fixed by the format (omit "
                       "--group_size or give 16)"));
    }
    options.group_size = 16;
  } else if (group_size && options.format == WeightFormat::kFp8) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group_size ", *group_size,
                     ": --format fp8 has one scale per output channel (groups are w4a16's)"));
  } else if (group_size) {
    // (Refused here, before a calibration run; QuantizeCheckpoint refuses it too.)
    if (*group_size < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--group_size must be ≥ 0 (0: per channel); got ", *group_size));
    }
    if (*group_size > kMaxW4a16GroupSize) {
      return absl::InvalidArgumentError(absl::StrCat("--group_size ", *group_size, ": at most ",
                                                     kMaxW4a16GroupSize, " inputs per group"));
    }
    options.group_size = *group_size;
    // Our loader takes any group size (a last partial group included); vLLM's W4A16 kernels
    // (Marlin, Machete) take per-channel scales or groups of 32, 64 or 128 only.
    if (*group_size != 0 && *group_size != 32 && *group_size != 64 && *group_size != 128) {
      std::fprintf(stderr,
                   "warning: --group_size %d: dgserve serves it, but vLLM's W4A16 kernels take "
                   "only 32, 64, 128 or 0 (per channel)\n",
                   *group_size);
    }
  }
  const std::string layout = absl::GetFlag(FLAGS_nvfp4_layout);
  if (!layout.empty() && options.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_layout applies to --format nvfp4 only (--format is ", format, ")"));
  }
  if (layout == "compressed-tensors") {
    options.nvfp4_layout = Nvfp4Layout::kCompressedTensors;
  } else if (layout.empty() || layout == "modelopt") {
    options.nvfp4_layout = Nvfp4Layout::kModelOpt;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_layout '", layout, "': must be modelopt or compressed-tensors"));
  }
  const std::string activations = absl::GetFlag(FLAGS_nvfp4_activations);
  if (!activations.empty() && options.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nvfp4_activations applies to --format nvfp4 only (--format is ", format, ")"));
  }
  if (activations == "none") {
    if (options.nvfp4_layout != Nvfp4Layout::kCompressedTensors) {
      return absl::InvalidArgumentError(
          "--nvfp4_activations none (weight-only NVFP4A16) needs --nvfp4_layout "
          "compressed-tensors: ModelOpt's weight-only NVFP4 export is not supported");
    }
    options.nvfp4_activations = Nvfp4Activations::kNone;
  } else if (activations.empty() || activations == "nvfp4") {
    options.nvfp4_activations = Nvfp4Activations::kNvfp4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_activations '", activations, "': must be nvfp4 or none"));
  }
  options.ignore.clear();
  // "lm_head, re:.*norm.*" as "lm_head,re:.*norm.*"; a repeated entry once (the first).
  for (absl::string_view e : absl::StrSplit(absl::GetFlag(FLAGS_ignore), ',')) {
    e = absl::StripAsciiWhitespace(e);
    if (!e.empty() &&
        std::find(options.ignore.begin(), options.ignore.end(), e) == options.ignore.end()) {
      options.ignore.emplace_back(e);
    }
  }
  options.max_shard_bytes = absl::GetFlag(FLAGS_max_shard_bytes);
  if (options.max_shard_bytes <= 0) {  // before anything is written to --out
    return absl::InvalidArgumentError(
        absl::StrCat("--max_shard_bytes ", options.max_shard_bytes, ": must be positive"));
  }
  // (Before a calibration run, which the ignore list's modules decide.)
  DGSERVE_RETURN_IF_ERROR(CheckModulePatterns(options.ignore, "--ignore"));
  // (Each entry as the writer makes it: ModelOpt's fnmatch patterns. CheckIgnoreList checks the
  // list against --in's modules before a calibration runs, QuantizeCheckpoint otherwise.)
  DGSERVE_RETURN_IF_ERROR(WrittenIgnoreList(options).status());
  DGSERVE_RETURN_IF_ERROR(CheckQuantizeInput(absl::GetFlag(FLAGS_in)));
  DGSERVE_RETURN_IF_ERROR(CheckCalibrationFlags(options, format));
  // --out can be made and written, before any calibration.
  DGSERVE_RETURN_IF_ERROR(CheckQuantizePaths(absl::GetFlag(FLAGS_in), absl::GetFlag(FLAGS_out)));
  options.gptq_dampening = absl::GetFlag(FLAGS_gptq_dampening).get().value_or(0.01);
  double calibration_s = 0;
  const bool calibrated =
      absl::GetFlag(FLAGS_calibration).given || absl::GetFlag(FLAGS_calibration_sudoku).given;
  // Calibrated, Calibrate warns of the ignore entries that name no module after its checks of
  // the prompts and the ignore list, before the calibration runs.
  if (!calibrated) WarnUnmatchedIgnore(absl::GetFlag(FLAGS_in), options);
  DGSERVE_RETURN_IF_ERROR(Calibrate(absl::GetFlag(FLAGS_in), &options, &calibration_s));
  const std::string out = absl::GetFlag(FLAGS_out);
  DGSERVE_ASSIGN_OR_RETURN(QuantizeSummary s,
                           QuantizeCheckpoint(absl::GetFlag(FLAGS_in), out, options));
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const char* nvfp4_layout = s.quant.format != WeightFormat::kNvfp4 ? ""
                             : s.quant.nvfp4_compressed_tensors     ? " (compressed-tensors)"
                                                                    : " (modelopt)";
  // The whole run's time; calibrated, also the calibration's (the calibration runs alone, not the
  // weight load) and the write's (QuantizeCheckpoint).
  char times[96] = "";
  if (calibrated) {
    std::snprintf(times, sizeof(times), " (calibration %.1f s, write %.1f s)", calibration_s,
                  s.seconds);
  }
  std::printf(
      "wrote %s: format %s%s%s, %d modules quantized, %d kept in their dtype, in %.1f s%s\n",
      out.c_str(), QuantizationName(s.quant),
      s.quant.format != WeightFormat::kW4A16 ? ""
      : s.quant.channel_groups               ? " (per channel)"
                               : absl::StrCat(" (group ", s.quant.group_size, ")").c_str(),
      nvfp4_layout, s.quantized, s.kept, total_s, times);
  if (!options.gptq_hessians.empty() || !options.w4a16_modules.empty()) {
    std::printf(
        "gptq: %d modules by GPTQ, %d rounded to nearest (no Hessian: experts no calibration "
        "row reached, or routers and self-conditioning modules a custom --ignore leaves "
        "quantized)\n",
        s.gptq, s.rtn_without_hessian);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::RunFlagsOnlyTool(
      argc, argv, "dgserve-quantize",
      "Writes a quantized checkpoint (compressed-tensors FP8/W4A16, NVFP4 in ModelOpt's or\n"
      "compressed-tensors' layout) from a bf16 DiffusionGemma checkpoint.\n"
      "  dgserve-quantize --in DIR --out DIR --format fp8|w4a16|nvfp4 [--group_size N] [--ignore "
      "LIST]\n"
      "                   [--nvfp4_layout modelopt|compressed-tensors] [--nvfp4_activations "
      "nvfp4|none]\n"
      "                   [--calibration PROMPTS.jsonl | --calibration_sudoku PUZZLES.jsonl]\n"
      "                   [--calibration_limit N] [--calibration_steps N]\n"
      "                   [--gptq [--gptq_sequential] [--gptq_dampening F] [--gptq_max_gb G]]  "
      "(w4a16, calibrated)",
      "tools/quantize_main.cc", dgserve::Run);
}
