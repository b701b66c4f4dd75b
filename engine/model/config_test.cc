#include "engine/model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>

#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"

namespace dgserve {
namespace {

using ::dgserve::testing::GoldenDir;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

json GoldenJson(const std::string& model, const std::string& file) {
  auto text = ReadFileToString(GoldenDir() + "/" + model + "/" + file);
  EXPECT_THAT(text, IsOk()) << "golden data missing: set DGSERVE_GOLDEN_DIR";
  return text.ok() ? json::parse(*text) : json::object();
}

TEST(ModelConfigTest, ParsesGoldenTinyV512) {
  auto c = LoadModelConfig(GoldenDir() + "/tiny-v512/config.json");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->num_layers, 6);
  EXPECT_EQ(c->num_heads, 4);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->num_global_kv_heads, 1);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->global_head_dim, 32);
  EXPECT_EQ(c->intermediate_size, 48);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->top_k_experts, 2);
  EXPECT_EQ(c->moe_intermediate_size, 24);
  EXPECT_EQ(c->sliding_window, 8);
  EXPECT_EQ(c->canvas_length, 16);
  EXPECT_EQ(c->max_position_embeddings, 262144);
  EXPECT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->final_logit_softcapping, 30.0f);
  EXPECT_EQ(c->rope_theta_sliding, 1e4f);
  EXPECT_EQ(c->rope_theta_full, 1e6f);
  EXPECT_EQ(c->partial_rotary_factor_full, 0.25f);
  EXPECT_EQ(c->pad_token_id, 0);
  EXPECT_EQ(c->bos_token_id, 2);
  const LayerType S = LayerType::kSliding, F = LayerType::kFull;
  EXPECT_THAT(c->layer_types, ElementsAre(S, S, F, S, S, F));
  EXPECT_EQ(c->HeadDim(2), 32);
  EXPECT_EQ(c->KvHeads(2), 1);
  EXPECT_EQ(c->HeadDim(0), 16);
  EXPECT_EQ(c->EmbedScale(), 8.0f);
  EXPECT_EQ(c->FullRopeAngles(), 4);
}

TEST(ModelConfigTest, ParsesGoldenTinyG3) {
  auto c = LoadModelConfig(GoldenDir() + "/tiny-g3/config.json");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->vocab_size, 262144);
  EXPECT_EQ(c->hidden_size, 128);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->global_head_dim, 64);
  EXPECT_EQ(c->intermediate_size, 96);
  EXPECT_EQ(c->moe_intermediate_size, 32);
  EXPECT_EQ(c->sliding_window, 16);
  EXPECT_EQ(c->canvas_length, 32);
  EXPECT_EQ(c->EmbedScale(), 11.3125f);  // bf16(sqrt(128)), README §3
}

TEST(GenerationConfigTest, ParsesGoldenConfigs) {
  for (const char* model : {"tiny-v512", "tiny-g3"}) {
    auto g = LoadGenerationConfig(GoldenDir() + "/" + model + "/generation_config.json");
    ASSERT_THAT(g, IsOk()) << model;
    EXPECT_EQ(g->max_denoising_steps, 48);
    EXPECT_EQ(g->t_min, 0.4f);
    EXPECT_EQ(g->t_max, 0.8f);
    EXPECT_EQ(g->entropy_bound, 0.1f);
    EXPECT_EQ(g->stability_threshold, 1);
    EXPECT_EQ(g->confidence_threshold, 0.005f);
    EXPECT_THAT(g->stop_token_ids, ElementsAre(1, 106, 50));
    EXPECT_EQ(g->pad_token_id, 0);
    EXPECT_EQ(g->max_new_tokens, std::string(model) == "tiny-g3" ? 32 : 16);
  }
}

TEST(GenerationConfigTest, EmptyObjectGivesDefaults) {
  auto g = ParseGenerationConfig("{}", "gen.json");
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(g->max_denoising_steps, 48);
  EXPECT_THAT(g->stop_token_ids, ElementsAre(1, 106, 50));
}

TEST(ModelConfigTest, MissingFileIsNotFound) {
  EXPECT_THAT(LoadModelConfig("/nonexistent/config.json"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/config.json")));
}

TEST(ModelConfigTest, MalformedJson) {
  EXPECT_THAT(ParseModelConfig("{\"text_config\": {", "my/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("my/config.json"), HasSubstr("malformed JSON"))));
  EXPECT_THAT(ParseModelConfig("[1, 2]", "my/config.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("my/config.json")));
}

// Applies `edit` to the golden tiny-v512 config and parses the result.
absl::StatusOr<ModelConfig> ParseEdited(void (*edit)(json&)) {
  json j = GoldenJson("tiny-v512", "config.json");
  edit(j);
  return ParseModelConfig(j.dump(), "edited/config.json");
}

TEST(ModelConfigTest, MissingFieldIsNamed) {
  auto c = ParseEdited([](json& j) { j["text_config"].erase("hidden_size"); });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("edited/config.json"), HasSubstr("hidden_size"),
                                HasSubstr("missing"))));
  c = ParseEdited([](json& j) { j.erase("canvas_length"); });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("canvas_length")));
}

TEST(ModelConfigTest, IllTypedFieldIsNamed) {
  auto c = ParseEdited([](json& j) { j["text_config"]["num_experts"] = "eight"; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_experts")));
  c = ParseEdited([](json& j) { j["text_config"]["vocab_size"] = 0; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab_size")));
}

TEST(ModelConfigTest, LayerTypesLengthMismatch) {
  auto c = ParseEdited([](json& j) { j["text_config"]["num_hidden_layers"] = 5; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("layer_types"), HasSubstr("6 entries"))));
  c = ParseEdited([](json& j) { j["text_config"]["layer_types"][0] = "chunked_attention"; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer_types")));
}

TEST(ModelConfigTest, KvHeadsMustDivideHeads) {
  auto c = ParseEdited([](json& j) { j["text_config"]["num_key_value_heads"] = 3; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads")));
  c = ParseEdited([](json& j) { j["text_config"]["num_global_key_value_heads"] = 3; });
  EXPECT_THAT(
      c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_global_key_value_heads")));
}

TEST(ModelConfigTest, TopKMustNotExceedExperts) {
  auto c = ParseEdited([](json& j) { j["text_config"]["top_k_experts"] = 9; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("top_k_experts"), HasSubstr("9"))));
}

// A canvas as long as the context leaves no position for a prompt: every request would fail.
TEST(ModelConfigTest, CanvasMustLeaveRoomForAPrompt) {
  auto c = ParseEdited([](json& j) { j["text_config"]["max_position_embeddings"] = 17; });
  ASSERT_THAT(c, IsOk());  // tiny-v512's canvas: 16 of 17
  c = ParseEdited([](json& j) { j["text_config"]["max_position_embeddings"] = 16; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("canvas_length"), HasSubstr("(16)"),
                                HasSubstr("max_position_embeddings (16)"))));
}

TEST(ModelConfigTest, RejectsOtherModelsAndActivations) {
  auto c = ParseEdited([](json& j) { j["text_config"]["model_type"] = "gemma3_text"; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model_type")));
  c = ParseEdited([](json& j) { j["text_config"]["hidden_activation"] = "relu"; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden_activation")));
  c = ParseEdited([](json& j) { j["architectures"] = json::array({"LlamaForCausalLM"}); });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("architectures"), HasSubstr("LlamaForCausalLM"))));
  c = ParseEdited([](json& j) { j["model_type"] = "llama"; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model_type")));
}

TEST(ModelConfigTest, SpecialTokenErrorsNameTheirOwnField) {
  auto c = ParseEdited([](json& j) { j["text_config"]["bos_token_id"] = 999999; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'bos_token_id'")));
  c = ParseEdited([](json& j) { j["text_config"]["pad_token_id"] = 999999; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'pad_token_id'")));
}

// Issue #15: a float field beyond float's range became inf and passed the "> 1" check.
TEST(ModelConfigTest, FloatBeyondFloatRangeIsNamed) {
  auto c = ParseEdited([](json& j) {
    j["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = 1e300;
  });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          AllOf(HasSubstr("rope_theta"), HasSubstr("out of range"))));
  c = ParseEdited([](json& j) { j["text_config"]["final_logit_softcapping"] = -1e300; });
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kInvalidArgument,
                          HasSubstr("final_logit_softcapping")));
}

TEST(GenerationConfigTest, BadValuesAreNamed) {
  struct Case {
    const char* json;
    const char* field;
  };
  const Case cases[] = {
      {R"({"t_min": 0.9, "t_max": 0.8})", "t_min"},
      {R"({"t_min": -0.1})", "t_min"},
      {R"({"t_max": "hot"})", "t_max"},
      {R"({"max_denoising_steps": 0})", "max_denoising_steps"},
      {R"({"max_new_tokens": 1.5})", "max_new_tokens"},
      {R"({"stability_threshold": -1})", "stability_threshold"},
      {R"({"confidence_threshold": 0})", "confidence_threshold"},
      {R"({"sampler_config": {"entropy_bound": -1}})", "entropy_bound"},
      {R"({"sampler_config": {"_cls_name": "TopKSamplerConfig"}})", "_cls_name"},
      {R"({"eos_token_id": "eos"})", "eos_token_id"},
      {R"({"eos_token_id": [1, -2]})", "eos_token_id"},
      // Issue #15: ids beyond int32 were truncated (4294967297 became 1), a negative single id
      // was accepted, and doubles beyond float became inf (t_max 1e300 passed t_min < t_max).
      {R"({"eos_token_id": [1, 4294967297]})", "eos_token_id"},
      {R"({"eos_token_id": -5})", "eos_token_id"},
      {R"({"eos_token_id": 2147483648})", "eos_token_id"},
      {R"({"t_max": 1e300})", "t_max"},
      {R"({"sampler_config": {"entropy_bound": 1e39}})", "entropy_bound"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseGenerationConfig(c.json, "gen/generation_config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("gen/generation_config.json"), HasSubstr(c.field))))
        << c.json;
  }
  EXPECT_THAT(ParseGenerationConfig("{", "g.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("malformed JSON")));
}

// A prompt that leaves no room for one canvas is the prompt's fault, named with its length and
// the limit (it was reported as max_new_tokens); one that fits is checked against the canvases
// of max_new_tokens, saying how many new tokens fit.
TEST(CheckContextFitsTest, NamesThePromptOrMaxNewTokens) {
  ModelConfig c;
  c.max_position_embeddings = 4096;
  c.canvas_length = 91;
  EXPECT_THAT(CheckContextFits(4005, 91, c), IsOk());
  EXPECT_THAT(CheckContextFits(4006, 91, c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "prompt: the prompt has 4006 tokens; with one canvas of 91 tokens they "
                       "exceed the context limit of 4096 positions of this model (a prompt may "
                       "have at most 4005 tokens)"));
  EXPECT_THAT(CheckContextFits(5000, 1, c), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     HasSubstr("prompt: the prompt has 5000")));
  EXPECT_THAT(CheckContextFits(3914, 182, c), IsOk());
  EXPECT_THAT(CheckContextFits(3950, 182, c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "max_new_tokens: the prompt (3950 tokens) plus 2 canvases of 91 tokens for "
                       "max_new_tokens=182 exceed the context limit of 4096 positions (at most "
                       "91 new tokens fit after this prompt)"));
}

// ReadInputToString reads a pipe (bash's <(...) is /dev/fd/N, not a regular file), at most
// max_bytes of it.
TEST(ReadInputToStringTest, ReadsAPipeBounded) {
  for (const size_t max_bytes : {size_t(5), size_t(100)}) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    ASSERT_EQ(::write(fds[1], "hello pipe", 10), 10);
    ::close(fds[1]);
    const std::string path = "/dev/fd/" + std::to_string(fds[0]);
    EXPECT_THAT(ReadFileToString(path), StatusIs(absl::StatusCode::kInvalidArgument));
    absl::StatusOr<std::string> text = ReadInputToString(path, max_bytes);
    ::close(fds[0]);
    ASSERT_THAT(text, IsOk());
    EXPECT_EQ(*text, max_bytes == 5 ? "hello" : "hello pipe");
  }
  EXPECT_THAT(ReadInputToString("/", 10),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/ is a directory")));
  EXPECT_THAT(ReadInputToString("/nonexistent/x", 10), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace dgserve
