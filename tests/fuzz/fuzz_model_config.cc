// Fuzzes config.json and generation_config.json parsing. The first byte picks the parser (even:
// ParseModelConfig, odd: ParseGenerationConfig), the rest is the file's text. Any text gives a
// validated config or INVALID_ARGUMENT naming the file and a field; a config that parses
// satisfies the invariants the rest of the engine relies on.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/model/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  if (size == 0) return 0;
  const bool generation = data[0] & 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::string source = generation ? "fuzz/generation_config.json" : "fuzz/config.json";
  if (generation) {
    absl::StatusOr<dgserve::GenerationConfig> g = dgserve::ParseGenerationConfig(text, source);
    if (!g.ok()) {
      dgserve::fuzz::CheckInvalidArgument(g.status());
      Check(g.status().message().find(source) != std::string::npos, "error does not name file");
      return 0;
    }
    Check(g->t_min >= 0 && g->t_min < g->t_max, "t_min/t_max");
    Check(std::isfinite(g->t_max) && std::isfinite(g->entropy_bound) &&
              std::isfinite(g->confidence_threshold),
          "non-finite sampler default");
    Check(g->entropy_bound > 0 && g->confidence_threshold > 0, "bounds");
    Check(g->max_new_tokens > 0 && g->max_denoising_steps > 0 && g->stability_threshold >= 0,
          "integer defaults");
    for (int32_t id : g->stop_token_ids) Check(id >= 0, "negative stop token id");
    return 0;
  }
  absl::StatusOr<dgserve::ModelConfig> c = dgserve::ParseModelConfig(text, source);
  if (!c.ok()) {
    dgserve::fuzz::CheckInvalidArgument(c.status());
    Check(c.status().message().find(source) != std::string::npos, "error does not name file");
    return 0;
  }
  Check(c->num_layers > 0 && static_cast<int>(c->layer_types.size()) == c->num_layers,
        "layer_types size");
  Check(c->num_heads % c->num_kv_heads == 0 && c->num_heads % c->num_global_kv_heads == 0,
        "heads");
  Check(c->top_k_experts <= c->num_experts, "top_k");
  Check(c->pad_token_id >= 0 && c->pad_token_id < c->vocab_size, "pad id");
  Check(c->bos_token_id >= 0 && c->bos_token_id < c->vocab_size, "bos id");
  Check(std::isfinite(c->rms_norm_eps) && c->rms_norm_eps > 0, "rms_norm_eps");
  Check(std::isfinite(c->final_logit_softcapping), "softcapping");
  Check(std::isfinite(c->rope_theta_sliding) && std::isfinite(c->rope_theta_full), "rope_theta");
  (void)c->EmbedScale();
  (void)c->FullRopeAngles();
  return 0;
}
