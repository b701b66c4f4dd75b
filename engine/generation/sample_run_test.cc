// SampleRun, the state machine of one sample's canvases, driven by hand over the real CPU
// backend on the tiny-v512 golden shape with random weights (generator seed 512): its phases and
// their errors, the step input it builds (self-conditioning hand-over), the completion cut and
// the ends of a sample (stop token, max_new_tokens, stop sequence), a resume from a committed
// canvas, and canvases of several runs batched into one pass — each against the same run alone
// or against Generator.
#include "engine/generation/sample_run.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/generator.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using Phase = SampleRun::Phase;

// What a run produced, canvas by canvas.
struct Canvases {
  std::vector<std::vector<int32_t>> tokens;  // finalized, per canvas
  std::vector<int> steps;
  std::vector<int32_t> completion;
  std::string finish_reason;
  bool stop_sequence = false;
};

class SampleRunTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("sample_run_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  void SetUp() override { backend_ = CreateCpuBackend(config(), checkpoint_->weights); }

  const ModelConfig& config() const { return checkpoint_->config; }
  int C() const { return config().canvas_length; }

  std::vector<int32_t> Prompt() const {
    std::vector<int32_t> p;
    for (int i = 0; i < 9; ++i) p.push_back((i * 71 + 13) % config().vocab_size);
    return p;
  }

  SampleSpec Spec(int canvases) const {
    SampleSpec s;
    s.sampler.max_denoising_steps = 5;
    s.seed = 21;
    s.max_new_tokens = canvases * C();
    s.stop_token_ids = {};
    return s;
  }

  // A KV cache holding the prompt (and `committed` canvases after it).
  std::unique_ptr<ContiguousKvCache> Prefilled(const std::vector<int32_t>& committed = {}) {
    auto kv = std::make_unique<ContiguousKvCache>(config(), 1024);
    const std::vector<int32_t> prompt = Prompt();
    EncodeInput in{prompt, kv.get()};
    EXPECT_THAT(backend_->Encode({&in, 1}), IsOk());
    if (!committed.empty()) {
      EncodeInput c{committed, kv.get()};
      EXPECT_THAT(backend_->Encode({&c, 1}), IsOk());
    }
    return kv;
  }

  // Drives `run` to its end alone over `kv`.
  Canvases Drive(SampleRun& run, KvCache& kv) {
    Canvases out;
    while (run.phase() != Phase::kFinished) {
      if (run.phase() == Phase::kCommit) {
        EncodeInput in{run.to_commit(), &kv};
        EXPECT_THAT(backend_->Encode({&in, 1}), IsOk());
        EXPECT_THAT(run.CommitDone(), IsOk());
      }
      EXPECT_THAT(run.StartCanvas(), IsOk());
      while (run.phase() == Phase::kDenoising) {
        absl::StatusOr<DenoiseStepInput> in = run.StepInput(kv);
        EXPECT_THAT(in.status(), IsOk());
        if (!in.ok()) return out;
        EXPECT_THAT(backend_->DenoiseStep({&*in, 1}), IsOk());
        EXPECT_THAT(run.ApplyStep().status(), IsOk());
      }
      absl::StatusOr<FinishedCanvas> f = run.FinishCanvas();
      EXPECT_THAT(f.status(), IsOk());
      if (!f.ok()) return out;
      out.tokens.emplace_back(f->tokens.begin(), f->tokens.end());
      out.steps.push_back(f->steps);
      out.stop_sequence = out.stop_sequence || f->stop_sequence;
    }
    out.completion = run.completion();
    out.finish_reason = std::string(run.finish_reason());
    return out;
  }

  Canvases DriveFresh(SampleSpec spec) {
    absl::StatusOr<SampleRun> run = SampleRun::Create(config(), std::move(spec));
    EXPECT_THAT(run.status(), IsOk());
    if (!run.ok()) return {};
    auto kv = Prefilled();
    return Drive(*run, *kv);
  }

  static Checkpoint* checkpoint_;
  std::unique_ptr<ModelBackend> backend_;
};
Checkpoint* SampleRunTest::checkpoint_ = nullptr;

TEST_F(SampleRunTest, PhasesAndStepInputs) {
  SampleSpec spec = Spec(2);
  spec.sampler.confidence_threshold = 1e-30f;  // the stop rule never fires: 5 steps a canvas
  absl::StatusOr<SampleRun> run = SampleRun::Create(config(), spec);
  ASSERT_THAT(run.status(), IsOk());
  auto kv = Prefilled();
  EXPECT_EQ(run->phase(), Phase::kStartCanvas);
  EXPECT_EQ(run->canvas(), 0);
  // Calls out of phase are refused and change nothing.
  EXPECT_EQ(run->StepInput(*kv).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(run->ApplyStep().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(run->FinishCanvas().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(run->CommitDone().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(run->to_commit().empty());
  EXPECT_EQ(run->phase(), Phase::kStartCanvas);

  ASSERT_THAT(run->StartCanvas(), IsOk());
  EXPECT_EQ(run->phase(), Phase::kDenoising);
  EXPECT_EQ(run->StartCanvas().code(), absl::StatusCode::kFailedPrecondition);
  const float* previous_next_soft = nullptr;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    ASSERT_EQ(run->phase(), Phase::kDenoising);
    absl::StatusOr<DenoiseStepInput> in = run->StepInput(*kv);
    ASSERT_THAT(in.status(), IsOk());
    EXPECT_EQ(int(in->canvas.size()), C());
    EXPECT_EQ(in->kv, kv.get());
    EXPECT_EQ(in->temperature, StepTemperature(spec.sampler, step));
    EXPECT_EQ(int(in->uniforms.size()), C());
    EXPECT_NE(in->rows, nullptr);
    EXPECT_TRUE(in->row_masks.empty());
    // Step 0 has no self-conditioning input; step s > 0 reads what step s − 1 wrote; the last
    // step writes none.
    if (step == 0) {
      EXPECT_EQ(in->sc_soft, nullptr);
      EXPECT_FALSE(in->sparse_sc);
    } else {
      EXPECT_EQ(in->sc_soft, previous_next_soft);
    }
    if (step == 4) {
      EXPECT_EQ(in->next_soft, nullptr);
    } else {
      EXPECT_NE(in->next_soft, nullptr);
      EXPECT_NE(in->next_soft, in->sc_soft);
    }
    previous_next_soft = in->next_soft;
    ASSERT_THAT(backend_->DenoiseStep({&*in, 1}), IsOk());
    absl::StatusOr<StepOutcome> out = run->ApplyStep();
    ASSERT_THAT(out.status(), IsOk());
    EXPECT_EQ(out->step, step);
    EXPECT_EQ(run->total_steps(), step + 1);
    // argmax() is the step's argmax canvas, which the backend wrote into the rows.
    for (int j = 0; j < C(); ++j) EXPECT_EQ(run->argmax()[j], in->rows[j].argmax);
  }
  EXPECT_EQ(run->phase(), Phase::kCanvasDone);
  const std::vector<int32_t> argmax(run->argmax().begin(), run->argmax().end());
  absl::StatusOr<FinishedCanvas> f = run->FinishCanvas();
  ASSERT_THAT(f.status(), IsOk());
  EXPECT_EQ(f->index, 0);
  EXPECT_EQ(f->steps, 5);
  EXPECT_FALSE(f->stopped_early);
  EXPECT_FALSE(f->stop_token);
  EXPECT_FALSE(f->last);
  EXPECT_EQ(std::vector<int32_t>(f->tokens.begin(), f->tokens.end()), argmax);
  EXPECT_EQ(std::vector<int32_t>(f->completion.begin(), f->completion.end()), argmax);
  EXPECT_EQ(run->phase(), Phase::kCommit);
  EXPECT_EQ(run->canvas(), 1);
  EXPECT_EQ(std::vector<int32_t>(run->to_commit().begin(), run->to_commit().end()), argmax);
  EXPECT_TRUE(run->argmax().empty());
  ASSERT_THAT(run->CommitDone(), IsOk());
  EXPECT_EQ(run->phase(), Phase::kStartCanvas);
}

TEST_F(SampleRunTest, SelfConditioningOffPassesNoSoftEmbedding) {
  SampleSpec spec = Spec(1);
  spec.sampler.confidence_threshold = 1e-30f;
  spec.sampler.self_conditioning = false;
  absl::StatusOr<SampleRun> run = SampleRun::Create(config(), spec);
  ASSERT_THAT(run.status(), IsOk());
  auto kv = Prefilled();
  ASSERT_THAT(run->StartCanvas(), IsOk());
  int steps = 0;
  while (run->phase() == Phase::kDenoising) {
    absl::StatusOr<DenoiseStepInput> in = run->StepInput(*kv);
    ASSERT_THAT(in.status(), IsOk());
    EXPECT_EQ(in->sc_soft, nullptr) << "step " << steps;
    EXPECT_EQ(in->next_soft, nullptr) << "step " << steps;
    ASSERT_THAT(backend_->DenoiseStep({&*in, 1}), IsOk());
    ASSERT_THAT(run->ApplyStep().status(), IsOk());
    ++steps;
  }
  EXPECT_EQ(steps, 5);
}

TEST_F(SampleRunTest, SameTokensAsGenerator) {
  GenerationRequest r = DefaultRequest(checkpoint_->generation);
  r.prompt = Prompt();
  r.max_new_tokens = 3 * C() - 5;
  r.seed = 21;
  r.sampler.max_denoising_steps = 5;
  r.stop_token_ids = {};
  Generator gen(*backend_);
  absl::StatusOr<GenerationResult> want = gen.Generate(r);
  ASSERT_THAT(want.status(), IsOk());

  SampleSpec spec = Spec(3);
  spec.sampler = r.sampler;
  spec.max_new_tokens = r.max_new_tokens;
  spec.pad_token_id = r.pad_token_id;
  const Canvases got = DriveFresh(spec);
  ASSERT_EQ(got.tokens.size(), 3u);
  std::vector<int32_t> all;
  for (const auto& t : got.tokens) all.insert(all.end(), t.begin(), t.end());
  EXPECT_EQ(all, want->tokens);
  EXPECT_EQ(got.steps, want->steps_per_canvas);
  // The completion stops 5 tokens short of the last canvas: max_new_tokens.
  EXPECT_EQ(int(got.completion.size()), 3 * C() - 5);
  EXPECT_EQ(got.completion, std::vector<int32_t>(all.begin(), all.end() - 5));
  EXPECT_EQ(got.completion, want->completion);
  EXPECT_EQ(got.finish_reason, "length");
  EXPECT_EQ(want->finish_reason, "length");
}

TEST_F(SampleRunTest, StopTokenEndsTheSampleAndCutsTheCompletion) {
  const Canvases free_run = DriveFresh(Spec(3));
  ASSERT_EQ(free_run.tokens.size(), 3u);
  // Make the token at position 5 of canvas 1 a stop token (its first occurrence in canvas 1 is
  // where the cut falls, unless canvas 0 holds it too: then the run ends there).
  const int32_t stop = free_run.tokens[1][5];
  SampleSpec spec = Spec(3);
  spec.stop_token_ids = {stop};
  spec.pad_token_id = 0;
  const Canvases got = DriveFresh(spec);
  std::vector<int32_t> generated;
  for (const auto& t : free_run.tokens) generated.insert(generated.end(), t.begin(), t.end());
  const size_t first = std::find(generated.begin(), generated.end(), stop) - generated.begin();
  ASSERT_LE(first, size_t(C() + 5));
  const size_t stop_canvas = first / C();
  EXPECT_EQ(got.tokens.size(), stop_canvas + 1);  // no canvas after the stop token
  EXPECT_EQ(got.finish_reason, "stop");
  EXPECT_EQ(got.completion, std::vector<int32_t>(generated.begin(), generated.begin() + first));
  // The canvas holding it keeps it and is padded after it.
  const std::vector<int32_t>& last = got.tokens.back();
  EXPECT_EQ(last[first % C()], stop);
  for (size_t j = first % C() + 1; j < size_t(C()); ++j) EXPECT_EQ(last[j], 0) << j;
  // Canvases before it are as in the free run (stop ids do not change the draws).
  for (size_t n = 0; n < stop_canvas; ++n) EXPECT_EQ(got.tokens[n], free_run.tokens[n]);
}

TEST_F(SampleRunTest, ResumeFromACommittedCanvasGivesTheSameNextCanvas) {
  const Canvases whole = DriveFresh(Spec(2));
  ASSERT_EQ(whole.tokens.size(), 2u);
  // No stop ids: the finalized canvas 0 is the raw one the KV committed.
  SampleSpec spec = Spec(1);
  spec.first_canvas = 1;
  absl::StatusOr<SampleRun> run = SampleRun::Create(config(), spec);
  ASSERT_THAT(run.status(), IsOk());
  EXPECT_EQ(run->canvas(), 1);
  auto kv = Prefilled(whole.tokens[0]);
  const Canvases resumed = Drive(*run, *kv);
  ASSERT_EQ(resumed.tokens.size(), 1u);
  EXPECT_EQ(resumed.tokens[0], whole.tokens[1]);
  EXPECT_EQ(resumed.steps[0], whole.steps[1]);
  EXPECT_EQ(run->canvas(), 2);
}

TEST_F(SampleRunTest, BatchedRunsGiveTheTokensOfEachAlone) {
  // Two samples of different seeds and step budgets, stepped in one batched pass while both
  // denoise; the one that ends first commits while the other still steps.
  SampleSpec a = Spec(2), b = Spec(2);
  b.seed = 22;
  b.sampler.max_denoising_steps = 3;
  const Canvases alone_a = DriveFresh(a), alone_b = DriveFresh(b);

  absl::StatusOr<SampleRun> ra = SampleRun::Create(config(), a);
  absl::StatusOr<SampleRun> rb = SampleRun::Create(config(), b);
  ASSERT_THAT(ra.status(), IsOk());
  ASSERT_THAT(rb.status(), IsOk());
  auto kva = Prefilled(), kvb = Prefilled();
  SampleRun* runs[2] = {&*ra, &*rb};
  KvCache* kvs[2] = {kva.get(), kvb.get()};
  Canvases got[2];
  int iterations = 0;
  while (ra->phase() != Phase::kFinished || rb->phase() != Phase::kFinished) {
    ASSERT_LT(++iterations, 100);
    std::vector<EncodeInput> commits;
    for (int i = 0; i < 2; ++i) {
      if (runs[i]->phase() == Phase::kCommit) commits.push_back({runs[i]->to_commit(), kvs[i]});
    }
    if (!commits.empty()) ASSERT_THAT(backend_->Encode(commits), IsOk());
    for (int i = 0; i < 2; ++i) {
      if (runs[i]->phase() == Phase::kCommit) ASSERT_THAT(runs[i]->CommitDone(), IsOk());
      if (runs[i]->phase() == Phase::kStartCanvas) ASSERT_THAT(runs[i]->StartCanvas(), IsOk());
    }
    std::vector<DenoiseStepInput> batch;
    std::vector<SampleRun*> stepping;
    for (int i = 0; i < 2; ++i) {
      if (runs[i]->phase() != Phase::kDenoising) continue;
      absl::StatusOr<DenoiseStepInput> in = runs[i]->StepInput(*kvs[i]);
      ASSERT_THAT(in.status(), IsOk());
      batch.push_back(*in);
      stepping.push_back(runs[i]);
    }
    if (!batch.empty()) ASSERT_THAT(backend_->DenoiseStep(batch), IsOk());
    for (SampleRun* r : stepping) ASSERT_THAT(r->ApplyStep().status(), IsOk());
    for (int i = 0; i < 2; ++i) {
      if (runs[i]->phase() != Phase::kCanvasDone) continue;
      absl::StatusOr<FinishedCanvas> f = runs[i]->FinishCanvas();
      ASSERT_THAT(f.status(), IsOk());
      got[i].tokens.emplace_back(f->tokens.begin(), f->tokens.end());
      got[i].steps.push_back(f->steps);
    }
  }
  EXPECT_EQ(got[0].tokens, alone_a.tokens);
  EXPECT_EQ(got[0].steps, alone_a.steps);
  EXPECT_EQ(got[1].tokens, alone_b.tokens);
  EXPECT_EQ(got[1].steps, alone_b.steps);
  EXPECT_NE(alone_a.tokens, alone_b.tokens);
}

TEST_F(SampleRunTest, TemplateWithoutHolesIsFinishedWithoutAPass) {
  std::vector<int32_t> ids(C());
  for (int j = 0; j < C(); ++j) ids[j] = (j * 37 + 200) % config().vocab_size;
  auto t = CanvasTemplate::Create(ids, {}, C(), config().vocab_size);
  ASSERT_THAT(t.status(), IsOk());
  SampleSpec spec = Spec(2);
  spec.canvas_template = *t;
  absl::StatusOr<SampleRun> run = SampleRun::Create(config(), spec);
  ASSERT_THAT(run.status(), IsOk());
  ASSERT_THAT(run->StartCanvas(), IsOk());
  EXPECT_EQ(run->phase(), Phase::kCanvasDone);
  absl::StatusOr<FinishedCanvas> f = run->FinishCanvas();
  ASSERT_THAT(f.status(), IsOk());
  EXPECT_EQ(std::vector<int32_t>(f->tokens.begin(), f->tokens.end()), ids);
  EXPECT_EQ(f->steps, 0);
  EXPECT_EQ(f->mean_entropy, 0.0f);
  EXPECT_EQ(run->total_steps(), 0);
  // The second canvas is not clamped (template_every_canvas is off): it denoises.
  ASSERT_THAT(run->CommitDone(), IsOk());
  ASSERT_THAT(run->StartCanvas(), IsOk());
  EXPECT_EQ(run->phase(), Phase::kDenoising);
}

TEST_F(SampleRunTest, StopSequenceEndsTheSampleAtItsCanvas) {
  absl::StatusOr<Tokenizer> tok =
      Tokenizer::Load(::dgserve::testing::GoldenDir() + "/tiny-v512/tokenizer.json");
  ASSERT_THAT(tok.status(), IsOk());
  const Canvases free_run = DriveFresh(Spec(3));
  ASSERT_EQ(free_run.tokens.size(), 3u);
  // The text of canvas 1 ends a stop sequence that begins in canvas 0's text.
  StreamDecoder dec(*tok);
  const std::string text0 = dec.Push(free_run.tokens[0]);
  const std::string text1 = dec.Push(free_run.tokens[1]);
  ASSERT_FALSE(text0.empty());
  ASSERT_FALSE(text1.empty());
  const std::string stop = text0.substr(text0.size() - 1) + text1;
  ASSERT_EQ((text0 + text1).find(stop), text0.size() - 1) << "pick another seed";

  SampleSpec spec = Spec(3);
  spec.tokenizer = &*tok;
  spec.stop_sequences = {stop};
  const Canvases got = DriveFresh(spec);
  EXPECT_TRUE(got.stop_sequence);
  ASSERT_EQ(got.tokens.size(), 2u);  // canvas 2 never runs
  EXPECT_EQ(got.tokens[1], free_run.tokens[1]);
  EXPECT_EQ(got.finish_reason, "stop");
  // The completion keeps the canvas's tokens whole: cutting the text is the gateway's.
  EXPECT_EQ(int(got.completion.size()), 2 * C());

  // A resume at canvas 1 that is told the completion before it matches the same sequence.
  SampleSpec resumed = Spec(2);
  resumed.first_canvas = 1;
  resumed.tokenizer = &*tok;
  resumed.stop_sequences = {stop};
  resumed.completion_before = free_run.tokens[0];
  absl::StatusOr<SampleRun> run = SampleRun::Create(config(), resumed);
  ASSERT_THAT(run.status(), IsOk());
  auto kv = Prefilled(free_run.tokens[0]);
  const Canvases got_resumed = Drive(*run, *kv);
  EXPECT_TRUE(got_resumed.stop_sequence);
  EXPECT_EQ(got_resumed.tokens.size(), 1u);
  EXPECT_EQ(got_resumed.finish_reason, "stop");
  // Without completion_before the sequence is not found in canvas 1's text alone.
  resumed.completion_before.clear();
  absl::StatusOr<SampleRun> blind = SampleRun::Create(config(), resumed);
  ASSERT_THAT(blind.status(), IsOk());
  auto kv2 = Prefilled(free_run.tokens[0]);
  const Canvases got_blind = Drive(*blind, *kv2);
  EXPECT_FALSE(got_blind.stop_sequence);
  EXPECT_EQ(got_blind.tokens.size(), 2u);
  EXPECT_EQ(got_blind.finish_reason, "length");
}

TEST_F(SampleRunTest, CreateRefusesBadSpecs) {
  SampleSpec s = Spec(1);
  s.max_new_tokens = 0;
  EXPECT_EQ(SampleRun::Create(config(), s).status().code(), absl::StatusCode::kInvalidArgument);
  s = Spec(1);
  s.first_canvas = -1;
  EXPECT_EQ(SampleRun::Create(config(), s).status().code(), absl::StatusCode::kInvalidArgument);
  s = Spec(1);
  s.stop_token_ids = {config().vocab_size};
  EXPECT_EQ(SampleRun::Create(config(), s).status().code(), absl::StatusCode::kInvalidArgument);
  s = Spec(1);
  s.pad_token_id = -1;
  EXPECT_EQ(SampleRun::Create(config(), s).status().code(), absl::StatusCode::kInvalidArgument);
  s = Spec(1);
  s.sampler.max_denoising_steps = 0;
  EXPECT_EQ(SampleRun::Create(config(), s).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dgserve
