// dgserve-sudoku-eval: measures a cluster serving the sudoku model on a JSONL file of puzzles
// (as written by dgserve-sudoku-gen: {"id", "puzzle", "solution", "givens"} per line).
//
//   dgserve-sudoku-eval --gateway 127.0.0.1:50051 --puzzles tools/sudoku/data/test.jsonl
//       [--limit N] [--concurrency C] [--steps N] [--self_conditioning=false] [--seed S]
//       [--min_givens G] [--json_out FILE] [--api_key KEY] [--timeout_s T]
//       [--template=false] [--candidates [--model DIR]] [--samples N]
//       [--t_min T] [--t_max T] [--sample_temperature_spread X]
//
// Request i (0-based, after the --min_givens filter and --limit) is a unary Generate with the
// prompt ToRows(puzzle), max_tokens 91 and seed S+i (sudoku::SudokuRequest): by default the
// givens as a canvas template (blanks restricted to 1-9); --candidates: the token-form template
// whose blanks each allow only the digits CandidateMasks leaves (the ids from DIR/tokenizer.json,
// --model, default models/sudoku); --template=false: the plain prompt. C requests are in flight
// at a time over one gRPC channel. Each answer text is read with sudoku::ParseAnswer, checked
// with sudoku::Verify and scored with sudoku::CorrectBlanks against the file's solution.
//
// Report (stdout table; JSON with --json_out), overall and by givens bucket (<30, 30-34, 35-39,
// >=40): puzzles, solved, solve rate (solved / puzzles; a failed request counts as unsolved),
// cell accuracy over the blank cells of the answered puzzles ("n/a", JSON null, when they have
// none), mean denoising steps per canvas
// (Usage.denoising_steps / Usage.canvases), mean and p50 client-measured seconds per answered
// puzzle, and RPC errors. Exit status: 1 when a flag or the puzzle file is bad (an unwritable
// --json_out too, before any request) or any request failed (the status: the first failed
// puzzle's code), else 0.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli.h"
#include "common/jsonl.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "dgserve/v1/generation.grpc.pb.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "service/address_list.h"
#include "tools/sudoku/sudoku.h"
#include "tools/sudoku/sudoku_cli.h"

ABSL_FLAG(std::string, gateway, "127.0.0.1:50051", "the gateway's gRPC address");
ABSL_FLAG(std::string, api_key, "", "API key (if the gateway requires one)");
ABSL_FLAG(std::string, puzzles, "", "JSONL puzzle file (required), as dgserve-sudoku-gen writes");
ABSL_FLAG(int64_t, limit, 0, "evaluate at most this many puzzles (0 = all)");
ABSL_FLAG(int32_t, concurrency, 8, "requests in flight at a time (>= 1)");
ABSL_FLAG(int32_t, steps, 0, "max denoising steps per canvas (0 = the model's default)");
ABSL_FLAG(double, entropy_bound, 0,
          "entropy bound of the sampler in nats (0 = the model's default; else > 0)");
ABSL_FLAG(double, t_min, -1, "temperature schedule's t_min (< 0: the model's default)");
ABSL_FLAG(double, t_max, -1, "temperature schedule's t_max (< 0: the model's default)");
ABSL_FLAG(double, sample_temperature_spread, 0,
          "with --samples N: sample i runs t_min and t_max times 1 + X*i/(N-1) (the gateway "
          "checks -0.95 <= X <= 4)");
ABSL_FLAG(bool, self_conditioning, true,
          "false: send the ablation control (self-conditioning input zero at every step)");
ABSL_FLAG(uint64_t, seed, 0, "request i uses seed S+i");
ABSL_FLAG(int32_t, min_givens, 0, "only puzzles with at least this many givens");
ABSL_FLAG(std::string, json_out, "", "also write the report as JSON to this file");
ABSL_FLAG(double, timeout_s, 600, "deadline of each request in seconds (> 0)");
ABSL_FLAG(bool, template, true,
          "send the givens as a canvas template (digits fixed, blanks restricted to 1-9); false: "
          "the plain prompt only");
ABSL_FLAG(bool, candidates, false,
          "send the givens as a template whose blanks each allow only the digits not already "
          "given in their row, column and box (one elimination pass over the givens; an aid "
          "outside the model); the digit ids come from --model's tokenizer.json");
ABSL_FLAG(std::string, model, "models/sudoku",
          "with --candidates: the sudoku model's directory (its tokenizer.json gives the ids)");
ABSL_FLAG(int32_t, samples, 1,
          "parallel samples per puzzle (n, one prefill); solved when any sample solves it");

namespace dgserve::sudoku {
namespace {

using json = nlohmann::ordered_json;

struct Item {
  std::string id;
  Grid puzzle{};
  Grid solution{};
  int givens = 0;
};

struct Result {
  bool ok = false;     // the RPC succeeded
  std::string error;   // the gRPC status when it did not
  absl::StatusCode code = absl::StatusCode::kOk;  // ...and its code
  std::string answer;  // the answer text
  bool solved = false;
  std::string verdict;  // Verify's message when not solved
  int distinct = 0;     // distinct answer grids among the samples
  int samples_solved = 0;  // samples whose answer solves the puzzle
  int blanks = 0, correct = 0, steps = 0, canvases = 0;
  double seconds = 0;
};

// Reads the JSONL puzzle file. Blank lines are skipped; any other line must be an object with
// "puzzle" and "solution" (81-cell strings, the solution solving the puzzle), optional "id"
// (string or number; default "line N") and "givens" (must match the puzzle). Errors name
// FILE:LINE.
absl::StatusOr<std::vector<Item>> LoadPuzzles(const std::string& path) {
  std::vector<Item> items;
  auto add_item = [&](const nlohmann::json& j, int line_no) -> absl::Status {
    // ForEachJsonLine names FILE:LINE.
    auto bad = [](const std::string& why) { return absl::InvalidArgumentError(why); };
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    Item item;
    if (!j.contains("id")) {
      item.id = absl::StrCat("line ", line_no);
    } else if (j["id"].is_string()) {
      item.id = j["id"].get<std::string>();
    } else if (j["id"].is_number()) {
      item.id = j["id"].dump();
    } else {
      return bad("\"id\" is not a string or number");
    }
    for (const char* key : {"puzzle", "solution"}) {
      if (!j.contains(key) || !j[key].is_string()) {
        return bad(absl::StrCat("\"", key, "\" is missing or not a string"));
      }
      absl::StatusOr<Grid> g = ParseGrid(j[key].get<std::string>());
      if (!g.ok()) return bad(absl::StrCat("\"", key, "\": ", g.status().message()));
      (std::string(key) == "puzzle" ? item.puzzle : item.solution) = *g;
    }
    if (absl::Status v = Verify(item.puzzle, item.solution); !v.ok()) {
      return bad(absl::StrCat("\"solution\" does not solve \"puzzle\": ", v.message()));
    }
    item.givens = CountGivens(item.puzzle);
    if (j.contains("givens") &&
        (!j["givens"].is_number_integer() || j["givens"].get<int64_t>() != item.givens)) {
      return bad(
          absl::StrCat("\"givens\" is ", j["givens"].dump(), " but the puzzle has ", item.givens));
    }
    items.push_back(std::move(item));
    return absl::OkStatus();
  };
  DGSERVE_RETURN_IF_ERROR(ForEachJsonLine(path, /*limit=*/0, add_item));
  return items;
}

// Aggregates over a subset of the puzzles.
struct Stats {
  int puzzles = 0, solved = 0, errors = 0;
  long blanks = 0, correct = 0, steps = 0, canvases = 0, distinct = 0;
  std::vector<double> seconds;  // answered puzzles only

  void Add(const Result& r) {
    ++puzzles;
    if (!r.ok) {
      ++errors;
      return;
    }
    solved += r.solved;
    distinct += r.distinct;
    blanks += r.blanks;
    correct += r.correct;
    steps += r.steps;
    canvases += r.canvases;
    seconds.push_back(r.seconds);
  }
  double SolveRate() const { return puzzles ? double(solved) / puzzles : 0; }
  // Over the blank cells; none ("n/a", JSON null) when the puzzles had none.
  std::optional<double> CellAccuracy() const {
    if (blanks == 0) return std::nullopt;
    return double(correct) / double(blanks);
  }
  double StepsPerCanvas() const { return canvases ? double(steps) / double(canvases) : 0; }
  // Distinct answer grids per answered puzzle (1 with one sample).
  double MeanDistinct() const {
    const int answered = puzzles - errors;
    return answered ? double(distinct) / answered : 0;
  }
  double MeanSeconds() const {
    double sum = 0;
    for (double s : seconds) sum += s;
    return seconds.empty() ? 0 : sum / double(seconds.size());
  }
  double P50Seconds() const {
    if (seconds.empty()) return 0;
    std::vector<double> v = seconds;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
  json ToJson() const {
    return {{"puzzles", puzzles},
            {"solved", solved},
            {"solve_rate", SolveRate()},
            {"cell_accuracy", CellAccuracy() ? json(*CellAccuracy()) : json(nullptr)},
            {"blank_cells", blanks},
            {"correct_blank_cells", correct},
            {"mean_steps_per_canvas", StepsPerCanvas()},
            {"mean_seconds", MeanSeconds()},
            {"p50_seconds", P50Seconds()},
            {"mean_distinct_answers", MeanDistinct()},
            {"errors", errors}};
  }
};

constexpr const char* kBuckets[] = {"<30", "30-34", "35-39", ">=40"};
int BucketOf(int givens) { return givens < 30 ? 0 : givens < 35 ? 1 : givens < 40 ? 2 : 3; }

std::string TableRow(const std::string& name, const Stats& s) {
  const std::string cells =
      s.CellAccuracy() ? absl::StrFormat("%.1f%%", 100 * *s.CellAccuracy()) : std::string("n/a");
  return absl::StrFormat("%-8s %7d %7d %7.1f%% %9s %13.2f %8.3f %8.3f %7d\n", name, s.puzzles,
                         s.solved, 100 * s.SolveRate(), cells, s.StepsPerCanvas(),
                         s.MeanSeconds(), s.P50Seconds(), s.errors);
}

// Sends one puzzle's request and scores the answer.
Result Solve(v1::GenerationService::Stub& stub, const Item& item,
             const v1::GenerateRequest& request) {
  Result r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(int64_t(absl::GetFlag(FLAGS_timeout_s) * 1000)));
  if (const std::string key = absl::GetFlag(FLAGS_api_key); !key.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + key);
  }
  v1::GenerateResponse resp;
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = stub.Generate(&ctx, request, &resp);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) {
    r.error = absl::StrCat("gRPC status ", int(s.error_code()), ": ", s.error_message());
    r.code = static_cast<absl::StatusCode>(s.error_code());
    return r;
  }
  r.ok = true;
  // The first sample (by index) that solves the puzzle, else sample 0; and how many of the
  // samples' grids differ (a grid as ParseAnswer reads it, so spacing does not count).
  r.answer = resp.text();
  bool found = false;
  std::set<Grid> grids;
  for (const v1::Choice& c : resp.choices()) {
    const Grid g = ParseAnswer(c.text());
    grids.insert(g);
    if (!Verify(item.puzzle, g).ok()) continue;
    ++r.samples_solved;
    if (!found) r.answer = c.text();
    found = true;
  }
  if (resp.choices().empty()) {
    grids.insert(ParseAnswer(r.answer));
    r.samples_solved = Verify(item.puzzle, ParseAnswer(r.answer)).ok() ? 1 : 0;
  }
  r.distinct = int(grids.size());
  const Grid answer = ParseAnswer(r.answer);
  const absl::Status v = Verify(item.puzzle, answer);
  r.solved = v.ok();
  r.verdict = std::string(v.message());
  r.blanks = 81 - item.givens;
  r.correct = CorrectBlanks(item.puzzle, item.solution, answer);
  r.steps = resp.usage().denoising_steps();
  r.canvases = resp.usage().canvases();
  return r;
}

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_puzzles);
  const int64_t limit = absl::GetFlag(FLAGS_limit);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int min_givens = absl::GetFlag(FLAGS_min_givens);
  const double timeout_s = absl::GetFlag(FLAGS_timeout_s);
  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (absl::Status s = ValidateTarget("--gateway", absl::GetFlag(FLAGS_gateway)); !s.ok()) return s;
  if (path.empty()) return absl::InvalidArgumentError("--puzzles FILE is required");
  if (limit < 0) return absl::InvalidArgumentError(absl::StrCat("--limit must be >= 0, got ", limit));
  if (concurrency < 1 || concurrency > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency must be in [1, 1024], got ", concurrency));
  }
  if (steps < 0) return absl::InvalidArgumentError(absl::StrCat("--steps must be >= 0, got ", steps));
  if (min_givens < 0 || min_givens > 81) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min_givens must be in [0, 81], got ", min_givens));
  }
  if (absl::GetFlag(FLAGS_samples) < 1 || absl::GetFlag(FLAGS_samples) > kMaxSamplesPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat("--samples must be in [1, ", kMaxSamplesPerRequest,
                                                   "], got ", absl::GetFlag(FLAGS_samples)));
  }
  if (!(timeout_s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout_s must be > 0, got ", timeout_s));
  }
  if (!json_out.empty()) {
    // Written at the end; checked (without creating it) before any request.
    const std::filesystem::path out(json_out);
    const std::filesystem::path dir = out.has_parent_path() ? out.parent_path() : ".";
    const bool exists = access(json_out.c_str(), F_OK) == 0;
    std::error_code ec;
    if (exists && std::filesystem::is_directory(out, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write --json_out ", json_out, ": it is a directory"));
    }
    if (exists ? access(json_out.c_str(), W_OK) != 0 : access(dir.c_str(), W_OK) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write --json_out ", json_out, ": ", std::strerror(errno)));
    }
  }

  DGSERVE_ASSIGN_OR_RETURN(std::vector<Item> all, LoadPuzzles(path));
  std::vector<Item> items;
  for (Item& item : all) {
    if (item.givens < min_givens) continue;
    if (limit > 0 && int64_t(items.size()) == limit) break;
    items.push_back(std::move(item));
  }
  if (items.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " has no puzzle with at least ", min_givens, " givens (", all.size(), " in all)"));
  }

  v1::DiffusionControls diffusion;
  if (steps > 0) diffusion.set_max_denoising_steps(steps);
  if (const double beta = absl::GetFlag(FLAGS_entropy_bound); beta != 0) {
    if (!(beta > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("--entropy_bound must be > 0, got ", beta));
    }
    diffusion.set_entropy_bound(static_cast<float>(beta));
  }
  if (!absl::GetFlag(FLAGS_self_conditioning)) diffusion.set_self_conditioning(false);
  // The gateway checks the schedule (0 <= t_min < t_max, finite) and names the field.
  if (const double t = absl::GetFlag(FLAGS_t_min); t >= 0) diffusion.set_t_min(float(t));
  if (const double t = absl::GetFlag(FLAGS_t_max); t >= 0) diffusion.set_t_max(float(t));
  if (const double s = absl::GetFlag(FLAGS_sample_temperature_spread); s != 0) {
    diffusion.set_sample_temperature_spread(float(s));
  }
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  SudokuMode mode;
  mode.use_template = absl::GetFlag(FLAGS_template);
  mode.candidates = absl::GetFlag(FLAGS_candidates);
  mode.samples = absl::GetFlag(FLAGS_samples);
  if (mode.candidates && !mode.use_template) {
    return absl::InvalidArgumentError("--candidates is a template: not with --template=false");
  }
  std::optional<SudokuTokens> tokens;
  if (mode.candidates) {
    const std::string tokenizer_path = absl::GetFlag(FLAGS_model) + "/tokenizer.json";
    absl::StatusOr<Tokenizer> tok = Tokenizer::Load(tokenizer_path);
    if (!tok.ok()) {
      return absl::Status(tok.status().code(),
                          absl::StrCat(tok.status().message(),
                                       " (--model names the sudoku model's directory)"));
    }
    absl::StatusOr<SudokuTokens> t = LoadSudokuTokens(*tok);
    if (!t.ok()) {
      return absl::Status(t.status().code(),
                          absl::StrCat(tokenizer_path, ": ", t.status().message()));
    }
    tokens = *t;
  }
  // Every request is built before any is sent: a puzzle the mode cannot send is an error, not
  // a request.
  std::vector<v1::GenerateRequest> requests;
  requests.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    absl::StatusOr<v1::GenerateRequest> req = SudokuRequest(
        items[i].puzzle, seed + i, diffusion, mode, tokens ? &*tokens : nullptr);
    if (!req.ok()) {
      return absl::Status(req.status().code(), absl::StrCat(path, ": puzzle ", items[i].id, ": ",
                                                            req.status().message()));
    }
    requests.push_back(*std::move(req));
  }
  auto channel =
      grpc::CreateChannel(absl::GetFlag(FLAGS_gateway), grpc::InsecureChannelCredentials());
  auto stub = v1::GenerationService::NewStub(channel);

  std::vector<Result> results(items.size());
  std::atomic<size_t> next{0};
  std::mutex mu;  // guards `done` and stderr progress lines
  size_t done = 0;
  const size_t report_every = std::max<size_t>(1, items.size() / 10);
  const auto start = std::chrono::steady_clock::now();
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      results[i] = Solve(*stub, items[i], requests[i]);
      std::lock_guard<std::mutex> lock(mu);
      ++done;
      if (!results[i].ok) {
        std::fprintf(stderr, "dgserve-sudoku-eval: puzzle %s: %s\n", items[i].id.c_str(),
                     results[i].error.c_str());
      }
      if (done % report_every == 0 || done == items.size()) {
        std::fprintf(stderr, "dgserve-sudoku-eval: %zu/%zu done\n", done, items.size());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < std::min<int>(concurrency, int(items.size())); ++t) {
    threads.emplace_back(worker);
  }
  for (std::thread& t : threads) t.join();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  Stats total, buckets[4];
  json per_puzzle = json::array();
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    const Result& r = results[i];
    total.Add(r);
    buckets[BucketOf(item.givens)].Add(r);
    json p = {{"id", item.id}, {"givens", item.givens}, {"seed", seed + i}, {"ok", r.ok}};
    if (r.ok) {
      p["solved"] = r.solved;
      if (!r.solved) p["verdict"] = r.verdict;
      p["correct_blank_cells"] = r.correct;
      p["blank_cells"] = r.blanks;
      p["denoising_steps"] = r.steps;
      p["canvases"] = r.canvases;
      p["answer"] = r.answer;
      p["distinct_answers"] = r.distinct;
      p["samples_solved"] = r.samples_solved;
    } else {
      p["error"] = r.error;
    }
    p["seconds"] = r.seconds;
    per_puzzle.push_back(std::move(p));
  }

  std::string table = absl::StrFormat("%-8s %7s %7s %8s %9s %13s %8s %8s %7s\n", "givens",
                                      "puzzles", "solved", "rate", "cell acc", "steps/canvas",
                                      "mean s", "p50 s", "errors");
  table += TableRow("all", total);
  for (int b = 0; b < 4; ++b) {
    if (buckets[b].puzzles > 0) table += TableRow(kBuckets[b], buckets[b]);
  }
  std::printf("%s", table.c_str());
  std::printf("%d puzzles from %s, %s, %d sample(s) each, concurrency %d, %.2f s wall\n",
              total.puzzles, path.c_str(),
              mode.candidates    ? "candidates template (per-blank digits from the givens)"
              : mode.use_template ? "template"
                                  : "plain prompt",
              absl::GetFlag(FLAGS_samples), concurrency, wall);
  if (absl::GetFlag(FLAGS_samples) > 1 && total.puzzles > total.errors) {
    std::printf("distinct answers per puzzle: %.2f of %d samples (mean over answered puzzles)\n",
                total.MeanDistinct(), absl::GetFlag(FLAGS_samples));
  }
  std::fflush(stdout);

  if (!json_out.empty()) {
    json report = total.ToJson();
    report["settings"] = {
        {"gateway", absl::GetFlag(FLAGS_gateway)},
        {"puzzles_file", path},
        {"limit", limit},
        {"min_givens", min_givens},
        {"concurrency", concurrency},
        {"steps", steps},
        {"self_conditioning", absl::GetFlag(FLAGS_self_conditioning)},
        {"entropy_bound", absl::GetFlag(FLAGS_entropy_bound)},
        {"seed", seed},
        {"template", absl::GetFlag(FLAGS_template)},
        {"candidates", mode.candidates},
        {"samples", absl::GetFlag(FLAGS_samples)},
        {"t_min", absl::GetFlag(FLAGS_t_min)},
        {"t_max", absl::GetFlag(FLAGS_t_max)},
        {"sample_temperature_spread", absl::GetFlag(FLAGS_sample_temperature_spread)}};
    report["wall_seconds"] = wall;
    json by = json::object();
    for (int b = 0; b < 4; ++b) by[kBuckets[b]] = buckets[b].ToJson();
    report["by_givens"] = std::move(by);
    report["results"] = std::move(per_puzzle);
    std::ofstream f(json_out, std::ios::out | std::ios::trunc);
    f << report.dump(2) << '\n';
    f.close();
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write --json_out ", json_out));
  }
  if (total.errors > 0) {
    // The first failure's code: a request the gateway refuses (INVALID_ARGUMENT, e.g. --samples
    // above its --max_n) is not reported as an unreachable gateway.
    absl::StatusCode code = absl::StatusCode::kUnavailable;
    for (const Result& r : results) {
      if (!r.ok) {
        code = r.code;
        break;
      }
    }
    return absl::Status(code, absl::StrCat(total.errors, " of ", total.puzzles,
                                           " requests failed (see above)"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve::sudoku

int main(int argc, char** argv) {
  return dgserve::RunFlagsOnlyTool(
      argc, argv, "dgserve-sudoku-eval",
      "Measures a cluster serving the sudoku model on a JSONL puzzle file.\n"
      "  dgserve-sudoku-eval --gateway HOST:PORT --puzzles FILE [--limit N] [--concurrency C] "
      "[--steps N] [--entropy_bound X] [--self_conditioning=false] [--seed S] [--min_givens G] "
      "[--json_out FILE] [--template=false] [--candidates [--model DIR]] [--samples N]",
      "tools/sudoku/eval_main.cc", dgserve::sudoku::Run);
}
