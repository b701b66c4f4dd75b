// The random-checkpoint generator against the golden data (README §2.3): per-tensor sha256 of the
// bf16 bytes, first values, family constants, the worked values; configs written in the golden
// layout; write → load round trips (single file and sharded).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <bit>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::GoldenDir;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::LoadedValues;
using ::dgserve::testing::MakeTempDir;
using nlohmann::json;

std::string Sha256Hex(const void* data, size_t n) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EXPECT_EQ(EVP_Digest(data, n, md, &len, EVP_sha256(), nullptr), 1);
  std::string hex;
  char buf[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", md[i]);
    hex += buf;
  }
  return hex;
}

json ReadJson(const std::string& path) {
  auto text = ReadFileToString(path);
  EXPECT_THAT(text, IsOk()) << "golden data missing? set DGSERVE_GOLDEN_DIR";
  return text.ok() ? json::parse(*text) : json::object();
}

const char* FamilyName(InitFamily f) {
  switch (f) {
    case InitFamily::kEmbed:
      return "EMBED";
    case InitFamily::kLinear:
      return "LINEAR";
    case InitFamily::kRouter:
      return "ROUTER";
    case InitFamily::kGain:
      return "GAIN";
    case InitFamily::kQkNorm:
      return "QKNORM";
    case InitFamily::kScalar:
      return "SCALAR";
  }
  return "?";
}

uint32_t Hex(const json& j) {
  return static_cast<uint32_t>(std::stoul(j.get<std::string>(), nullptr, 16));
}

TEST(RandomCheckpointTest, WorkedValuesOfReadme) {
  struct Row {
    const char* name;
    InitFamily family;
    std::vector<int64_t> shape;
    int64_t i;
    uint64_t fnv, key, x;
    int32_t k;
    uint16_t bf16;
  };
  const Row rows[] = {
      {"model.decoder.layers.0.layer_scalar",
       InitFamily::kScalar,
       {1},
       0,
       0x606751CA079B7F4Eull,
       0x0E9423349363554Eull,
       0xF95E1B14EFBE96E5ull,
       7953947,
       0x3F63},
      {"model.encoder.language_model.layers.0.layer_scalar",
       InitFamily::kScalar,
       {1},
       0,
       0x4C35CB8BFAE15FE0ull,
       0x22C6B9756E1975E0ull,
       0xAE07B0636AB8B595ull,
       3016624,
       0x3F3D},
      {"model.decoder.embed_tokens.weight",
       InitFamily::kEmbed,
       {512, 64},
       1,
       0x6C6E15765759E1B0ull,
       0x029D6788C3A1CBB0ull,
       0x76B322D1435837A8ull,
       -609502,
       0xBD4E},
      {"model.decoder.layers.0.self_attn.q_proj.weight",
       InitFamily::kLinear,
       {64, 64},
       5,
       0xA423A91806E2F1F5ull,
       0xCAD0DBE6921ADBF5ull,
       0xB245DB4950D9E1B8ull,
       3294683,
       0x3DAE},
  };
  for (const Row& r : rows) {
    EXPECT_EQ(Fnv1a64(r.name), r.fnv) << r.name;
    EXPECT_EQ(TensorKey(r.name, 512), r.key) << r.name;
    const uint64_t x = SplitMix64(r.key + r.i);
    EXPECT_EQ(x, r.x) << r.name;
    EXPECT_EQ(static_cast<int32_t>(x >> 40) - 8388608, r.k) << r.name;
    EXPECT_EQ(RandomBf16({r.name, r.shape, r.family}, 512, r.i), r.bf16) << r.name;
  }
  EXPECT_EQ(Bf16ToFloat(0x3F63), 0.88671875f);
  EXPECT_EQ(Bf16ToFloat(0x3F3D), 0.73828125f);
}

TEST(RandomCheckpointTest, FamilyConstantsOfReadme) {
  const std::pair<int64_t, uint32_t> linear[] = {
      {64, 0x3E5DB3D7}, {48, 0x3E800000}, {24, 0x3EB504F3}, {128, 0x3E1CC471},
      {96, 0x3E3504F3}, {32, 0x3E9CC471}, {256, 0x3DDDB3D7}};
  for (auto [fan_in, bits] : linear) {
    EXPECT_EQ(std::bit_cast<uint32_t>(FamilyConstants({"w", {7, fan_in}, InitFamily::kLinear}).a),
              bits)
        << fan_in;
  }
  EXPECT_EQ(std::bit_cast<uint32_t>(FamilyConstants({"e", {2, 2}, InitFamily::kEmbed}).a),
            0x3F315CACu);
  EXPECT_EQ(std::bit_cast<uint32_t>(FamilyConstants({"r", {2, 2}, InitFamily::kRouter}).a),
            0x3FDDB3D7u);
  EXPECT_EQ(std::bit_cast<uint32_t>(FamilyConstants({"s", {1}, InitFamily::kScalar}).c),
            0x3F266666u);
}

// Every tensor of both golden models: names, shapes, families, constants, sha256, first values.
TEST(RandomCheckpointTest, MatchesGoldenModelJson) {
  const json index = ReadJson(GoldenDir() + "/index.json");
  ASSERT_TRUE(index.contains("models"));
  int models = 0;
  for (auto& [model_name, entry] : index["models"].items()) {
    SCOPED_TRACE(model_name);
    ++models;
    const std::string model_dir =
        (fs::path(GoldenDir()) / entry["config"].get<std::string>()).parent_path().string();
    auto configs = LoadConfigsFromModelDir(model_dir);
    ASSERT_THAT(configs, IsOk());
    const json model = ReadJson(GoldenDir() + "/" + entry["model_json"].get<std::string>());
    const uint64_t seed = entry["generator_seed"].get<uint64_t>();
    ASSERT_EQ(model["generator"]["seed"].get<uint64_t>(), seed);
    const std::vector<TensorSpec> specs = ExpectedTensors(configs->config);
    const json& tensors = model["tensors"];
    ASSERT_EQ(specs.size(), tensors.size());
    ASSERT_EQ(static_cast<int>(specs.size()), entry["n_tensors"].get<int>());
    int64_t params = 0;
    for (size_t t = 0; t < specs.size(); ++t) {
      const TensorSpec& spec = specs[t];
      const json& g = tensors[t];
      SCOPED_TRACE(spec.name);
      ASSERT_EQ(spec.name, g["name"].get<std::string>());
      ASSERT_EQ(spec.shape, g["shape"].get<std::vector<int64_t>>());
      EXPECT_EQ(FamilyName(spec.family), g["family"].get<std::string>());
      const InitConstants k = FamilyConstants(spec);
      EXPECT_EQ(std::bit_cast<uint32_t>(k.a), Hex(g["a_f32_hex"]));
      if (g["c_f32_hex"].is_null()) {
        EXPECT_FALSE(k.has_offset);
      } else {
        EXPECT_TRUE(k.has_offset);
        EXPECT_EQ(std::bit_cast<uint32_t>(k.c), Hex(g["c_f32_hex"]));
      }
      const std::vector<uint16_t> values = RandomTensorBf16(spec, seed);
      params += spec.numel();
      EXPECT_EQ(Sha256Hex(values.data(), values.size() * 2), g["sha256"].get<std::string>());
      const json& first = g["first_bf16_hex"];
      for (size_t i = 0; i < first.size() && i < values.size(); ++i) {
        EXPECT_EQ(values[i], Hex(first[i])) << "element " << i;
        EXPECT_EQ(values[i], RandomBf16(spec, seed, static_cast<int64_t>(i)));
      }
    }
    EXPECT_EQ(params, entry["n_params"].get<int64_t>());
    EXPECT_EQ(configs->config.EmbedScale(), entry["embed_scale"].get<float>());
  }
  EXPECT_EQ(models, 2);
}

TEST(RandomCheckpointTest, WritesConfigsInGoldenLayout) {
  for (const char* model : {"tiny-v512", "tiny-g3"}) {
    SCOPED_TRACE(model);
    const std::string dir = GoldenDir() + "/" + model;
    auto configs = LoadConfigsFromModelDir(dir);
    ASSERT_THAT(configs, IsOk());
    EXPECT_EQ(json::parse(ModelConfigToJson(configs->config)), ReadJson(dir + "/config.json"));
    EXPECT_EQ(json::parse(GenerationConfigToJson(configs->generation)),
              ReadJson(dir + "/generation_config.json"));
  }
}

// Loads `dir` and checks every tensor equals the generator's bf16 value exactly.
void ExpectLoadsExactly(const std::string& dir, const ModelConfig& config, uint64_t seed) {
  auto ckpt = LoadCheckpoint(dir);
  ASSERT_THAT(ckpt, IsOk());
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const std::vector<uint16_t> expect = RandomTensorBf16(spec, seed);
    const std::vector<float> got = LoadedValues(ckpt->weights, spec.name);
    ASSERT_EQ(got.size(), expect.size()) << spec.name;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], Bf16ToFloat(expect[i])) << spec.name << " element " << i;
    }
  }
}

TEST(RandomCheckpointTest, TinyV512RoundTripsSingleAndSharded) {
  const std::string golden = GoldenDir() + "/tiny-v512";
  auto configs = LoadConfigsFromModelDir(golden);
  ASSERT_THAT(configs, IsOk());
  const std::string dir = MakeTempDir("tiny_v512");
  WriteOptions opt;
  opt.tokenizer_path = golden + "/tokenizer.json";
  ASSERT_THAT(WriteRandomCheckpoint(configs->config, configs->generation, 512, dir, opt), IsOk());
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(*ReadFileToString(dir + "/" + f), *ReadFileToString(golden + "/" + f)) << f;
  }
  EXPECT_EQ(ReadJson(dir + "/config.json"), ReadJson(golden + "/config.json"));
  EXPECT_EQ(ReadJson(dir + "/generation_config.json"),
            ReadJson(golden + "/generation_config.json"));
  ExpectLoadsExactly(dir, configs->config, 512);
  auto single = LoadCheckpoint(dir);
  ASSERT_THAT(single, IsOk());
  EXPECT_EQ(single->generation.stop_token_ids, configs->generation.stop_token_ids);
  EXPECT_EQ(single->config.layer_types, configs->config.layer_types);

  opt.max_shard_bytes = 100'000;  // 822 KB of bf16 → 9+ shards
  ASSERT_THAT(WriteRandomCheckpoint(configs->config, configs->generation, 512, dir, opt), IsOk());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  const json index = ReadJson(dir + "/model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 411068 * 2);
  EXPECT_EQ(index["weight_map"].size(), 142u);
  EXPECT_TRUE(fs::exists(dir + "/model-00001-of-00009.safetensors") ||
              fs::exists(dir + "/model-00001-of-00010.safetensors"));
  auto sharded = LoadCheckpoint(dir);
  ASSERT_THAT(sharded, IsOk());
  for (const TensorSpec& spec : ExpectedTensors(configs->config)) {
    EXPECT_EQ(LoadedValues(sharded->weights, spec.name), LoadedValues(single->weights, spec.name))
        << spec.name;
  }
  fs::remove_all(dir);
}

TEST(RandomCheckpointTest, TinyG3WritesAndLoads) {
  auto configs = LoadConfigsFromModelDir(GoldenDir() + "/tiny-g3");
  ASSERT_THAT(configs, IsOk());
  const std::string dir = MakeTempDir("tiny_g3");
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_THAT(WriteRandomCheckpoint(configs->config, configs->generation, 3, dir), IsOk());
  const auto t1 = std::chrono::steady_clock::now();
  const uintmax_t size = fs::file_size(dir + "/model.safetensors");
  EXPECT_GT(size, uintmax_t{34759484} * 2);          // the data
  EXPECT_LT(size, uintmax_t{34759484} * 2 + 65536);  // + the header
  auto ckpt = LoadCheckpoint(dir);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_THAT(ckpt, IsOk());
  std::printf("tiny-g3: generate+write %.3f s, load %.3f s\n",
              std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(t2 - t1).count());
  const std::vector<uint16_t>& e = ckpt->weights.embed_tokens;  // bf16 bits
  ASSERT_EQ(e.size(), 262144u * 128u);
  EXPECT_EQ(e[0], 0xBC72);  // model.json first_bf16_hex
  EXPECT_EQ(e[3], 0x3E78);
  const TensorSpec spec{"model.decoder.embed_tokens.weight", {262144, 128}, InitFamily::kEmbed};
  for (int64_t i : {int64_t{12345}, int64_t{262144} * 128 - 1}) {
    EXPECT_EQ(e[i], RandomBf16(spec, 3, i)) << i;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dgserve
