// DenoiseEngine on the CUDA backend (label `gpu-emu`: built against engine/cuda/emu's emulation,
// which is the device here; `gpu` against a real one). The engine's backend keeps K/V in its
// device block pool (blocks of 4 positions); the KV arrives through the in-process transport,
// encoded (and synced to the host) by a second CUDA backend, which also runs Generator for the
// expected tokens: the backend is row invariant, so a sample's tokens are Generator's for its
// seed whatever it is batched with.
//   - PoolAtItsBoundRunsTheBatchInParts: kv_pool_max_bytes of 96 KiB (full-layer blocks of
//     1 KiB: 2 layers × K, V × 4 rows × 32 bf16; sliding ones of 4 KiB: 4 layers, float32). Two
//     requests of 120-token prompts and two canvases need 2 × 34 full blocks for their commit and
//     second canvas, and each its sliding blocks (the window and the rows the host still lacks):
//     more than the bound for both, less for each. The engine runs those passes one request at a
//     time (DenoiseStep / Encode answer RESOURCE_EXHAUSTED for both), the backend copying the
//     other request's device-only rows to its cache to free its blocks (swap-out). Both requests
//     give Generator's tokens. A third request of 280 positions (70 full blocks and 2 sliding,
//     78 KiB) fits alone once the two pools give each other the memory of their unheld blocks
//     (compaction), and completes beside a fourth that runs in parts with it.
//   - OneRequestMayTakeTheWholeBound: at 128 KiB, requests one pass of whose sample needs more
//     (a 481-position prompt's steps, a 464-position prompt's commit) are refused at Submit
//     (OUT_OF_RANGE, bytes by hand); a 480-position prompt, exactly the bound, completes with
//     Generator's tokens.
//   - SamplesShareThePromptsDeviceBlocks: two samples of one 120-token prompt (sample 1 a fork
//     of sample 0's cache, whole 16-token host blocks shared): sample 1's device mirror takes the
//     device blocks of the 112 positions in whole host blocks (28 blocks of 4) instead of
//     uploading them; each sample gives Generator's tokens for its seed.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/testing/status_matchers.h"
#include "denoise_worker/denoise_engine.h"
#include "denoise_worker/denoise_engine_testing.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/generation/generator.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transfer.h"
#include "worker/worker_model.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;

class DenoiseEngineCudaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("denoise_engine_cuda_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }

  void SetUp() override {
    auto reference = CreateCudaBackend(config(), checkpoint_->weights, Options());
    if (reference.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << reference.status();
    }
    ASSERT_THAT(reference.status(), IsOk());
    test_backend_ = *std::move(reference);
    auto pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(pool.status(), IsOk());
    pool_ = *std::move(pool);
    auto sender_pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(sender_pool.status(), IsOk());
    sender_pool_ = *std::move(sender_pool);
    receiver_ = std::make_unique<kv::KvReceiver>(pool_.get(), config().max_position_embeddings);
    target_ = "denoise-engine-cuda-test-" +
              std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
    kv::RegisterInProcessReceiver(target_, receiver_.get());
    transport_ = kv::CreateInProcessTransport();
  }
  void TearDown() override {
    engine_.reset();
    if (receiver_ != nullptr) kv::UnregisterInProcessReceiver(target_);
  }

  const ModelConfig& config() const { return checkpoint_->config; }
  int C() const { return config().canvas_length; }
  // Blocks of 4 positions (a few hundred blocks for these prompts); `pool_bytes` bounds them.
  static CudaBackendOptions Options(size_t pool_bytes = 0) {
    CudaBackendOptions o;
    o.kv_block_size = 4;
    o.kv_pool_max_bytes = pool_bytes;
    return o;
  }
  void StartEngine(size_t pool_bytes, bool admit_by_kv_memory = true) {
    auto backend = CreateCudaBackend(config(), checkpoint_->weights, Options(pool_bytes));
    ASSERT_THAT(backend.status(), IsOk());
    backend_ = *std::move(backend);
    DenoiseEngineOptions o;
    o.max_batch_canvases = 16;
    o.admit_by_kv_memory = admit_by_kv_memory;
    o.model_id = "tiny";
    engine_ = std::make_unique<DenoiseEngine>(backend_.get(), pool_.get(), receiver_.get(),
                                              std::move(o), nullptr);
  }

  std::vector<int32_t> Prompt(int n, int salt) const {
    std::vector<int32_t> p;
    for (int i = 0; i < n; ++i) p.push_back((i * 67 + 9 + salt * 31) % config().vocab_size);
    return p;
  }
  // Every canvas takes its 4 steps (no confidence stop), so two requests started one engine
  // iteration apart still step their second canvases side by side.
  v1::DenoiseRequest Request(const std::string& id, int prompt_tokens, int max_new_tokens) const {
    v1::DenoiseRequest r =
        denoise_testing::Request(checkpoint_->generation, id, prompt_tokens, max_new_tokens,
                                 /*max_denoising_steps=*/4, /*canvas_step_interval=*/0);
    r.mutable_sampler()->set_confidence_threshold(1e-30f);
    return r;
  }
  // The request's tokens through Generator on the reference backend, with seed `seed`.
  std::vector<int32_t> Generate(const std::vector<int32_t>& prompt, const v1::DenoiseRequest& r,
                                uint64_t seed) {
    GenerationRequest g = DefaultRequest(checkpoint_->generation);
    g.prompt = prompt;
    g.max_new_tokens = r.max_new_tokens();
    g.seed = seed;
    g.sampler.max_denoising_steps = r.sampler().max_denoising_steps();
    g.sampler.confidence_threshold = r.sampler().confidence_threshold();
    g.pad_token_id = r.pad_token_id();
    Generator gen(*test_backend_);
    absl::StatusOr<GenerationResult> res = gen.Generate(g);
    EXPECT_THAT(res.status(), IsOk());
    return res.ok() ? res->tokens : std::vector<int32_t>{};
  }
  // Encodes `prompt` on the reference backend, syncs it to the host (as the prefill worker does
  // before it ships) and sends it to the receiver as request `id`.
  void SendKv(const std::string& id, const std::vector<int32_t>& prompt) {
    ASSERT_THAT(denoise_testing::SendPromptKv(*test_backend_, sender_pool_.get(), *transport_,
                                              target_, id, prompt),
                IsOk());
  }
  // The job's events until it ends (at most 300 s: the emulation is slow).
  static denoise_testing::JobEvents Collect(DenoiseJob& job, int samples = 1) {
    return denoise_testing::Collect(job, samples, absl::Seconds(300));
  }

  static inline Checkpoint* checkpoint_ = nullptr;
  std::unique_ptr<ModelBackend> backend_;       // the engine thread's
  std::unique_ptr<ModelBackend> test_backend_;  // this thread's (KV, Generator)
  std::unique_ptr<kv::BlockPool> pool_, sender_pool_;
  std::unique_ptr<kv::KvReceiver> receiver_;
  std::unique_ptr<kv::KvTransport> transport_;
  std::string target_;
  std::unique_ptr<DenoiseEngine> engine_;
};

TEST_F(DenoiseEngineCudaTest, PoolAtItsBoundRunsTheBatchInParts) {
  // Admission by K/V memory off: every request joins the batch (on, b would wait for a).
  ASSERT_NO_FATAL_FAILURE(StartEngine(96 * 1024, /*admit_by_kv_memory=*/false));
  const std::vector<int32_t> pa = Prompt(120, 1), pb = Prompt(120, 2), pc = Prompt(280, 3);
  const v1::DenoiseRequest a = Request("a", 120, 2 * C()), b = Request("b", 120, 2 * C()),
                           c = Request("c", 280, C());
  // Both KVs wait in the receiver: both requests start in the same step.
  ASSERT_NO_FATAL_FAILURE(SendKv("a", pa));
  ASSERT_NO_FATAL_FAILURE(SendKv("b", pb));
  auto ja = std::make_shared<DenoiseJob>(a), jb = std::make_shared<DenoiseJob>(b);
  ASSERT_THAT(engine_->Submit(ja), IsOk());
  ASSERT_THAT(engine_->Submit(jb), IsOk());
  const denoise_testing::JobEvents ga = Collect(*ja), gb = Collect(*jb);
  ASSERT_THAT(ga.final, IsOk());
  ASSERT_THAT(gb.final, IsOk());
  EXPECT_EQ(ga.Tokens(0), Generate(pa, a, a.seed()));
  EXPECT_EQ(gb.Tokens(0), Generate(pb, b, b.seed()));
  const CudaKvPoolStats st = GetCudaKvPoolStats(*backend_).value();
  EXPECT_LE(st.device_bytes, 96 * 1024);  // the bound held
  // Started in the same engine iteration, a and b step and commit together and those passes are
  // refused and run in parts; started one iteration apart (the engine may run between the two
  // Submits), a's commit runs beside b's step and each takes the other's blocks (swap-out).
  // Either way a sequence was swapped out.
  EXPECT_GE(st.swap_outs, 1);
  EXPECT_EQ(engine_->stats().device_step_limit, 0);  // lifted when a sample ended
  // 280 positions alone fit (70 full blocks and 2 sliding, 78 KiB), beside a request that fits.
  ASSERT_NO_FATAL_FAILURE(SendKv("c", pc));
  ASSERT_NO_FATAL_FAILURE(SendKv("a2", pa));
  v1::DenoiseRequest a2 = a;
  a2.set_request_id("a2");
  auto jc = std::make_shared<DenoiseJob>(c), ja2 = std::make_shared<DenoiseJob>(a2);
  ASSERT_THAT(engine_->Submit(jc), IsOk());
  ASSERT_THAT(engine_->Submit(ja2), IsOk());
  const denoise_testing::JobEvents gc = Collect(*jc), ga2 = Collect(*ja2);
  ASSERT_THAT(gc.final, IsOk());
  EXPECT_EQ(gc.Tokens(0), Generate(pc, c, c.seed()));
  ASSERT_THAT(ga2.final, IsOk());
  EXPECT_EQ(ga2.Tokens(0), ga.Tokens(0));
  // c's 70 full blocks beside a2's: their common steps (a2 joins while c has steps left) ran in
  // parts, the pools compacted in turn.
  EXPECT_GE(engine_->stats().passes_in_parts, 1);
  EXPECT_GE(GetCudaKvPoolStats(*backend_)->compactions, 1);
  EXPECT_LE(GetCudaKvPoolStats(*backend_)->device_bytes, 96 * 1024);
}

TEST_F(DenoiseEngineCudaTest, AdmissionWaitsForKvMemory) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(96 * 1024));
  // As above, a and b together need more than the bound for their commits and second canvases;
  // with admission by K/V memory b waits in the queue until a ends (seen held), then runs alone:
  // no pass is refused and nothing is swapped out (both happen whenever the two overlap, as
  // above).
  const std::vector<int32_t> pa = Prompt(120, 1), pb = Prompt(120, 2);
  const v1::DenoiseRequest a = Request("a", 120, 2 * C()), b = Request("b", 120, 2 * C());
  ASSERT_NO_FATAL_FAILURE(SendKv("a", pa));
  ASSERT_NO_FATAL_FAILURE(SendKv("b", pb));
  auto ja = std::make_shared<DenoiseJob>(a), jb = std::make_shared<DenoiseJob>(b);
  ASSERT_THAT(engine_->Submit(ja), IsOk());
  ASSERT_THAT(engine_->Submit(jb), IsOk());
  // b is seen held while a runs (its steps take seconds under the emulation; polled every ms).
  bool held = false;
  for (int i = 0; i < 300000 && !held && !ja->ended(); ++i) {
    held = engine_->stats().held_for_kv_memory == 1;
    if (!held) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(held);
  const denoise_testing::JobEvents ga = Collect(*ja), gb = Collect(*jb);
  ASSERT_THAT(ga.final, IsOk());
  ASSERT_THAT(gb.final, IsOk());
  EXPECT_EQ(ga.Tokens(0), Generate(pa, a, a.seed()));
  EXPECT_EQ(gb.Tokens(0), Generate(pb, b, b.seed()));
  const CudaKvPoolStats st = GetCudaKvPoolStats(*backend_).value();
  EXPECT_LE(st.device_bytes, 96 * 1024);
  EXPECT_EQ(st.swap_outs, 0);
  EXPECT_EQ(engine_->stats().passes_in_parts, 0);
  EXPECT_EQ(engine_->stats().held_for_kv_memory, 0);  // nothing waits now
}

TEST_F(DenoiseEngineCudaTest, OneRequestMayTakeTheWholeBound) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(128 * 1024));
  // A prompt of 481 positions needs, for the steps over it, its 121 full blocks (1 KiB) and the
  // 3 sliding ones (4 KiB) of [474, 481): 136,192 bytes > 131,072. Refused at Submit, naming
  // prompt_tokens whatever max_new_tokens asks. A prompt of 464 fits (116 full blocks and the
  // 2 sliding ones of [457, 464): 126,976), but its commit of a first canvas (464 → 480) holds
  // 120 full blocks and the sliding blocks of [457, 464) (the window its first row reads) and of
  // [464, 480) (the new rows the host lacks: the deferred copy), 6 blocks: 147,456 bytes, so a
  // second canvas is refused, naming max_new_tokens (before, admitted, it failed in the commit).
  for (const auto& [prompt_tokens, new_tokens, field, bytes] :
       {std::tuple{481, C(), "prompt_tokens: ", "481 positions needs 136192 bytes"},
        std::tuple{481, 2 * C(), "prompt_tokens: ", "481 positions needs 136192 bytes"},
        std::tuple{464, 2 * C(), "max_new_tokens: ", "480 positions needs 147456 bytes"}}) {
    auto job = std::make_shared<DenoiseJob>(Request("over", prompt_tokens, new_tokens));
    const absl::Status s = engine_->Submit(job);
    EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
    EXPECT_EQ(s.message().rfind(field, 0), 0u) << s;
    EXPECT_NE(s.message().find(bytes), std::string::npos) << s;
  }
  // 480 positions: 120 full blocks and the 2 sliding ones of [473, 480), the whole bound. The
  // full pool grows to 128 blocks first; the sliding pool's first block comes from its 8 unheld
  // blocks (compacted, nothing moved), the second from the room left.
  const std::vector<int32_t> prompt = Prompt(480, 6);
  const v1::DenoiseRequest r = Request("whole", 480, C());
  ASSERT_NO_FATAL_FAILURE(SendKv("whole", prompt));
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  const denoise_testing::JobEvents got = Collect(*job);
  ASSERT_THAT(got.final, IsOk());
  EXPECT_EQ(got.Tokens(0), Generate(prompt, r, r.seed()));
  const CudaKvPoolStats st = GetCudaKvPoolStats(*backend_).value();
  EXPECT_EQ(st.full_blocks, 120);
  EXPECT_EQ(st.sliding_blocks, 2);
  EXPECT_EQ(st.device_bytes, 128 * 1024);
  EXPECT_EQ(st.compactions, 1);
  EXPECT_EQ(st.blocks_moved, 0);
  EXPECT_EQ(st.swap_outs, 0);
}

TEST_F(DenoiseEngineCudaTest, SamplesShareThePromptsDeviceBlocks) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(0));
  const std::vector<int32_t> prompt = Prompt(120, 4);
  v1::DenoiseRequest r = Request("two", 120, C());
  r.set_num_samples(2);
  ASSERT_NO_FATAL_FAILURE(SendKv("two", prompt));
  auto job = std::make_shared<DenoiseJob>(r);
  ASSERT_THAT(engine_->Submit(job), IsOk());
  const denoise_testing::JobEvents got = Collect(*job, 2);
  ASSERT_THAT(got.final, IsOk());
  EXPECT_EQ(got.Tokens(0), Generate(prompt, r, r.seed()));
  EXPECT_EQ(got.Tokens(1), Generate(prompt, r, r.seed() + 1));
  // Host blocks of 16: positions [0, 112) in whole blocks shared by the fork; 112 … 119 copied.
  EXPECT_EQ(GetCudaKvPoolStats(*backend_)->shared_blocks_taken, 112 / 4);
}

}  // namespace
}  // namespace dgserve
