// dgserve-loadgen: drives a dgserve gateway with streaming requests (gRPC GenerateStream or the
// OpenAI HTTP API) in an open loop (Poisson arrivals) or a closed loop (N back-to-back workers)
// and reports throughput, TTFT and end-to-end latency percentiles, diffusion steps and errors.
// See tools/loadgen/README.md.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli.h"
#include "tools/loadgen/clients.h"
#include "tools/loadgen/loadgen.h"

ABSL_FLAG(std::string, target, "", "gRPC gateway HOST:PORT (GenerationService.GenerateStream)");
ABSL_FLAG(std::string, http, "",
          "HTTP gateway HOST:PORT or its base URL http://HOST:PORT/v1 (OpenAI API, streaming)");
ABSL_FLAG(std::optional<std::string>, endpoint, std::nullopt,
          "with --http: chat (/v1/chat/completions, the default) or completions (/v1/completions)");
ABSL_FLAG(std::string, api_key, "", "sent as 'authorization: Bearer KEY'");
ABSL_FLAG(std::string, model, "", "model name sent with each request (empty: the served one)");
ABSL_FLAG(std::optional<int32_t>, grpc_channels, std::nullopt,
          "with --target: gRPC connections to spread the requests over (default 1)");
ABSL_FLAG(std::string, mode, "closed", "open (Poisson arrivals at --rate) or closed "
          "(--concurrency workers back to back)");
ABSL_FLAG(double, rate, 0, "open loop: mean arrivals per second");
ABSL_FLAG(std::optional<int32_t>, concurrency, std::nullopt, "closed loop: workers (default 1)");
ABSL_FLAG(std::optional<int32_t>, max_inflight, std::nullopt,
          "open loop: requests in flight at most (default 256); arrivals beyond are dropped "
          "(counted, not queued)");
ABSL_FLAG(std::string, prompts, "", "JSONL file: {\"prompt\": ...} or {\"messages\": [...]} "
          "per line, optional \"max_tokens\"; used in turn. Empty: synthetic prompts");
ABSL_FLAG(double, prompt_tokens_mean, 32, "synthetic prompts: mean length in words (~tokens)");
ABSL_FLAG(double, prompt_tokens_std, 8, "synthetic prompts: standard deviation of the length");
ABSL_FLAG(double, max_tokens_mean, 64, "max_tokens per request: mean (prompts without one)");
ABSL_FLAG(double, max_tokens_std, 0, "max_tokens per request: standard deviation");
ABSL_FLAG(uint64_t, seed, 1, "seed of the arrival schedule and the synthetic prompts");
ABSL_FLAG(int32_t, max_denoising_steps, 0, "per-request max_denoising_steps (0: server default)");
ABSL_FLAG(int32_t, canvas_step_interval, 0, "ask for a canvas step event every k steps; "
          "enables the client-side time to first canvas step (0: none)");
ABSL_FLAG(double, duration_s, 0, "stop issuing requests after this many seconds (0: no limit)");
ABSL_FLAG(int64_t, requests, 0, "stop issuing after this many requests (0: no limit)");
ABSL_FLAG(double, drain_s, 30, "after issuing stops, wait this long for requests in flight, "
          "then cancel them (reported as unfinished)");
ABSL_FLAG(double, timeout_s, 300, "deadline of each request, gRPC or HTTP (seconds)");
ABSL_FLAG(std::optional<double>, max_backoff_s, std::nullopt,
          "closed loop: after a refusal for load (HTTP 429, 503 with Retry-After, gRPC "
          "RESOURCE_EXHAUSTED) a worker waits the server's Retry-After, else a backoff from 50 ms "
          "doubling with jitter, at most this many seconds (default 1; 0: no wait)");
ABSL_FLAG(bool, progress, true, "print live progress to stderr every second");
ABSL_FLAG(bool, json, false, "print the report as one JSON object instead of text");
ABSL_FLAG(bool, fail_on_error, false, "exit with status 1 if any request failed");

namespace dgserve::loadgen {
namespace {

std::atomic<bool> g_parsing_flags{false};
std::atomic<int> g_interrupts{0};

void ExitTwoOnFlagError() {
  if (g_parsing_flags.load()) std::_Exit(2);
}

void OnInterrupt(int) {
  if (g_interrupts.fetch_add(1) >= 1) std::_Exit(130);
}

[[noreturn]] void Usage(const std::string& msg) {
  std::fprintf(stderr, "dgserve-loadgen: error: %s\n(see dgserve-loadgen --help)\n", msg.c_str());
  std::exit(2);
}

// Open loop workers: threads start on demand, at most `cap` tasks run or wait at once.
class BoundedPool {
 public:
  explicit BoundedPool(int cap) : cap_(cap) {}
  ~BoundedPool() { Join(); }

  // Runs `task` on a pool thread; false (and nothing runs) when `cap` tasks are in flight.
  bool TrySubmit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ >= cap_) return false;
    ++busy_;
    queue_.push_back(std::move(task));
    if (static_cast<int>(queue_.size()) > waiting_) threads_.emplace_back([this] { Work(); });
    cv_.notify_one();
    return true;
  }

  // Stops the threads once the queue is empty and waits for them.
  void Join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++waiting_;
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      --waiting_;
      if (queue_.empty()) return;
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
      --busy_;
    }
  }

  const int cap_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  int busy_ = 0, waiting_ = 0;
  bool stop_ = false;
};

struct Counters {
  std::atomic<int64_t> sent{0}, ok{0}, errors{0}, dropped{0}, held_back{0}, tokens{0}, inflight{0};
  std::atomic<int64_t> backed_off{0}, backoff_wait_ns{0};  // closed loop: OverloadBackoff
};

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

class Runner {
 public:
  Runner(const Options& o, PromptSource prompts, std::unique_ptr<Client> client)
      : o_(o), prompts_(std::move(prompts)), client_(std::move(client)) {}

  // Runs the load, then returns the results of the requests that ended.
  std::vector<RequestResult> Run(Canceller* canceller) {
    start_ = Clock::now();
    std::thread progress;
    if (absl::GetFlag(FLAGS_progress)) progress = std::thread([this] { Progress(); });
    std::unique_ptr<BoundedPool> pool;
    std::vector<std::thread> workers;
    if (o_.mode == Mode::kOpen) {
      pool = std::make_unique<BoundedPool>(o_.max_inflight);
      Dispatch(pool.get());
    } else {
      for (int w = 0; w < o_.concurrency; ++w) workers.emplace_back([this, w] { Worker(w); });
      while (!stop_issuing_.load() && workers_done_.load() < o_.concurrency) {
        if (IssueTimeOver()) StopIssuing();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      StopIssuing();
    }
    // Drain: wait for the requests in flight, then cut them off.
    const Clock::time_point drain_end =
        issue_end_ + std::chrono::milliseconds(static_cast<int64_t>(o_.drain_s * 1000));
    while (counters_.inflight.load() > 0 && Clock::now() < drain_end && g_interrupts.load() < 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (counters_.inflight.load() > 0) {
      std::fprintf(stderr, "dgserve-loadgen: drain time over; cancelling %lld requests\n",
                   static_cast<long long>(counters_.inflight.load()));
      canceller->CancelAll();
      const Clock::time_point cut = Clock::now() + std::chrono::seconds(5);
      while (counters_.inflight.load() > 0 && Clock::now() < cut) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    wall_s_ = Since(start_);
    issue_s_ = std::chrono::duration<double>(issue_end_ - start_).count();
    finished_.store(true);
    if (progress.joinable()) progress.join();
    stuck_ = counters_.inflight.load() > 0;
    if (!stuck_) {
      if (pool) pool->Join();
      for (std::thread& t : workers) t.join();
    } else {
      // Requests that ignore the cancellation (an HTTP read blocked until its timeout): leave
      // their threads; main exits without joining them.
      for (std::thread& t : workers) t.detach();
      (void)pool.release();  // its threads are still running
    }
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }

  const Counters& counters() const { return counters_; }
  double wall_s() const { return wall_s_; }
  double issue_s() const { return issue_s_; }
  bool stuck() const { return stuck_; }

 private:
  bool IssueTimeOver() const {
    return g_interrupts.load() > 0 || (o_.duration_s > 0 && Since(start_) >= o_.duration_s);
  }

  void StopIssuing() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_issuing_.exchange(true)) issue_end_ = Clock::now();
  }

  // Open loop: follows the Poisson schedule until the duration or request count is reached.
  void Dispatch(BoundedPool* pool) {
    PoissonSchedule schedule(o_.rate, o_.seed);
    for (uint64_t i = 0;; ++i) {
      if (o_.requests > 0 && static_cast<int64_t>(i) >= o_.requests) break;
      const double t = schedule.NextArrival();
      if (o_.duration_s > 0 && t >= o_.duration_s) {
        // Wait out the rest of the duration so the run lasts as long as asked.
        while (!IssueTimeOver()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        break;
      }
      const Clock::time_point at = start_ + std::chrono::nanoseconds(static_cast<int64_t>(t * 1e9));
      while (Clock::now() < at && g_interrupts.load() == 0) {
        std::this_thread::sleep_until(std::min(at, Clock::now() + std::chrono::milliseconds(50)));
      }
      if (g_interrupts.load() > 0) break;
      ConnectBackoff::Admission a;
      {
        std::lock_guard<std::mutex> lock(backoff_mu_);
        a = backoff_.TryStart(Since(start_));
      }
      if (!a.admitted) {  // the target refuses connections: this arrival is not sent
        counters_.held_back.fetch_add(1);
        continue;
      }
      counters_.inflight.fetch_add(1);
      if (pool->TrySubmit([this, i, probe = a.probe] { RunOne(i, probe); })) {
        counters_.sent.fetch_add(1);
      } else {
        counters_.inflight.fetch_sub(1);
        counters_.dropped.fetch_add(1);
        if (a.probe) {
          std::lock_guard<std::mutex> lock(backoff_mu_);
          backoff_.CancelProbe();
        }
      }
    }
    StopIssuing();
  }

  // Closed loop: one request after another until issuing stops; after a refusal for load the
  // next one waits (OverloadBackoff).
  void Worker(int worker) {
    OverloadBackoff overload(o_.max_backoff_s, o_.seed, static_cast<uint64_t>(worker));
    double wait_s = 0;
    while (!stop_issuing_.load()) {
      const int64_t i = next_index_.fetch_add(1);
      // Every index of --requests is taken: issuing stops when the last one is sent (another
      // worker may still wait to send its own, which stopping here would cut off).
      if (o_.requests > 0 && i >= o_.requests) break;
      bool probe = false;
      if ((wait_s > 0 && !WaitOut(wait_s)) || !WaitForAdmission(&probe)) {
        StopIssuing();
        break;
      }
      counters_.inflight.fetch_add(1);
      if (counters_.sent.fetch_add(1) + 1 == o_.requests) StopIssuing();  // the last request
      const Outcome out = RunOne(static_cast<uint64_t>(i), probe);
      wait_s = 0;
      if (out.load_refusal) {
        wait_s = overload.OnRefused(out.retry_after_s);
      } else if (out.reached_server) {
        overload.OnServed();
      }
    }
    workers_done_.fetch_add(1);
  }

  // Closed loop: sleeps `wait_s` after a refusal for load, counting the wait and the time slept
  // for the report; false when issuing stopped (the duration ended, the request count was
  // reached, Ctrl-C) first, which ends the wait at once.
  bool WaitOut(double wait_s) {
    if (stop_issuing_.load() || IssueTimeOver()) return false;
    counters_.backed_off.fetch_add(1);
    const Clock::time_point t0 = Clock::now();
    const Clock::time_point end =
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
    bool issuing = true;
    for (Clock::time_point now = t0; now < end; now = Clock::now()) {
      std::this_thread::sleep_until(std::min(end, now + std::chrono::milliseconds(20)));
      if (stop_issuing_.load() || IssueTimeOver()) {
        issuing = false;
        break;
      }
    }
    counters_.backoff_wait_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
    return issuing;
  }

  // Closed loop: waits until the ConnectBackoff lets a request start; false when issuing
  // stopped (or the duration ended) first.
  bool WaitForAdmission(bool* probe) {
    while (true) {
      if (stop_issuing_.load() || IssueTimeOver()) return false;
      const double now = Since(start_);
      ConnectBackoff::Admission a;
      {
        std::lock_guard<std::mutex> lock(backoff_mu_);
        a = backoff_.TryStart(now);
      }
      if (a.admitted) {
        *probe = a.probe;
        return true;
      }
      const double wait_s = std::clamp(a.retry_at - now, 0.001, 0.05);
      std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
    }
  }

  // What the closed loop needs to know of a request that ended.
  struct Outcome {
    bool load_refusal = false;
    std::optional<double> retry_after_s;
    bool reached_server = false;  // an answer from the server, and not a refusal for load
  };

  Outcome RunOne(uint64_t index, bool probe) {
    const Prompt p = prompts_.Get(index);
    RequestResult r = client_->Run(p, p.max_tokens, start_);
    const Outcome out{r.load_refusal, r.retry_after_s,
                      !r.load_refusal && !r.connect_failed && !r.cancelled};
    {
      std::lock_guard<std::mutex> lock(backoff_mu_);
      const double delay_before = backoff_.delay();
      backoff_.Finish(Since(start_), probe, r.connect_failed);
      if (delay_before == 0 && backoff_.delay() > 0) {
        std::fprintf(stderr,
                     "dgserve-loadgen: cannot connect to %s:%d; retrying one request at a time "
                     "with a backoff of %g ms doubling to %g s\n",
                     o_.host.c_str(), o_.port, ConnectBackoff::kInitialS * 1000,
                     ConnectBackoff::kMaxS);
      }
    }
    if (r.ok) {
      counters_.ok.fetch_add(1);
      counters_.tokens.fetch_add(r.completion_tokens);
    } else if (!r.cancelled) {
      counters_.errors.fetch_add(1);
      std::lock_guard<std::mutex> lock(mu_);
      if (errors_logged_++ < 5) {
        std::fprintf(stderr, "dgserve-loadgen: request %llu failed: %s: %s\n",
                     static_cast<unsigned long long>(index), r.error.c_str(),
                     r.error_message.c_str());
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      results_.push_back(std::move(r));
    }
    counters_.inflight.fetch_sub(1);
    return out;
  }

  void Progress() {
    int64_t last_ok = 0, last_tokens = 0;
    Clock::time_point last = start_;
    int tick = 1;
    while (!finished_.load()) {
      const Clock::time_point next = start_ + std::chrono::seconds(tick++);
      while (Clock::now() < next && !finished_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const Clock::time_point now = Clock::now();
      const double dt = std::chrono::duration<double>(now - last).count();
      const int64_t ok = counters_.ok.load(), tokens = counters_.tokens.load();
      std::fprintf(stderr,
                   "[%6.1fs] sent %lld done %lld errors %lld dropped %lld inflight %lld | "
                   "%.2f req/s %.1f tok/s\n",
                   Since(start_), static_cast<long long>(counters_.sent.load()),
                   static_cast<long long>(ok), static_cast<long long>(counters_.errors.load()),
                   static_cast<long long>(counters_.dropped.load()),
                   static_cast<long long>(counters_.inflight.load()),
                   dt > 0 ? static_cast<double>(ok - last_ok) / dt : 0.0,
                   dt > 0 ? static_cast<double>(tokens - last_tokens) / dt : 0.0);
      last_ok = ok;
      last_tokens = tokens;
      last = now;
    }
  }

  const Options o_;
  const PromptSource prompts_;
  std::unique_ptr<Client> client_;
  Clock::time_point start_, issue_end_;
  Counters counters_;
  std::atomic<bool> stop_issuing_{false}, finished_{false};
  std::atomic<int> workers_done_{0};
  std::atomic<int64_t> next_index_{0};
  std::mutex mu_;
  std::mutex backoff_mu_;
  ConnectBackoff backoff_;  // guarded by backoff_mu_
  std::vector<RequestResult> results_;
  int errors_logged_ = 0;
  double wall_s_ = 0, issue_s_ = 0;
  bool stuck_ = false;
};

// Builds Options from the flags; exits 2 with a message on bad values.
Options OptionsFromFlags() {
  Options o;
  const std::string target = absl::GetFlag(FLAGS_target), http = absl::GetFlag(FLAGS_http);
  if (target.empty() == http.empty()) {
    Usage("give exactly one of --target HOST:PORT (gRPC) and --http HOST:PORT (OpenAI API)");
  }
  o.protocol = target.empty() ? Protocol::kHttp : Protocol::kGrpc;
  auto hp = ParseHostPort(target.empty() ? http : target);
  if (!hp.ok()) Usage(absl::StrCat(target.empty() ? "--http " : "--target ",
                                   std::string(hp.status().message())));
  o.host = hp->first;
  o.port = hp->second;
  // Flags of one protocol or mode are unset (std::nullopt) unless given: one given for the other
  // would be ignored, so it is refused, as --rate with --mode closed is (ValidateOptions).
  const std::optional<std::string> endpoint_flag = absl::GetFlag(FLAGS_endpoint);
  if (endpoint_flag && o.protocol == Protocol::kGrpc) {
    Usage("--endpoint applies to --http; --target sends gRPC GenerateStream");
  }
  const std::string endpoint = endpoint_flag.value_or("chat");
  if (endpoint == "chat") {
    o.endpoint = Endpoint::kChat;
  } else if (endpoint == "completions") {
    o.endpoint = Endpoint::kCompletions;
  } else {
    Usage(absl::StrCat("--endpoint must be chat or completions, not '", endpoint, "'"));
  }
  o.api_key = absl::GetFlag(FLAGS_api_key);
  o.model = absl::GetFlag(FLAGS_model);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "open") {
    o.mode = Mode::kOpen;
  } else if (mode == "closed") {
    o.mode = Mode::kClosed;
  } else {
    Usage(absl::StrCat("--mode must be open or closed, not '", mode, "'"));
  }
  o.rate = absl::GetFlag(FLAGS_rate);
  // Unset: 1 in closed mode, "not given" (0) in open mode; an explicit value is checked as is.
  const std::optional<int32_t> concurrency = absl::GetFlag(FLAGS_concurrency);
  o.concurrency = concurrency.value_or(o.mode == Mode::kClosed ? 1 : 0);
  if (o.mode == Mode::kOpen && concurrency.has_value()) o.concurrency = std::max(1, *concurrency);
  const std::optional<int32_t> max_inflight = absl::GetFlag(FLAGS_max_inflight);
  if (max_inflight && o.mode == Mode::kClosed) {
    Usage("--max_inflight applies to --mode open; --concurrency bounds a closed loop");
  }
  o.max_inflight = max_inflight.value_or(o.max_inflight);
  o.prompts_file = absl::GetFlag(FLAGS_prompts);
  o.prompt_tokens_mean = absl::GetFlag(FLAGS_prompt_tokens_mean);
  o.prompt_tokens_std = absl::GetFlag(FLAGS_prompt_tokens_std);
  o.max_tokens_mean = absl::GetFlag(FLAGS_max_tokens_mean);
  o.max_tokens_std = absl::GetFlag(FLAGS_max_tokens_std);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.max_denoising_steps = absl::GetFlag(FLAGS_max_denoising_steps);
  o.canvas_step_interval = absl::GetFlag(FLAGS_canvas_step_interval);
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.requests = absl::GetFlag(FLAGS_requests);
  o.drain_s = absl::GetFlag(FLAGS_drain_s);
  o.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  // Open-loop arrivals are the schedule: nothing waits after a refusal there.
  const std::optional<double> max_backoff = absl::GetFlag(FLAGS_max_backoff_s);
  if (max_backoff && o.mode == Mode::kOpen) {
    Usage("--max_backoff_s applies to --mode closed; an open loop's arrivals follow --rate");
  }
  o.max_backoff_s = max_backoff.value_or(o.max_backoff_s);
  if (absl::Status s = ValidateOptions(o); !s.ok()) Usage(std::string(s.message()));
  const std::optional<int32_t> channels = absl::GetFlag(FLAGS_grpc_channels);
  if (channels && o.protocol == Protocol::kHttp) {
    Usage("--grpc_channels applies to --target (gRPC); --http opens a connection per request");
  }
  if (channels.value_or(1) < 1) Usage("--grpc_channels must be >= 1");
  return o;
}

int Main(int argc, char** argv) {
  InitCommandLine(
      "Load generator for a dgserve gateway.\n"
      "  dgserve-loadgen --target HOST:PORT --mode closed --concurrency 4 --duration_s 30\n"
      "  dgserve-loadgen --http HOST:PORT --mode open --rate 2 --requests 100 --json",
      "tools/loadgen/");
  // Abseil exits 1 on an unknown flag or a bad value; ours is 2 (--help and --version keep
  // Abseil's status).
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a.empty() || a[0] != '-') continue;
    while (!a.empty() && a[0] == '-') a.remove_prefix(1);
    if (a.substr(0, 4) == "help" || a.substr(0, 7) == "version") help = true;
  }
  if (!help) {
    g_parsing_flags.store(true);
    std::atexit(ExitTwoOnFlagError);
  }
  std::vector<char*> positional = dgserve::ParseCommandLine(argc, argv);
  g_parsing_flags.store(false);
  if (positional.size() > 1) Usage(absl::StrCat("unexpected argument '", positional[1], "'"));

  const Options o = OptionsFromFlags();
  std::vector<Prompt> file_prompts;
  if (!o.prompts_file.empty()) {
    absl::StatusOr<std::vector<Prompt>> p = LoadPromptsFile(o.prompts_file);
    if (!p.ok()) Usage(std::string(p.status().message()));
    file_prompts = *std::move(p);
    if (o.protocol == Protocol::kHttp && o.endpoint == Endpoint::kCompletions) {
      for (size_t i = 0; i < file_prompts.size(); ++i) {
        if (file_prompts[i].is_chat) {
          Usage(absl::StrCat("--prompts ", o.prompts_file, ": prompt ", i + 1,
                             " has \"messages\", which /v1/completions does not take; use "
                             "--endpoint chat"));
        }
      }
    }
  }
  SyntheticOptions synth;
  synth.prompt_words_mean = o.prompt_tokens_mean;
  synth.prompt_words_std = o.prompt_tokens_std;
  synth.max_tokens_mean = o.max_tokens_mean;
  synth.max_tokens_std = o.max_tokens_std;
  synth.seed = o.seed;

  Canceller canceller;
  std::unique_ptr<Client> client =
      o.protocol == Protocol::kGrpc
          ? MakeGrpcClient(o, absl::GetFlag(FLAGS_grpc_channels).value_or(1), &canceller)
          : MakeHttpClient(o, &canceller);
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGPIPE, SIG_IGN);
  Runner runner(o, PromptSource(std::move(file_prompts), synth), std::move(client));
  std::vector<RequestResult> results = runner.Run(&canceller);

  RunInfo info;
  info.protocol = o.protocol == Protocol::kGrpc ? "grpc" : "http";
  info.target = JoinHostPort(o.host, o.port);  // "[::1]:80", as --http and --target take it
  info.endpoint = o.protocol == Protocol::kGrpc ? "GenerateStream"
                  : o.endpoint == Endpoint::kChat ? "/v1/chat/completions"
                                                  : "/v1/completions";
  info.mode = o.mode == Mode::kOpen ? "open" : "closed";
  info.rate = o.rate;
  info.concurrency = o.concurrency;
  info.sent = runner.counters().sent.load();
  info.dropped = runner.counters().dropped.load();
  info.held_back = runner.counters().held_back.load();
  info.backed_off = runner.counters().backed_off.load();
  info.backoff_wait_s = static_cast<double>(runner.counters().backoff_wait_ns.load()) / 1e9;
  info.max_backoff_s = o.max_backoff_s;
  info.wall_s = runner.wall_s();
  info.issue_s = runner.issue_s();
  const Report report = BuildReport(results, info);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ReportJson(report).dump().c_str());
  } else {
    std::fputs(FormatReport(report).c_str(), stdout);
  }
  std::fflush(stdout);
  int code = absl::GetFlag(FLAGS_fail_on_error) && report.errors > 0 ? 1 : 0;
  if (report.never_reachable) {
    std::fprintf(stderr,
                 "dgserve-loadgen: error: %s was never reachable (%lld connection attempts "
                 "failed)\n",
                 info.target.c_str(), static_cast<long long>(report.connect_errors));
    code = 3;
  }
  if (runner.stuck()) std::_Exit(code);  // threads still blocked in requests
  return code;
}

}  // namespace
}  // namespace dgserve::loadgen

int main(int argc, char** argv) { return dgserve::loadgen::Main(argc, argv); }
