// Fuzzes the gateway's validation of a GenerateRequest (Gateway::Prepare: model, input, chat
// template, tokenization, max_tokens against the context, stop sequences, diffusion controls,
// stream options). The input is a GenerateRequest in protobuf wire format, as a gRPC client
// sends it; bytes that do not parse are skipped. Errors must be INVALID_ARGUMENT or NOT_FOUND
// (unknown model); a prepared request must be one the workers can run.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/model/config.h"
#include "gateway/gateway.h"
#include "service/canvas_template_proto.h"
#include "tests/fuzz/tokenizer_fixture.h"

namespace {

const dgserve::Gateway& SharedGateway() {
  static const dgserve::Gateway* gateway = [] {
    const std::string dir = dgserve::fuzz::SourceDir() + "/tests/testdata/golden/tiny-g3";
    absl::StatusOr<dgserve::ModelConfig> config = dgserve::LoadModelConfig(dir + "/config.json");
    if (!config.ok()) dgserve::fuzz::Fail(config.status().ToString());
    absl::StatusOr<dgserve::GenerationConfig> generation =
        dgserve::LoadGenerationConfig(dir + "/generation_config.json");
    if (!generation.ok()) dgserve::fuzz::Fail(generation.status().ToString());
    dgserve::GatewayOptions options;
    options.model_id = "tiny-g3";
    return new dgserve::Gateway(*config, *generation, dgserve::fuzz::SharedTokenizer(), options,
                                /*prefill=*/nullptr, /*denoise=*/nullptr, /*metrics=*/nullptr);
  }();
  return *gateway;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)SharedGateway();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  if (size > 16384) return 0;
  dgserve::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<dgserve::PreparedRequest> p = SharedGateway().Prepare(request);
  if (!p.ok()) {
    dgserve::fuzz::CheckInvalidArgument(p.status(), absl::StatusCode::kNotFound);
    return 0;
  }
  const int vocab = 262144;
  Check(!p->prompt.empty(), "empty prompt");
  for (int32_t id : p->prompt) Check(id >= 0 && id < vocab, "prompt id outside the vocabulary");
  Check(p->max_tokens > 0, "max_tokens <= 0");
  const int64_t canvases = (int64_t(p->max_tokens) + 31) / 32;
  Check(int64_t(p->prompt.size()) + canvases * 32 <= 262144, "beyond the context");
  Check(p->stop.size() <= 4, "too many stops");
  Check(!p->request_id.empty(), "no request id");
  const dgserve::v1::SamplerSettings& s = p->sampler;
  Check(s.max_denoising_steps() > 0, "max_denoising_steps");
  Check(std::isfinite(s.t_min()) && std::isfinite(s.t_max()) && s.t_min() < s.t_max(), "t range");
  Check(std::isfinite(s.entropy_bound()) && std::isfinite(s.confidence_threshold()), "bounds");
  Check(p->canvas_step_interval >= 0, "canvas_step_interval");
  Check(p->n >= 1 && p->n <= 16, "n outside [1, --max_n]");
  if (p->canvas_template) {
    // Resolved to the token-id form, and valid for the model (what the denoise worker runs).
    Check(p->canvas_template->text().empty() && p->canvas_template->allowed_size() == 0,
          "template text form not resolved");
    Check(dgserve::CanvasTemplateFromProto(*p->canvas_template, 32, vocab).ok(),
          "prepared template invalid");
  }
  return 0;
}
