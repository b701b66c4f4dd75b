// dgserve-loadgen's pure parts: options and their validation, the Poisson arrival schedule,
// prompts (JSONL files and synthetic ones), percentiles, the OpenAI SSE stream reader and the
// report. Nothing here touches the network or the wall clock, so all of it is unit-tested.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace dgserve::loadgen {

// ---------------------------------------------------------------------------------------------
// Options

enum class Protocol { kGrpc, kHttp };
enum class Endpoint { kChat, kCompletions };
enum class Mode { kOpen, kClosed };

struct Options {
  Protocol protocol = Protocol::kGrpc;
  std::string host;  // from --target or --http
  int port = 0;
  Endpoint endpoint = Endpoint::kChat;  // HTTP only
  std::string api_key;
  std::string model;  // empty = the served model

  Mode mode = Mode::kClosed;
  double rate = 0;      // open loop: requests/s (Poisson)
  int concurrency = 0;  // closed loop: workers
  int max_inflight = 256;

  std::string prompts_file;
  double prompt_tokens_mean = 32, prompt_tokens_std = 8;
  double max_tokens_mean = 64, max_tokens_std = 0;
  uint64_t seed = 1;
  int max_denoising_steps = 0;   // 0 = the server's default
  int canvas_step_interval = 0;  // 0 = no CanvasStep events

  double duration_s = 0;  // 0 = unbounded
  int64_t requests = 0;   // 0 = unbounded
  double drain_s = 30;
  double timeout_s = 300;
  // Closed loop: the longest wait after a refusal for load (OverloadBackoff); 0 = no wait.
  double max_backoff_s = 1;
};

// Splits "HOST:PORT" (IPv6 as "[::1]:80"). An "http://" prefix and a trailing "/" or "/v1" (the
// OpenAI base URL, http://HOST:PORT/v1) are tolerated; another scheme, another path or white
// space is an error naming it.
absl::StatusOr<std::pair<std::string, int>> ParseHostPort(std::string_view address);

// "HOST:PORT" as ParseHostPort reads it back: an IPv6 host in brackets ("[::1]:80").
std::string JoinHostPort(const std::string& host, int port);

// Checks ranges and combinations of `o` (both the flag values and what they imply). The message
// names the offending flag, e.g. "--rate must be > 0 with --mode open".
absl::Status ValidateOptions(const Options& o);

// ---------------------------------------------------------------------------------------------
// Arrival schedule

// Poisson arrivals at `rate` per second: exponential inter-arrival gaps drawn from a 64-bit
// Mersenne Twister seeded with `seed`, so the schedule is the same on every run with the seed.
class PoissonSchedule {
 public:
  PoissonSchedule(double rate, uint64_t seed);
  // Seconds from the previous arrival to the next one.
  double NextGap();
  // Seconds from the start of the run to the next arrival (the running sum of NextGap()).
  double NextArrival();

 private:
  std::mt19937_64 rng_;
  std::exponential_distribution<double> gap_;
  double t_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Backoff while the target refuses connections

// Spaces the attempts while the target cannot be connected to, so a dead target is not sent
// requests as fast as the loop can make them. After a connection failure only one attempt at a
// time (a probe) may start, `delay` after the previous failure; the delay starts at `initial_s`
// and doubles after each failed probe up to `max_s`. Any attempt that reaches the server (even
// one the server refuses) ends the backoff. Times are seconds on the caller's clock (the run's,
// or a test's fake one). Not thread-safe.
class ConnectBackoff {
 public:
  static constexpr double kInitialS = 0.05, kMaxS = 1.0;
  explicit ConnectBackoff(double initial_s = kInitialS, double max_s = kMaxS);

  struct Admission {
    bool admitted = false;
    bool probe = false;   // admitted as the one attempt allowed during the backoff
    double retry_at = 0;  // not admitted: when to ask again
  };
  // Whether an attempt may start at `now`.
  Admission TryStart(double now);
  // The end, at `now`, of an attempt TryStart admitted (`probe` as TryStart said).
  void Finish(double now, bool probe, bool connect_failed);
  // A probe TryStart admitted that was not sent after all (the open loop's pool was full).
  void CancelProbe() { probe_in_flight_ = false; }
  // The current delay between probes; 0 when not backing off.
  double delay() const { return delay_; }

 private:
  const double initial_s_, max_s_;
  double delay_ = 0, next_at_ = 0;
  bool probe_in_flight_ = false;
};

// ---------------------------------------------------------------------------------------------
// Backoff after a refusal for load (closed loop)

// Retry-After as an HTTP-date: the client's clock is not compared with the server's, so the
// date reads as this many seconds.
inline constexpr double kRetryAfterDateS = 1.0;

// Parses an HTTP Retry-After value (RFC 9110 10.2.3): delta-seconds ("1", "120") are those
// seconds (at most 1e9); an HTTP-date ("Wed, 21 Oct 2015 07:28:00 GMT") is kRetryAfterDateS;
// empty (absent) or anything else is no hint (nullopt).
std::optional<double> ParseRetryAfter(std::string_view value);

// Whether an HTTP answer refuses the request for load: 429 (Too Many Requests), or 503 with a
// Retry-After field (the gateway's answer when its admission queue, or its budget of request
// bodies, is full; a 503 without one, e.g. a draining gateway, is not a load refusal).
bool IsHttpLoadRefusal(int http_status, bool has_retry_after);

// How long a closed-loop worker waits after the server refused its request for load (HTTP 429 or
// 503 with Retry-After, gRPC RESOURCE_EXHAUSTED), so a full server is not sent the next request
// at once and the run measures serving, not how fast the server refuses. The wait is the
// server's Retry-After when it gave one, else a backoff: after the n-th refusal in a row,
// d = kInitialS * 2^(n-1), and the wait is d/2 plus a jitter uniform in [0, d/2) drawn from a
// generator seeded with the run's seed and the worker. Either is capped at `max_s`; `max_s` 0
// never waits (the behaviour before the backoff). One per worker; not thread-safe.
class OverloadBackoff {
 public:
  static constexpr double kInitialS = 0.05;
  OverloadBackoff(double max_s, uint64_t seed, uint64_t worker);
  // The wait in seconds after a refusal; `retry_after_s`: the server's hint (ParseRetryAfter).
  double OnRefused(std::optional<double> retry_after_s);
  // The server took a request: the next refusal's backoff starts from kInitialS again.
  void OnServed() { refusals_ = 0; }

 private:
  const double max_s_;
  std::mt19937_64 rng_;
  int refusals_ = 0;  // in a row, without a hint
};

// ---------------------------------------------------------------------------------------------
// Prompts

struct ChatMessage {
  std::string role;
  std::string content;
};

struct Prompt {
  bool is_chat = false;
  std::string text;                   // when !is_chat
  std::vector<ChatMessage> messages;  // when is_chat
  int64_t max_tokens = 0;             // 0 = draw from the --max_tokens_* distribution
};

// Parses a JSONL prompt file: one JSON object per non-blank line, {"prompt": "..."} or
// {"messages": [{"role": ..., "content": ...}, ...]}, with an optional positive integer
// "max_tokens". Errors name the line ("line 3: ...").
absl::StatusOr<std::vector<Prompt>> ParsePromptsJsonl(std::string_view content);

// Reads and parses `path` with ParsePromptsJsonl; errors name the file.
absl::StatusOr<std::vector<Prompt>> LoadPromptsFile(const std::string& path);

struct SyntheticOptions {
  double prompt_words_mean = 32, prompt_words_std = 8;
  double max_tokens_mean = 64, max_tokens_std = 0;
  uint64_t seed = 1;
};

// The prompt of request `index`: the file prompts in turn (when there are any), otherwise a
// synthetic prompt of about N(mean, std) words (at least 1). A prompt without max_tokens gets
// round(N(max_tokens_mean, max_tokens_std)) clamped to >= 1. The result depends only on the
// seed and `index`, never on thread timing; Get is safe to call from many threads.
class PromptSource {
 public:
  PromptSource(std::vector<Prompt> file_prompts, SyntheticOptions options);
  Prompt Get(uint64_t index) const;
  // round(N(mean, std)) clamped to >= 1 (std 0 gives round(mean)); exposed for tests.
  static int64_t DrawPositive(std::mt19937_64& rng, double mean, double std);

 private:
  std::vector<Prompt> file_prompts_;
  SyntheticOptions options_;
};

// ---------------------------------------------------------------------------------------------
// Statistics

// The q-th percentile (0 <= q <= 100) of `values` with linear interpolation between the closest
// ranks (numpy's default); 0 for no values.
double Percentile(std::vector<double> values, double q);

struct Summary {
  size_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};

// count, mean, p50/p90/p99 and max of `values`.
Summary Summarize(const std::vector<double>& values);

// The outcome of one request as the client saw it. Times are seconds; -1 = not observed.
struct RequestResult {
  bool ok = false;
  bool cancelled = false;  // cut off by the load generator when the drain time ran out
  std::string error;       // error key: gRPC code name ("UNAVAILABLE"), "HTTP 429", "http:Read"
  std::string error_message;
  bool connect_failed = false;  // never reached the server (connection refused, no route, ...)
  // Refused for load: HTTP 429 or 503 with Retry-After, gRPC RESOURCE_EXHAUSTED.
  bool load_refusal = false;
  std::optional<double> retry_after_s;  // the server's Retry-After (ParseRetryAfter), if any
  double start_s = 0;         // issue time since the start of the run
  double ttft_s = -1;         // first committed block
  double first_step_s = -1;   // first CanvasStep event (needs --canvas_step_interval)
  double e2e_s = -1;          // until the stream ended
  double server_first_step_s = -1;  // usage.timings.first_step_seconds (server side)
  int64_t prompt_tokens = 0, completion_tokens = 0, canvases = 0, denoising_steps = 0;
};

// Run-level facts that the results alone do not carry.
struct RunInfo {
  std::string protocol;  // "grpc" or "http"
  std::string target;    // host:port
  std::string endpoint;  // HTTP: "chat" or "completions"; gRPC: "GenerateStream"
  std::string mode;      // "open" or "closed"
  double rate = 0;
  int concurrency = 0;
  int64_t sent = 0;     // requests issued to the server
  int64_t dropped = 0;  // open loop: arrivals refused because --max_inflight were in flight
  int64_t held_back = 0;  // open loop: arrivals not sent during a ConnectBackoff
  // Closed loop: refusals for load a worker waited after (OverloadBackoff), the seconds waited
  // in all (cut short when the run ended) and --max_backoff_s.
  int64_t backed_off = 0;
  double backoff_wait_s = 0;
  double max_backoff_s = 0;
  double issue_s = 0;   // start of the run until issuing stopped
  double wall_s = 0;    // start of the run until the report
};

struct Report {
  RunInfo info;
  // Start of the run until the last request ended, at least until issuing stopped (the wall
  // time when requests were cut off): the denominator of the rates.
  double elapsed_s = 0;
  int64_t completed = 0, errors = 0, unfinished = 0;
  double requests_per_s = 0, output_tokens_per_s = 0;
  Summary ttft, e2e, first_step, server_first_step;
  int64_t prompt_tokens = 0, completion_tokens = 0, canvases = 0, denoising_steps = 0;
  double mean_steps_per_canvas = 0;
  std::map<std::string, int64_t> errors_by_code;
  // Errors that never reached the server (RequestResult::connect_failed).
  int64_t connect_errors = 0;
  // Requests were sent and every one that ended failed to connect: the target was never
  // reachable (the report says so; dgserve-loadgen exits 3).
  bool never_reachable = false;
};

// Aggregates `results` (successful requests feed the latency and token figures). Requests sent
// but without a result, and cancelled ones, count as unfinished.
Report BuildReport(const std::vector<RequestResult>& results, const RunInfo& info);

// The human-readable report (several lines, ends with a newline).
std::string FormatReport(const Report& r);

// The same report as one JSON object.
nlohmann::ordered_json ReportJson(const Report& r);

// ---------------------------------------------------------------------------------------------
// OpenAI streaming (server-sent events)

// Splits a server-sent event stream into events and hands each event's data (the "data:" lines
// joined by "\n") to the callback. Bytes may arrive in any pieces; "\r\n" is accepted.
class SseParser {
 public:
  void Feed(std::string_view bytes, const std::function<void(std::string_view data)>& on_data);

 private:
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

// What one SSE data payload of /v1/chat/completions or /v1/completions carries.
struct StreamChunk {
  enum Kind { kDone, kContent, kCanvasStep, kUsage, kError, kOther, kInvalid };
  Kind kind = kOther;
  std::string error_code;  // kError: error.code ("unavailable"); kInvalid: the parse message
  std::string error_message;
  int64_t prompt_tokens = 0, completion_tokens = 0, canvases = 0, denoising_steps = 0;
  double server_first_step_s = -1;
};

// Classifies an SSE data payload: "[DONE]", a chunk with non-empty text/content, a dgserve
// canvas_step chunk, the usage chunk, an error object or something else (e.g. the final chunk
// with only a finish_reason).
StreamChunk ClassifyChunk(std::string_view data);

// The OpenAI request body for `prompt` (stream with usage, the dgserve pass-through controls).
// `chat` selects /v1/chat/completions (a plain prompt becomes one user message); a chat prompt
// for /v1/completions is an error.
absl::StatusOr<std::string> HttpRequestBody(const Prompt& prompt, int64_t max_tokens, bool chat,
                                            const Options& o);

}  // namespace dgserve::loadgen
