#include "tools/loadgen/clients.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "dgserve/v1/generation.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dgserve::loadgen {

void Canceller::CancelAll() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_.store(true, std::memory_order_release);
  for (grpc::ClientContext* ctx : contexts_) ctx->TryCancel();
}

void Canceller::Register(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  contexts_.insert(ctx);
  if (cancelled_.load(std::memory_order_acquire)) ctx->TryCancel();
}

void Canceller::Unregister(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  contexts_.erase(ctx);
}

namespace {

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The canonical name of a gRPC status code ("UNAVAILABLE").
std::string GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return absl::StrCat("CODE_", static_cast<int>(code));
  }
}

class GrpcClient : public Client {
 public:
  GrpcClient(const Options& o, int channels, Canceller* canceller)
      : options_(o), canceller_(canceller) {
    const std::string target = JoinHostPort(o.host, o.port);
    for (int i = 0; i < std::max(1, channels); ++i) {
      grpc::ChannelArguments args;
      // Distinct arguments give each channel its own connection.
      args.SetInt("dgserve.loadgen.channel", i);
      args.SetMaxReceiveMessageSize(-1);
      channels_.push_back(
          grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
      stubs_.push_back(v1::GenerationService::NewStub(channels_.back()));
    }
  }

  RequestResult Run(const Prompt& prompt, int64_t max_tokens,
                    Clock::time_point run_start) override {
    v1::GenerateRequest req;
    if (!options_.model.empty()) req.set_model(options_.model);
    if (prompt.is_chat) {
      for (const ChatMessage& m : prompt.messages) {
        v1::ChatMessage* cm = req.mutable_chat()->add_messages();
        cm->set_role(m.role);
        cm->set_content(m.content);
      }
    } else {
      req.set_text(prompt.text);
    }
    req.set_max_tokens(static_cast<int32_t>(std::min<int64_t>(max_tokens, INT32_MAX)));
    if (options_.max_denoising_steps > 0) {
      req.mutable_diffusion()->set_max_denoising_steps(options_.max_denoising_steps);
    }
    if (options_.canvas_step_interval > 0) {
      req.mutable_stream_options()->set_canvas_step_interval(options_.canvas_step_interval);
    }

    RequestResult r;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_s * 1000)));
    if (!options_.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.api_key);
    canceller_->Register(&ctx);
    const Clock::time_point t0 = Clock::now();
    r.start_s = std::chrono::duration<double>(t0 - run_start).count();
    const size_t channel = next_.fetch_add(1, std::memory_order_relaxed) % stubs_.size();
    std::unique_ptr<grpc::ClientReader<v1::GenerateEvent>> reader =
        stubs_[channel]->GenerateStream(&ctx, req);
    v1::GenerateEvent ev;
    bool finished = false;
    int64_t block_tokens = 0;
    while (reader->Read(&ev)) {
      if (ev.has_canvas_step()) {
        if (r.first_step_s < 0) r.first_step_s = Since(t0);
      } else if (ev.has_block()) {
        if (r.ttft_s < 0) r.ttft_s = Since(t0);
        block_tokens += ev.block().token_ids_size();
      } else if (ev.has_finished()) {
        finished = true;
        const v1::Usage& u = ev.finished().usage();
        r.prompt_tokens = u.prompt_tokens();
        r.completion_tokens = u.completion_tokens();
        r.canvases = u.canvases();
        r.denoising_steps = u.denoising_steps();
        if (u.timings().first_step_seconds() > 0) {
          r.server_first_step_s = u.timings().first_step_seconds();
        }
      }
    }
    grpc::Status status = reader->Finish();
    r.e2e_s = Since(t0);
    canceller_->Unregister(&ctx);
    if (status.ok() && finished) {
      r.ok = true;
      if (r.completion_tokens == 0) r.completion_tokens = block_tokens;
    } else if (canceller_->cancelled()) {
      r.cancelled = true;
    } else if (!status.ok()) {
      r.error = GrpcCodeName(status.error_code());
      r.error_message = status.error_message();
      // The gateway's answer when its admission queue is full (it sends no retry hint).
      r.load_refusal = status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
      // UNAVAILABLE on a channel that is not connected: the call never reached the server (a
      // server that answers UNAVAILABLE itself leaves the channel READY).
      r.connect_failed =
          status.error_code() == grpc::StatusCode::UNAVAILABLE &&
          channels_[channel]->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY;
    } else {
      r.error = "NO_FINISHED_EVENT";
      r.error_message = "the stream ended without a Finished event";
    }
    return r;
  }

 private:
  Options options_;
  Canceller* canceller_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::GenerationService::Stub>> stubs_;
  std::atomic<uint64_t> next_{0};
};

class HttpLoadClient : public Client {
 public:
  HttpLoadClient(const Options& o, Canceller* canceller) : options_(o), canceller_(canceller) {}

  RequestResult Run(const Prompt& prompt, int64_t max_tokens,
                    Clock::time_point run_start) override {
    RequestResult r;
    const bool chat = options_.endpoint == Endpoint::kChat;
    absl::StatusOr<std::string> body = HttpRequestBody(prompt, max_tokens, chat, options_);
    const Clock::time_point t0 = Clock::now();
    r.start_s = std::chrono::duration<double>(t0 - run_start).count();
    if (!body.ok()) {
      r.error = "bad_prompt";
      r.error_message = std::string(body.status().message());
      r.e2e_s = 0;
      return r;
    }
    // A new connection per request (libcurl; common/http_client.h).
    dgserve::HttpClient cli(options_.host, options_.port);
    cli.set_connect_timeout(absl::Seconds(10));
    // --timeout_s: the deadline of the whole request (as for gRPC), which also bounds the wait
    // between two chunks.
    cli.set_timeout(absl::Seconds(options_.timeout_s));
    HttpRequest req;
    req.method = "POST";
    req.path = chat ? "/v1/chat/completions" : "/v1/completions";
    req.body = *std::move(body);
    req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
    if (!options_.api_key.empty())
      req.headers.emplace_back("Authorization", "Bearer " + options_.api_key);
    req.is_cancelled = [this] { return canceller_->cancelled(); };

    std::string error_body;
    SseParser parser;
    bool done = false, usage_seen = false;
    StreamChunk stream_error;
    stream_error.kind = StreamChunk::kOther;
    auto on_data = [&](std::string_view data) {
      StreamChunk c = ClassifyChunk(data);
      switch (c.kind) {
        case StreamChunk::kDone: done = true; break;
        case StreamChunk::kContent:
          if (r.ttft_s < 0) r.ttft_s = Since(t0);
          break;
        case StreamChunk::kCanvasStep:
          if (r.first_step_s < 0) r.first_step_s = Since(t0);
          break;
        case StreamChunk::kUsage:
          usage_seen = true;
          r.prompt_tokens = c.prompt_tokens;
          r.completion_tokens = c.completion_tokens;
          r.canvases = c.canvases;
          r.denoising_steps = c.denoising_steps;
          if (c.server_first_step_s > 0) r.server_first_step_s = c.server_first_step_s;
          break;
        case StreamChunk::kError:
        case StreamChunk::kInvalid:
          if (stream_error.kind == StreamChunk::kOther) stream_error = c;
          break;
        case StreamChunk::kOther: break;
      }
    };
    HttpResponse res = cli.Stream(req, [&](const HttpResponse& head, std::string_view chunk) {
      if (head.status != 200) {
        if (error_body.size() < 4096) error_body.append(chunk.substr(0, 4096));
        return true;
      }
      parser.Feed(chunk, on_data);
      return true;
    });
    r.e2e_s = Since(t0);
    const int http_status = res.status == 0 ? -1 : res.status;
    if (canceller_->cancelled() && !done) {
      r.cancelled = true;
    } else if (!res && http_status == -1) {
      r.error = absl::StrCat("http:", res.error_kind);
      r.error_message = absl::StrCat("POST http://", options_.host, ":", options_.port, req.path,
                                     ": ", res.error);
      r.connect_failed = res.error_kind == "connect";
    } else if (http_status != 200) {
      r.error = absl::StrCat("HTTP ", http_status);
      const bool has_retry_after = res.HeaderCount("Retry-After") > 0;
      r.load_refusal = IsHttpLoadRefusal(http_status, has_retry_after);
      if (r.load_refusal) r.retry_after_s = ParseRetryAfter(res.Header("Retry-After"));
      nlohmann::json j = nlohmann::json::parse(error_body, nullptr, false);
      r.error_message = j.is_object() && j.contains("error") && j["error"].is_object()
                            ? j["error"].value("message", error_body)
                            : error_body;
    } else if (stream_error.kind != StreamChunk::kOther) {
      r.error = absl::StrCat("stream:", stream_error.error_code);
      r.error_message = stream_error.error_message;
    } else if (!res) {
      r.error = absl::StrCat("http:", res.error_kind);
      r.error_message = absl::StrCat("the stream broke off: ", res.error);
    } else if (!done) {
      r.error = "stream:incomplete";
      r.error_message = "the stream ended without data: [DONE]";
    } else if (!usage_seen) {
      r.error = "stream:no_usage";
      r.error_message = "no usage chunk although stream_options.include_usage was set";
    } else {
      r.ok = true;
    }
    return r;
  }

 private:
  Options options_;
  Canceller* canceller_;
};

}  // namespace

std::unique_ptr<Client> MakeGrpcClient(const Options& o, int channels, Canceller* canceller) {
  return std::make_unique<GrpcClient>(o, channels, canceller);
}

std::unique_ptr<Client> MakeHttpClient(const Options& o, Canceller* canceller) {
  return std::make_unique<HttpLoadClient>(o, canceller);
}

}  // namespace dgserve::loadgen
