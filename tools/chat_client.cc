#include "tools/chat_client.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "dgserve/v1/generation.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dgserve {

absl::StatusOr<v1::ListModelsResponse> ListServedModels(const ChatClientOptions& options) {
  auto channel = grpc::CreateChannel(options.gateway, grpc::InsecureChannelCredentials());
  auto stub = v1::GenerationService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!options.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + options.api_key);
  v1::ListModelsResponse resp;
  const grpc::Status s = stub->ListModels(&ctx, v1::ListModelsRequest(), &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("gateway ", options.gateway, ": ", s.error_message()));
  }
  return resp;
}

absl::StatusOr<v1::Finished> StreamGeneration(
    const v1::GenerateRequest& request, const ChatClientOptions& options,
    const std::function<void(const v1::GenerateEvent&)>& on_event) {
  auto channel = grpc::CreateChannel(options.gateway, grpc::InsecureChannelCredentials());
  auto stub = v1::GenerationService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(int64_t(options.timeout_seconds * 1000)));
  if (!options.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + options.api_key);
  auto reader = stub->GenerateStream(&ctx, request);
  v1::GenerateEvent ev;
  v1::Finished finished;
  while (reader->Read(&ev)) {
    if (ev.has_finished()) finished = ev.finished();
    on_event(ev);
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("gateway ", options.gateway, ": ", s.error_message()));
  }
  return finished;
}

absl::Status RunChatClient(const v1::GenerateRequest& request, const ChatClientOptions& options) {
  bool printed = false;  // any answer text on standard output
  absl::StatusOr<v1::Finished> result =
      StreamGeneration(request, options, [&](const v1::GenerateEvent& ev) {
        if (ev.has_canvas_step() && options.show_steps) {
          const v1::CanvasStep& s = ev.canvas_step();
          std::fprintf(stderr, "[canvas %d step %2d] T=%.3f accepted=%3d H=%.4f | %s\n",
                       s.canvas(), s.step(), s.temperature(), s.accepted(), s.mean_entropy(),
                       absl::StrReplaceAll(s.text(), {{"\n", "\\n"}}).c_str());
        } else if (ev.has_block()) {
          std::fputs(ev.block().text().c_str(), stdout);
          std::fflush(stdout);
          printed = printed || !ev.block().text().empty();
        }
      });
  // The answer's line ends; a request that failed before any text leaves standard output empty.
  if (result.ok() || printed) {
    std::fputs("\n", stdout);
    std::fflush(stdout);
  }
  if (!result.ok()) return result.status();
  const v1::Finished& finished = *result;
  const v1::Usage& u = finished.usage();
  std::fprintf(stderr,
               "finish %s | prompt tokens %d (%d cached) | completion tokens %d | canvases %d | "
               "denoising steps %d | first block %.3f s | total %.3f s\n",
               finished.finish_reason().c_str(), u.prompt_tokens(), u.cached_prompt_tokens(),
               u.completion_tokens(), u.canvases(), u.denoising_steps(),
               u.timings().first_block_seconds(), u.timings().total_seconds());
  return absl::OkStatus();
}

}  // namespace dgserve
