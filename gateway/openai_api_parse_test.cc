// The OpenAI request parser (openai_api.h): completions and chat bodies accepted, refused with
// the field named, and the error param extracted from a message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"
#include "gateway/openai_api.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using json = nlohmann::json;

OpenAiRequest ParseOk(const std::string& body, bool chat = false) {
  absl::StatusOr<OpenAiRequest> r =
      chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
  EXPECT_THAT(r, IsOk()) << body;
  return r.ok() ? *r : OpenAiRequest{};
}

// Expects INVALID_ARGUMENT whose message starts with `prefix` (the field name).
void ExpectError(const std::string& body, const std::string& prefix, bool chat = false) {
  absl::StatusOr<OpenAiRequest> r =
      chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument, StartsWith(prefix))) << body;
}

// ---------------------------------------------------------------- completions: accepted forms

TEST(ParseCompletionsTest, MinimalStringPrompt) {
  OpenAiRequest r = ParseOk(R"({"prompt": "Hello"})");
  EXPECT_EQ(r.request.text(), "Hello");
  EXPECT_EQ(r.model, "");
  EXPECT_EQ(r.request.model(), "");
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_FALSE(r.chat);
  EXPECT_EQ(r.request.max_tokens(), 0);
  EXPECT_FALSE(r.request.has_seed());
  EXPECT_EQ(r.request.stop_size(), 0);
  EXPECT_FALSE(r.request.diffusion().has_t_min());
  EXPECT_FALSE(r.request.diffusion().has_self_conditioning());  // unset: on
  EXPECT_EQ(r.request.stream_options().canvas_step_interval(), 0);
}

TEST(ParseCompletionsTest, ArrayOfOneString) {
  EXPECT_EQ(ParseOk(R"({"prompt": ["Hi there"]})").request.text(), "Hi there");
}

TEST(ParseCompletionsTest, TokenIdsPrompt) {
  OpenAiRequest r = ParseOk(R"({"prompt": [2, 100, 2147483647]})");
  ASSERT_TRUE(r.request.has_token_ids());
  EXPECT_THAT(r.request.token_ids().ids(), ElementsAre(2, 100, 2147483647));
  OpenAiRequest r2 = ParseOk(R"({"prompt": [[5, 6]]})");
  EXPECT_THAT(r2.request.token_ids().ids(), ElementsAre(5, 6));
}

TEST(ParseCompletionsTest, AllSupportedFields) {
  OpenAiRequest r = ParseOk(R"({
    "model": "diffusiongemma", "prompt": "x", "max_tokens": 64, "stream": true,
    "stream_options": {"include_usage": true}, "stop": ["END", "\n\n"], "seed": 18446744073709551615,
    "temperature": 1, "top_p": 1.0, "n": 1, "user": "u1",
    "max_denoising_steps": 32, "entropy_bound": 0.5, "t_min": 0.1, "t_max": 2,
    "confidence_threshold": 1.25, "stability_threshold": 3, "canvas_step_interval": 4,
    "canvas_text": true, "self_conditioning": false, "sample_temperature_spread": -0.5})");
  EXPECT_EQ(r.model, "diffusiongemma");
  EXPECT_EQ(r.request.model(), "diffusiongemma");
  EXPECT_EQ(r.request.max_tokens(), 64);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_THAT(r.request.stop(), ElementsAre("END", "\n\n"));
  ASSERT_TRUE(r.request.has_seed());
  EXPECT_EQ(r.request.seed(), 18446744073709551615ull);
  const v1::DiffusionControls& d = r.request.diffusion();
  EXPECT_EQ(d.max_denoising_steps(), 32);
  EXPECT_FLOAT_EQ(d.entropy_bound(), 0.5f);
  EXPECT_FLOAT_EQ(d.t_min(), 0.1f);
  EXPECT_FLOAT_EQ(d.t_max(), 2.0f);
  EXPECT_FLOAT_EQ(d.confidence_threshold(), 1.25f);
  EXPECT_EQ(d.stability_threshold(), 3);
  ASSERT_TRUE(d.has_self_conditioning());
  EXPECT_FALSE(d.self_conditioning());
  EXPECT_FLOAT_EQ(d.sample_temperature_spread(), -0.5f);
  EXPECT_EQ(r.request.stream_options().canvas_step_interval(), 4);
  EXPECT_TRUE(r.request.stream_options().canvas_text());
}

TEST(ParseCompletionsTest, NChoices) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "n": 3})").request.n(), 3);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "n": 0})").request.n(), 0);  // the core reads 0 as 1
  EXPECT_EQ(ParseOk(R"({"prompt": "x"})").request.n(), 0);
}

TEST(ParseCompletionsTest, StopAsString) {
  EXPECT_THAT(ParseOk(R"({"prompt": "x", "stop": "###"})").request.stop(), ElementsAre("###"));
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "stop": []})").request.stop_size(), 0);
}

TEST(ParseCompletionsTest, SeedZeroAndMaxCompletionTokens) {
  OpenAiRequest r = ParseOk(R"({"prompt": "x", "seed": 0, "max_completion_tokens": 1000000})");
  ASSERT_TRUE(r.request.has_seed());
  EXPECT_EQ(r.request.seed(), 0u);
  EXPECT_EQ(r.request.max_tokens(), 1000000);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_tokens": 7, "max_completion_tokens": 7})")
                .request.max_tokens(),
            7);
}

TEST(ParseCompletionsTest, NullsAndToleratedDefaults) {
  OpenAiRequest r = ParseOk(R"({
    "prompt": "x", "model": null, "max_tokens": null, "stop": null, "seed": null,
    "temperature": null, "top_p": null, "stream_options": null, "suffix": null,
    "logprobs": false, "echo": false, "n": 1, "best_of": 1, "presence_penalty": 0,
    "frequency_penalty": 0.0, "logit_bias": {}, "response_format": null, "user": null})");
  EXPECT_EQ(r.request.text(), "x");
  EXPECT_EQ(r.request.max_tokens(), 0);
  EXPECT_FALSE(r.request.has_seed());
  // OpenAI's defaults that ask for nothing (clients that always send them): accepted.
  r = ParseOk(R"({"prompt": "x", "response_format": {"type": "text"}, "top_logprobs": 0,
    "store": false})");
  EXPECT_EQ(r.request.text(), "x");
  EXPECT_EQ(r.request.max_tokens(), 0);
  EXPECT_FALSE(r.request.has_seed());
}

TEST(ParseCompletionsTest, StreamFalseWithoutOptions) {
  OpenAiRequest r = ParseOk(R"({"prompt": "x", "stream": false})");
  EXPECT_FALSE(r.stream);
}

// ---------------------------------------------------------------- completions: rejections

// Bytes that are not UTF-8 inside a JSON string used to pass the parser and fail later, when
// the request was serialized again, as an HTTP 500.
TEST(ParseCompletionsTest, InvalidUtf8IsInvalidArgument) {
  ExpectError("{\"prompt\": \"\xff\xfe\", \"max_tokens\": 3}",
              "request body is not valid UTF-8 (first bad byte at offset 12)");
  ExpectError("{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3(\"}]}",
              "request body is not valid UTF-8", /*chat=*/true);
}

// Issue #15 item 5: a number beyond a double made nlohmann::json throw out_of_range, which was
// not caught (HTTP 500). Every JSON exception is a 400 now, in any field and on both endpoints.
// A number beyond a double is refused naming its field (it was "malformed JSON" with no param).
TEST(ParseCompletionsTest, NumberOverflowIsInvalidArgumentNotAnException) {
  ExpectError(R"({"prompt":"x","seed":1e400})", "seed: number 1e400 is beyond a double");
  ExpectError(R"({"prompt":"x","max_tokens":-1e400})", "max_tokens: number -1e400 is beyond");
  ExpectError(R"({"prompt":"x","t_min":1e99999})", "t_min: number 1e99999 is beyond a double");
  ExpectError(R"({"messages":[{"role":"user","content":"x"}],"entropy_bound":1e400})",
              "entropy_bound: number 1e400 is beyond a double", /*chat=*/true);
  const absl::StatusOr<OpenAiRequest> r = ParseCompletionsRequest(R"({"prompt":[1,2,3e999]})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ErrorParam(r.status()), "prompt[2]");
}

TEST(ParseCompletionsTest, PromptRejections) {
  ExpectError(R"({})", "prompt: required");
  ExpectError(R"({"prompt": null})", "prompt: required");
  ExpectError(R"({"prompt": ""})", "prompt: must not be empty");
  ExpectError(R"({"prompt": []})", "prompt: must not be empty");
  ExpectError(R"({"prompt": [""]})", "prompt: must not be empty");
  ExpectError(R"({"prompt": [[]]})", "prompt: must not be empty");
  ExpectError(R"({"prompt": ["a", "b"]})", "prompt: several prompts");
  ExpectError(R"({"prompt": [[1], [2]]})", "prompt: several prompts");
  ExpectError(R"({"prompt": [1, "a"]})", "prompt[1]: must be a token id, as prompt[0] is");
  ExpectError(R"({"prompt": [1, -2]})", "prompt[1]: must be a token id");
  ExpectError(R"({"prompt": [1, 2.5]})", "prompt[1]: must be an integer");
  ExpectError(R"({"prompt": [4294967296]})", "prompt[0]: must be a token id");
  // Whole numbers no 64-bit integer holds are named as token ids out of range, not as non-integers.
  ExpectError(R"({"prompt": [18446744073709551616]})", "prompt[0]: must be a token id");
  ExpectError(R"({"prompt": [1e30]})", "prompt[0]: must be a token id in [0, 2^31) (got 1e+30)");
  ExpectError(R"({"prompt": [2147483648]})",
              "prompt[0]: must be a token id in [0, 2^31) (got 2147483648)");
  ExpectError(R"({"prompt": [[1, "x"]]})", "prompt[0][1]: must be an integer");
  ExpectError(R"({"prompt": 5})", "prompt: must be a string");
  ExpectError(R"({"prompt": {"text": "x"}})", "prompt: must be a string");
}

// Integer fields take a whole number in any JSON notation, as vLLM's request models do (5.0 and 5e0
// are 5); -0 is 0. The parser keeps these as doubles or signed integers.
TEST(ParseCompletionsTest, WholeNumbersInAnyNotation) {
  const OpenAiRequest r = ParseOk(
      R"({"prompt": [1.0, 2e0, -0], "max_tokens": 5.0, "n": 3e0, "seed": 1e19, "best_of": 1.0,
          "max_denoising_steps": 4e1, "stream": true, "canvas_step_interval": 2.0})");
  EXPECT_THAT(r.request.token_ids().ids(), ElementsAre(1, 2, 0));
  EXPECT_EQ(r.request.max_tokens(), 5);
  EXPECT_EQ(r.request.n(), 3);
  EXPECT_EQ(r.request.seed(), 10000000000000000000ull);
  EXPECT_EQ(r.request.diffusion().max_denoising_steps(), 40);
  EXPECT_EQ(r.request.stream_options().canvas_step_interval(), 2);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "seed": -0})").request.seed(), 0u);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "seed": 18446744073709551615})").request.seed(),
            18446744073709551615ull);
}

// A key repeated within one object is refused, at any depth (the parser kept the last, so
// {"max_tokens": 2, "max_tokens": -5} and the reverse order were answered differently, and a
// proxy reading the first value saw another request). The same key in different objects is fine.
TEST(ParseCompletionsTest, DuplicateKeysAreRefused) {
  ExpectError(R"({"prompt": "x", "max_tokens": 2, "max_tokens": -5})",
              "max_tokens: appears more than once in its JSON object");
  ExpectError(R"({"prompt": "x", "stream": true, "stream": false})", "stream: appears more");
  ExpectError(R"({"prompt": "x", "canvas_template": {"token_ids": [1], "token_ids": [2]}})",
              "canvas_template.token_ids: appears more than once");
  ExpectError(R"({"messages": [{"role": "user", "content": "a", "role": "system"}]})",
              "messages[0].role: appears more than once", /*chat=*/true);
  ExpectError(R"({"messages": [{"role": "user", "content": "a"},
                               {"role": "user", "content": [{"type": "text", "text": "b",
                                                             "type": "text"}]}]})",
              "messages[1].content[0].type: appears more than once", /*chat=*/true);
  const OpenAiRequest r = ParseOk(
      R"({"prompt": "x", "max_tokens": 3,
          "canvas_template": {"token_ids": [1, -1], "holes": [{"position": 1,
            "allowed_token_ids": [5]}, {"position": 0, "allowed_token_ids": [6]}]}})");
  EXPECT_EQ(r.request.max_tokens(), 3);
  EXPECT_EQ(r.request.canvas_template().holes_size(), 2);
}

// An array prompt holds one kind of element; a mixed one names the first element of another kind
// (["a", 5] was answered "several prompts in one request are not supported").
TEST(ParseCompletionsTest, MixedArrayPromptNamesTheOddElement) {
  ExpectError(R"({"prompt": ["a", 5]})", "prompt[1]: must be a string, as prompt[0] is");
  ExpectError(R"({"prompt": [5, "a"]})", "prompt[1]: must be a token id, as prompt[0] is");
  ExpectError(R"({"prompt": [[5], 6]})",
              "prompt[1]: must be an array of token ids, as prompt[0] is");
  ExpectError(R"({"prompt": [true, 5]})", "prompt[0]: must be an integer token id");
  EXPECT_THAT(ParseOk(R"({"prompt": [5, 6.0, 7]})").request.token_ids().ids(),
              ElementsAre(5, 6, 7));
}

TEST(ParseCompletionsTest, MaxTokensRejections) {
  ExpectError(R"({"prompt": "x", "max_tokens": "5"})", "max_tokens: must be an integer");
  ExpectError(R"({"prompt": "x", "max_tokens": 5.5})", "max_tokens: must be an integer");
  ExpectError(R"({"prompt": "x", "max_tokens": 0})", "max_tokens: must be between 1 and");
  ExpectError(R"({"prompt": "x", "max_tokens": -3})", "max_tokens: must be between 1 and");
  ExpectError(R"({"prompt": "x", "max_tokens": 1000001})",
              "max_tokens: must be between 1 and 1000000 (got 1000001)");
  // However large, a whole number gets the range (it said "must be an integer" beyond 2^64).
  ExpectError(R"({"prompt": "x", "max_tokens": 99999999999999999999})",
              "max_tokens: must be between 1 and 1000000 (got 1e+20)");
  ExpectError(R"({"prompt": "x", "max_tokens": 18446744073709551615})",
              "max_tokens: must be between 1 and 1000000 (got 18446744073709551615)");
  // Whatever the notation: 2e6 is out of range like 2000000, 5.5 is not a whole number.
  ExpectError(R"({"prompt": "x", "max_tokens": 2e6})",
              "max_tokens: must be between 1 and 1000000 (got 2000000.0)");
  ExpectError(R"({"prompt": "x", "max_tokens": -1e10})", "max_tokens: must be between 1 and");
  ExpectError(R"({"prompt": "x", "max_completion_tokens": 0})", "max_completion_tokens: must");
  ExpectError(R"({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 6})",
              "max_completion_tokens: differs");
}

TEST(ParseCompletionsTest, StreamRejections) {
  ExpectError(R"({"prompt": "x", "stream": "true"})", "stream: must be a boolean");
  ExpectError(R"({"prompt": "x", "stream": 1})", "stream: must be a boolean");
  ExpectError(R"({"prompt": "x", "stream_options": {"include_usage": true}})",
              "stream_options: only allowed when stream is true");
  ExpectError(R"({"prompt": "x", "stream": true, "stream_options": []})",
              "stream_options: must be an object");
  ExpectError(R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})",
              "stream_options.include_usage: must be a boolean");
  ExpectError(R"({"prompt": "x", "stream_options": {"continuous_usage_stats": true}})",
              "stream_options: only allowed when stream is true");
  ExpectError(R"({"prompt": "x", "stream_options": {"include_usage": true,
                  "continuous_usage_stats": false}})",
              "stream_options: only allowed when stream is true");
  ExpectError(
      R"({"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": "yes"}})",
      "stream_options.continuous_usage_stats: must be a boolean");
  ExpectError(R"({"prompt": "x", "stream": true, "stream_options": {"usage_every": true}})",
              "unsupported field: stream_options.usage_every");
}

// vLLM's stream_options.continuous_usage_stats: accepted, and on only together with
// include_usage (as vLLM's should_include_usage); false changes nothing.
TEST(ParseCompletionsTest, ContinuousUsageStats) {
  struct Case {
    const char* options;
    bool include_usage, continuous;
  };
  for (const Case& c : {
           Case{R"({"include_usage": true, "continuous_usage_stats": true})", true, true},
           Case{R"({"continuous_usage_stats": true, "include_usage": true})", true, true},
           Case{R"({"include_usage": true, "continuous_usage_stats": false})", true, false},
           Case{R"({"include_usage": false, "continuous_usage_stats": true})", false, false},
           Case{R"({"continuous_usage_stats": true})", false, false},
           Case{R"({"include_usage": true, "continuous_usage_stats": null})", true, false},
       }) {
    for (const bool chat : {false, true}) {
      const std::string body = absl::StrCat(
          chat ? R"({"messages": [{"role": "user", "content": "x"}])" : R"({"prompt": "x")",
          R"(, "stream": true, "stream_options": )", c.options, "}");
      OpenAiRequest r = ParseOk(body, chat);
      EXPECT_EQ(r.include_usage, c.include_usage) << body;
      EXPECT_EQ(r.continuous_usage, c.continuous) << body;
      EXPECT_EQ(r.request.stream_options().continuous_usage(), c.continuous) << body;
    }
  }
  EXPECT_FALSE(ParseOk(R"({"prompt": "x", "stream": true})").continuous_usage);
}

// What clients without tools send ("tools": [], "tool_choice": "none", or nulls) is no tools;
// any real tool or tool choice stays refused.
TEST(ParseCompletionsTest, NoToolsIsAccepted) {
  for (const char* fields :
       {R"("tools": [])", R"("tools": null)", R"("tool_choice": "none")", R"("tool_choice": null)",
        R"("tools": [], "tool_choice": "none")", R"("tools": null, "tool_choice": "none")",
        R"("tools": [], "tool_choice": null)"}) {
    for (const bool chat : {false, true}) {
      const std::string body = absl::StrCat(
          chat ? R"({"messages": [{"role": "user", "content": "x"}], )" : R"({"prompt": "x", )",
          fields, "}");
      absl::StatusOr<OpenAiRequest> r =
          chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
      ASSERT_THAT(r, IsOk()) << body;
      EXPECT_EQ(chat ? r->request.chat().messages(0).content() : r->request.text(), "x") << body;
    }
  }
  struct Refused {
    const char* fields;
    const char* field;  // the one named
  };
  for (const Refused& c : {
           Refused{R"("tools": [{"type": "function", "function": {"name": "f"}}])", "tools"},
           Refused{R"("tools": [], "tool_choice": "auto")", "tool_choice"},
           Refused{R"("tool_choice": "required")", "tool_choice"},
           Refused{R"("tool_choice": {"type": "function", "function": {"name": "f"}})",
                   "tool_choice"},
           Refused{R"("functions": [])", "functions"},
           Refused{R"("functions": [{"name": "f"}])", "functions"},
           Refused{R"("function_call": "none")", "function_call"},
           Refused{R"("function_call": "auto")", "function_call"},
           Refused{R"("function_call": {"name": "f"})", "function_call"},
       }) {
    for (const bool chat : {false, true}) {
      const std::string body = absl::StrCat(
          chat ? R"({"messages": [{"role": "user", "content": "x"}], )" : R"({"prompt": "x", )",
          c.fields, "}");
      ExpectError(body, absl::StrCat("unsupported field: ", c.field), chat);
    }
  }
}

// A tool field of the wrong type is named as a wrong type, as any other field's is (a non-array
// "tools" was refused as "unsupported field: tools", as if tools were asked for), and an unknown
// tool choice is named with what was sent; well-formed requests for tools say why they are
// refused.
TEST(ParseCompletionsTest, ToolFieldTypeErrors) {
  struct Case {
    const char* fields;
    const char* field;    // the error's param
    const char* message;  // the whole message
  };
  constexpr char kToolChoice[] =
      R"(tool_choice: must be "none", "auto", "required" or an object naming a function)";
  constexpr char kFunctionCall[] =
      R"(function_call: must be "none", "auto" or an object naming a function)";
  for (
      const Case& c : {
          Case{R"("tools": {})", "tools", "tools: must be an array of tool objects"},
          Case{R"("tools": {"type": "function"})", "tools",
               "tools: must be an array of tool objects"},
          Case{R"("tools": 3)", "tools", "tools: must be an array of tool objects"},
          Case{R"("tools": "x")", "tools", "tools: must be an array of tool objects"},
          Case{R"("tools": false)", "tools", "tools: must be an array of tool objects"},
          Case{R"("tool_choice": 3)", "tool_choice", kToolChoice},
          Case{R"("tool_choice": [])", "tool_choice", kToolChoice},
          Case{R"("tool_choice": true)", "tool_choice", kToolChoice},
          Case{
              R"("tool_choice": "None")", "tool_choice",
              R"(tool_choice: must be "none", "auto", "required" or an object naming a function (got "None"))"},
          Case{
              R"("tool_choice": "")", "tool_choice",
              R"(tool_choice: must be "none", "auto", "required" or an object naming a function (got ""))"},
          Case{R"("functions": {})", "functions",
               "functions: must be an array of function objects"},
          Case{R"("functions": "f")", "functions",
               "functions: must be an array of function objects"},
          Case{R"("function_call": 1)", "function_call", kFunctionCall},
          Case{
              R"("function_call": "required")", "function_call",
              R"(function_call: must be "none", "auto" or an object naming a function (got "required"))"},
          // Well formed: refused as unsupported, with the reason.
          Case{R"("tools": [{"type": "function", "function": {"name": "f"}}])", "tools",
               "unsupported field: tools (tool calling is not supported; only [] is accepted)"},
          Case{R"("tools": [3])", "tools",
               "unsupported field: tools (tool calling is not supported; only [] is accepted)"},
          Case{
              R"("tool_choice": "auto")", "tool_choice",
              R"(unsupported field: tool_choice (tool calling is not supported; only "none" is accepted))"},
          Case{
              R"("tool_choice": "required")", "tool_choice",
              R"(unsupported field: tool_choice (tool calling is not supported; only "none" is accepted))"},
          Case{
              R"("tool_choice": {"type": "function", "function": {"name": "f"}})", "tool_choice",
              R"(unsupported field: tool_choice (tool calling is not supported; only "none" is accepted))"},
          Case{R"("functions": [])", "functions",
               "unsupported field: functions (function calling, the legacy form of tools, is not "
               "supported)"},
          Case{R"("function_call": "none")", "function_call",
               "unsupported field: function_call (function calling, the legacy form of tools, is "
               "not supported)"},
      }) {
    for (const bool chat : {false, true}) {
      const std::string body = absl::StrCat(
          chat ? R"({"messages": [{"role": "user", "content": "x"}], )" : R"({"prompt": "x", )",
          c.fields, "}");
      absl::StatusOr<OpenAiRequest> r =
          chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
      ASSERT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument)) << body;
      EXPECT_EQ(std::string(r.status().message()), c.message) << body;
      EXPECT_EQ(ErrorParam(r.status()), c.field) << body;
    }
  }
}

TEST(ParseCompletionsTest, StopRejections) {
  ExpectError(R"({"prompt": "x", "stop": ""})", "stop: must not be empty");
  ExpectError(R"({"prompt": "x", "stop": ["a", ""]})", "stop[1]: must not be empty");
  ExpectError(R"({"prompt": "x", "stop": ["a", 3]})", "stop[1]: must be a string");
  ExpectError(R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", "stop: at most 4");
  ExpectError(R"({"prompt": "x", "stop": 7})", "stop: must be a string or an array");
}

TEST(ParseCompletionsTest, SeedRejections) {
  ExpectError(R"({"prompt": "x", "seed": -1})", "seed: must be an integer in [0, 2^64) (got -1)");
  ExpectError(R"({"prompt": "x", "seed": -1e30})", "seed: must be an integer in [0, 2^64)");
  ExpectError(R"({"prompt": "x", "seed": 2e19})", "seed: must be an integer in [0, 2^64)");
  ExpectError(R"({"prompt": "x", "seed": 1.5})", "seed: must be an integer");
  ExpectError(R"({"prompt": "x", "seed": "42"})", "seed: must be an integer");
  ExpectError(R"({"prompt": "x", "seed": 18446744073709551616})",
              "seed: must be an integer in [0, 2^64) (got 1.8446744073709552e+19)");
}

TEST(ParseCompletionsTest, SamplingRejections) {
  ExpectError(R"({"prompt": "x", "temperature": 0.7})", "temperature: not supported");
  ExpectError(R"({"prompt": "x", "temperature": 0})", "temperature: not supported");
  ExpectError(R"({"prompt": "x", "temperature": "hot"})", "temperature: must be a number");
  ExpectError(R"({"prompt": "x", "top_p": 0.9})", "top_p: not supported");
  absl::StatusOr<OpenAiRequest> r = ParseCompletionsRequest(R"({"prompt": "x", "temperature": 2})");
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("t_min and t_max")));
  ExpectError(R"({"prompt": "x", "n": -1})", "n: must be >= 1");
  // Beyond int32: named as too large, not as below 1 (it said "must be >= 1").
  ExpectError(R"({"prompt": "x", "n": 4294967297})", "n: too large (4294967297)");
  ExpectError(R"({"prompt": "x", "n": "1"})", "n: must be an integer");
  ExpectError(R"({"prompt": "x", "n": 18446744073709551616})",
              "n: too large (1.8446744073709552e+19)");
  ExpectError(R"({"prompt": "x", "n": 1e30})", "n: too large (1e+30)");
  ExpectError(R"({"prompt": "x", "n": -1e30})", "n: must be >= 1");
  ExpectError(R"({"prompt": "x", "n": 18446744073709551615})",
              "n: too large (18446744073709551615)");
  ExpectError(R"({"prompt": "x", "n": -9223372036854775808})", "n: must be >= 1");
  ExpectError(R"({"prompt": "x", "n": 2.5})", "n: must be an integer");
  ExpectError(R"({"prompt": "x", "user": 5})", "user: must be a string");
  ExpectError(R"({"prompt": "x", "model": 5})", "model: must be a string");
}

TEST(ParseCompletionsTest, UnsupportedFields) {
  for (const char* field : {R"("logprobs": 5)",
                            R"("logprobs": true)",
                            R"("logprobs": 0)",
                            R"("top_logprobs": 2)",
                            R"("echo": true)",
                            R"("best_of": 3)",
                            R"("suffix": "s")",
                            R"("presence_penalty": 0.5)",
                            R"("frequency_penalty": -1)",
                            R"("logit_bias": {"50256": -100})",
                            R"("response_format": {"type": "json_object"})",
                            R"("response_format": {"type": "text", "schema": {}})",
                            R"("response_format": "text")",
                            R"("top_logprobs": 1)",
                            R"("top_logprobs": 0.5)",
                            R"("store": true)",
                            R"("tools": [{"type": "function"}])",
                            R"("tool_choice": "auto")",
                            R"("tool_choice": "required")",
                            R"("functions": [])",
                            R"("whatever": 1)",
                            R"("chat_template_kwargs": {"enable_thinking": true})"}) {
    const std::string body = std::string(R"({"prompt": "x", )") + field + "}";
    const std::string name = json::parse(std::string("{") + field + "}").begin().key();
    ExpectError(body, "unsupported field: " + name);
  }
  ExpectError(R"({"prompt": "x", "messages": []})", "unsupported field: messages (this endpoint");
  // OpenAI's suffix (insertion) points to what infills here.
  ExpectError(R"({"prompt": "x", "suffix": "s"})",
              "unsupported field: suffix (for infilling give \"canvas_template\"");
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "suffix": "s"})",
              "unsupported field: suffix (for infilling give \"canvas_template\"", true);
}

TEST(ParseCompletionsTest, DiffusionControlTypeChecks) {
  ExpectError(R"({"prompt": "x", "max_denoising_steps": 1.5})",
              "max_denoising_steps: must be an integer");
  ExpectError(R"({"prompt": "x", "max_denoising_steps": 3000000000})",
              "max_denoising_steps: must be an integer in [-2^31, 2^31) (got 3000000000)");
  ExpectError(R"({"prompt": "x", "max_denoising_steps": 9223372036854775808})",
              "max_denoising_steps: must be an integer in [-2^31, 2^31) (got 9223372036854775808)");
  ExpectError(R"({"prompt": "x", "stability_threshold": 1e19})",
              "stability_threshold: must be an integer in [-2^31, 2^31) (got 1e+19)");
  ExpectError(R"({"prompt": "x", "stability_threshold": 3e9})",
              "stability_threshold: must be an integer in [-2^31, 2^31) (got 3000000000.0)");
  ExpectError(R"({"prompt": "x", "stability_threshold": "3"})",
              "stability_threshold: must be an integer");
  ExpectError(R"({"prompt": "x", "entropy_bound": "0.5"})", "entropy_bound: must be a number");
  ExpectError(R"({"prompt": "x", "t_min": true})", "t_min: must be a number");
  ExpectError(R"({"prompt": "x", "t_max": [1]})", "t_max: must be a number");
  ExpectError(R"({"prompt": "x", "sample_temperature_spread": "wide"})",
              "sample_temperature_spread: must be a number");
  ExpectError(R"({"prompt": "x", "t_max": 1e300})",
              "t_max: must be a finite float32 (magnitude at most FLT_MAX, 3.4028235e38) (got "
              "1e+300)");
  ExpectError(R"({"prompt": "x", "entropy_bound": -1e39})",
              "entropy_bound: must be a finite float32");
  // A nonzero value float32 rounds to 0 is named as such (it said "must be > 0, got 0").
  ExpectError(R"({"prompt": "x", "entropy_bound": 1e-50})",
              "entropy_bound: 1e-50 rounds to 0 in float32; give 0 or a magnitude of about 1e-45");
  ExpectError(R"({"prompt": "x", "confidence_threshold": {}})",
              "confidence_threshold: must be a number");
  ExpectError(R"({"prompt": "x", "stream": true, "canvas_step_interval": -1})",
              "canvas_step_interval: must be an integer in [0, 2^31) (got -1)");
  ExpectError(R"({"prompt": "x", "stream": true, "canvas_step_interval": 1.5})",
              "canvas_step_interval: must be an integer");
  ExpectError(R"({"prompt": "x", "canvas_step_interval": 2})",
              "canvas_step_interval: canvas steps are only sent when stream is true");
  ExpectError(R"({"prompt": "x", "stream": true, "canvas_text": true})",
              "canvas_text: requires canvas_step_interval > 0");
  ExpectError(R"({"prompt": "x", "stream": true, "canvas_text": 1})",
              "canvas_text: must be a boolean");
  ExpectError(R"({"prompt": "x", "self_conditioning": "no"})",
              "self_conditioning: must be a boolean");
  ExpectError(R"({"prompt": "x", "self_conditioning": 0})", "self_conditioning: must be a boolean");
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "self_conditioning": [false]})",
              "self_conditioning: must be a boolean", /*chat=*/true);
  // true is accepted and kept (explicitly on); null is absent.
  const v1::DiffusionControls on =
      ParseOk(R"({"messages": [{"role": "user", "content": "x"}], "self_conditioning": true})",
              /*chat=*/true)
          .request.diffusion();
  ASSERT_TRUE(on.has_self_conditioning());
  EXPECT_TRUE(on.self_conditioning());
  EXPECT_FALSE(ParseOk(R"({"prompt": "x", "self_conditioning": null})")
                   .request.diffusion()
                   .has_self_conditioning());
  // Range checks are the core's: a negative entropy bound passes the type check here.
  EXPECT_FLOAT_EQ(
      ParseOk(R"({"prompt": "x", "entropy_bound": -1})").request.diffusion().entropy_bound(),
      -1.0f);
}

// An empty form of the canvas template is named as empty (it said "give text or token_ids" to a
// request that gave token_ids: []).
TEST(ParseCompletionsTest, EmptyCanvasTemplateFormsAreNamedEmpty) {
  ExpectError(R"({"prompt": "1", "canvas_template": {"token_ids": []}})",
              "canvas_template.token_ids: must not be empty");
  ExpectError(R"({"prompt": "1", "canvas_template": {"text": ""}})",
              "canvas_template.text: must not be empty");
  ExpectError(R"({"prompt": "1", "canvas_template": {}})", "canvas_template: give");
}

// ---------------------------------------------------------------- chat

TEST(ParseChatTest, StringAndPartsContent) {
  OpenAiRequest r = ParseOk(R"({"model": "m", "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "system", "content": [{"type": "text", "text": "Really."}]},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": "ok", "name": null},
      {"role": "user", "content": ""}]})",
                            /*chat=*/true);
  EXPECT_TRUE(r.chat);
  ASSERT_TRUE(r.request.has_chat());
  const v1::ChatInput& c = r.request.chat();
  ASSERT_EQ(c.messages_size(), 5);
  EXPECT_EQ(c.messages(0).role(), "system");
  EXPECT_EQ(c.messages(0).content(), "Be brief.");
  EXPECT_EQ(c.messages(1).role(), "system");
  EXPECT_EQ(c.messages(1).content(), "Really.");
  EXPECT_EQ(c.messages(2).role(), "user");
  EXPECT_EQ(c.messages(2).content(), "a\nb");
  EXPECT_EQ(c.messages(3).role(), "assistant");
  EXPECT_EQ(c.messages(4).content(), "");  // an empty string is allowed
  EXPECT_FALSE(c.enable_thinking());
}

// Gemma's role name "model" is the assistant's, and OpenAI's optional message "name" is accepted
// and not used (both were refused: "unsupported role", "unsupported field").
TEST(ParseChatTest, ModelRoleAndMessageNameAreAccepted) {
  OpenAiRequest r = ParseOk(R"({"messages": [
      {"role": "system", "content": "Be brief.", "name": "rules"},
      {"role": "user", "content": "hi", "name": "alice"},
      {"role": "model", "content": "hello", "name": "gemma"},
      {"role": "user", "content": "again"}]})",
                            /*chat=*/true);
  const v1::ChatInput& c = r.request.chat();
  ASSERT_EQ(c.messages_size(), 4);
  EXPECT_EQ(c.messages(0).role(), "system");
  EXPECT_EQ(c.messages(0).content(), "Be brief.");
  EXPECT_EQ(c.messages(1).role(), "user");
  EXPECT_EQ(c.messages(1).content(), "hi");
  EXPECT_EQ(c.messages(2).role(), "assistant");
  EXPECT_EQ(c.messages(2).content(), "hello");
  EXPECT_EQ(c.messages(3).role(), "user");
  // A name that is not a string is still an error naming it.
  ExpectError(R"({"messages": [{"role": "user", "content": "x", "name": 7}]})",
              "messages[0].name: must be a string", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x", "name": "a", "name": "b"}]})",
              "messages[0].name: appears more than once", true);
}

TEST(ParseChatTest, EnableThinkingInEitherOrder) {
  OpenAiRequest a = ParseOk(
      R"({"chat_template_kwargs": {"enable_thinking": true},
          "messages": [{"role": "user", "content": "hi"}]})",
      true);
  EXPECT_TRUE(a.request.chat().enable_thinking());
  OpenAiRequest b = ParseOk(
      R"({"messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"enable_thinking": false}, "max_completion_tokens": 9,
          "stream": true, "stream_options": {"include_usage": false}})",
      true);
  EXPECT_FALSE(b.request.chat().enable_thinking());
  EXPECT_EQ(b.request.max_tokens(), 9);
  EXPECT_TRUE(b.stream);
  EXPECT_FALSE(b.include_usage);
}

TEST(ParseChatTest, Rejections) {
  ExpectError(R"({})", "messages: required", true);
  ExpectError(R"({"messages": []})", "messages: must not be empty", true);
  ExpectError(R"({"messages": {}})", "messages: must be an array", true);
  ExpectError(R"({"messages": ["hi"]})", "messages[0]: must be an object", true);
  ExpectError(R"({"messages": [{"content": "hi"}]})", "messages[0].role: required", true);
  ExpectError(R"({"messages": [{"role": "user"}]})", "messages[0].content: required", true);
  ExpectError(R"({"messages": [{"role": 1, "content": "x"}]})",
              "messages[0].role: must be a string", true);
  ExpectError(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})",
      "messages[1].role: unsupported role \"tool\"", true);
  ExpectError(R"({"messages": [{"role": "user", "content": 5}]})",
              "messages[0].content: must be a string or an array", true);
  ExpectError(R"({"messages": [{"role": "user", "content": [
                  {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]})",
              "messages[0].content[1].type: unsupported content part type 'image_url'", true);
  ExpectError(R"({"messages": [{"role": "user", "content": [{"text": "a"}]}]})",
              "messages[0].content[0].type: required", true);
  ExpectError(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})",
              "messages[0].content[0].text: required", true);
  ExpectError(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]})",
              "messages[0].content[0].text: must be a string", true);
  ExpectError(R"({"messages": [{"role": "user", "content": ["a"]}]})",
              "messages[0].content[0]: must be an object", true);
  // An empty array of parts is no content (it used to generate from an empty turn).
  ExpectError(R"({"messages": [{"role": "user", "content": []}]})",
              "messages[0].content: must not be an empty array", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
              "unsupported field: messages[0].tool_calls", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "prompt": "p"})",
              "unsupported field: prompt (this endpoint takes messages", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})",
              "unsupported field: tools", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}],
                  "chat_template_kwargs": {"enable_thinking": "yes"}})",
              "chat_template_kwargs.enable_thinking: must be a boolean", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}],
                  "chat_template_kwargs": {"add_generation_prompt": false}})",
              "unsupported field: chat_template_kwargs.add_generation_prompt", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1})",
              "chat_template_kwargs: must be an object", true);
  ExpectError(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})",
              "max_tokens: must be between", true);
}

TEST(ErrorParamTest, ExtractsFieldNames) {
  auto param = [](const std::string& body, bool chat = false) {
    absl::StatusOr<OpenAiRequest> r =
        chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
    return r.ok() ? std::string("<ok>") : ErrorParam(r.status());
  };
  EXPECT_EQ(param(R"({"prompt": "x", "max_tokens": "a"})"), "max_tokens");
  EXPECT_EQ(param(R"({"prompt": "x", "logprobs": 3})"), "logprobs");
  EXPECT_EQ(param(R"({"prompt": "x", "self_conditioning": "no"})"), "self_conditioning");
  EXPECT_EQ(param(R"({"prompt": "x", "messages": 3})"), "messages");
  EXPECT_EQ(param(R"({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})", true),
            "messages[0].content[0].type");
  // Keys are named whole, whatever they hold (the message is not cut at a space or ": ").
  EXPECT_EQ(param(R"({"prompt": "x", "foo bar": 1})"), "foo bar");
  EXPECT_EQ(param(R"({"prompt": "x", "a: b": 1})"), "a: b");
  EXPECT_EQ(param(R"({"prompt": "x", "a b": 1, "a b": 2})"), "a b");
  EXPECT_EQ(param(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 1,
                                                                "x y": 2}]}]})",
                  true),
            "messages[0].content[0].text");
  // A null text part is absent, as every null is.
  EXPECT_EQ(param(R"({"messages": [{"role": "user", "content": [{"type": "text",
                                                                "text": null}]}]})",
                  true),
            "messages[0].content[0].text");
  EXPECT_THAT(
      ParseChatCompletionsRequest(
          R"({"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]})"),
      StatusIs(absl::StatusCode::kInvalidArgument, "messages[0].content[0].text: required"));
  EXPECT_EQ(param(R"({"prompt": )"), "");
  EXPECT_EQ(param(R"([])"), "");
  EXPECT_EQ(ErrorParam(absl::UnavailableError("no healthy worker")), "");
  // The sampler's range errors (engine/denoise/sampler_params.cc) name the field first.
  EXPECT_EQ(
      ErrorParam(absl::InvalidArgumentError("max_denoising_steps must be in [1, 1024], got 0")),
      "max_denoising_steps");
  EXPECT_EQ(ErrorParam(absl::InvalidArgumentError("t_max must be finite and > t_min (2), got 1")),
            "t_max");
  EXPECT_EQ(ErrorParam(absl::InvalidArgumentError("t_min: must be < t_max")), "t_min");
}

}  // namespace
}  // namespace dgserve
