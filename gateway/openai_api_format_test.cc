// The OpenAI response side (openai_api.h): response and chunk JSON, the SSE framing, the
// accumulator of a non-streaming answer and the stream formatter, one or several choices.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

// ---------------------------------------------------------------- formatting

v1::Usage SampleUsage() {
  v1::Usage u;
  u.set_prompt_tokens(10);
  u.set_completion_tokens(5);
  u.set_total_tokens(15);
  u.set_cached_prompt_tokens(4);
  u.set_canvases(2);
  u.set_denoising_steps(17);
  u.mutable_timings()->set_queue_seconds(0.25);
  u.mutable_timings()->set_total_seconds(1.5);
  return u;
}

void ExpectUsage(const json& u) {
  EXPECT_EQ(u["prompt_tokens"], 10);
  EXPECT_EQ(u["completion_tokens"], 5);
  EXPECT_EQ(u["total_tokens"], 15);
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(u["dgserve"]["cached_prompt_tokens"], 4);
  EXPECT_EQ(u["dgserve"]["canvases"], 2);
  EXPECT_EQ(u["dgserve"]["denoising_steps"], 17);
  EXPECT_DOUBLE_EQ(u["dgserve"]["timings"]["queue_seconds"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(u["dgserve"]["timings"]["total_seconds"].get<double>(), 1.5);
  EXPECT_TRUE(u["dgserve"]["timings"].contains("prefill_seconds"));
  EXPECT_TRUE(u["dgserve"]["timings"].contains("first_block_seconds"));
}

ResponseContext Ctx(bool chat) { return ResponseContext{"r42", "dg-tiny", 1700000000, chat}; }

TEST(FormatTest, CompletionResponse) {
  json j = json::parse(CompletionResponseJson(Ctx(false), "Hello", "length", SampleUsage()));
  EXPECT_EQ(j["id"], "cmpl-r42");
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "dg-tiny");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["text"], "Hello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  ExpectUsage(j["usage"]);
}

TEST(FormatTest, ChatResponse) {
  json j = json::parse(ChatCompletionResponseJson(Ctx(true), "Hi \xC3\xA9", "stop", SampleUsage()));
  EXPECT_EQ(j["id"], "chatcmpl-r42");
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hi \xC3\xA9");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  ExpectUsage(j["usage"]);
}

TEST(FormatTest, CompletionChunks) {
  json delta = json::parse(CompletionChunkJson(Ctx(false), "abc"));
  EXPECT_EQ(delta["id"], "cmpl-r42");
  EXPECT_EQ(delta["object"], "text_completion");
  EXPECT_EQ(delta["choices"][0]["text"], "abc");
  EXPECT_TRUE(delta["choices"][0]["finish_reason"].is_null());
  json last = json::parse(CompletionChunkJson(Ctx(false), "", "stop"));
  EXPECT_EQ(last["choices"][0]["text"], "");
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
}

TEST(FormatTest, ChatChunks) {
  json first = json::parse(ChatChunkJson(Ctx(true), "He", /*with_role=*/true));
  EXPECT_EQ(first["id"], "chatcmpl-r42");
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "He");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  json next = json::parse(ChatChunkJson(Ctx(true), "llo", false));
  EXPECT_FALSE(next["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(next["choices"][0]["delta"]["content"], "llo");
  json last = json::parse(ChatChunkJson(Ctx(true), "", false, "length"));
  EXPECT_TRUE(last["choices"][0]["delta"].is_object());
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
}

TEST(FormatTest, UsageChunk) {
  json c = json::parse(UsageChunkJson(Ctx(true), SampleUsage()));
  EXPECT_EQ(c["object"], "chat.completion.chunk");
  EXPECT_TRUE(c["choices"].is_array());
  EXPECT_TRUE(c["choices"].empty());
  ExpectUsage(c["usage"]);
  EXPECT_EQ(json::parse(UsageChunkJson(Ctx(false), SampleUsage()))["object"], "text_completion");
}

TEST(FormatTest, CanvasStepChunk) {
  v1::CanvasStep s;
  s.set_canvas(1);
  s.set_step(3);
  s.add_token_ids(7);
  s.add_token_ids(8);
  s.set_text("ab\xC3");  // ends inside a character: replaced, never throws
  s.set_accepted(12);
  s.set_mean_entropy(0.1f);
  s.set_temperature(0.75f);
  json chat = json::parse(CanvasStepChunkJson(Ctx(true), s));
  EXPECT_EQ(chat["object"], "chat.completion.chunk");
  EXPECT_TRUE(chat["choices"][0]["delta"].is_object());
  EXPECT_TRUE(chat["choices"][0]["delta"].empty());
  EXPECT_TRUE(chat["choices"][0]["finish_reason"].is_null());
  const json& cs = chat["dgserve"]["canvas_step"];
  EXPECT_EQ(cs["canvas"], 1);
  EXPECT_EQ(cs["step"], 3);
  EXPECT_EQ(cs["token_ids"], json::array({7, 8}));
  EXPECT_EQ(cs["text"].get<std::string>().substr(0, 2), "ab");
  EXPECT_EQ(cs["accepted"], 12);
  EXPECT_EQ(cs["mean_entropy"].get<double>(), 0.1);  // shortest float repr, not 0.10000000149
  EXPECT_EQ(cs["temperature"].get<double>(), 0.75);
  json comp = json::parse(CanvasStepChunkJson(Ctx(false), s));
  EXPECT_EQ(comp["object"], "text_completion");
  EXPECT_EQ(comp["choices"][0]["text"], "");
  EXPECT_EQ(comp["dgserve"]["canvas_step"]["step"], 3);
}

TEST(FormatTest, ModelsList) {
  v1::ListModelsResponse models;
  v1::ModelInfo* m = models.add_models();
  m->set_id("dg-tiny");
  m->set_context_length(8192);
  m->set_canvas_length(256);
  m->set_vocab_size(1000);
  json j = json::parse(ModelsListJson(models, 1700000001));
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "dg-tiny");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["created"], 1700000001);
  EXPECT_EQ(j["data"][0]["owned_by"], "dgserve");
  EXPECT_EQ(j["data"][0]["context_length"], 8192);
  EXPECT_EQ(j["data"][0]["dgserve"]["canvas_length"], 256);
  EXPECT_EQ(json::parse(ModelJson(*m, 5))["id"], "dg-tiny");
  EXPECT_TRUE(json::parse(ModelsListJson({}, 0))["data"].empty());
}

TEST(FormatTest, Sse) {
  EXPECT_EQ(SseEvent(R"({"a":1})"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseDone(), "data: [DONE]\n\n");
}

// ---------------------------------------------------------------- accumulator and stream

v1::GenerateEvent Block(const std::string& text, const std::string& id = "req-1") {
  v1::GenerateEvent e;
  e.set_request_id(id);
  e.mutable_block()->set_text(text);
  return e;
}

v1::GenerateEvent Finished(const std::string& reason) {
  v1::GenerateEvent e;
  e.set_request_id("req-1");
  e.mutable_finished()->set_finish_reason(reason);
  *e.mutable_finished()->mutable_usage() = SampleUsage();
  return e;
}

v1::GenerateEvent Step(int step) {
  v1::GenerateEvent e;
  e.set_request_id("req-1");
  e.mutable_canvas_step()->set_step(step);
  return e;
}

// Splits SSE text into the JSON payloads ("[DONE]" kept as a string).
std::vector<std::string> Frames(const std::string& sse) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < sse.size()) {
    size_t end = sse.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos);
    if (end == std::string::npos) break;
    std::string frame = sse.substr(pos, end - pos);
    EXPECT_EQ(frame.substr(0, 6), "data: ");
    out.push_back(frame.substr(6));
    pos = end + 2;
  }
  return out;
}

TEST(ResponseAccumulatorTest, CollectsBlocks) {
  ResponseAccumulator acc;
  acc.OnEvent(Step(0));
  acc.OnEvent(Block("Hel"));
  acc.OnEvent(Block("lo"));
  EXPECT_FALSE(acc.finished());
  acc.OnEvent(Finished("stop"));
  EXPECT_TRUE(acc.finished());
  EXPECT_EQ(acc.request_id(), "req-1");
  json j = json::parse(acc.Json(ResponseContext{"fallback", "m", 1, false}));
  EXPECT_EQ(j["id"], "cmpl-req-1");
  EXPECT_EQ(j["choices"][0]["text"], "Hello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  ExpectUsage(j["usage"]);
  json c = json::parse(acc.Json(ResponseContext{"fallback", "m", 1, true}));
  EXPECT_EQ(c["choices"][0]["message"]["content"], "Hello");
}

TEST(StreamFormatterTest, ChatStreamWithUsage) {
  StreamFormatter f(ResponseContext{"local", "m", 9, true}, /*include_usage=*/true);
  std::string sse;
  sse += f.OnEvent(Step(0));
  sse += f.OnEvent(Block("Hi"));
  EXPECT_EQ(f.OnEvent(Block("")), "");
  sse += f.OnEvent(Block(" there"));
  sse += f.OnEvent(Finished("length"));
  sse += f.OnEnd(absl::OkStatus());
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 6u);
  json step = json::parse(frames[0]);
  EXPECT_EQ(step["id"], "chatcmpl-req-1");
  EXPECT_TRUE(step["choices"][0]["delta"].empty());
  json first = json::parse(frames[1]);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "Hi");
  json second = json::parse(frames[2]);
  EXPECT_FALSE(second["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(second["choices"][0]["delta"]["content"], " there");
  json last = json::parse(frames[3]);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  json usage = json::parse(frames[4]);
  EXPECT_TRUE(usage["choices"].empty());
  ExpectUsage(usage["usage"]);
  EXPECT_EQ(frames[5], "[DONE]");
}

TEST(StreamFormatterTest, ChatRoleOnFinalChunkWhenNoText) {
  StreamFormatter f(ResponseContext{"local", "m", 9, true}, false);
  std::string sse = f.OnEvent(Finished("stop"));
  sse += f.OnEnd(absl::OkStatus());
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 2u);
  json last = json::parse(frames[0]);
  EXPECT_EQ(last["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(frames[1], "[DONE]");
}

TEST(StreamFormatterTest, CompletionStreamWithoutUsage) {
  StreamFormatter f(ResponseContext{"local", "m", 9, false}, false);
  std::string sse = f.OnEvent(Block("a"));
  sse += f.OnEvent(Finished("stop"));
  sse += f.OnEnd(absl::OkStatus());
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(json::parse(frames[0])["id"], "cmpl-req-1");
  EXPECT_EQ(json::parse(frames[0])["choices"][0]["text"], "a");
  EXPECT_EQ(json::parse(frames[1])["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(frames[2], "[DONE]");
}

// An error event ends the stream with [DONE] after it, as vLLM does (a client waiting for
// [DONE] used to wait for the connection to close instead).
TEST(StreamFormatterTest, ErrorAfterEventsIsFollowedByDone) {
  StreamFormatter f(ResponseContext{"local", "m", 9, false}, true);
  std::string sse = f.OnEvent(Block("a"));
  sse += f.OnEnd(absl::UnavailableError("worker lost"));
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(frames[2], "[DONE]");
  json err = json::parse(frames[1]);
  EXPECT_EQ(err["error"]["message"], "worker lost");
  EXPECT_EQ(err["error"]["type"], "service_unavailable");
  // OK without a Finished event is an internal error (then [DONE]).
  StreamFormatter g(ResponseContext{"local", "m", 9, false}, false);
  std::vector<std::string> g_frames = Frames(g.OnEnd(absl::OkStatus()));
  ASSERT_EQ(g_frames.size(), 2u);
  EXPECT_EQ(g_frames[1], "[DONE]");
  EXPECT_EQ(json::parse(g_frames[0])["error"]["type"], "server_error");
}

v1::GenerateEvent WithIndex(v1::GenerateEvent e, int index) {
  e.set_index(index);
  return e;
}

// A stream's error event has the error body the same error would have as an HTTP response:
// `param` names a request field for INVALID_ARGUMENT only ("messages" for a chat's prompt),
// never a worker role taken from the message (a deadline said "param": "denoise").
TEST(StreamFormatterTest, ErrorEventParamIsTheHttpResponses) {
  const absl::Status deadline = absl::DeadlineExceededError("denoise: Deadline Exceeded");
  const absl::Status bad = absl::InvalidArgumentError("prompt: too long");
  for (const bool chat : {false, true}) {
    for (const absl::Status& st : {deadline, bad}) {
      StreamFormatter f(ResponseContext{"local", "m", 9, chat}, false, 2);
      std::string sse = f.OnEvent(WithIndex(Block("a"), 1));
      sse += f.OnEnd(st);
      std::vector<std::string> frames = Frames(sse);
      ASSERT_EQ(frames.size(), 3u);
      const json err = json::parse(frames[1])["error"];
      const std::string param = CoreErrorParam(st, chat);
      if (param.empty()) {
        EXPECT_TRUE(err["param"].is_null()) << frames[1];
      } else {
        EXPECT_EQ(err["param"], param) << frames[1];
      }
    }
  }
  EXPECT_EQ(CoreErrorParam(bad, true), "messages");
  EXPECT_EQ(CoreErrorParam(deadline, false), "");
}

TEST(ResponseAccumulatorTest, OneChoicePerIndexAndSummedUsage) {
  ResponseAccumulator acc;
  acc.OnEvent(WithIndex(Block("a0"), 0));
  acc.OnEvent(WithIndex(Block("b1"), 1));
  acc.OnEvent(WithIndex(Block("c0"), 0));
  acc.OnEvent(WithIndex(Finished("stop"), 0));
  acc.OnEvent(WithIndex(Finished("length"), 1));
  json j = json::parse(acc.Json(ResponseContext{"fallback", "m", 1, true}));
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "a0c0");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["message"]["content"], "b1");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  const v1::Usage u = SampleUsage();
  EXPECT_EQ(j["usage"]["prompt_tokens"], u.prompt_tokens());  // the prompt counts once
  EXPECT_EQ(j["usage"]["completion_tokens"], 2 * u.completion_tokens());
  EXPECT_EQ(j["usage"]["total_tokens"], u.prompt_tokens() + 2 * u.completion_tokens());
}

TEST(StreamFormatterTest, TwoChoicesInterleaveEachWithItsFinishThenOneUsageAndDone) {
  StreamFormatter f(ResponseContext{"local", "m", 9, true}, /*include_usage=*/true, 2);
  std::string sse;
  sse += f.OnEvent(WithIndex(Block("x"), 1));
  sse += f.OnEvent(WithIndex(Block("y"), 0));
  sse += f.OnEvent(WithIndex(Block("z"), 1));
  sse += f.OnEvent(WithIndex(Finished("stop"), 0));
  EXPECT_FALSE(f.finished());
  sse += f.OnEvent(WithIndex(Finished("length"), 1));
  EXPECT_TRUE(f.finished());
  sse += f.OnEnd(absl::OkStatus());
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 7u);
  const std::vector<std::pair<int, std::string>> want = {{1, "x"}, {0, "y"}, {1, "z"}};
  for (size_t i = 0; i < want.size(); ++i) {
    json c = json::parse(frames[i])["choices"][0];
    EXPECT_EQ(c["index"], want[i].first) << i;
    EXPECT_EQ(c["delta"]["content"], want[i].second) << i;
    EXPECT_EQ(c["delta"].contains("role"), i < 2) << i;  // the first chunk of each choice
  }
  json f0 = json::parse(frames[3])["choices"][0], f1 = json::parse(frames[4])["choices"][0];
  EXPECT_EQ(f0["index"], 0);
  EXPECT_EQ(f0["finish_reason"], "stop");
  EXPECT_EQ(f1["index"], 1);
  EXPECT_EQ(f1["finish_reason"], "length");
  json usage = json::parse(frames[5]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2 * SampleUsage().completion_tokens());
  EXPECT_EQ(frames[6], "[DONE]");
}

// A block of choice `index` whose usage so far counts `completion` tokens (continuous usage).
v1::GenerateEvent BlockWithUsage(const std::string& text, int completion, int index = 0) {
  v1::GenerateEvent e = WithIndex(Block(text), index);
  v1::Usage* u = e.mutable_block()->mutable_usage();
  u->set_prompt_tokens(SampleUsage().prompt_tokens());
  u->set_cached_prompt_tokens(SampleUsage().cached_prompt_tokens());
  u->set_completion_tokens(completion);
  u->set_total_tokens(SampleUsage().prompt_tokens() + completion);
  return e;
}

// The usage a chunk carries with continuous usage: the OpenAI fields only.
void ExpectChunkUsage(const json& chunk, int completion) {
  ASSERT_TRUE(chunk.contains("usage")) << chunk.dump();
  const json& u = chunk["usage"];
  EXPECT_EQ(u["prompt_tokens"], SampleUsage().prompt_tokens()) << chunk.dump();
  EXPECT_EQ(u["completion_tokens"], completion) << chunk.dump();
  EXPECT_EQ(u["total_tokens"], SampleUsage().prompt_tokens() + completion) << chunk.dump();
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], SampleUsage().cached_prompt_tokens())
      << chunk.dump();
  EXPECT_FALSE(u.contains("dgserve")) << chunk.dump();
}

// stream_options.continuous_usage_stats: every text chunk carries its choice's usage so far,
// the finish chunk the choice's final usage; canvas-step chunks carry none; the usage chunk is
// as without it.
TEST(StreamFormatterTest, ContinuousUsageInEveryChoiceChunk) {
  for (const bool chat : {false, true}) {
    SCOPED_TRACE(chat ? "chat" : "completions");
    StreamFormatter f(ResponseContext{"local", "m", 9, chat}, /*include_usage=*/true, 1,
                      /*continuous_usage=*/true);
    std::string sse;
    sse += f.OnEvent(Step(0));
    sse += f.OnEvent(BlockWithUsage("Hi", 2));
    EXPECT_EQ(f.OnEvent(BlockWithUsage("", 2)), "");
    sse += f.OnEvent(BlockWithUsage(" there", 4));
    sse += f.OnEvent(Finished("length"));  // completion_tokens 5
    sse += f.OnEnd(absl::OkStatus());
    std::vector<std::string> frames = Frames(sse);
    ASSERT_EQ(frames.size(), 6u);
    EXPECT_FALSE(json::parse(frames[0]).contains("usage"));  // a canvas step is no token chunk
    ExpectChunkUsage(json::parse(frames[1]), 2);
    ExpectChunkUsage(json::parse(frames[2]), 4);
    json last = json::parse(frames[3]);
    EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
    ExpectChunkUsage(last, SampleUsage().completion_tokens());
    json usage = json::parse(frames[4]);
    EXPECT_TRUE(usage["choices"].empty());
    ExpectUsage(usage["usage"]);
    EXPECT_EQ(frames[5], "[DONE]");
  }
  // Without it no choice chunk carries usage, even when the blocks have one.
  StreamFormatter g(ResponseContext{"local", "m", 9, false}, /*include_usage=*/true);
  std::vector<std::string> frames =
      Frames(g.OnEvent(BlockWithUsage("a", 1)) + g.OnEvent(Finished("stop")));
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_FALSE(json::parse(frames[0]).contains("usage"));
  EXPECT_FALSE(json::parse(frames[1]).contains("usage"));
  ExpectUsage(json::parse(frames[2])["usage"]);
}

// With n > 1 each choice's chunks count that choice's tokens (as vLLM); the usage chunk sums.
TEST(StreamFormatterTest, ContinuousUsageCountsEachChoiceOnItsOwn) {
  StreamFormatter f(ResponseContext{"local", "m", 9, false}, true, 2, true);
  std::string sse;
  sse += f.OnEvent(BlockWithUsage("x", 3, 1));
  sse += f.OnEvent(BlockWithUsage("y", 1, 0));
  sse += f.OnEvent(WithIndex(Finished("stop"), 0));
  sse += f.OnEvent(WithIndex(Finished("stop"), 1));
  std::vector<std::string> frames = Frames(sse);
  ASSERT_EQ(frames.size(), 5u);
  ExpectChunkUsage(json::parse(frames[0]), 3);
  ExpectChunkUsage(json::parse(frames[1]), 1);
  ExpectChunkUsage(json::parse(frames[2]), 5);
  ExpectChunkUsage(json::parse(frames[3]), 5);
  EXPECT_EQ(json::parse(frames[4])["usage"]["completion_tokens"], 10);
}

}  // namespace
}  // namespace dgserve
