#include "tools/loadgen/loadgen.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/limits.h"

namespace dgserve::loadgen {

using nlohmann::json;

namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

bool Finite(double v) { return std::isfinite(v); }

std::string_view Strip(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// A generator per request (or worker): depends only on the seed and the index (splitmix64 of both).
std::mt19937_64 RequestRng(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return std::mt19937_64(z ^ (z >> 31));
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> ParseHostPort(std::string_view address) {
  std::string_view a = address;
  if (const size_t scheme = a.find("://"); scheme != std::string_view::npos) {
    if (a.substr(0, scheme) != "http") {
      return Bad(absl::StrCat("address '", std::string(address), "': only http:// is supported (",
                              std::string(a.substr(0, scheme)),
                              "://: dgserve-loadgen speaks plain HTTP and gRPC); give HOST:PORT"));
    }
    a.remove_prefix(scheme + 3);
  }
  // The OpenAI base URL (http://HOST:PORT/v1, as the README and OpenAI clients write it) names
  // the same server; any other path is refused rather than dropped.
  if (const size_t slash = a.find('/'); slash != std::string_view::npos) {
    const std::string_view path = a.substr(slash);
    if (path != "/" && path != "/v1" && path != "/v1/") {
      return Bad(absl::StrCat("address '", std::string(address), "': the path '", std::string(path),
                              "' is not taken (give HOST:PORT or the base URL "
                              "http://HOST:PORT/v1; the endpoint is --endpoint's)"));
    }
    a = a.substr(0, slash);
  }
  if (std::any_of(a.begin(), a.end(), [](char c) { return std::isspace((unsigned char)c); })) {
    return Bad(absl::StrCat("address '", std::string(address), "' holds white space"));
  }
  const size_t colon = a.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == a.size()) {
    return Bad(absl::StrCat("address '", std::string(address), "' is not HOST:PORT"));
  }
  std::string host(a.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return Bad(absl::StrCat("address '", std::string(address),
                            "': write an IPv6 host in brackets, [::1]:PORT"));
  }
  std::string_view port_text = a.substr(colon + 1);
  int port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 1 ||
      port > 65535 || host.empty()) {
    return Bad(absl::StrCat("address '", std::string(address), "': port must be 1..65535"));
  }
  return std::make_pair(host, port);
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

absl::Status ValidateOptions(const Options& o) {
  if (o.host.empty() || o.port < 1 || o.port > 65535) {
    return Bad("give the server with --target HOST:PORT (gRPC) or --http HOST:PORT (OpenAI API)");
  }
  if (o.mode == Mode::kOpen) {
    if (!(o.rate > 0) || !Finite(o.rate)) return Bad("--rate must be > 0 with --mode open");
    if (o.concurrency != 0) {
      return Bad("--concurrency applies to --mode closed; use --rate and --max_inflight");
    }
  } else {
    if (o.concurrency < 1) return Bad("--concurrency must be >= 1 with --mode closed");
    if (o.rate != 0) return Bad("--rate applies to --mode open; use --concurrency");
  }
  if (o.max_inflight < 1) return Bad("--max_inflight must be >= 1");
  if (!(o.duration_s >= 0) || !Finite(o.duration_s)) return Bad("--duration_s must be >= 0");
  if (o.requests < 0) return Bad("--requests must be >= 0");
  if (o.duration_s == 0 && o.requests == 0) {
    return Bad("bound the run with --duration_s SECONDS and/or --requests N");
  }
  if (!(o.drain_s >= 0) || !Finite(o.drain_s)) return Bad("--drain_s must be >= 0");
  if (!(o.timeout_s > 0) || !Finite(o.timeout_s)) return Bad("--timeout_s must be > 0");
  if (!(o.prompt_tokens_mean >= 1) || !Finite(o.prompt_tokens_mean)) {
    return Bad("--prompt_tokens_mean must be >= 1");
  }
  if (!(o.prompt_tokens_std >= 0) || !Finite(o.prompt_tokens_std)) {
    return Bad("--prompt_tokens_std must be >= 0");
  }
  if (!(o.max_tokens_mean >= 1) || !Finite(o.max_tokens_mean)) {
    return Bad("--max_tokens_mean must be >= 1");
  }
  if (o.max_tokens_mean > double(kMaxTokensPerRequest)) {
    return Bad(absl::StrCat("--max_tokens_mean must be <= ", kMaxTokensPerRequest,
                            " (the gateway refuses a larger max_tokens)"));
  }
  if (!(o.max_tokens_std >= 0) || !Finite(o.max_tokens_std)) {
    return Bad("--max_tokens_std must be >= 0");
  }
  if (o.max_denoising_steps < 0 || o.max_denoising_steps > 1024) {
    return Bad("--max_denoising_steps must be 0 (server default) or 1..1024");
  }
  if (o.canvas_step_interval < 0) return Bad("--canvas_step_interval must be >= 0");
  if (!(o.max_backoff_s >= 0) || !Finite(o.max_backoff_s)) {
    return Bad("--max_backoff_s must be a finite number >= 0 (0: no wait after a refusal)");
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

PoissonSchedule::PoissonSchedule(double rate, uint64_t seed) : rng_(seed), gap_(rate) {}

double PoissonSchedule::NextGap() { return gap_(rng_); }

double PoissonSchedule::NextArrival() {
  t_ += NextGap();
  return t_;
}

// ---------------------------------------------------------------------------------------------

ConnectBackoff::ConnectBackoff(double initial_s, double max_s)
    : initial_s_(initial_s), max_s_(std::max(initial_s, max_s)) {}

ConnectBackoff::Admission ConnectBackoff::TryStart(double now) {
  Admission a;
  if (delay_ == 0) {
    a.admitted = true;
    return a;
  }
  if (probe_in_flight_) {
    a.retry_at = now + delay_;  // asked again when the probe may have ended
    return a;
  }
  if (now < next_at_) {
    a.retry_at = next_at_;
    return a;
  }
  probe_in_flight_ = true;
  a.admitted = a.probe = true;
  return a;
}

void ConnectBackoff::Finish(double now, bool probe, bool connect_failed) {
  if (probe) probe_in_flight_ = false;
  if (!connect_failed) {
    delay_ = 0;
    return;
  }
  if (delay_ == 0) {
    delay_ = initial_s_;
    next_at_ = now + delay_;
  } else if (probe) {
    delay_ = std::min(2 * delay_, max_s_);
    next_at_ = now + delay_;
  } else {
    // An attempt that started before the backoff: it moves the next probe, not the delay.
    next_at_ = std::max(next_at_, now + delay_);
  }
}

// ---------------------------------------------------------------------------------------------

std::optional<double> ParseRetryAfter(std::string_view value) {
  value = Strip(value);
  if (value.empty()) return std::nullopt;
  if (std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    if (value.size() > 9) return 1e9;
    return static_cast<double>(std::stoll(std::string(value)));
  }
  // An HTTP-date: IMF-fixdate "Sun, 06 Nov 1994 08:49:37 GMT", or the obsolete RFC 850
  // "Sunday, 06-Nov-94 08:49:37 GMT" and asctime "Sun Nov  6 08:49:37 1994" forms.
  static constexpr std::string_view kDays[] = {"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"};
  const bool day = std::any_of(std::begin(kDays), std::end(kDays),
                               [&](std::string_view d) { return value.substr(0, 3) == d; });
  const bool digit_at_end = std::isdigit(static_cast<unsigned char>(value.back())) != 0;
  if (day && value.size() >= 24 && (value.substr(value.size() - 4) == " GMT" || digit_at_end)) {
    return kRetryAfterDateS;
  }
  return std::nullopt;
}

bool IsHttpLoadRefusal(int http_status, bool has_retry_after) {
  return http_status == 429 || (http_status == 503 && has_retry_after);
}

OverloadBackoff::OverloadBackoff(double max_s, uint64_t seed, uint64_t worker)
    : max_s_(std::max(0.0, max_s)), rng_(RequestRng(seed ^ 0x6F766572'6C6F6164ull, worker)) {}

double OverloadBackoff::OnRefused(std::optional<double> retry_after_s) {
  if (max_s_ == 0) return 0;
  if (retry_after_s.has_value()) return std::clamp(*retry_after_s, 0.0, max_s_);
  refusals_ = std::min(refusals_ + 1, 40);  // 0.05 s * 2^39 is past any cap
  const double d = std::min(kInitialS * std::ldexp(1.0, refusals_ - 1), max_s_);
  return d / 2 + std::uniform_real_distribution<double>(0, d / 2)(rng_);
}

// ---------------------------------------------------------------------------------------------

namespace {

absl::StatusOr<Prompt> ParsePromptObject(const json& j) {
  if (!j.is_object()) return Bad("expected a JSON object");
  Prompt p;
  const bool has_prompt = j.contains("prompt"), has_messages = j.contains("messages");
  if (has_prompt == has_messages) return Bad("needs exactly one of \"prompt\" and \"messages\"");
  if (has_prompt) {
    const json& v = j["prompt"];
    if (!v.is_string()) return Bad("\"prompt\" must be a string");
    p.text = v.get<std::string>();
    if (p.text.empty()) return Bad("\"prompt\" is empty");
  } else {
    const json& v = j["messages"];
    if (!v.is_array() || v.empty()) return Bad("\"messages\" must be a non-empty array");
    p.is_chat = true;
    for (size_t i = 0; i < v.size(); ++i) {
      const json& m = v[i];
      if (!m.is_object() || !m.contains("role") || !m.contains("content") ||
          !m["role"].is_string() || !m["content"].is_string()) {
        return Bad(absl::StrCat("messages[", i, "] must be {\"role\": string, \"content\": string}"));
      }
      const std::string role = m["role"].get<std::string>();
      // The gateway's roles (developer is read as system, model as assistant), sent as written.
      if (role != "system" && role != "developer" && role != "user" && role != "assistant" &&
          role != "model") {
        return Bad(absl::StrCat("messages[", i,
                                "].role must be system, developer, user, assistant or model"));
      }
      p.messages.push_back({role, m["content"].get<std::string>()});
    }
  }
  if (j.contains("max_tokens") && !j["max_tokens"].is_null()) {
    const json& v = j["max_tokens"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1) {
      return Bad("\"max_tokens\" must be a positive integer");
    }
    if (v.get<int64_t>() > kMaxTokensPerRequest) {
      return Bad(absl::StrCat("\"max_tokens\" must be at most ", kMaxTokensPerRequest,
                              " (the gateway refuses more)"));
    }
    p.max_tokens = v.get<int64_t>();
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "prompt" && it.key() != "messages" && it.key() != "max_tokens") {
      return Bad(absl::StrCat("unknown key \"", it.key(), "\""));
    }
  }
  return p;
}

}  // namespace

absl::StatusOr<std::vector<Prompt>> ParsePromptsJsonl(std::string_view content) {
  std::vector<Prompt> out;
  size_t line_no = 0;
  while (!content.empty()) {
    const size_t nl = content.find('\n');
    std::string_view line = content.substr(0, nl);
    content = nl == std::string_view::npos ? std::string_view() : content.substr(nl + 1);
    ++line_no;
    line = Strip(line);
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Bad(absl::StrCat("line ", line_no, ": not valid JSON"));
    absl::StatusOr<Prompt> p = ParsePromptObject(j);
    if (!p.ok()) return Bad(absl::StrCat("line ", line_no, ": ", std::string(p.status().message())));
    out.push_back(*std::move(p));
  }
  if (out.empty()) return Bad("no prompts (every line is blank)");
  return out;
}

absl::StatusOr<std::vector<Prompt>> LoadPromptsFile(const std::string& path) {
  // A directory opens, and reads as empty: named as what it is, not as a file of blank lines.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Bad(absl::StrCat("--prompts ", path, ": is a directory, not a JSONL file"));
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Bad(absl::StrCat("--prompts ", path, ": cannot open",
                            errno != 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Bad(absl::StrCat("--prompts ", path, ": read error"));
  absl::StatusOr<std::vector<Prompt>> p = ParsePromptsJsonl(ss.str());
  if (!p.ok()) return Bad(absl::StrCat("--prompts ", path, ": ", std::string(p.status().message())));
  return p;
}

namespace {

// Plain words for synthetic prompts (most are one token in Gemma's vocabulary).
constexpr const char* kWords[] = {
    "the",    "a",      "model",  "writes", "about",  "river",  "stone",  "light",  "city",
    "night",  "garden", "story",  "of",     "and",    "in",     "with",   "quiet",  "green",
    "small",  "old",    "new",    "bright", "cold",   "warm",   "house",  "road",   "tree",
    "window", "sea",    "mountain", "bird", "song",   "paper",  "friend", "morning", "rain",
    "explain", "why",   "how",    "what",   "when",   "please", "short",  "long",   "list",
    "three",  "ideas",  "for",    "simple", "summer", "winter", "book",   "music",  "table",
    "water",  "fire",   "cloud",  "star",   "machine", "learning", "time", "world", "people"};
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

}  // namespace

PromptSource::PromptSource(std::vector<Prompt> file_prompts, SyntheticOptions options)
    : file_prompts_(std::move(file_prompts)), options_(options) {}

int64_t PromptSource::DrawPositive(std::mt19937_64& rng, double mean, double std) {
  double v = mean;
  if (std > 0) v = std::normal_distribution<double>(mean, std)(rng);
  const double r = std::round(v);
  if (!(r >= 1)) return 1;
  if (r > 1e9) return 1'000'000'000;
  return static_cast<int64_t>(r);
}

Prompt PromptSource::Get(uint64_t index) const {
  std::mt19937_64 rng = RequestRng(options_.seed, index);
  Prompt p;
  if (!file_prompts_.empty()) {
    p = file_prompts_[index % file_prompts_.size()];
  } else {
    const int64_t words = DrawPositive(rng, options_.prompt_words_mean, options_.prompt_words_std);
    std::uniform_int_distribution<size_t> pick(0, kNumWords - 1);
    p.text.reserve(static_cast<size_t>(words) * 7);
    for (int64_t i = 0; i < words; ++i) {
      if (i > 0) p.text += ' ';
      p.text += kWords[pick(rng)];
    }
  }
  if (p.max_tokens == 0) {
    // A draw past the gateway's limit is the limit (a mean at most the limit is checked).
    p.max_tokens = std::min<int64_t>(
        DrawPositive(rng, options_.max_tokens_mean, options_.max_tokens_std), kMaxTokensPerRequest);
  }
  return p;
}

// ---------------------------------------------------------------------------------------------

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  q = std::clamp(q, 0.0, 100.0);
  const double pos = q / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (pos - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

Summary Summarize(const std::vector<double>& values) {
  Summary s;
  s.count = values.size();
  if (values.empty()) return s;
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  s.p50 = Percentile(values, 50);
  s.p90 = Percentile(values, 90);
  s.p99 = Percentile(values, 99);
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

Report BuildReport(const std::vector<RequestResult>& results, const RunInfo& info) {
  Report r;
  r.info = info;
  std::vector<double> ttft, e2e, first_step, server_first_step;
  double last_end = 0;
  int64_t cancelled = 0, reached = 0;
  for (const RequestResult& x : results) {
    if (x.e2e_s >= 0) last_end = std::max(last_end, x.start_s + x.e2e_s);
    if (x.cancelled) {
      ++cancelled;
      continue;
    }
    if (!x.ok) {
      ++r.errors;
      ++r.errors_by_code[x.error.empty() ? "UNKNOWN" : x.error];
      if (x.connect_failed) {
        ++r.connect_errors;
      } else {
        ++reached;
      }
      continue;
    }
    ++reached;
    ++r.completed;
    if (x.ttft_s >= 0) ttft.push_back(x.ttft_s);
    if (x.e2e_s >= 0) e2e.push_back(x.e2e_s);
    if (x.first_step_s >= 0) first_step.push_back(x.first_step_s);
    if (x.server_first_step_s > 0) server_first_step.push_back(x.server_first_step_s);
    r.prompt_tokens += x.prompt_tokens;
    r.completion_tokens += x.completion_tokens;
    r.canvases += x.canvases;
    r.denoising_steps += x.denoising_steps;
  }
  const int64_t missing = std::max<int64_t>(0, info.sent - static_cast<int64_t>(results.size()));
  r.unfinished = missing + cancelled;
  r.never_reachable = r.connect_errors > 0 && reached == 0;
  r.elapsed_s = r.unfinished > 0 ? info.wall_s : std::max(last_end, info.issue_s);
  if (r.elapsed_s <= 0) r.elapsed_s = info.wall_s;
  if (r.elapsed_s > 0) {
    r.requests_per_s = static_cast<double>(r.completed) / r.elapsed_s;
    r.output_tokens_per_s = static_cast<double>(r.completion_tokens) / r.elapsed_s;
  }
  r.ttft = Summarize(ttft);
  r.e2e = Summarize(e2e);
  r.first_step = Summarize(first_step);
  r.server_first_step = Summarize(server_first_step);
  if (r.canvases > 0) {
    r.mean_steps_per_canvas =
        static_cast<double>(r.denoising_steps) / static_cast<double>(r.canvases);
  }
  return r;
}

namespace {

std::string SummaryLine(const char* name, const Summary& s) {
  if (s.count == 0) return absl::StrFormat("    %-22s %s\n", name, "n/a");
  return absl::StrFormat("    %-22s %8.3f %8.3f %8.3f %8.3f %8.3f %6d\n", name, s.p50, s.p90,
                         s.p99, s.mean, s.max, s.count);
}

nlohmann::ordered_json SummaryJson(const Summary& s) {
  if (s.count == 0) return nullptr;
  return nlohmann::ordered_json{{"count", s.count}, {"mean", s.mean}, {"p50", s.p50},
              {"p90", s.p90},     {"p99", s.p99},   {"max", s.max}};
}

std::string LoadShape(const RunInfo& i) {
  if (i.mode == "open") return absl::StrFormat("open loop, Poisson %.3g req/s", i.rate);
  return absl::StrFormat("closed loop, concurrency %d", i.concurrency);
}

}  // namespace

std::string FormatReport(const Report& r) {
  const RunInfo& i = r.info;
  std::string s = "dgserve-loadgen report\n";
  absl::StrAppendFormat(&s, "  target       %s %s (%s)\n", i.protocol, i.target, i.endpoint);
  if (r.never_reachable) {
    absl::StrAppendFormat(&s,
                          "  UNREACHABLE  the target was never reachable: all %d attempts failed "
                          "to connect (is the gateway running at %s?)\n",
                          r.connect_errors, i.target);
  }
  absl::StrAppendFormat(&s, "  load         %s\n", LoadShape(i));
  absl::StrAppendFormat(&s, "  elapsed      %.2f s (wall %.2f s)\n", r.elapsed_s, i.wall_s);
  absl::StrAppendFormat(&s,
                        "  requests     sent %d  completed %d  errors %d  dropped %d  "
                        "unfinished %d\n",
                        i.sent, r.completed, r.errors, i.dropped, r.unfinished);
  if (r.connect_errors > 0 || i.held_back > 0) {
    absl::StrAppendFormat(&s,
                          "  connect      %d failed to connect; retried with a backoff of %g ms "
                          "doubling to %g s",
                          r.connect_errors, ConnectBackoff::kInitialS * 1000,
                          ConnectBackoff::kMaxS);
    if (i.mode == "open") absl::StrAppendFormat(&s, " (%d arrivals held back)", i.held_back);
    s += "\n";
  }
  if (i.backed_off > 0) {
    absl::StrAppendFormat(&s,
                          "  backoff      %d refusals for load waited after, %.2f s in all "
                          "(Retry-After, else %g ms doubling; at most %g s each)\n",
                          i.backed_off, i.backoff_wait_s, OverloadBackoff::kInitialS * 1000,
                          i.max_backoff_s);
  }
  absl::StrAppendFormat(&s, "  throughput   %.3f req/s  %.1f output tokens/s\n", r.requests_per_s,
                        r.output_tokens_per_s);
  if (r.completed > 0) {
    absl::StrAppendFormat(&s, "  tokens       prompt %.1f  completion %.1f (mean per request)\n",
                          static_cast<double>(r.prompt_tokens) / r.completed,
                          static_cast<double>(r.completion_tokens) / r.completed);
  }
  absl::StrAppendFormat(&s, "  latency (s)\n    %-22s %8s %8s %8s %8s %8s %6s\n", "", "p50",
                        "p90", "p99", "mean", "max", "n");
  s += SummaryLine("TTFT (first block)", r.ttft);
  s += SummaryLine("end-to-end", r.e2e);
  s += SummaryLine("first canvas step", r.first_step);
  s += SummaryLine("first step (server)", r.server_first_step);
  if (r.canvases > 0) {
    absl::StrAppendFormat(&s,
                          "  diffusion    %.2f steps per canvas (%d denoising steps over %d "
                          "canvases)\n",
                          r.mean_steps_per_canvas, r.denoising_steps, r.canvases);
  } else {
    s += "  diffusion    n/a (no usage reported)\n";
  }
  if (r.errors_by_code.empty()) {
    s += "  errors       none\n";
  } else {
    s += "  errors      ";
    for (const auto& [code, n] : r.errors_by_code) absl::StrAppendFormat(&s, " %s=%d", code, n);
    s += "\n";
  }
  return s;
}

nlohmann::ordered_json ReportJson(const Report& r) {
  using ojson = nlohmann::ordered_json;
  const RunInfo& i = r.info;
  ojson j = {
      {"protocol", i.protocol},
      {"target", i.target},
      {"endpoint", i.endpoint},
      {"mode", i.mode},
      {"rate", i.mode == "open" ? ojson(i.rate) : ojson(nullptr)},
      {"concurrency", i.mode == "closed" ? ojson(i.concurrency) : ojson(nullptr)},
      {"wall_s", i.wall_s},
      {"elapsed_s", r.elapsed_s},
      {"sent", i.sent},
      {"completed", r.completed},
      {"errors", r.errors},
      {"dropped", i.dropped},
      {"unfinished", r.unfinished},
      {"connect_errors", r.connect_errors},
      {"held_back", i.held_back},
      {"backed_off", i.backed_off},
      {"backoff_wait_s", i.backoff_wait_s},
      {"max_backoff_s", i.mode == "closed" ? ojson(i.max_backoff_s) : ojson(nullptr)},
      {"reachable", !r.never_reachable},
      {"requests_per_s", r.requests_per_s},
      {"output_tokens_per_s", r.output_tokens_per_s},
      {"prompt_tokens", r.prompt_tokens},
      {"completion_tokens", r.completion_tokens},
      {"ttft_s", SummaryJson(r.ttft)},
      {"e2e_s", SummaryJson(r.e2e)},
      {"first_canvas_step_s", SummaryJson(r.first_step)},
      {"server_first_step_s", SummaryJson(r.server_first_step)},
      {"canvases", r.canvases},
      {"denoising_steps", r.denoising_steps},
      {"mean_steps_per_canvas", r.canvases > 0 ? ojson(r.mean_steps_per_canvas) : ojson(nullptr)},
      {"errors_by_code", ojson::object()},
  };
  for (const auto& [code, n] : r.errors_by_code) j["errors_by_code"][code] = n;
  return j;
}

// ---------------------------------------------------------------------------------------------

void SseParser::Feed(std::string_view bytes,
                     const std::function<void(std::string_view data)>& on_data) {
  for (char c : bytes) {
    if (c != '\n') {
      line_ += c;
      continue;
    }
    std::string_view line = line_;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // blank line: the event ends
      if (has_data_) on_data(data_);
      data_.clear();
      has_data_ = false;
    } else if (line.substr(0, 5) == "data:") {
      std::string_view v = line.substr(5);
      if (!v.empty() && v.front() == ' ') v.remove_prefix(1);
      if (has_data_) data_ += '\n';
      data_ += v;
      has_data_ = true;
    }  // comments (":...") and other fields are ignored
    line_.clear();
  }
}

StreamChunk ClassifyChunk(std::string_view data) {
  StreamChunk c;
  if (Strip(data) == "[DONE]") {
    c.kind = StreamChunk::kDone;
    return c;
  }
  json j = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    c.kind = StreamChunk::kInvalid;
    c.error_code = "invalid_chunk";
    c.error_message = std::string(data.substr(0, 200));
    return c;
  }
  if (j.contains("error") && j["error"].is_object()) {
    const json& e = j["error"];
    c.kind = StreamChunk::kError;
    c.error_code = e.contains("code") && e["code"].is_string() ? e["code"].get<std::string>()
                                                                : "error";
    if (e.contains("message") && e["message"].is_string()) c.error_message = e["message"];
    return c;
  }
  if (j.contains("usage") && j["usage"].is_object()) {
    const json& u = j["usage"];
    c.kind = StreamChunk::kUsage;
    c.prompt_tokens = u.value("prompt_tokens", int64_t{0});
    c.completion_tokens = u.value("completion_tokens", int64_t{0});
    if (u.contains("dgserve") && u["dgserve"].is_object()) {
      const json& d = u["dgserve"];
      c.canvases = d.value("canvases", int64_t{0});
      c.denoising_steps = d.value("denoising_steps", int64_t{0});
      if (d.contains("timings") && d["timings"].is_object()) {
        c.server_first_step_s = d["timings"].value("first_step_seconds", -1.0);
      }
    }
    return c;
  }
  if (j.contains("dgserve") && j["dgserve"].is_object() && j["dgserve"].contains("canvas_step")) {
    c.kind = StreamChunk::kCanvasStep;
    return c;
  }
  if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
    const json& ch = j["choices"][0];
    if (ch.contains("text") && ch["text"].is_string() && !ch["text"].get_ref<const std::string&>().empty()) {
      c.kind = StreamChunk::kContent;
    } else if (ch.contains("delta") && ch["delta"].is_object() && ch["delta"].contains("content") &&
               ch["delta"]["content"].is_string() &&
               !ch["delta"]["content"].get_ref<const std::string&>().empty()) {
      c.kind = StreamChunk::kContent;
    }
  }
  return c;
}

absl::StatusOr<std::string> HttpRequestBody(const Prompt& prompt, int64_t max_tokens, bool chat,
                                            const Options& o) {
  json j = json::object();
  if (!o.model.empty()) j["model"] = o.model;
  if (chat) {
    json msgs = json::array();
    if (prompt.is_chat) {
      for (const ChatMessage& m : prompt.messages) {
        msgs.push_back({{"role", m.role}, {"content", m.content}});
      }
    } else {
      msgs.push_back({{"role", "user"}, {"content", prompt.text}});
    }
    j["messages"] = std::move(msgs);
  } else {
    if (prompt.is_chat) {
      return Bad("a \"messages\" prompt needs --endpoint chat (or the gRPC --target)");
    }
    j["prompt"] = prompt.text;
  }
  if (max_tokens > 0) j["max_tokens"] = max_tokens;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  if (o.max_denoising_steps > 0) j["max_denoising_steps"] = o.max_denoising_steps;
  if (o.canvas_step_interval > 0) j["canvas_step_interval"] = o.canvas_step_interval;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace dgserve::loadgen
