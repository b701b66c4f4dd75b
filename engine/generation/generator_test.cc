// The generation loop's self-conditioning control (SamplerParams::self_conditioning): with it off,
// every step's decoder pass is the step-0 pass (no SC input, spec §3.5 steps 2–3 with soft = 0);
// with it on (the default), steps ≥ 1 take the previous step's tempered probabilities. Checked on
// the tiny-v512 golden shape with random weights, through a backend that records each step's
// decoder inputs and logits.
#include "engine/generation/generator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/forwarding_backend_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;

// What the generator fed one fused denoising step, and the logits of that decoder pass.
struct RecordedStep {
  std::vector<int32_t> canvas;
  bool has_sc = false;            // a self-conditioning input was passed
  bool computes_next_sc = false;  // the step was asked for the next step's SC input
  std::vector<float> logits;      // [C, V] Decode() of the same inputs, before the step
  std::vector<int32_t> argmax;    // [C] the fused step's argmax per position
};

// Forwards everything to `inner`; each DenoiseStep call is recorded, including the logits of an
// unfused Decode() over the very same inputs (canvas, SC input, KV), run just before it.
class RecordingBackend final : public ::dgserve::testing::ForwardingBackend {
 public:
  explicit RecordingBackend(ModelBackend& inner) : ForwardingBackend(inner) {}

  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override {
    const size_t first = steps.size();
    for (const DenoiseStepInput& in : batch) {
      RecordedStep s;
      s.canvas.assign(in.canvas.begin(), in.canvas.end());
      s.has_sc = in.sc_soft != nullptr;
      s.computes_next_sc = in.next_soft != nullptr;
      s.logits.resize(in.canvas.size() * size_t(config().vocab_size));
      DecodeInput d{in.canvas, in.sc_soft, in.kv, s.logits.data()};
      if (absl::Status st = inner().Decode({&d, 1}); !st.ok()) return st;
      steps.push_back(std::move(s));
    }
    if (absl::Status st = inner().DenoiseStep(batch); !st.ok()) return st;
    for (size_t i = 0; i < batch.size(); ++i) {
      for (size_t j = 0; j < batch[i].canvas.size(); ++j) {
        steps[first + i].argmax.push_back(batch[i].rows[j].argmax);
      }
    }
    return absl::OkStatus();
  }

  std::vector<RecordedStep> steps;
};

class SelfConditioningTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("generator_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }

  const ModelConfig& config() const { return checkpoint_->config; }

  // One canvas, 4 steps that all run (a confidence threshold no mean entropy gets below).
  GenerationRequest Request(bool self_conditioning) const {
    GenerationRequest r = DefaultRequest(checkpoint_->generation);
    for (int i = 0; i < 9; ++i) r.prompt.push_back((i * 37 + 11) % config().vocab_size);
    r.max_new_tokens = config().canvas_length;
    r.sampler.max_denoising_steps = 4;
    r.sampler.confidence_threshold = 1e-30f;
    r.stop_token_ids = {};
    r.seed = 5;
    r.sampler.self_conditioning = self_conditioning;
    return r;
  }

  // The recorded steps of one generation.
  std::vector<RecordedStep> Run(const GenerationRequest& r) const {
    auto cpu = CreateCpuBackend(checkpoint_->config, checkpoint_->weights);
    RecordingBackend rec(*cpu);
    Generator gen(rec);
    auto res = gen.Generate(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return std::move(rec.steps);
  }

  // A fresh SC-free decoder pass (DecodeInput::sc_soft = nullptr, as at step 0) over `canvas`,
  // on a new KV cache holding the prompt encoded the way the generator encodes it.
  std::vector<float> FreshScFreeLogits(const GenerationRequest& r,
                                       const std::vector<int32_t>& canvas) const {
    auto cpu = CreateCpuBackend(checkpoint_->config, checkpoint_->weights);
    ContiguousKvCache kv(config(), int(r.prompt.size()) + config().canvas_length);
    EncodeInput enc{r.prompt, &kv};
    EXPECT_THAT(cpu->Encode({&enc, 1}), IsOk());
    std::vector<float> logits(canvas.size() * size_t(config().vocab_size));
    DecodeInput d{canvas, nullptr, &kv, logits.data()};
    EXPECT_THAT(cpu->Decode({&d, 1}), IsOk());
    return logits;
  }

  static Checkpoint* checkpoint_;
};
Checkpoint* SelfConditioningTest::checkpoint_ = nullptr;

TEST_F(SelfConditioningTest, DefaultIsOn) {
  EXPECT_TRUE(SamplerParams{}.self_conditioning);
  EXPECT_TRUE(DefaultRequest(checkpoint_->generation).sampler.self_conditioning);
}

TEST_F(SelfConditioningTest, OffFeedsNoSelfConditioningAtAnyStep) {
  const std::vector<RecordedStep> on = Run(Request(true));
  const std::vector<RecordedStep> off = Run(Request(false));
  ASSERT_EQ(on.size(), 4u);
  ASSERT_EQ(off.size(), 4u);
  for (size_t s = 0; s < off.size(); ++s) {
    EXPECT_FALSE(off[s].has_sc) << "step " << s;
    EXPECT_FALSE(off[s].computes_next_sc) << "step " << s;  // nothing to compute it for
    EXPECT_EQ(on[s].has_sc, s > 0) << "step " << s;
    EXPECT_EQ(on[s].computes_next_sc, s + 1 < on.size()) << "step " << s;
  }
}

TEST_F(SelfConditioningTest, OffStepLogitsEqualAFreshScFreePass) {
  const GenerationRequest r_on = Request(true), r_off = Request(false);
  const std::vector<RecordedStep> on = Run(r_on);
  const std::vector<RecordedStep> off = Run(r_off);
  ASSERT_GE(on.size(), 3u);
  ASSERT_GE(off.size(), 3u);
  const int V = config().vocab_size;

  // Step 0 is the same pass either way: same initial canvas, no SC input.
  EXPECT_EQ(on[0].canvas, off[0].canvas);
  EXPECT_EQ(on[0].logits, off[0].logits);

  // Off: step 2's logits are, bit for bit, a fresh SC-free decoder pass over step 2's canvas, and
  // the fused step sampled from them (its argmax is theirs).
  const std::vector<float> fresh = FreshScFreeLogits(r_off, off[2].canvas);
  EXPECT_EQ(off[2].logits, fresh);
  ASSERT_EQ(off[2].argmax.size(), off[2].canvas.size());
  for (size_t j = 0; j < off[2].canvas.size(); ++j) {
    const float* row = fresh.data() + j * size_t(V);
    EXPECT_EQ(off[2].argmax[j], int32_t(std::max_element(row, row + V) - row)) << "row " << j;
  }

  // On: step 2's logits differ from the off run's, and from an SC-free pass over the on run's own
  // step-2 canvas (so the equality above is not one that holds whatever the SC input).
  EXPECT_NE(on[2].logits, off[2].logits);
  EXPECT_NE(on[2].logits, FreshScFreeLogits(r_on, on[2].canvas));
}

}  // namespace
}  // namespace dgserve
