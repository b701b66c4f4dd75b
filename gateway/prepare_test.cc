// Gateway::Prepare's prompt bound (--max_prompt_tokens, issue 36 item 6): a prompt longer than
// the gateway's limit is INVALID_ARGUMENT naming its field, before any worker is involved; and
// what the Sudoku model's prompts make of characters outside its vocabulary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "common/status_convert.h"
#include "common/testing/status_matchers.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/gateway.h"
#include "gateway/openai_api.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string SourceDir() {
  const char* d = std::getenv("DGSERVE_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelConfig> config =
        LoadModelConfig(SourceDir() + "/tests/testdata/golden/tiny-v512/config.json");
    ASSERT_THAT(config, IsOk());
    config_ = *config;
    absl::StatusOr<Tokenizer> tokenizer =
        Tokenizer::Load(SourceDir() + "/engine/tokenizer/testdata/tiny_v512_tokenizer.json");
    ASSERT_THAT(tokenizer, IsOk());
    tokenizer_.emplace(*std::move(tokenizer));
  }

  absl::StatusOr<PreparedRequest> Prepare(int64_t max_prompt_tokens,
                                          const v1::GenerateRequest& request) {
    GatewayOptions options;
    options.model_id = "m";
    options.max_prompt_tokens = max_prompt_tokens;
    const Gateway gateway(config_, GenerationConfig{}, *tokenizer_, options, nullptr, nullptr,
                          nullptr);
    return gateway.Prepare(request);
  }

  static v1::GenerateRequest Ids(int n) {
    v1::GenerateRequest r;
    for (int i = 0; i < n; ++i) r.mutable_token_ids()->add_ids(2 + i % 50);
    r.set_max_tokens(1);
    return r;
  }

  ModelConfig config_;
  std::optional<Tokenizer> tokenizer_;
};

TEST_F(PrepareTest, DefaultIsDocumented) {
  EXPECT_EQ(GatewayOptions{}.max_prompt_tokens, 32768);
  EXPECT_EQ(kDefaultMaxPromptTokens, 32768);
}

TEST_F(PrepareTest, TokenIdsBeyondTheLimitAreRefusedNamingPrompt) {
  absl::StatusOr<PreparedRequest> ok = Prepare(10, Ids(10));
  ASSERT_THAT(ok, IsOk());
  EXPECT_EQ(ok->prompt.size(), 10u);
  absl::StatusOr<PreparedRequest> refused = Prepare(10, Ids(11));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("prompt: 11 tokens exceed"));
  EXPECT_THAT(refused.status().message(), HasSubstr("at most 10 tokens (--max_prompt_tokens)"));
  // OpenAI's code for a prompt that is too long.
  EXPECT_THAT(OpenAiErrorBody(refused.status()), HasSubstr("\"context_length_exceeded\""));
  // 0: only the context limit binds.
  EXPECT_THAT(Prepare(0, Ids(11)), IsOk());
}

TEST_F(PrepareTest, TextAndChatPromptsAreCutAtTheLimitAndRefused) {
  v1::GenerateRequest text;
  std::string words;
  for (int i = 0; i < 200; ++i) words += "hello world ";
  text.set_text(words);
  text.set_max_tokens(1);
  absl::StatusOr<PreparedRequest> refused = Prepare(16, text);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("prompt: more than 16 tokens exceed"));
  ASSERT_THAT(Prepare(0, text), IsOk());
  EXPECT_GT(Prepare(0, text)->prompt.size(), 16u);

  v1::GenerateRequest chat;
  v1::ChatMessage* m = chat.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content(words);
  chat.set_max_tokens(1);
  refused = Prepare(16, chat);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("messages: more than 16 tokens exceed"));
}

// DiffusionControls.sample_temperature_spread (issue 36 item 8) reaches the denoise worker's
// sampler settings; out of range it is INVALID_ARGUMENT naming the field, and unset it is 0.
TEST_F(PrepareTest, SampleTemperatureSpreadIsPassedOnAndChecked) {
  v1::GenerateRequest r = Ids(3);
  r.set_n(4);
  absl::StatusOr<PreparedRequest> unset = Prepare(0, r);
  ASSERT_THAT(unset, IsOk());
  EXPECT_EQ(unset->sampler.sample_temperature_spread(), 0.0f);
  r.mutable_diffusion()->set_sample_temperature_spread(-0.75f);
  absl::StatusOr<PreparedRequest> set = Prepare(0, r);
  ASSERT_THAT(set, IsOk());
  EXPECT_EQ(set->sampler.sample_temperature_spread(), -0.75f);
  r.mutable_diffusion()->set_sample_temperature_spread(-1.0f);
  absl::StatusOr<PreparedRequest> refused = Prepare(0, r);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("sample_temperature_spread must be in"));
}

// A draining gateway refuses a new request as UNAVAILABLE before the front end starts any work
// (HTTP 503), whatever its queue holds: with its slots and queue full it said RESOURCE_EXHAUSTED
// (429, "retry later"), and with room it said OK and refused later.
TEST_F(PrepareTest, ADrainingGatewayRefusesNewRequestsAsUnavailable) {
  GatewayOptions options;
  options.model_id = "m";
  Gateway gateway(config_, GenerationConfig{}, *tokenizer_, options, nullptr, nullptr, nullptr);
  EXPECT_THAT(gateway.CheckAdmission(), IsOk());
  gateway.SetDraining(true);
  EXPECT_THAT(gateway.CheckAdmission(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(gateway.CheckAdmission().message(), "gateway is draining");
}

// Characters outside the Sudoku model's vocabulary (models/sudoku: "\n", "▁", ".", digits and
// control tokens) reach the model as <unk> (3), one per run, as vLLM's Hugging Face tokenizer
// gives them: a prompt from /v1/completions, /v1/chat/completions or gRPC (the same
// v1::GenerateRequest) is accepted, not refused, and nothing in it is dropped. Expected ids from
// npm @lenml/tokenizers 3.7.2 (transformers.js) on models/sudoku/tokenizer.json, node 20:
// encode("1é 2∑😀x\n") -> [2, 110, 3, 108, 111, 3, 107]; encode of the chat template's text
// "<bos><|turn>user\nPuzzle: 1é 2∑😀x<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
// with add_special_tokens false -> the ids below.
TEST(PrepareSudokuTest, CharactersOutsideTheVocabularyBecomeUnk) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(SourceDir() + "/models/sudoku/config.json");
  ASSERT_THAT(config, IsOk());
  absl::StatusOr<Tokenizer> tokenizer =
      Tokenizer::Load(SourceDir() + "/models/sudoku/tokenizer.json");
  ASSERT_THAT(tokenizer, IsOk());
  GatewayOptions options;
  options.model_id = "sudoku";
  const Gateway gateway(*config, GenerationConfig{}, *std::move(tokenizer), options, nullptr,
                        nullptr, nullptr);
  const std::string text = "1\xc3\xa9 2\xe2\x88\x91\xf0\x9f\x98\x80x\n";  // "1é 2∑😀x\n"

  absl::StatusOr<OpenAiRequest> completions =
      ParseCompletionsRequest(R"({"prompt": "1\u00e9 2\u2211\ud83d\ude00x\n", "max_tokens": 1})");
  ASSERT_THAT(completions, IsOk());
  EXPECT_EQ(completions->request.text(), text);  // the HTTP front end passes it on as sent
  absl::StatusOr<PreparedRequest> p = gateway.Prepare(completions->request);
  ASSERT_THAT(p, IsOk());
  EXPECT_THAT(p->prompt, ElementsAre(2, 110, 3, 108, 111, 3, 107));

  absl::StatusOr<OpenAiRequest> chat = ParseChatCompletionsRequest(
      R"({"messages": [{"role": "user", "content": "Puzzle: 1\u00e9 2\u2211\ud83d\ude00x"}],)"
      R"( "max_tokens": 1})");
  ASSERT_THAT(chat, IsOk());
  p = gateway.Prepare(chat->request);
  ASSERT_THAT(p, IsOk());
  EXPECT_THAT(p->prompt, ElementsAre(2, 105, 3, 107, 3, 108, 110, 3, 108, 111, 3, 106, 107, 105, 3,
                                     107, 100, 3, 107, 101));
}

}  // namespace
}  // namespace dgserve
