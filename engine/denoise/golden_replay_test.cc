// Replays the golden denoising traces (golden README §4–§6) through the sampler: from the
// recorded per-step `entropy`, `argmax`, `sampled` and renoise tokens (`next` at non-accepted
// positions), acceptance, the next canvas, mean entropy, the stop rule, step count and the
// committed canvas must match exactly. For models whose logits files hold the full vocabulary,
// the row sampler is also run on the recorded logits (argmax exact, entropy/lse within 1e-4).
//
// Data: $DGSERVE_GOLDEN_DIR, else $DGSERVE_SOURCE_DIR/tests/testdata/golden; every model and case
// listed in index.json is replayed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/denoise/canvas_state.h"
#include "engine/denoise/entropy_bound.h"
#include "engine/denoise/finalize.h"
#include "engine/denoise/row_sampler.h"
#include "engine/denoise/sampler_params.h"
#include "engine/denoise/stopping.h"
#include "nlohmann/json.hpp"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using json = nlohmann::json;

fs::path GoldenDir() {
  if (const char* dir = std::getenv("DGSERVE_GOLDEN_DIR"); dir != nullptr && *dir != '\0') {
    return dir;
  }
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  return fs::path(src != nullptr ? src : ".") / "tests" / "testdata" / "golden";
}

json ReadJson(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  if (!in.good()) return json();
  return json::parse(in);
}

std::vector<float> ReadFloats(const fs::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  if (!in.good()) return {};
  const std::streamsize bytes = in.tellg();
  in.seekg(0);
  std::vector<float> data(bytes / sizeof(float));
  in.read(reinterpret_cast<char*>(data.data()), bytes);
  return data;
}

SamplerParams ParamsFrom(const json& g) {
  SamplerParams p;
  p.max_denoising_steps = g.at("max_denoising_steps").get<int>();
  p.t_min = g.at("t_min").get<float>();
  p.t_max = g.at("t_max").get<float>();
  p.entropy_bound = g.at("entropy_bound").get<float>();
  p.stability_threshold = g.at("stability_threshold").get<int>();
  p.confidence_threshold = g.at("confidence_threshold").get<float>();
  return p;
}

struct CaseRef {
  std::string model;
  std::string name;
  fs::path json_path;
  fs::path logits_path;
  bool full_vocab_logits = false;
  std::vector<int32_t> stop_ids;
  int32_t pad_id = 0;
};

std::vector<CaseRef> ListCases(const fs::path& dir) {
  std::vector<CaseRef> cases;
  const json index = ReadJson(dir / "index.json");
  if (index.is_null()) return cases;
  for (const auto& [model, m] : index.at("models").items()) {
    const json gen = ReadJson(dir / m.at("generation_config").get<std::string>());
    for (const auto& [name, c] : m.at("cases").items()) {
      CaseRef ref;
      ref.model = model;
      ref.name = name;
      ref.json_path = dir / c.at("json").get<std::string>();
      ref.logits_path = dir / c.at("logits").get<std::string>();
      ref.full_vocab_logits = c.value("full_vocab_logits", false);
      ref.stop_ids = gen.at("eos_token_id").get<std::vector<int32_t>>();
      ref.pad_id = gen.at("pad_token_id").get<int32_t>();
      cases.push_back(ref);
    }
  }
  return cases;
}

class GoldenReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = GoldenDir();
    ASSERT_TRUE(fs::exists(dir_ / "index.json"))
        << "golden data not found at " << dir_
        << " (set DGSERVE_GOLDEN_DIR to a golden data directory)";
    cases_ = ListCases(dir_);
    ASSERT_FALSE(cases_.empty());
  }
  fs::path dir_;
  std::vector<CaseRef> cases_;
};

TEST_F(GoldenReplayTest, AcceptanceRenoiseStopAndCommitAreExact) {
  int steps_checked = 0, blocks_checked = 0;
  for (const CaseRef& c : cases_) {
    SCOPED_TRACE(c.model + "/" + c.name);
    const json data = ReadJson(c.json_path);
    const SamplerParams params = ParamsFrom(data.at("generation"));
    ASSERT_THAT(ValidateSamplerParams(params), IsOk());
    const int32_t vocab = data.at("vocab_size").get<int32_t>();
    const int length = data.at("canvas_length").get<int>();
    for (const json& block : data.at("blocks")) {
      SCOPED_TRACE("block " + std::to_string(block.at("block").get<int>()));
      const auto init = block.at("init_canvas").get<std::vector<int32_t>>();
      ASSERT_EQ(static_cast<int>(init.size()), length);
      absl::StatusOr<CanvasDenoiser> den =
          CanvasDenoiser::CreateWithInitialCanvas(params, init, vocab, 0, nullptr);
      ASSERT_THAT(den, IsOk());
      // An independent stop rule fed the same values (the denoiser's own one is checked through
      // StepOutcome).
      StableAndConfidentStop stop_rule(params.stability_threshold, params.confidence_threshold);
      for (const json& step : block.at("steps")) {
        const int s = step.at("step").get<int>();
        SCOPED_TRACE("step " + std::to_string(s));
        ASSERT_FALSE(den->done());
        ASSERT_EQ(den->step(), s);
        EXPECT_EQ(den->temperature(), step.at("t").get<float>());
        EXPECT_EQ(StepTemperature(params, s), step.at("t").get<float>());
        const auto fed = step.at("fed").get<std::vector<int32_t>>();
        EXPECT_TRUE(std::equal(fed.begin(), fed.end(), den->canvas().begin(), den->canvas().end()))
            << "fed canvas differs";

        const auto entropy = step.at("entropy").get<std::vector<float>>();
        const auto argmax = step.at("argmax").get<std::vector<int32_t>>();
        const auto sampled = step.at("sampled").get<std::vector<int32_t>>();
        const auto lse = step.at("lse").get<std::vector<float>>();
        const auto next = step.at("next").get<std::vector<int32_t>>();
        const auto accepted = step.at("accepted").get<std::vector<int>>();
        std::vector<RowResult> rows(length);
        for (int j = 0; j < length; ++j) rows[j] = {argmax[j], sampled[j], entropy[j], lse[j]};

        // The pieces on their own.
        EXPECT_EQ(AcceptPositions(entropy, static_cast<double>(params.entropy_bound)), accepted);
        const float mean = MeanEntropy(entropy);
        EXPECT_EQ(mean, step.at("mean_entropy").get<float>());
        const bool stop = stop_rule.Update(argmax, mean);
        EXPECT_EQ(stop, step.at("stop").get<bool>());
        EXPECT_EQ(stop_rule.confident(), step.at("confident").get<bool>());
        // The traces record `stable` as "argmax canvas unchanged since the previous step"; with
        // S = 1 that is the rule's stable, with S = 0 the rule treats every step as stable.
        EXPECT_EQ(stop_rule.argmax_unchanged(), step.at("stable").get<bool>());
        if (params.stability_threshold == 1) {
          EXPECT_EQ(stop_rule.stable(), step.at("stable").get<bool>());
        }

        // The state machine, renoising with the recorded tokens.
        absl::StatusOr<StepOutcome> out = den->ApplyStepWithDraws(rows, next);
        ASSERT_THAT(out, IsOk());
        EXPECT_EQ(out->accepted, accepted);
        EXPECT_EQ(out->mean_entropy, step.at("mean_entropy").get<float>());
        EXPECT_EQ(out->stop, step.at("stop").get<bool>());
        EXPECT_EQ(out->confident, step.at("confident").get<bool>());
        EXPECT_EQ(out->argmax_unchanged, step.at("stable").get<bool>());
        EXPECT_TRUE(
            std::equal(next.begin(), next.end(), den->canvas().begin(), den->canvas().end()))
            << "next canvas differs";
        // Accepted positions took the sampled token (the renoise rule, checked independently).
        for (int j : accepted) EXPECT_EQ(next[j], sampled[j]) << "position " << j;
        EXPECT_TRUE(std::equal(argmax.begin(), argmax.end(), den->committed().begin(),
                               den->committed().end()));
        ++steps_checked;
      }
      EXPECT_TRUE(den->done());
      EXPECT_EQ(den->step(), block.at("n_steps").get<int>());
      EXPECT_EQ(den->stopped_early(), block.at("stopped_early").get<bool>());
      const auto committed = block.at("committed").get<std::vector<int32_t>>();
      std::vector<int32_t> ours(den->committed().begin(), den->committed().end());
      EXPECT_EQ(ours, committed);
      const bool had_stop = FinalizeCanvas(ours, c.stop_ids, c.pad_id);
      EXPECT_EQ(ours, block.at("committed_finalized").get<std::vector<int32_t>>());
      EXPECT_EQ(had_stop, std::find_first_of(committed.begin(), committed.end(), c.stop_ids.begin(),
                                             c.stop_ids.end()) != committed.end());
      ++blocks_checked;
    }
  }
  EXPECT_GE(blocks_checked, 10);  // 2 models × 4 cases, two_blocks has 2 blocks
  std::printf("replayed %d blocks, %d steps\n", blocks_checked, steps_checked);
}

TEST_F(GoldenReplayTest, RowSamplerOnRecordedFullVocabularyLogits) {
  int rows_checked = 0;
  double worst_entropy = 0.0, worst_lse = 0.0;
  for (const CaseRef& c : cases_) {
    if (!c.full_vocab_logits) continue;
    SCOPED_TRACE(c.model + "/" + c.name);
    const json data = ReadJson(c.json_path);
    const int32_t vocab = data.at("vocab_size").get<int32_t>();
    const int length = data.at("canvas_length").get<int>();
    const std::vector<float> logits = ReadFloats(c.logits_path);
    for (const json& block : data.at("blocks")) {
      for (const json& step : block.at("steps")) {
        const int index = step.at("logits_index").get<int>();
        const float t = step.at("t").get<float>();
        ASSERT_LE(static_cast<size_t>(index + 1) * length * vocab, logits.size());
        std::vector<float> rows(logits.begin() + static_cast<size_t>(index) * length * vocab,
                                logits.begin() + static_cast<size_t>(index + 1) * length * vocab);
        std::vector<float> uniforms(length, 0.5f);
        std::vector<RowResult> out(length);
        SampleRows(rows.data(), length, vocab, t, uniforms, /*write_probs=*/true, out);
        const auto argmax = step.at("argmax").get<std::vector<int32_t>>();
        const auto entropy = step.at("entropy").get<std::vector<double>>();
        const auto lse = step.at("lse").get<std::vector<double>>();
        for (int j = 0; j < length; ++j) {
          EXPECT_EQ(out[j].argmax, argmax[j]) << "step " << step.at("step") << " pos " << j;
          EXPECT_NEAR(out[j].entropy, entropy[j], 1e-4);
          EXPECT_NEAR(out[j].lse, lse[j], 1e-4);
          worst_entropy = std::max(worst_entropy, std::abs(out[j].entropy - entropy[j]));
          worst_lse = std::max(worst_lse, std::abs(out[j].lse - lse[j]));
          double sum = 0.0;
          for (int v = 0; v < vocab; ++v) sum += rows[static_cast<size_t>(j) * vocab + v];
          EXPECT_NEAR(sum, 1.0, 1e-5);  // written probabilities (self-conditioning input)
          ++rows_checked;
        }
      }
    }
  }
  std::printf("row sampler on %d recorded rows: max |dH| %.3g, max |dlse| %.3g\n", rows_checked,
              worst_entropy, worst_lse);
  EXPECT_GT(rows_checked, 0);
}

}  // namespace
}  // namespace dgserve
