// DenoiseEngine in one process, no gRPC: the real CPU backend on random tiny-v512 weights, a
// block pool and a KvReceiver fed by the in-process transport (the prompt KV encoded here, as
// the prefill worker would). Checked: the tokens equal Generator's (one sample, two requests
// in one batch, n samples scheduled in parts, a resume from a committed canvas, a stop token),
// admission (validation, duplicates, draining, a full queue), cancellation while waiting for KV
// and while running, the KV wait deadline, and KV of the wrong length.
#include "denoise_worker/denoise_engine.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/testing/status_matchers.h"
#include "denoise_worker/denoise_engine_testing.h"
#include "denoise_worker/denoise_metrics.h"
#include "engine/generation/generator.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transfer.h"
#include "worker/worker_model.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;

using denoise_testing::JobEvents;

class DenoiseEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("denoise_engine_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }

  void SetUp() override {
    backend_ = CreateCpuBackend(config(), checkpoint_->weights);
    test_backend_ = CreateCpuBackend(config(), checkpoint_->weights);
    auto pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(pool.status(), IsOk());
    pool_ = *std::move(pool);
    auto sender_pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(sender_pool.status(), IsOk());
    sender_pool_ = *std::move(sender_pool);
    receiver_ = std::make_unique<kv::KvReceiver>(pool_.get(), config().max_position_embeddings);
    target_ = "denoise-engine-test-" +
              std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
    kv::RegisterInProcessReceiver(target_, receiver_.get());
    transport_ = kv::CreateInProcessTransport();
  }
  void TearDown() override {
    engine_.reset();
    kv::UnregisterInProcessReceiver(target_);
  }

  const ModelConfig& config() const { return checkpoint_->config; }
  int C() const { return config().canvas_length; }

  void StartEngine(int max_batch_canvases = 16, int max_queue = 256,
                   int64_t max_kv_wait_ms = 60000, DenoiseMetrics* metrics = nullptr) {
    DenoiseEngineOptions o;
    o.max_batch_canvases = max_batch_canvases;
    o.max_queue = max_queue;
    o.max_kv_wait_ms = max_kv_wait_ms;
    o.model_id = "tiny";
    engine_ = std::make_unique<DenoiseEngine>(backend_.get(), pool_.get(), receiver_.get(),
                                              std::move(o), metrics);
  }

  std::vector<int32_t> Prompt() const {
    std::vector<int32_t> p;
    for (int i = 0; i < 21; ++i) p.push_back((i * 67 + 9) % config().vocab_size);
    return p;
  }

  v1::DenoiseRequest Request(const std::string& id, int prompt_tokens, int max_new_tokens) const {
    return denoise_testing::Request(checkpoint_->generation, id, prompt_tokens, max_new_tokens,
                                    /*max_denoising_steps=*/6, /*canvas_step_interval=*/1);
  }

  // The same request through Generator, with seed `seed`.
  // `temperature_factor`: t_min and t_max scaled by it (a sample of a spread request).
  GenerationResult Generate(const std::vector<int32_t>& prompt, const v1::DenoiseRequest& r,
                            uint64_t seed, float temperature_factor = 1.0f) {
    GenerationRequest g = DefaultRequest(checkpoint_->generation);
    g.prompt = prompt;
    g.max_new_tokens = r.max_new_tokens();
    g.seed = seed;
    g.sampler.max_denoising_steps = r.sampler().max_denoising_steps();
    g.sampler.t_min *= temperature_factor;
    g.sampler.t_max *= temperature_factor;
    g.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
    g.pad_token_id = r.pad_token_id();
    Generator gen(*test_backend_);
    absl::StatusOr<GenerationResult> res = gen.Generate(g);
    EXPECT_THAT(res.status(), IsOk());
    return res.ok() ? *std::move(res) : GenerationResult{};
  }

  // Encodes `prompt` into a paged KV and sends it to the receiver as request `id`.
  void SendKv(const std::string& id, const std::vector<int32_t>& prompt) {
    ASSERT_THAT(denoise_testing::SendPromptKv(*test_backend_, sender_pool_.get(), *transport_,
                                              target_, id, prompt),
                IsOk());
  }

  // Pops the job's events until it ends (at most 120 s).
  JobEvents Collect(DenoiseJob& job, int samples = 1) {
    return denoise_testing::Collect(job, samples, absl::Seconds(120));
  }

  static std::vector<int32_t> Ids(const v1::DenoiseBlockEvent& b) {
    return std::vector<int32_t>(b.token_ids().begin(), b.token_ids().end());
  }

  static Checkpoint* checkpoint_;
  std::unique_ptr<ModelBackend> backend_;       // the engine thread's
  std::unique_ptr<ModelBackend> test_backend_;  // this thread's (KV, Generator)
  std::unique_ptr<kv::BlockPool> pool_, sender_pool_;
  std::unique_ptr<kv::KvReceiver> receiver_;
  std::unique_ptr<kv::KvTransport> transport_;
  std::string target_;
  // The engine's thread writes these until the engine is destroyed (TearDown), so they live in
  // the fixture, not in a test body: a registry local to the test died while the thread still
  // set a gauge after the last job ended ("malloc_consolidate(): unaligned fastbin chunk").
  prometheus::Registry registry_;
  DenoiseMetrics metrics_{registry_};
  std::unique_ptr<DenoiseEngine> engine_;
};
Checkpoint* DenoiseEngineTest::checkpoint_ = nullptr;

TEST_F(DenoiseEngineTest, OneSampleGivesTheGeneratorsTokensAndEvents) {
  StartEngine();
  const std::vector<int32_t> prompt = Prompt();
  v1::DenoiseRequest r = Request("one", int(prompt.size()), 3 * C() - 4);
  const GenerationResult want = Generate(prompt, r, r.seed());
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("one", prompt);
  const JobEvents got = Collect(*job);
  ASSERT_THAT(got.final, IsOk());
  ASSERT_EQ(got.blocks[0].size(), 3u);
  std::vector<int32_t> tokens;
  for (int n = 0; n < 3; ++n) {
    const v1::DenoiseBlockEvent& b = got.blocks[0][n];
    EXPECT_EQ(b.index(), n);
    EXPECT_EQ(b.steps(), want.steps_per_canvas[n]);
    EXPECT_FALSE(b.stop_token());
    tokens.insert(tokens.end(), b.token_ids().begin(), b.token_ids().end());
  }
  EXPECT_EQ(tokens, want.tokens);
  EXPECT_EQ(got.step_events[0], want.decoder_passes);  // canvas_step_interval 1: every step
  ASSERT_TRUE(got.finished[0].has_value());
  EXPECT_EQ(got.finished[0]->finish_reason(), "length");
  EXPECT_EQ(got.finished[0]->canvases(), 3);
  EXPECT_EQ(got.finished[0]->denoising_steps(), want.decoder_passes);
  EXPECT_EQ(engine_->stats().queued, 0);
}

TEST_F(DenoiseEngineTest, SamplesScheduledInPartsGiveTheirSeedsTokens) {
  StartEngine(/*max_batch_canvases=*/2);  // 3 samples: the third joins when a slot frees up
  const std::vector<int32_t> prompt = Prompt();
  v1::DenoiseRequest r = Request("three", int(prompt.size()), 2 * C());
  r.set_num_samples(3);
  r.set_canvas_step_interval(0);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("three", prompt);
  const JobEvents got = Collect(*job, 3);
  ASSERT_THAT(got.final, IsOk());
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(::testing::Message() << "sample " << i);
    const GenerationResult want = Generate(prompt, r, r.seed() + i);
    ASSERT_EQ(got.blocks[i].size(), 2u);
    std::vector<int32_t> tokens;
    for (const auto& b : got.blocks[i]) {
      tokens.insert(tokens.end(), b.token_ids().begin(), b.token_ids().end());
    }
    EXPECT_EQ(tokens, want.tokens);
    EXPECT_EQ(got.step_events[i], 0);
    ASSERT_TRUE(got.finished[i].has_value());
    EXPECT_EQ(got.finished[i]->denoising_steps(), want.decoder_passes);
  }
  EXPECT_NE(Ids(got.blocks[0][0]), Ids(got.blocks[1][0]));
}

// sample_temperature_spread −0.5 over 3 samples: sample i runs t_min and t_max × 1, 0.75, 0.5,
// so each sample's tokens are Generator's with that schedule and its seed.
TEST_F(DenoiseEngineTest, SampleTemperatureSpreadGivesEachSampleItsSchedule) {
  StartEngine(/*max_batch_canvases=*/4);
  const std::vector<int32_t> prompt = Prompt();
  v1::DenoiseRequest r = Request("spread", int(prompt.size()), C());
  r.set_num_samples(3);
  r.set_canvas_step_interval(0);
  r.mutable_sampler()->set_sample_temperature_spread(-0.5f);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("spread", prompt);
  const JobEvents got = Collect(*job, 3);
  ASSERT_THAT(got.final, IsOk());
  const float factor[3] = {1.0f, 0.75f, 0.5f};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(::testing::Message() << "sample " << i);
    ASSERT_EQ(got.blocks[i].size(), 1u);
    EXPECT_EQ(Ids(got.blocks[i][0]), Generate(prompt, r, r.seed() + i, factor[i]).tokens);
  }
  // The schedule made a difference: at its own temperatures sample 2 gives other tokens.
  EXPECT_NE(Ids(got.blocks[2][0]), Generate(prompt, r, r.seed() + 2).tokens);
}

TEST_F(DenoiseEngineTest, RequestsBatchedTogetherGiveTheirTokensAlone) {
  StartEngine(16, 256, 60000, &metrics_);
  const std::vector<int32_t> prompt = Prompt();
  std::vector<int32_t> other = prompt;
  other.resize(13);
  // A long request (every step of every canvas) and a short one that joins while it runs.
  v1::DenoiseRequest a = Request("long", int(prompt.size()), 3 * C());
  a.mutable_sampler()->set_max_denoising_steps(24);
  a.mutable_sampler()->set_confidence_threshold(1e-30f);
  v1::DenoiseRequest b = Request("short", int(other.size()), C());
  b.set_seed(77);
  // Both KVs wait in the receiver, so both requests are ready as soon as they are submitted.
  SendKv("long", prompt);
  SendKv("short", other);
  auto ja = std::make_shared<DenoiseJob>(a), jb = std::make_shared<DenoiseJob>(b);
  ASSERT_THAT(engine_->Submit(ja), IsOk());
  ASSERT_THAT(engine_->Submit(jb), IsOk());
  const JobEvents ga = Collect(*ja), gb = Collect(*jb);
  ASSERT_THAT(ga.final, IsOk());
  ASSERT_THAT(gb.final, IsOk());

  GenerationRequest g = DefaultRequest(checkpoint_->generation);
  g.prompt = prompt;
  g.max_new_tokens = a.max_new_tokens();
  g.seed = a.seed();
  g.sampler.max_denoising_steps = 24;
  g.sampler.confidence_threshold = 1e-30f;
  g.stop_token_ids = {};
  Generator gen(*test_backend_);
  absl::StatusOr<GenerationResult> want_a = gen.Generate(g);
  ASSERT_THAT(want_a.status(), IsOk());
  const GenerationResult want_b = Generate(other, b, b.seed());
  std::vector<int32_t> ta, tb;
  for (const auto& x : ga.blocks[0])
    ta.insert(ta.end(), x.token_ids().begin(), x.token_ids().end());
  for (const auto& x : gb.blocks[0])
    tb.insert(tb.end(), x.token_ids().begin(), x.token_ids().end());
  EXPECT_EQ(ta, want_a->tokens);
  EXPECT_EQ(tb, want_b.tokens);
  EXPECT_EQ(want_a->decoder_passes, 72);
  // Every pass is counted once; some steps carried both canvases.
  const auto batches = metrics_.batch_canvases.Collect().histogram;
  EXPECT_EQ(batches.sample_sum, double(want_a->decoder_passes + want_b.decoder_passes));
  EXPECT_LT(batches.sample_count, uint64_t(want_a->decoder_passes + want_b.decoder_passes));
  EXPECT_EQ(metrics_.canvases.Value(), 4);
}

TEST_F(DenoiseEngineTest, ResumeFromACommittedCanvasGivesTheSameLaterCanvases) {
  StartEngine();
  const std::vector<int32_t> prompt = Prompt();
  v1::DenoiseRequest whole = Request("whole", int(prompt.size()), 3 * C());
  const GenerationResult want = Generate(prompt, whole, whole.seed());
  ASSERT_EQ(want.canvases, 3);
  // The gateway's resume: prompt + the raw committed canvas 0, from canvas 1 on.
  std::vector<int32_t> resumed_prompt = prompt;
  resumed_prompt.insert(resumed_prompt.end(), want.tokens.begin(), want.tokens.begin() + C());
  v1::DenoiseRequest r = Request("resumed", int(resumed_prompt.size()), 2 * C());
  r.set_first_canvas(1);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("resumed", resumed_prompt);
  const JobEvents got = Collect(*job);
  ASSERT_THAT(got.final, IsOk());
  ASSERT_EQ(got.blocks[0].size(), 2u);
  EXPECT_EQ(got.blocks[0][0].index(), 1);
  EXPECT_EQ(got.blocks[0][1].index(), 2);
  EXPECT_EQ(Ids(got.blocks[0][0]),
            std::vector<int32_t>(want.tokens.begin() + C(), want.tokens.begin() + 2 * C()));
  EXPECT_EQ(Ids(got.blocks[0][1]),
            std::vector<int32_t>(want.tokens.begin() + 2 * C(), want.tokens.end()));
  ASSERT_TRUE(got.finished[0].has_value());
  EXPECT_EQ(got.finished[0]->canvases(), 3);  // index of the last canvas + 1
}

TEST_F(DenoiseEngineTest, StopTokenEndsTheSampleAtItsCanvas) {
  StartEngine();
  const std::vector<int32_t> prompt = Prompt();
  v1::DenoiseRequest r = Request("stop", int(prompt.size()), 3 * C());
  const GenerationResult free_run = Generate(prompt, r, r.seed());
  const int32_t stop = free_run.tokens[C() + 3];  // in canvas 1 (or earlier)
  r.add_stop_token_ids(stop);
  const GenerationResult want = Generate(prompt, r, r.seed());
  ASSERT_EQ(want.finish_reason, "stop");
  ASSERT_LT(want.canvases, 3);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("stop", prompt);
  const JobEvents got = Collect(*job);
  ASSERT_THAT(got.final, IsOk());
  ASSERT_EQ(int(got.blocks[0].size()), want.canvases);
  EXPECT_TRUE(got.blocks[0].back().stop_token());
  std::vector<int32_t> tokens;
  for (const auto& b : got.blocks[0]) {
    tokens.insert(tokens.end(), b.token_ids().begin(), b.token_ids().end());
  }
  EXPECT_EQ(tokens, want.tokens);
  ASSERT_TRUE(got.finished[0].has_value());
  EXPECT_EQ(got.finished[0]->finish_reason(), "stop");
  EXPECT_EQ(got.finished[0]->canvases(), want.canvases);
}

TEST_F(DenoiseEngineTest, Admission) {
  StartEngine(/*max_batch_canvases=*/1, /*max_queue=*/1);
  const int P = 21;
  auto bad = [&](v1::DenoiseRequest r) {
    return engine_->Submit(std::make_shared<DenoiseJob>(std::move(r))).code();
  };
  v1::DenoiseRequest r = Request("", P, C());
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);  // no id
  r = Request("a", P, 0);
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);
  r = Request("a", P, C());
  r.set_num_samples(kMaxSamplesPerRequest + 1);
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);
  r = Request("a", P, C());
  r.set_first_canvas(2);  // 2 canvases of 16 do not fit in 21 prompt tokens
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);
  r = Request("a", P, C());
  r.add_stop_token_ids(config().vocab_size);
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);
  r = Request("a", P, C());
  r.mutable_sampler()->set_max_denoising_steps(0);
  EXPECT_EQ(bad(r), absl::StatusCode::kInvalidArgument);

  // Two requests fit (max_queue + max_batch_canvases), waiting for KV; a third does not.
  EXPECT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("a", P, C()))), IsOk());
  EXPECT_EQ(bad(Request("a", P, C())), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("b", P, C()))), IsOk());
  EXPECT_EQ(bad(Request("c", P, C())), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->stats().queued, 2);
  engine_->SetDraining(true);
  EXPECT_TRUE(engine_->draining());
  EXPECT_EQ(bad(Request("d", P, C())), absl::StatusCode::kUnavailable);
}

// The gateway prefills before it asks the denoise worker: a request the worker refuses has its KV
// in the receiver already, which nothing would claim before its lease ends (30 s by default),
// holding blocks the admitted requests need. It is freed at once; KV a waiting request with the
// same id expects is not (a duplicate is refused, the first goes on).
TEST_F(DenoiseEngineTest, ARefusedRequestsKvIsFreedAtOnce) {
  StartEngine(/*max_batch_canvases=*/1, /*max_queue=*/1);
  const int P = 21;
  const int full = int(kv::LayerKind::kFull);
  ASSERT_EQ(pool_->stats().used[full], 0);
  // a and b wait for KV: the queue is full.
  ASSERT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("a", P, C()))), IsOk());
  ASSERT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("b", P, C()))), IsOk());
  SendKv("c", Prompt());  // 21 tokens: 2 full-attention blocks of 16
  EXPECT_EQ(pool_->stats().used[full], 2);
  EXPECT_EQ(engine_->Submit(std::make_shared<DenoiseJob>(Request("c", P, C()))).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_->stats().used[full], 0);
  SendKv("d", Prompt());  // a bad request's KV too
  EXPECT_EQ(engine_->Submit(std::make_shared<DenoiseJob>(Request("d", P, 0))).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->stats().used[full], 0);
  // A duplicate of a waiting request (refused for the full queue first): a's KV, when it comes,
  // still goes to a, which completes.
  EXPECT_EQ(engine_->Submit(std::make_shared<DenoiseJob>(Request("a", P, C()))).code(),
            absl::StatusCode::kResourceExhausted);
  engine_->Cancel("b");
  EXPECT_EQ(engine_->Submit(std::make_shared<DenoiseJob>(Request("a", P, C()))).code(),
            absl::StatusCode::kAlreadyExists);
  SendKv("a", Prompt());
}

TEST_F(DenoiseEngineTest, PromptLargerThanThePoolIsOutOfRange) {
  // A pool of 1 MiB: its full-attention blocks hold fewer tokens than the context limit.
  auto small = CreateKvPool(config(), "tiny", 1, 16);
  ASSERT_THAT(small.status(), IsOk());
  kv::UnregisterInProcessReceiver(target_);
  receiver_.reset();
  pool_ = *std::move(small);
  receiver_ = std::make_unique<kv::KvReceiver>(pool_.get(), config().max_position_embeddings);
  kv::RegisterInProcessReceiver(target_, receiver_.get());
  const int64_t full_tokens = pool_->stats().total[int(kv::LayerKind::kFull)] * 16;
  ASSERT_GT(full_tokens, 0);
  ASSERT_LT(full_tokens + 1 + C(), config().max_position_embeddings);
  StartEngine();
  const absl::Status s =
      engine_->Submit(std::make_shared<DenoiseJob>(Request("too-big", int(full_tokens) + 1, C())));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("KV pool holds"), std::string::npos) << s;
  EXPECT_EQ(engine_->stats().queued, 0);
  // A prompt the pool holds, but whose committed canvases at max_new_tokens it cannot: one
  // block more than the pool once full_tokens / C canvases are committed after 1 prompt token.
  ASSERT_EQ(full_tokens % C(), 0);
  const absl::Status commits =
      engine_->Submit(std::make_shared<DenoiseJob>(Request("long", 1, int(full_tokens) + C())));
  EXPECT_EQ(commits.code(), absl::StatusCode::kOutOfRange) << commits;
  EXPECT_NE(commits.message().find("max_new_tokens"), std::string::npos) << commits;
  // Four samples of a prompt with a partial last block: each further sample copies it (Fork).
  const int total = int(full_tokens / 16);
  v1::DenoiseRequest forks = Request("forks", (total - 3) * 16 + 1, C());
  forks.set_num_samples(4);
  const absl::Status samples = engine_->Submit(std::make_shared<DenoiseJob>(forks));
  EXPECT_EQ(samples.code(), absl::StatusCode::kOutOfRange) << samples;
  EXPECT_NE(samples.message().find("num_samples"), std::string::npos) << samples;
  EXPECT_EQ(engine_->stats().queued, 0);
  // The largest prompt the pool holds is admitted (it waits for its KV), and so are the four
  // samples of a prompt of whole blocks, and the longest completion that fits.
  EXPECT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("fits", int(full_tokens), C()))),
              IsOk());
  forks.set_request_id("forks-whole");
  forks.set_prompt_tokens((total - 3) * 16);
  EXPECT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(forks)), IsOk());
  EXPECT_THAT(
      engine_->Submit(std::make_shared<DenoiseJob>(Request("longest", 1, int(full_tokens)))),
      IsOk());
  EXPECT_EQ(engine_->stats().queued, 3);
}

TEST_F(DenoiseEngineTest, CancelWhileWaitingForKv) {
  StartEngine();
  auto a = std::make_shared<DenoiseJob>(Request("a", 21, C()));
  auto b = std::make_shared<DenoiseJob>(Request("b", 21, C()));
  ASSERT_THAT(engine_->Submit(a), IsOk());
  ASSERT_THAT(engine_->Submit(b), IsOk());
  EXPECT_TRUE(engine_->Cancel("a"));
  EXPECT_TRUE(engine_->Cancel("b", absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(engine_->Cancel("nobody"));
  const JobEvents ga = Collect(*a), gb = Collect(*b);
  EXPECT_EQ(ga.final.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(ga.final.message(), "request a cancelled");
  EXPECT_EQ(gb.final.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(gb.final.message(), "request b: deadline exceeded");
  EXPECT_TRUE(ga.blocks[0].empty());
  EXPECT_EQ(engine_->stats().queued, 0);
  // The id is free again.
  EXPECT_THAT(engine_->Submit(std::make_shared<DenoiseJob>(Request("a", 21, C()))), IsOk());
}

TEST_F(DenoiseEngineTest, CancelWhileRunningFreesTheBatchSlot) {
  StartEngine();
  const std::vector<int32_t> prompt = Prompt();
  // Many canvases of 48 steps that never stop early: still running when cancelled.
  v1::DenoiseRequest r = Request("long", int(prompt.size()), 40 * C());
  r.mutable_sampler()->set_max_denoising_steps(48);
  r.mutable_sampler()->set_confidence_threshold(1e-30f);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("long", prompt);
  v1::DenoiseEvent ev;
  std::optional<absl::Status> final;
  ASSERT_TRUE(job->Pop(&ev, &final, absl::Seconds(60)));  // it runs
  EXPECT_TRUE(ev.has_step());
  EXPECT_TRUE(engine_->Cancel("long"));
  const JobEvents got = Collect(*job);
  EXPECT_EQ(got.final.code(), absl::StatusCode::kCancelled);
  EXPECT_LT(got.blocks[0].size(), 40u);
  // The engine thread lets it go at its next iteration.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (engine_->stats().active_canvases > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(engine_->stats().active_canvases, 0);
  EXPECT_EQ(engine_->stats().active_requests, 0);
}

TEST_F(DenoiseEngineTest, KvThatNeverArrivesFailsAtTheDeadline) {
  StartEngine();
  v1::DenoiseRequest r = Request("late", 21, C());
  r.set_kv_wait_ms(100);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  const JobEvents got = Collect(*job);
  EXPECT_EQ(got.final.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(got.final.message().find("did not arrive in time"), absl::string_view::npos)
      << got.final;
}

// Issue 36 item 3: a caller's kv_wait_ms was never clamped (a Denoise call could hold its queue
// place for as long as it asked); it is at most the KV lease bound now.
TEST_F(DenoiseEngineTest, KvWaitIsClampedToTheLeaseBound) {
  StartEngine(16, 256, /*max_kv_wait_ms=*/200);
  v1::DenoiseRequest r = Request("forever", 21, C());
  r.set_kv_wait_ms(int64_t{1} << 50);
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  const JobEvents got = Collect(*job);  // bounded: 120 s
  EXPECT_EQ(got.final.code(), absl::StatusCode::kDeadlineExceeded) << got.final;
}

// Calls waiting for their KV count in dgserve_denoise_queue_depth (272 such calls filled the
// queue while the gauge read 0: it was set only by the engine thread's loop).
TEST_F(DenoiseEngineTest, RequestsWaitingForKvAreInTheQueueGauge) {
  StartEngine(16, 256, 60000, &metrics_);
  std::vector<std::shared_ptr<DenoiseJob>> jobs;
  for (const char* id : {"q1", "q2", "q3"}) {
    jobs.push_back(std::make_shared<DenoiseJob>(Request(id, 21, C())));
    ASSERT_THAT(engine_->Submit(jobs.back()), IsOk());
  }
  EXPECT_EQ(metrics_.queue_depth.Value(), 3);
  EXPECT_EQ(engine_->stats().queued, 3);
  EXPECT_TRUE(engine_->Cancel("q1"));
  EXPECT_EQ(metrics_.queue_depth.Value(), 2);
  // One's KV arrives: it leaves the KV wait and runs; the gauge follows it out.
  SendKv("q2", Prompt());
  const JobEvents got = Collect(*jobs[1]);
  EXPECT_THAT(got.final, IsOk());
  EXPECT_EQ(metrics_.queue_depth.Value(), 1);
  EXPECT_TRUE(engine_->Cancel("q3"));
  EXPECT_EQ(metrics_.queue_depth.Value(), 0);
}

TEST_F(DenoiseEngineTest, KvOfAnotherLengthFailsTheRequest) {
  StartEngine();
  const std::vector<int32_t> prompt = Prompt();
  auto job = std::make_shared<DenoiseJob>(Request("short", int(prompt.size()) + 1, C()));
  ASSERT_THAT(engine_->Submit(job), IsOk());
  SendKv("short", prompt);
  const JobEvents got = Collect(*job);
  EXPECT_EQ(got.final.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(got.final.message().find("covers 21 tokens, the request says 22"),
            absl::string_view::npos)
      << got.final;
}

}  // namespace
}  // namespace dgserve
