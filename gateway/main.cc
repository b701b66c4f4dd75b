// dgserve-gateway: the public face of the cluster — gRPC GenerationService and the
// OpenAI-compatible HTTP API — routing to prefill and denoise workers; exports /metrics.
#include <atomic>
#include <cstdio>
#include <fstream>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cli.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "engine/model/random_checkpoint.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"
#include "gateway/gateway.h"
#include "gateway/gateway_metrics.h"
#include "gateway/grpc_service.h"
#include "gateway/http_server.h"
#include "gateway/worker_pool.h"
#include "service/address_list.h"
#include "service/internal_auth.h"
#include "service/server.h"
#include "worker/worker_model.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory: config.json, generation_config.json and tokenizer.json are read "
          "(weights are not)");
ABSL_FLAG(std::string, served_model_name, "", "model id (default: the directory's name)");
ABSL_FLAG(std::string, prefill_workers, "",
          "comma-separated prefill worker addresses: host:port or dns:///name:port");
ABSL_FLAG(std::string, denoise_workers, "",
          "comma-separated denoise worker addresses: host:port or dns:///name:port");
ABSL_FLAG(std::string, grpc_address, "127.0.0.1:0", "gRPC listen address (port 0: any free)");
ABSL_FLAG(std::string, http_address, "127.0.0.1:0", "OpenAI HTTP listen address");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:0", "Prometheus /metrics listen address");
ABSL_FLAG(std::string, ports_file, "", "write the bound ports here as JSON once serving");
ABSL_FLAG(int, max_concurrent_requests, 64,
          "requests running at once (gRPC and HTTP); beyond: queued, then 429 / RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_queued_requests, 0,
          "requests waiting for a slot (FIFO, within their deadline); beyond: 429 at once");
ABSL_FLAG(int, max_attempts, 3, "attempts per request on UNAVAILABLE before any output");
ABSL_FLAG(int, max_resumes, 2,
          "per request (n = 1): times a request whose denoise worker failed after output is "
          "continued from its next committed canvas on other workers; then UNAVAILABLE");
ABSL_FLAG(int64_t, max_prompt_tokens, dgserve::kDefaultMaxPromptTokens,
          "prompt tokens per request at most (after the chat template); longer prompts get "
          "INVALID_ARGUMENT (HTTP 400) naming prompt or messages. 0: only the model's context "
          "limit");
ABSL_FLAG(double, sse_keepalive_seconds, 15,
          "silence after which an HTTP stream gets an SSE comment (': keep-alive'), from the "
          "moment its request is accepted (set it below your proxies' idle timeout)");
ABSL_FLAG(int, max_n, 16, "samples per request (n) at most; larger n is INVALID_ARGUMENT");
ABSL_FLAG(std::string, api_keys, "", "comma-separated API keys (empty: no authentication)");
ABSL_FLAG(std::string, api_key_file, "", "file with one API key per line");
ABSL_FLAG(int64_t, max_body_bytes, 4 << 20,
          "largest HTTP request body and gRPC request message (larger: 413 / RESOURCE_EXHAUSTED, "
          "refused before it is parsed)");
ABSL_FLAG(int64_t, max_buffered_body_bytes, 64 << 20,
          "HTTP request bodies held at once across all connections (read or being read, not yet "
          "parsed; a chunked body counts --max_body_bytes); a body beyond it is refused on its "
          "head with 503 and Retry-After. 0: no bound");
ABSL_FLAG(double, request_timeout_seconds, 600,
          "deadline of a request without its own, seconds in (0, 1e7]");
ABSL_FLAG(double, drain_grace_seconds, 30, "on SIGTERM: time given to running requests");
ABSL_FLAG(int64_t, testing_delay_before_denoise_ms, 0,
          "fault injection for tests: pause this long between a prefill and its denoise call");

namespace dgserve {
namespace {

// The public API's keys from --api_keys and --api_key_file (one key per line; blank lines and
// lines starting with '#' are skipped). A flag that is given but names no key is an error
// (FAILED_PRECONDITION): an empty or unmounted key file must not turn authentication off.
// With neither flag the API is open, and a warning says so.
absl::StatusOr<std::vector<std::string>> ApiKeys() {
  const std::string list = absl::GetFlag(FLAGS_api_keys);
  std::vector<std::string> keys = SplitTargets(list);
  if (!list.empty() && keys.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--api_keys='", list, "' names no key; give keys, or leave the flag out to serve "
        "without authentication"));
  }
  if (const std::string f = absl::GetFlag(FLAGS_api_key_file); !f.empty()) {
    absl::StatusOr<std::string> text = ReadFileToString(f, 1 << 20);
    if (!text.ok()) {
      return absl::Status(text.status().code(),
                          absl::StrCat("--api_key_file: ", text.status().message()));
    }
    size_t from_file = 0;
    for (absl::string_view line : absl::StrSplit(*text, '\n')) {
      line = absl::StripAsciiWhitespace(line);
      if (line.empty() || line.front() == '#') continue;
      keys.emplace_back(line);
      ++from_file;
    }
    if (from_file == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--api_key_file ", f, " has no API key (only blank or '#' lines); refusing to serve "
          "without authentication — leave the flag out to do that on purpose"));
    }
  }
  if (keys.empty()) {
    DGSERVE_LOG_WARNING("no --api_keys / --api_key_file: the public API accepts every caller");
  }
  return keys;
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  DGSERVE_ASSIGN_OR_RETURN(const std::vector<std::string> prefill_targets,
                           ParseTargets("--prefill_workers", absl::GetFlag(FLAGS_prefill_workers)));
  DGSERVE_ASSIGN_OR_RETURN(const std::vector<std::string> denoise_targets,
                           ParseTargets("--denoise_workers", absl::GetFlag(FLAGS_denoise_workers)));
  if (prefill_targets.empty() || denoise_targets.empty()) {
    return absl::InvalidArgumentError("--prefill_workers and --denoise_workers are required");
  }
  absl::StatusOr<ModelDirConfigs> configs = LoadConfigsFromModelDir(dir);
  if (!configs.ok()) return configs.status();
  absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Load(dir + "/tokenizer.json");
  if (!tokenizer.ok()) return tokenizer.status();
  if (tokenizer->vocab_size() < configs->config.vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, "/tokenizer.json covers ", tokenizer->vocab_size(), " ids but the model has ",
        configs->config.vocab_size, ": it is not this model's tokenizer"));
  }
  absl::StatusOr<std::vector<std::string>> keys = ApiKeys();
  if (!keys.ok()) return keys.status();
  GatewayOptions gopts;
  gopts.model_id = ServedModelId(dir, absl::GetFlag(FLAGS_served_model_name));
  gopts.max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  gopts.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  if (const std::string& name = absl::GetFlag(FLAGS_served_model_name);
      !tokenizer_internal::IsValidUtf8(name) ||
      absl::c_any_of(name, [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; })) {
    // GET /v1/models/{id} could never name it (a path that decodes to such bytes is kept as
    // sent), and clients would have to send it in every request's "model".
    return absl::InvalidArgumentError(absl::StrCat(
        "--served_model_name '", absl::CHexEscape(name),
        "' holds a control character or bytes that are not UTF-8; give a printable model id"));
  }
  gopts.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  if (gopts.max_attempts < 1) {
    // 0 was taken as 1 without a word.
    return absl::InvalidArgumentError(
        absl::StrCat("--max_attempts must be ≥ 1 (1: no retry), got ", gopts.max_attempts));
  }
  gopts.max_resumes = absl::GetFlag(FLAGS_max_resumes);
  if (gopts.max_resumes < 0) return absl::InvalidArgumentError("--max_resumes must be ≥ 0");
  gopts.api_keys = *keys;
  gopts.max_n = absl::GetFlag(FLAGS_max_n);
  gopts.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  if (gopts.max_prompt_tokens < 0) {
    return absl::InvalidArgumentError(
        "--max_prompt_tokens must be ≥ 0 (0: no limit but the context)");
  }
  gopts.testing_delay_before_denoise =
      absl::Milliseconds(absl::GetFlag(FLAGS_testing_delay_before_denoise_ms));
  // A denoise worker runs at most kMaxSamplesPerRequest samples of one request.
  if (gopts.max_n < 1 || gopts.max_n > kMaxSamplesPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat("--max_n must be in [1, ", kMaxSamplesPerRequest,
                                                   "] (the denoise worker's limit), got ",
                                                   gopts.max_n));
  }
  if (gopts.max_concurrent_requests < 1) {
    return absl::InvalidArgumentError("--max_concurrent_requests must be ≥ 1");
  }
  if (gopts.max_queued_requests < 0) {
    return absl::InvalidArgumentError("--max_queued_requests must be ≥ 0");
  }
  // 0 is not "no timeout": every request would fail at once (504) on a gateway that says ready.
  if (const double t = absl::GetFlag(FLAGS_request_timeout_seconds); !(t > 0) || t > 1e7) {
    return absl::InvalidArgumentError(
        absl::StrCat("--request_timeout_seconds must be in (0, 1e7] seconds, got ", t));
  }
  // A negative grace (or NaN) gave running requests no time on SIGTERM.
  if (const double g = absl::GetFlag(FLAGS_drain_grace_seconds); !(g >= 0) || g > 1e7) {
    return absl::InvalidArgumentError(
        absl::StrCat("--drain_grace_seconds must be in [0, 1e7] seconds, got ", g));
  }
  if (absl::GetFlag(FLAGS_sse_keepalive_seconds) <= 0) {
    return absl::InvalidArgumentError("--sse_keepalive_seconds must be > 0");
  }

  const int64_t max_body_bytes = absl::GetFlag(FLAGS_max_body_bytes);
  if (max_body_bytes < 1 || max_body_bytes > (int64_t(1) << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_body_bytes must be in [1, 2^30], got ", max_body_bytes));
  }
  const int64_t max_buffered_body_bytes = absl::GetFlag(FLAGS_max_buffered_body_bytes);
  if (max_buffered_body_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_buffered_body_bytes must be ≥ 0 (0: no bound), got ", max_buffered_body_bytes));
  }
  absl::StatusOr<std::shared_ptr<const InternalAuth>> auth = InternalAuthFromFlags();
  if (!auth.ok()) return auth.status();

  ServerOptions opts;
  opts.max_receive_message_bytes = int(max_body_bytes);
  opts.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  opts.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  opts.ports_file = absl::GetFlag(FLAGS_ports_file);
  // The public port: with API keys, a call without a valid one is refused on its headers, before
  // its message is read (the handlers check again). The metrics object is made below; the
  // refusal counter reaches it through this pointer.
  std::atomic<GatewayMetrics*> metrics_for_refusals{nullptr};
  if (!gopts.api_keys.empty()) {
    opts.credentials = InsecureServerCredentialsWithProcessor(MakeMetadataProcessor(ApiKeyCheck(
        gopts.api_keys, [&metrics_for_refusals](const std::string& path) {
          GatewayMetrics* m = metrics_for_refusals.load();
          if (m != nullptr && absl::StartsWith(path, "/dgserve.v1.GenerationService/Generate")) {
            m->RequestsWithStatus("UNAUTHENTICATED").Increment();
          }
        })));
  } else {
    opts.credentials = grpc::InsecureServerCredentials();
  }
  // A request message that cannot be parsed never reaches a handler: counted here.
  opts.on_unparsable_request = [&metrics_for_refusals](const std::string& method,
                                                       const absl::Status&) {
    GatewayMetrics* m = metrics_for_refusals.load();
    if (m != nullptr && absl::StartsWith(method, "/dgserve.v1.GenerationService/Generate")) {
      m->RequestsWithStatus("INVALID_ARGUMENT").Increment();
    }
  };
  ServiceRunner runner(opts);
  GatewayMetrics metrics(runner.registry());
  metrics_for_refusals = &metrics;
  struct Unset {  // before `metrics` goes (the server may still be up on an error return)
    std::atomic<GatewayMetrics*>* p;
    ~Unset() { *p = nullptr; }
  } unset{&metrics_for_refusals};
  const ChannelFactory dial = [auth = *auth](const std::string& target,
                                             const grpc::ChannelArguments& args) {
    return auth->MakeChannel(target, args);
  };
  WorkerPool prefill("prefill", prefill_targets, gopts.model_id, dial);
  WorkerPool denoise("denoise", denoise_targets, gopts.model_id, dial);
  prefill.Start();
  denoise.Start();
  Gateway gateway(configs->config, configs->generation, *std::move(tokenizer), gopts, &prefill,
                  &denoise, &metrics);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_request_timeout_seconds));
  GenerationServiceImpl grpc_service(&gateway, timeout);
  if (absl::Status s = runner.Start({&grpc_service}, {v1::GenerationService::service_full_name()}); !s.ok()) return s;

  absl::StatusOr<std::pair<std::string, int>> http_addr =
      SplitHostPort(absl::GetFlag(FLAGS_http_address));
  if (!http_addr.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_address: ", http_addr.status().message()));
  }
  HttpServerOptions hopts;
  hopts.host = http_addr->first;
  hopts.port = http_addr->second;
  hopts.max_body_bytes = size_t(max_body_bytes);
  hopts.max_buffered_body_bytes = size_t(max_buffered_body_bytes);
  hopts.default_timeout = timeout;
  hopts.sse_keepalive_interval = absl::Seconds(absl::GetFlag(FLAGS_sse_keepalive_seconds));
  OpenAiHttpServer http(&gateway, hopts, &runner.registry());
  absl::StatusOr<int> http_port = http.Start();
  if (!http_port.ok()) return http_port.status();

  PeriodicTask gauges(absl::Milliseconds(250), [&] { gateway.UpdateWorkerGauges(); });
  if (absl::Status s = runner.WritePortsFile({{"http", *http_port}}); !s.ok()) return s;
  DGSERVE_LOG_INFO("gateway serving %s: gRPC port %d, HTTP port %d, metrics port %d",
                   gopts.model_id, runner.grpc_port(), *http_port, runner.metrics_port());
  const int sig = ServiceRunner::WaitForSignal();
  DGSERVE_LOG_INFO("signal %d: draining", sig);
  http.SetDraining(true);
  runner.SetServing(false);
  gateway.Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_grace_seconds)));
  http.Stop();
  runner.Shutdown(absl::Seconds(1));
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::ServiceMain(
      argc, argv,
      "dgserve-gateway --model DIR --prefill_workers ADDR[,ADDR] --denoise_workers ADDR[,ADDR] "
      "[--grpc_address HOST:PORT] [--http_address HOST:PORT] ...",
      "gateway/main.cc", dgserve::Run);
}
