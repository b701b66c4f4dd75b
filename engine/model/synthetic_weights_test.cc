// SyntheticModelWeights equals the weights loaded from the random checkpoint written with the
// same config and seed (every tensor, bit for bit), and the vectors-only form leaves exactly the
// matrices empty.
#include "engine/model/synthetic_weights.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {

void ExpectEqualToLoaded(const ModelConfig& c, uint64_t seed) {
  const std::string dir = testing::MakeTempDir("synthetic_weights");
  ASSERT_TRUE(WriteRandomCheckpoint(c, GenerationConfig{}, seed, dir).ok());
  auto ckpt = LoadCheckpoint(dir);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelWeights synth = SyntheticModelWeights(c, seed);
  const auto want = testing::WeightVectors(ckpt->weights);
  const auto got = testing::WeightVectors(synth);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, values] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name), values) << name;  // float32 values of bf16 bits: exact
  }
  EXPECT_EQ(testing::WeightScalars(synth), testing::WeightScalars(ckpt->weights));
  EXPECT_EQ(synth.embed_tokens, ckpt->weights.embed_tokens);
  EXPECT_EQ(synth.lm_head.UnpackBf16(), ckpt->weights.lm_head.UnpackBf16());
}

TEST(SyntheticWeightsTest, EqualsLoadedRandomCheckpointTiny) {
  ExpectEqualToLoaded(testing::TinyConfig(), 3);
  ExpectEqualToLoaded(testing::TinyConfig(), 11);
}

TEST(SyntheticWeightsTest, EqualsLoadedRandomCheckpointTinyV512) {
  auto cfgs = LoadConfigsFromModelDir(testing::GoldenDir() + "/tiny-v512");
  ASSERT_TRUE(cfgs.ok()) << cfgs.status();
  ExpectEqualToLoaded(cfgs->config, 512);
}

TEST(SyntheticWeightsTest, VectorsOnlyLeavesTheMatricesEmpty) {
  const ModelConfig c = testing::TinyConfig();
  const ModelWeights full = SyntheticModelWeights(c, 5);
  const ModelWeights small = SyntheticModelWeights(c, 5, /*matrices=*/false);
  EXPECT_TRUE(small.embed_tokens.empty());
  ASSERT_EQ(small.layers.size(), full.layers.size());
  for (size_t l = 0; l < small.layers.size(); ++l) {
    EXPECT_TRUE(small.layers[l].q_proj.empty());
    EXPECT_TRUE(small.layers[l].experts_gate_up_proj.empty());
    EXPECT_EQ(small.layers[l].input_layernorm, full.layers[l].input_layernorm);
    EXPECT_EQ(small.layers[l].router_per_expert_scale, full.layers[l].router_per_expert_scale);
    EXPECT_EQ(small.layers[l].decoder_layer_scalar, full.layers[l].decoder_layer_scalar);
  }
  EXPECT_EQ(small.final_norm, full.final_norm);
  // The matrices SyntheticMatrixSpecs lists are every rank-≥2 tensor.
  int64_t elements = 0;
  for (const TensorSpec& s : SyntheticMatrixSpecs(c)) elements += s.numel();
  EXPECT_EQ(
      elements * 2 + int64_t(c.vocab_size) * c.hidden_size * 2 +
          [&] {
            int64_t v = 0;
            for (const TensorSpec& s : ExpectedTensors(c)) {
              if (s.shape.size() < 2) v += s.numel() * 4;
            }
            return v;
          }(),
      WeightBytes(c));
}

}  // namespace
}  // namespace dgserve
