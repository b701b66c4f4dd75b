// Canvas templates (infilling) through the generation loop on the tiny-v512 shape with random
// weights: clamped positions never change at any step, restricted holes only ever hold and
// sample allowed ids, the fused step's masked results equal an independent unfused computation
// (Decode → −inf outside the mask → SampleRow), and a template without holes is the output
// with no decoder pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/denoise/canvas_template.h"
#include "engine/denoise/row_sampler.h"
#include "engine/generation/generator.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/forwarding_backend_testing.h"

namespace dgserve {
namespace {

// One fused step as the generator ran it, and the independent reference of its rows.
struct Step {
  std::vector<int32_t> canvas;
  std::vector<RowResult> fused;      // what DenoiseStep returned
  std::vector<RowResult> reference;  // Decode + mask + SampleRow over the same inputs
};

// Forwards to `inner`; before each DenoiseStep it computes the reference rows with the unfused
// path: Decode() logits, ids outside each row's mask set to −inf, then SampleRow with the same
// temperature and uniform.
class CheckingBackend final : public ::dgserve::testing::ForwardingBackend {
 public:
  explicit CheckingBackend(ModelBackend& inner) : ForwardingBackend(inner) {}

  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override {
    const int V = config().vocab_size;
    for (const DenoiseStepInput& in : batch) {
      Step s;
      s.canvas.assign(in.canvas.begin(), in.canvas.end());
      std::vector<float> logits(in.canvas.size() * size_t(V));
      DecodeInput d{in.canvas, in.sc_soft, in.kv, logits.data()};
      if (absl::Status st = inner().Decode({&d, 1}); !st.ok()) return st;
      for (size_t j = 0; j < in.canvas.size(); ++j) {
        float* row = logits.data() + j * size_t(V);
        const uint64_t* mask = in.row_masks.empty() ? nullptr : in.row_masks[j];
        for (int v = 0; mask && v < V; ++v) {
          if (((mask[v / 64] >> (v % 64)) & 1) == 0) row[v] = -std::numeric_limits<float>::infinity();
        }
        s.reference.push_back(SampleRow(row, V, in.temperature, in.uniforms[j]));
      }
      steps.push_back(std::move(s));
    }
    if (absl::Status st = inner().DenoiseStep(batch); !st.ok()) return st;
    size_t first = steps.size() - batch.size();
    for (size_t i = 0; i < batch.size(); ++i) {
      steps[first + i].fused.assign(batch[i].rows, batch[i].rows + batch[i].canvas.size());
    }
    return absl::OkStatus();
  }

  std::vector<Step> steps;
};

class CanvasTemplateGenerationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("canvas_template_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  const ModelConfig& config() const { return checkpoint_->config; }

  GenerationRequest Request(int canvases) const {
    GenerationRequest r = DefaultRequest(checkpoint_->generation);
    for (int i = 0; i < 7; ++i) r.prompt.push_back((i * 53 + 3) % config().vocab_size);
    r.max_new_tokens = canvases * config().canvas_length;
    r.sampler.max_denoising_steps = 6;
    r.stop_token_ids = {};
    r.seed = 11;
    return r;
  }

  // Positions 0, 3, 5, 9 fixed; 1, 2, 7 restricted to {40, 41, 42}; 11 to {7}; the rest free.
  std::shared_ptr<const CanvasTemplate> Template() const {
    const int C = config().canvas_length;
    std::vector<int32_t> ids(10, -1);
    ids[0] = 2;
    ids[3] = 100;
    ids[5] = 100;
    ids[9] = 511;
    std::vector<TemplateHoleSpec> holes = {
        {1, {42, 40, 41}}, {2, {40, 41, 42}}, {7, {41, 42, 40, 40}}, {11, {7}}};
    auto t = CanvasTemplate::Create(ids, holes, C, config().vocab_size);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }

  struct Run {
    GenerationResult result;
    std::vector<Step> steps;
  };
  Run Generate(const GenerationRequest& r) const {
    auto cpu = CreateCpuBackend(checkpoint_->config, checkpoint_->weights);
    CheckingBackend check(*cpu);
    Generator gen(check);
    auto res = gen.Generate(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return {res.ok() ? *std::move(res) : GenerationResult{}, std::move(check.steps)};
  }

  static Checkpoint* checkpoint_;
};
Checkpoint* CanvasTemplateGenerationTest::checkpoint_ = nullptr;

TEST_F(CanvasTemplateGenerationTest, ClampedPositionsNeverChangeAndHolesStayInTheirSets) {
  GenerationRequest r = Request(1);
  r.sampler.confidence_threshold = 1e-30f;  // all 6 steps run
  r.canvas_template = Template();
  const CanvasTemplate& t = *r.canvas_template;
  const Run run = Generate(r);
  ASSERT_EQ(run.steps.size(), 6u);
  const int C = config().canvas_length;
  for (size_t s = 0; s < run.steps.size(); ++s) {
    const Step& st = run.steps[s];
    ASSERT_EQ(int(st.fused.size()), C);
    for (int j = 0; j < C; ++j) {
      SCOPED_TRACE(::testing::Message() << "step " << s << " position " << j);
      EXPECT_TRUE(t.Allows(j, st.canvas[j])) << "input token " << st.canvas[j];
      EXPECT_TRUE(t.Allows(j, st.fused[j].argmax)) << "argmax " << st.fused[j].argmax;
      EXPECT_TRUE(t.Allows(j, st.fused[j].sampled)) << "sampled " << st.fused[j].sampled;
      if (!t.is_hole(j)) {
        EXPECT_EQ(st.canvas[j], t.fixed(j));
        EXPECT_EQ(st.fused[j].argmax, t.fixed(j));
        EXPECT_EQ(st.fused[j].entropy, 0.0f);  // a one-id distribution
      }
      // The fused masked step equals the unfused reference.
      EXPECT_EQ(st.fused[j].argmax, st.reference[j].argmax);
      EXPECT_NEAR(st.fused[j].entropy, st.reference[j].entropy, 2e-5f);
      EXPECT_EQ(st.fused[j].sampled, st.reference[j].sampled);
    }
  }
  // The committed canvas keeps every fixed token; restricted holes hold allowed ids.
  ASSERT_EQ(int(run.result.tokens.size()), C);
  for (int j = 0; j < C; ++j) EXPECT_TRUE(t.Allows(j, run.result.tokens[j])) << "position " << j;
  EXPECT_EQ(run.result.tokens[11], 7);  // a one-id hole
  // Restricted holes see a 3-id distribution: entropy ≤ ln 3, and above 0 somewhere.
  float max_entropy = 0;
  for (const Step& st : run.steps) {
    for (int j : {1, 2, 7}) {
      EXPECT_LE(st.fused[j].entropy, std::log(3.0f) + 1e-5f);
      max_entropy = std::max(max_entropy, st.fused[j].entropy);
    }
  }
  EXPECT_GT(max_entropy, 0.0f);
}

TEST_F(CanvasTemplateGenerationTest, WithoutHolesTheTemplateIsTheOutputAndNoPassRuns) {
  const int C = config().canvas_length;
  std::vector<int32_t> ids(C);
  for (int j = 0; j < C; ++j) ids[j] = (j * 29 + 5) % config().vocab_size;
  auto t = CanvasTemplate::Create(ids, {}, C, config().vocab_size);
  ASSERT_TRUE(t.ok()) << t.status();
  GenerationRequest r = Request(1);
  r.canvas_template = *t;
  const Run run = Generate(r);
  EXPECT_TRUE(run.steps.empty());
  EXPECT_EQ(run.result.decoder_passes, 0);
  EXPECT_EQ(run.result.tokens, ids);
  ASSERT_EQ(run.result.steps_per_canvas.size(), 1u);
  EXPECT_EQ(run.result.steps_per_canvas[0], 0);
}

TEST_F(CanvasTemplateGenerationTest, TheTemplateClampsTheFirstCanvasOrEveryCanvas) {
  const int C = config().canvas_length;
  GenerationRequest r = Request(2);
  r.sampler.confidence_threshold = 1e-30f;
  r.canvas_template = Template();
  const CanvasTemplate& t = *r.canvas_template;
  auto violations = [&](const Step& st) {
    int n = 0;
    for (int j = 0; j < C; ++j) n += !t.Allows(j, st.canvas[j]);
    return n;
  };
  const Run first_only = Generate(r);
  ASSERT_EQ(first_only.steps.size(), 12u);
  for (int s = 0; s < 6; ++s) EXPECT_EQ(violations(first_only.steps[s]), 0) << "step " << s;
  int free_second = 0;  // the second canvas is not clamped: random tokens break the template
  for (int s = 6; s < 12; ++s) free_second += violations(first_only.steps[s]);
  EXPECT_GT(free_second, 0);

  r.template_every_canvas = true;
  const Run every = Generate(r);
  ASSERT_EQ(every.steps.size(), 12u);
  for (int s = 0; s < 12; ++s) EXPECT_EQ(violations(every.steps[s]), 0) << "step " << s;
  // The first canvas is the same either way.
  EXPECT_EQ(std::vector<int32_t>(every.result.tokens.begin(), every.result.tokens.begin() + C),
            std::vector<int32_t>(first_only.result.tokens.begin(),
                                 first_only.result.tokens.begin() + C));
}

TEST_F(CanvasTemplateGenerationTest, ATemplateOfAnotherShapeIsRejected) {
  auto t = CanvasTemplate::Create({}, {}, config().canvas_length + 1, config().vocab_size);
  ASSERT_TRUE(t.ok());
  GenerationRequest r = Request(1);
  r.canvas_template = *t;
  auto cpu = CreateCpuBackend(checkpoint_->config, checkpoint_->weights);
  Generator gen(*cpu);
  EXPECT_THAT(gen.Generate(r).status(),
              ::dgserve::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve
