// dgserve: the command-line entry point.
//
//   dgserve generate --model DIR (--prompt TEXT | --prompt-file FILE) [--chat] [--thinking]
//                    [--max-tokens N] [--seed S]
//                    [--steps N] [--t-min X] [--t-max X] [--entropy-bound X]
//                    [--confidence-threshold X] [--stability-threshold N]
//                    [--no-self-conditioning] [--show-steps] [--json] [--device cpu|cuda]
//   dgserve chat --gateway HOST:PORT (--prompt TEXT | --prompt-file FILE) [same sampling flags]
//                [--api-key KEY] [--show-steps]   (a client of a running cluster)
//   dgserve sudoku (PUZZLE | --puzzle-file FILE) [--gateway HOST:PORT] [--model DIR] [--seed S]
//                  [--steps N] [--no-self-conditioning] [--template=false] [--candidates]
//                  [--samples N [--sample_temperature_spread X]] [--check]
//                  (tools/sudoku/sudoku_cli.h; --check: only check the puzzle)
//
// Flags may be spelled with dashes or underscores; a bool flag X is turned off by --no-X, --noX or
// --X=false. A flag only another command reads is refused.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/limits.h"
#include "common/openmp_env.h"
#include "common/status_macros.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/generator.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"
#include "service/address_list.h"
#include "tools/chat_client.h"
#include "tools/sudoku/sudoku_cli.h"
#include "tools/sudoku/sudoku_request.h"
#include "worker/backend_flags.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory (HF layout, with tokenizer.json); sudoku: default models/sudoku");
ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(std::string, prompt_file, "",
          "read the prompt from this file or pipe (e.g. <(cmd); --prompt-file=- for standard "
          "input), at most 64 MiB");
ABSL_FLAG(bool, chat, false, "wrap the prompt as one user turn of the Gemma 4 chat template");
ABSL_FLAG(bool, thinking, false, "with --chat: the thinking form of the template");
ABSL_FLAG(std::optional<int>, max_tokens, std::nullopt,
          "maximum new tokens (default: generation_config.json)");
ABSL_FLAG(uint64_t, seed, 0, "sampler seed");
ABSL_FLAG(std::optional<int>, steps, std::nullopt,
          "max denoising steps per canvas (default: generation_config.json)");
ABSL_FLAG(std::optional<double>, t_min, std::nullopt,
          "final temperature (default: generation_config.json)");
ABSL_FLAG(std::optional<double>, t_max, std::nullopt,
          "initial temperature (default: generation_config.json)");
ABSL_FLAG(std::optional<double>, entropy_bound, std::nullopt,
          "entropy bound per step (default: generation_config.json)");
ABSL_FLAG(std::optional<double>, confidence_threshold, std::nullopt,
          "stop when mean entropy is below this (default: generation_config.json)");
ABSL_FLAG(std::optional<int>, stability_threshold, std::nullopt,
          "steps the argmax canvas must be unchanged to stop (default: generation_config.json)");
ABSL_FLAG(bool, no_self_conditioning, false,
          "ablation: the decoder's self-conditioning input is zero at every denoising step (as at "
          "step 0); default: self-conditioning on");
ABSL_FLAG(std::string, device, "cpu",
          "generate: where the model runs: 'cpu', or 'cuda' (binaries built with CUDA, on a GPU; "
          "see --cuda_gemm_input; --cpu_gemm_input for the CPU)");
ABSL_FLAG(bool, show_steps, false,
          "print the argmax canvas after every denoising step (with --json: to standard error)");
ABSL_FLAG(bool, json, false,
          "generate: print one JSON object (text, token_ids, finish_reason) instead of streaming");
ABSL_FLAG(std::string, gateway, "127.0.0.1:50051", "chat, sudoku: the gateway's gRPC address");
ABSL_FLAG(std::string, api_key, "", "chat, sudoku: API key (if the gateway requires one)");
ABSL_FLAG(std::string, puzzle_file, "",
          "sudoku: read the puzzle from this file or pipe (- for standard input)");
ABSL_FLAG(bool, template, true,
          "sudoku: send the givens as a canvas template (digits fixed, blanks restricted to 1-9); "
          "--template=false sends the plain prompt only");
ABSL_FLAG(bool, candidates, false,
          "sudoku: send the givens as a template whose blanks each allow only the digits not "
          "already given in their row, column and box (one elimination pass, an aid outside the "
          "model); the token form of the API's canvas template");
ABSL_FLAG(bool, check, false,
          "sudoku: only check the puzzle (81 cells, givens without a conflict, a solution) and "
          "the flags; exit 0 if it would be sent, 1 otherwise; connects to nothing");
ABSL_FLAG(int, samples, 1, "sudoku: parallel samples from one prefill; the first that solves wins");
ABSL_FLAG(std::optional<double>, sample_temperature_spread, std::nullopt,
          "sudoku with --samples N > 1: sample i of N runs t_min and t_max times 1 + X*i/(N-1) "
          "(-0.95 to 4; default -0.75, which makes best-of-n pay on this model, "
          "tools/sudoku/README.md)");

namespace dgserve {
namespace {

std::string Escape(std::string s) {
  return absl::StrReplaceAll(s, {{"\n", "\\n"}, {"\r", "\\r"}, {"\t", "\\t"}});
}

// The prompt from --prompt or --prompt-file (bounded), and the --thinking/--chat check.
absl::StatusOr<std::string> ReadPrompt(bool always_chat = false) {
  std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (const std::string file = absl::GetFlag(FLAGS_prompt_file); !file.empty()) {
    if (!prompt.empty()) {
      return absl::InvalidArgumentError("give --prompt or --prompt-file, not both");
    }
    // Bounded: a prompt longer than the longest context could not be served anyway. A file, a
    // pipe (bash's <(...), /dev/stdin) or "-" (standard input) are read up to one byte past it.
    constexpr size_t kMaxPromptBytes = size_t(64) << 20;
    absl::StatusOr<std::string> text = ReadInputToString(file, kMaxPromptBytes + 1);
    if (!text.ok()) {
      return absl::Status(text.status().code(),
                          absl::StrCat("--prompt-file: ", text.status().message()));
    }
    prompt = *std::move(text);
    if (prompt.empty()) {  // named as the file's fault, not as a missing --prompt
      return absl::InvalidArgumentError(absl::StrCat("--prompt-file ",
                                                     file == "-" ? "- (standard input)" : file,
                                                     " is empty: no prompt in it"));
    }
    if (prompt.size() > kMaxPromptBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt-file ", file == "-" ? "- (standard input)" : file,
                       ": more than 64 MiB; prompts are limited to 64 MiB"));
    }
  }
  if (prompt.empty()) {
    return absl::InvalidArgumentError(
        "--prompt (or --prompt-file) is required and must not be empty");
  }
  // As the gateway's HTTP API refuses a body that is not UTF-8 (the tokenizer would take the bytes
  // as they are, and the gateway's gRPC parse fails with no offset).
  if (!tokenizer_internal::IsValidUtf8(prompt)) {
    const std::string file = absl::GetFlag(FLAGS_prompt_file);
    return absl::InvalidArgumentError(
        absl::StrCat(file.empty() ? "--prompt" : absl::StrCat("--prompt-file ", file),
                     ": not valid UTF-8 (first bad byte at offset ",
                     tokenizer_internal::ValidUtf8PrefixLength(prompt), ")"));
  }
  if (absl::GetFlag(FLAGS_thinking) && !absl::GetFlag(FLAGS_chat) && !always_chat) {
    return absl::InvalidArgumentError(
        "--thinking needs --chat (it selects the chat template's thinking form)");
  }
  return prompt;
}

// The sampler's float32 flags are read as doubles: a set value that is not a finite float32 (1e300
// would be sent as inf, "nan" as NaN) is refused naming the flag and the value as read. Returns
// INVALID_ARGUMENT.
absl::Status CheckFloatFlags() {
  struct FloatFlag {
    const char* name;  // as the usage line spells it
    const absl::Flag<std::optional<double>>* flag;
  };
  const FloatFlag kFlags[] = {
      {"t-min", &FLAGS_t_min},
      {"t-max", &FLAGS_t_max},
      {"entropy-bound", &FLAGS_entropy_bound},
      {"confidence-threshold", &FLAGS_confidence_threshold},
      {"sample_temperature_spread", &FLAGS_sample_temperature_spread},
  };
  for (const FloatFlag& f : kFlags) {
    const std::optional<double> v = absl::GetFlag(*f.flag);
    if (!v || std::isfinite(float(*v))) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "--", f.name, " ", absl::UnparseFlag(*v),
        ": must be a finite number that fits a 32-bit float (magnitude below 3.4e38)"));
  }
  return absl::OkStatus();
}

// The diffusion control flags that are set, checked by the gateway's own rules
// (ValidateSamplerParams) before anything is sent, so `dgserve chat` and `dgserve sudoku` report
// a bad value (e.g. --steps 0) at once instead of after connecting and drawing a grid. Unset flags
// are the served model's defaults, unknown here: they stand in with values that pass every
// rule (a t_max just above a lone --t-min, t_min 0 below a lone --t-max, and 1 step, the most
// lenient for the last-step temperature floor), so only the set flags can fail.
// Returns INVALID_ARGUMENT naming the field.
absl::Status CheckDiffusionFlags() {
  DGSERVE_RETURN_IF_ERROR(CheckFloatFlags());
  SamplerParams p;
  p.max_denoising_steps = absl::GetFlag(FLAGS_steps).value_or(1);
  const std::optional<double> t_min = absl::GetFlag(FLAGS_t_min);
  const std::optional<double> t_max = absl::GetFlag(FLAGS_t_max);
  p.t_min = t_min ? float(*t_min) : 0.0f;
  p.t_max = t_max ? float(*t_max) : std::max(p.t_max, std::nextafter(p.t_min, HUGE_VALF));
  if (auto v = absl::GetFlag(FLAGS_entropy_bound)) p.entropy_bound = float(*v);
  if (auto v = absl::GetFlag(FLAGS_confidence_threshold)) p.confidence_threshold = float(*v);
  if (auto v = absl::GetFlag(FLAGS_stability_threshold)) p.stability_threshold = *v;
  if (auto v = absl::GetFlag(FLAGS_sample_temperature_spread))
    p.sample_temperature_spread = float(*v);
  return ValidateSamplerParams(p);
}

// --max-tokens, when given, is at least 1 (0 would otherwise mean "the default" to the gateway and
// an error to `generate`). Shared by `dgserve chat` and `dgserve generate`.
absl::Status CheckMaxTokensFlag() {
  const std::optional<int> v = absl::GetFlag(FLAGS_max_tokens);
  if (!v || *v >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--max-tokens must be > 0 (leave it out for the model's default max_new_tokens), got ", *v));
}

// The diffusion control flags (--steps ... --no-self-conditioning) into `d`; unset flags stay
// unset (the served model's defaults). Shared by `dgserve chat` and `dgserve sudoku`.
void SetDiffusionControls(v1::DiffusionControls* d) {
  if (auto v = absl::GetFlag(FLAGS_steps)) d->set_max_denoising_steps(*v);
  if (auto v = absl::GetFlag(FLAGS_t_min)) d->set_t_min(float(*v));
  if (auto v = absl::GetFlag(FLAGS_t_max)) d->set_t_max(float(*v));
  if (auto v = absl::GetFlag(FLAGS_entropy_bound)) d->set_entropy_bound(float(*v));
  if (auto v = absl::GetFlag(FLAGS_confidence_threshold)) d->set_confidence_threshold(float(*v));
  if (auto v = absl::GetFlag(FLAGS_stability_threshold)) d->set_stability_threshold(*v);
  if (absl::GetFlag(FLAGS_no_self_conditioning)) d->set_self_conditioning(false);
  if (auto v = absl::GetFlag(FLAGS_sample_temperature_spread)) {
    d->set_sample_temperature_spread(float(*v));
  }
}

// --samples and --sample_temperature_spread shape a best-of-n Sudoku run; `generate` and
// `chat` make one sample, so they refuse the flags instead of ignoring them.
absl::Status RefuseSudokuOnlyFlags(const char* command) {
  if (absl::GetFlag(FLAGS_samples) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--samples applies to `dgserve sudoku` only; `dgserve ", command,
                     "` makes one sample (for n samples, send \"n\" to a gateway's OpenAI API)"));
  }
  if (absl::GetFlag(FLAGS_sample_temperature_spread)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sample_temperature_spread applies to `dgserve sudoku --samples N` only; `dgserve ",
        command, "` makes one sample"));
  }
  return absl::OkStatus();
}

// A flag given on the command line that `command` would ignore is refused, naming the commands
// that read it (a user would otherwise believe `chat --device cuda` ran on a GPU, or that
// `generate --gateway` used the gateway). --samples and --sample_temperature_spread keep their
// own messages (RefuseSudokuOnlyFlags).
// `given`: the flags on the command line, as NormaliseFlagNames returns them.
absl::Status RefuseFlagsOfOtherCommands(const std::string& command,
                                        const std::vector<std::string>& given) {
  struct Use {
    const char* flag;
    const char* commands;  // the commands that read it, as the message names them
  };
  static constexpr Use kUses[] = {
      {"model", "generate sudoku"},
      {"prompt", "generate chat"},
      {"prompt_file", "generate chat"},
      {"chat", "generate chat"},
      {"thinking", "generate chat"},
      {"max_tokens", "generate chat"},
      {"show_steps", "generate chat"},
      {"json", "generate"},
      {"device", "generate"},
      {"cpu_gemm_input", "generate"},
      {"cuda_gemm_input", "generate"},
      {"cuda_kv_pool_gb", "generate"},
      {"cuda_memory_utilization", "generate"},
      {"gateway", "chat sudoku"},
      {"api_key", "chat sudoku"},
      {"puzzle_file", "sudoku"},
      {"template", "sudoku"},
      {"candidates", "sudoku"},
      {"check", "sudoku"},
  };
  for (const Use& u : kUses) {
    if (std::find(given.begin(), given.end(), u.flag) == given.end()) continue;
    const std::vector<absl::string_view> commands = absl::StrSplit(u.commands, ' ');
    if (std::find(commands.begin(), commands.end(), command) != commands.end()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "--", absl::StrReplaceAll(u.flag, {{"_", "-"}}), " does not apply to `dgserve ", command,
        "` (it is read by `dgserve ", absl::StrJoin(commands, "`, `dgserve "), "`)"));
  }
  return absl::OkStatus();
}

// `dgserve chat`: the same prompt and sampling flags, sent to a running gateway.
absl::Status RunChat() {
  DGSERVE_RETURN_IF_ERROR(RefuseSudokuOnlyFlags("chat"));
  DGSERVE_ASSIGN_OR_RETURN(std::string prompt, ReadPrompt(/*always_chat=*/true));
  DGSERVE_RETURN_IF_ERROR(CheckDiffusionFlags());
  DGSERVE_RETURN_IF_ERROR(CheckMaxTokensFlag());
  v1::GenerateRequest req;
  {  // the gateway renders the chat template
    v1::ChatMessage* m = req.mutable_chat()->add_messages();
    m->set_role("user");
    m->set_content(prompt);
    req.mutable_chat()->set_enable_thinking(absl::GetFlag(FLAGS_thinking));
  }
  if (auto v = absl::GetFlag(FLAGS_max_tokens)) req.set_max_tokens(*v);
  req.set_seed(absl::GetFlag(FLAGS_seed));
  SetDiffusionControls(req.mutable_diffusion());
  ChatClientOptions opts;
  opts.gateway = absl::GetFlag(FLAGS_gateway);
  DGSERVE_RETURN_IF_ERROR(ValidateTarget("--gateway", opts.gateway));
  opts.api_key = absl::GetFlag(FLAGS_api_key);
  opts.show_steps = absl::GetFlag(FLAGS_show_steps);
  if (opts.show_steps) {
    req.mutable_stream_options()->set_canvas_step_interval(1);
    req.mutable_stream_options()->set_canvas_text(true);
  }
  return RunChatClient(req, opts);
}

// `dgserve sudoku PUZZLE`: the puzzle (the arguments, joined) to a gateway serving the sudoku
// model. True when the answer solves it.
absl::StatusOr<bool> RunSudoku(const std::vector<std::string>& args) {
  DGSERVE_RETURN_IF_ERROR(ValidateTarget("--gateway", absl::GetFlag(FLAGS_gateway)));
  sudoku::SudokuCliOptions o;
  o.puzzle = absl::StrJoin(args, " ");
  o.puzzle_file = absl::GetFlag(FLAGS_puzzle_file);
  if (std::string m = absl::GetFlag(FLAGS_model); !m.empty()) o.model_dir = m;
  o.seed = absl::GetFlag(FLAGS_seed);
  SetDiffusionControls(&o.diffusion);
  o.client.gateway = absl::GetFlag(FLAGS_gateway);
  o.client.api_key = absl::GetFlag(FLAGS_api_key);
  o.tty = isatty(fileno(stdout)) != 0;
  o.mode.use_template = absl::GetFlag(FLAGS_template);
  o.mode.candidates = absl::GetFlag(FLAGS_candidates);
  o.mode.samples = absl::GetFlag(FLAGS_samples);
  if (o.mode.samples > 1 && !absl::GetFlag(FLAGS_sample_temperature_spread)) {
    o.diffusion.set_sample_temperature_spread(sudoku::kSampleTemperatureSpread);
  }
  if (o.mode.candidates && !o.mode.use_template) {
    return absl::InvalidArgumentError("--candidates is a template: not with --template=false");
  }
  if (o.mode.samples == 1 && absl::GetFlag(FLAGS_sample_temperature_spread)) {
    return absl::InvalidArgumentError(
        "--sample_temperature_spread spreads the schedules of several samples: give --samples N "
        "> 1 with it");
  }
  if (o.mode.samples < 1 || o.mode.samples > kMaxSamplesPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--samples must be in [1, ", kMaxSamplesPerRequest,
        "] (the denoise worker's limit; a gateway's --max_n may be lower), got ", o.mode.samples));
  }
  DGSERVE_RETURN_IF_ERROR(CheckDiffusionFlags());
  if (absl::GetFlag(FLAGS_check)) {  // tools/up.sh, before it touches the cluster
    bool several = false;
    DGSERVE_ASSIGN_OR_RETURN(const sudoku::Grid grid, sudoku::LoadPuzzle(o, &several));
    std::printf("puzzle ok: %d givens, %s\n", sudoku::CountGivens(grid),
                several ? "several solutions" : "one solution");
    return true;
  }
  return sudoku::RunSudokuCli(o);
}

absl::Status RunGenerate() {
  DGSERVE_RETURN_IF_ERROR(RefuseSudokuOnlyFlags("generate"));
  DGSERVE_RETURN_IF_ERROR(CheckMaxTokensFlag());
  DGSERVE_RETURN_IF_ERROR(CheckFloatFlags());
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  DGSERVE_ASSIGN_OR_RETURN(const BackendSelection selection,
                           BackendSelectionFromFlags(absl::GetFlag(FLAGS_device)));
  DGSERVE_ASSIGN_OR_RETURN(std::string prompt, ReadPrompt());
  DGSERVE_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  DGSERVE_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(dir + "/tokenizer.json"));
  // The tokenizer must cover the model's vocabulary (else generated ids decode to nothing), and
  // may only add special tokens above it (Gemma's <image_soft_token> is id 262144).
  const int32_t V = ckpt.config.vocab_size;
  if (tok.vocab_size() < V) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, "/tokenizer.json covers ids [0, ", tok.vocab_size(),
                     ") but the model's vocabulary is ", V, ": it is not this model's tokenizer"));
  }
  for (int32_t id = V; id < tok.vocab_size(); ++id) {
    if (!tok.IsSpecial(id) && !tok.IdToPiece(id).empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, "/tokenizer.json has token id ", id, " ('", std::string(tok.IdToPiece(id)),
          "') beyond the model's vocabulary of ", V, ": it is not this model's tokenizer"));
    }
  }
  GenerationRequest req = DefaultRequest(ckpt.generation);
  if (absl::GetFlag(FLAGS_chat)) {
    ChatMessage msg{"user", prompt};
    ChatTemplateOptions opts;
    opts.enable_thinking = absl::GetFlag(FLAGS_thinking);
    DGSERVE_ASSIGN_OR_RETURN(req.prompt, RenderChat(tok, {&msg, 1}, opts));
  } else {
    req.prompt = tok.EncodeText(prompt, /*add_bos=*/true);  // as the gateway encodes a prompt
  }
  if (auto v = absl::GetFlag(FLAGS_max_tokens)) req.max_new_tokens = *v;
  req.seed = absl::GetFlag(FLAGS_seed);
  if (auto v = absl::GetFlag(FLAGS_steps)) req.sampler.max_denoising_steps = *v;
  if (auto v = absl::GetFlag(FLAGS_t_min)) req.sampler.t_min = float(*v);
  if (auto v = absl::GetFlag(FLAGS_t_max)) req.sampler.t_max = float(*v);
  if (auto v = absl::GetFlag(FLAGS_entropy_bound)) req.sampler.entropy_bound = float(*v);
  if (auto v = absl::GetFlag(FLAGS_confidence_threshold)) {
    req.sampler.confidence_threshold = float(*v);
  }
  if (auto v = absl::GetFlag(FLAGS_stability_threshold)) req.sampler.stability_threshold = *v;
  req.sampler.self_conditioning = !absl::GetFlag(FLAGS_no_self_conditioning);
  DGSERVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelBackend> backend,
                           CreateBackend(selection, ckpt.config, ckpt.weights));
  Generator gen(*backend);
  GenerationObserver obs;
  const bool show_steps = absl::GetFlag(FLAGS_show_steps);
  const bool json_output = absl::GetFlag(FLAGS_json);
  if (show_steps) {
    // With --json the step lines go to standard error: standard output holds only the JSON object.
    FILE* steps_out = json_output ? stderr : stdout;
    obs.on_step = [&, steps_out](const StepEvent& e) {
      std::fprintf(steps_out, "[canvas %d step %2d] T=%.4f accepted=%3d H=%.4f%s | %s\n", e.canvas,
                   e.step, e.temperature, e.accepted, e.mean_entropy, e.stop ? " stop" : "",
                   Escape(tok.Decode(e.argmax, /*skip_special=*/false)).c_str());
      std::fflush(steps_out);
    };
  }
  // Stream the text canvas by canvas; the decoder holds back a multi-byte character split across
  // two canvases until it is complete. Stops at the first stop token or at --max-tokens.
  StreamDecoder stream(tok, /*skip_special=*/true);
  std::string streamed;  // the text as streamed, canvas by canvas
  int emitted = 0;
  bool ended = false;
  obs.on_canvas = [&](const CanvasEvent& e) {
    std::vector<int32_t> take;
    for (int32_t id : e.tokens) {
      if (ended || emitted == req.max_new_tokens) break;
      if (std::find(req.stop_token_ids.begin(), req.stop_token_ids.end(), id) !=
          req.stop_token_ids.end()) {
        ended = true;
        break;
      }
      take.push_back(id);
      ++emitted;
    }
    const std::string text = stream.Push(take);
    streamed += text;
    if (json_output) return;
    if (show_steps) {
      std::printf("[canvas %d committed after %d steps%s] %s\n", e.canvas, e.steps,
                  e.stopped_early ? ", stopped early" : "", Escape(text).c_str());
    } else {
      std::fputs(text.c_str(), stdout);
    }
    std::fflush(stdout);
  };
  DGSERVE_ASSIGN_OR_RETURN(GenerationResult res, gen.Generate(req, obs));
  const std::string tail = stream.Finish();
  if (json_output) {
    nlohmann::json j = {{"text", streamed + tail},
                        {"token_ids", res.completion},
                        {"finish_reason", res.finish_reason},
                        {"prompt_tokens", res.prompt_tokens},
                        {"canvases", res.canvases},
                        {"steps_per_canvas", res.steps_per_canvas}};
    std::printf("%s\n", j.dump().c_str());
  } else if (show_steps) {
    std::printf("%s\n", tok.Decode(res.completion, /*skip_special=*/true).c_str());
  } else {
    std::printf("%s\n", tail.c_str());
  }
  std::fflush(stdout);
  const double step_ms = res.decoder_passes ? 1e3 * res.denoise_seconds / res.decoder_passes : 0;
  const double positions_per_s =
      res.denoise_seconds > 0
          ? double(res.decoder_passes) * ckpt.config.canvas_length / res.denoise_seconds
          : 0;
  std::fprintf(stderr,
               "prompt tokens %d | canvases %d | steps per canvas [%s] | %.1f ms per step | "
               "%.0f canvas positions/s | prefill %.3f s | finish %s\n",
               res.prompt_tokens, res.canvases, absl::StrJoin(res.steps_per_canvas, ", ").c_str(),
               step_ms, positions_per_s, res.prefill_seconds, res.finish_reason.c_str());
  if (std::ferror(stdout) || std::fflush(stdout) != 0) {
    return absl::DataLossError("could not write the answer to standard output");
  }
  return absl::OkStatus();
}

// absl flags are spelled with underscores; accept --max-tokens as well.
// Only words that name one of our flags are rewritten, so a value such as a file called
// "--my-prompt.txt" is left alone; --no-X (of a bool flag X) becomes Abseil's --noX. `given`
// receives the names of the flags before "--" (underscore spelling; --noX and --no-X as X).
std::vector<char*> NormaliseFlagNames(int argc, char** argv, std::vector<std::string>& storage,
                                      std::vector<std::string>& given) {
  storage.assign(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& a = storage[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::string name = a.substr(2, end - 2);
    std::replace(name.begin(), name.end(), '-', '_');
    const bool known = absl::FindCommandLineFlag(name) != nullptr;
    // --noflag, and --no-flag (--no_flag) as users of other CLIs spell it: Abseil reads only the
    // first. Only a bool flag can be negated (Abseil names any other in its error).
    std::string negated;
    if (!known && absl::StartsWith(name, "no")) {
      negated = name.substr(absl::StartsWith(name, "no_") ? 3 : 2);
      const absl::CommandLineFlag* f = absl::FindCommandLineFlag(negated);
      if (f == nullptr || (name[2] == '_' && !f->IsOfType<bool>())) negated.clear();
    }
    if (!known && negated.empty()) continue;
    a = "--" + (known ? name : "no" + negated) + a.substr(end);
    given.push_back(known ? name : negated);
  }
  std::vector<char*> out;
  for (std::string& s : storage) out.push_back(s.data());
  return out;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::UsePassiveOpenMpWaitUnlessSet(argv);
  dgserve::InitCommandLine(
      "dgserve generate --model DIR (--prompt TEXT | --prompt-file FILE) [--chat [--thinking]] "
      "[--max-tokens N] [--seed S] [--steps N --t-min X --t-max X --entropy-bound X "
      "--confidence-threshold X --stability-threshold N] [--no-self-conditioning] "
      "[--show-steps] [--json] [--device cpu|cuda]\n"
      "       dgserve chat --gateway HOST:PORT (--prompt TEXT | --prompt-file FILE) [--thinking] "
      "[same sampling flags] [--api-key KEY] [--show-steps]\n"
      "       dgserve sudoku (PUZZLE | --puzzle-file FILE) [--gateway HOST:PORT] [--api-key KEY] "
      "[--model DIR (default models/sudoku)] [--seed S] [--steps N] [--no-self-conditioning] "
      "[--template=false] [--candidates] [--samples N] [--check]\n"
      "         (PUZZLE: 81 cells, 1-9 and '.' or '0' for blanks; exit 0 solved, 2 wrong answer, "
      "1 error)",
      "tools/dgserve_main.cc");
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
                    std::string(argv[1]) == "help")) {
    std::printf("usage: %s\n\n`dgserve generate --help` lists the flags.\n",
                absl::ProgramUsageMessage().data());
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "--version") {  // as `dgserve generate --version`
    std::fputs(dgserve::VersionString().c_str(), stdout);
    return 0;
  }
  const std::string command = argc >= 2 ? argv[1] : "";
  if (command != "generate" && command != "chat" && command != "sudoku") {
    if (command.empty()) {
      std::fprintf(stderr, "dgserve: give a command: generate, chat or sudoku\n");
    } else {
      std::fprintf(stderr, "dgserve: unknown command '%s' (generate, chat or sudoku)\n",
                   command.c_str());
    }
    std::fprintf(stderr, "usage: %s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  std::vector<std::string> storage, given;
  std::vector<char*> args = dgserve::NormaliseFlagNames(argc - 1, argv + 1, storage, given);
  std::vector<char*> rest = dgserve::ParseCommandLine(int(args.size()), args.data());
  if (rest.size() > 1 && command != "sudoku") {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
  absl::Status st = dgserve::RefuseFlagsOfOtherCommands(command, given);
  try {
    if (!st.ok()) {
      // reported below
    } else if (command == "sudoku") {  // exit 0: solved, 2: a wrong answer, 1: an error
      absl::StatusOr<bool> solved =
          dgserve::RunSudoku(std::vector<std::string>(rest.begin() + 1, rest.end()));
      st = solved.status();
      if (st.ok()) return *solved ? 0 : 2;
    } else {
      st = command == "chat" ? dgserve::RunChat() : dgserve::RunGenerate();
    }
  } catch (const std::bad_alloc&) {
    st = absl::ResourceExhaustedError("out of memory");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
