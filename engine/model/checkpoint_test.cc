#include "engine/model/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::LoadedValues;
using ::dgserve::testing::MakeTempDir;
using ::dgserve::testing::StatusIs;
using ::dgserve::testing::TinyConfig;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

static_assert(std::is_nothrow_move_constructible_v<Checkpoint>);

constexpr uint64_t kSeed = 7;

// A tensor held in memory, for rewriting checkpoints.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::vector<OwnedTensor> ReadTensors(const std::string& path) {
  std::vector<OwnedTensor> out;
  auto f = SafetensorsFile::Open(path);
  EXPECT_THAT(f, IsOk());
  if (!f.ok()) return out;
  for (const TensorView& v : f->tensors()) {
    out.push_back(
        {v.name, v.dtype, v.shape, std::string(reinterpret_cast<const char*>(v.data), v.nbytes)});
  }
  return out;
}

void WriteTensors(const std::string& path, const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorSource> src;
  for (const OwnedTensor& t : tensors) {
    src.push_back(TensorFromBuffer(t.name, t.dtype, t.shape, t.bytes.data()));
  }
  ASSERT_THAT(WriteSafetensorsFile(path, std::move(src)), IsOk());
}

// Rewrites the JSON header of a safetensors file, keeping its data region.
void EditHeader(const std::string& path, const std::function<void(json&)>& edit) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len;
  std::memcpy(&len, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, len));
  edit(header);
  const std::string text = header.dump();
  const uint64_t new_len = text.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &new_len, 8);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out << text << bytes.substr(8 + len);
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("ckpt");
    config_ = TinyConfig();
    ASSERT_THAT(WriteRandomCheckpoint(config_, GenerationConfig(), kSeed, dir_), IsOk());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string File() const { return dir_ + "/model.safetensors"; }
  // Applies `edit` to the tensors of model.safetensors and writes the file back.
  void Edit(const std::function<void(std::vector<OwnedTensor>&)>& edit) {
    std::vector<OwnedTensor> t = ReadTensors(File());
    edit(t);
    WriteTensors(File(), t);
  }
  OwnedTensor* Find(std::vector<OwnedTensor>& t, const std::string& name) {
    for (OwnedTensor& x : t) {
      if (x.name == name) return &x;
    }
    ADD_FAILURE() << "no tensor " << name;
    return &t.front();
  }
  void ExpectError(const std::string& tensor, const std::string& file,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
    auto c = LoadCheckpoint(dir_);
    EXPECT_THAT(c, StatusIs(code, AllOf(HasSubstr(file), HasSubstr(tensor))));
  }

  std::string dir_;
  ModelConfig config_;
};

TEST_F(CheckpointTest, LoadsExactBf16Values) {
  auto c = LoadCheckpoint(dir_);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->dir, dir_);
  EXPECT_EQ(c->config.hidden_size, 16);
  EXPECT_EQ(c->generation.max_denoising_steps, 48);
  ASSERT_EQ(c->weights.layers.size(), 2u);
  EXPECT_TRUE(c->weights.layers[1].v_proj.empty());  // full layer: K = V
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    const std::vector<float> got = LoadedValues(c->weights, spec.name);
    ASSERT_EQ(static_cast<int64_t>(got.size()), spec.numel()) << spec.name;
    for (int64_t i = 0; i < spec.numel(); ++i) {
      ASSERT_EQ(got[i], Bf16ToFloat(RandomBf16(spec, kSeed, i))) << spec.name << " " << i;
    }
  }
  EXPECT_NE(c->weights.layers[0].decoder_layer_scalar, c->weights.layers[0].encoder_layer_scalar);
}

TEST_F(CheckpointTest, MissingTensor) {
  Edit([](std::vector<OwnedTensor>& t) {
    std::erase_if(
        t, [](const OwnedTensor& x) { return x.name == "model.decoder.layers.1.router.scale"; });
  });
  ExpectError("model.decoder.layers.1.router.scale", File());
  auto c = LoadCheckpoint(dir_);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("missing"), HasSubstr("[16]")));
}

TEST_F(CheckpointTest, MissingEncoderScalarHasNoFallback) {
  Edit([](std::vector<OwnedTensor>& t) {
    std::erase_if(t, [](const OwnedTensor& x) {
      return x.name == "model.encoder.language_model.layers.0.layer_scalar";
    });
  });
  ExpectError("model.encoder.language_model.layers.0.layer_scalar", File());
}

TEST_F(CheckpointTest, ExtraTensor) {
  Edit([](std::vector<OwnedTensor>& t) {
    t.push_back({"model.decoder.layers.0.mlp.bias", DType::kBF16, {24}, std::string(48, '\0')});
  });
  ExpectError("model.decoder.layers.0.mlp.bias", File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(), HasSubstr("unexpected"));
}

TEST_F(CheckpointTest, MisshapedTensor) {
  Edit([&](std::vector<OwnedTensor>& t) {
    Find(t, "model.decoder.layers.0.self_attn.q_norm.weight")->shape = {4, 2};
  });
  ExpectError("model.decoder.layers.0.self_attn.q_norm.weight", File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(),
              AllOf(HasSubstr("has shape [4, 2]"), HasSubstr("expects [8]")));
}

TEST_F(CheckpointTest, TruncatedFile) {
  // Data is written in name order, so the last byte belongs to the last tensor by name.
  fs::resize_file(File(), fs::file_size(File()) - 1);
  ExpectError("model.encoder.language_model.layers.1.layer_scalar", File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(), HasSubstr("truncated"));
  fs::resize_file(File(), fs::file_size(File()) / 2);
  ExpectError("truncated", File());
}

TEST_F(CheckpointTest, GarbageHeaderLength) {
  {
    std::fstream f(File(), std::ios::binary | std::ios::in | std::ios::out);
    f.write("\xFF\xFF\xFF\xFF\xFF\xFF\x00\x00", 8);
  }
  ExpectError("bad header length", File());
}

TEST_F(CheckpointTest, InvalidHeaderJson) {
  {
    std::fstream f(File(), std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(8 + 20);
    f.write("\"", 1);  // breaks the JSON in the middle of the first entry
  }
  ExpectError("not valid JSON", File());
}

TEST_F(CheckpointTest, OffsetsOutOfRange) {
  const std::string name = "model.decoder.norm.weight";
  EditHeader(File(), [&](json& h) { h[name]["data_offsets"] = {1u << 30, (1u << 30) + 32}; });
  ExpectError(name, File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(), HasSubstr("data region"));
}

TEST_F(CheckpointTest, UnsupportedDtype) {
  const std::string name = "model.decoder.layers.0.router.proj.weight";
  EditHeader(File(), [&](json& h) { h[name]["dtype"] = "F8_E5M2"; });
  ExpectError(name, File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(), HasSubstr("unsupported dtype 'F8_E5M2'"));
}

TEST_F(CheckpointTest, InconsistentConfig) {
  const std::string config_path = dir_ + "/config.json";
  json j = json::parse(*ReadFileToString(config_path));
  j["text_config"]["hidden_size"] = 32;
  std::ofstream(config_path) << j.dump(2);
  ExpectError("model.decoder.embed_tokens.weight", File());
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(),
              AllOf(HasSubstr("has shape [64, 16]"), HasSubstr("expects [64, 32]"),
                    HasSubstr(config_path), HasSubstr("more")));
}

TEST_F(CheckpointTest, MissingFiles) {
  EXPECT_THAT(LoadCheckpoint(dir_ + "/nope"), StatusIs(absl::StatusCode::kNotFound));
  fs::remove(dir_ + "/generation_config.json");  // optional
  EXPECT_THAT(LoadCheckpoint(dir_), IsOk());
  fs::remove(File());
  ExpectError("model.safetensors", dir_, absl::StatusCode::kNotFound);
  fs::remove(dir_ + "/config.json");
  ExpectError("config.json", dir_, absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ShardedErrors) {
  WriteOptions opt;
  opt.max_shard_bytes = 4096;
  ASSERT_THAT(WriteRandomCheckpoint(config_, GenerationConfig(), kSeed, dir_, opt), IsOk());
  const std::string index = dir_ + "/model.safetensors.index.json";
  ASSERT_TRUE(fs::exists(index));
  ASSERT_THAT(LoadCheckpoint(dir_), IsOk());
  json j = json::parse(*ReadFileToString(index));
  const std::string shard = j["weight_map"]["model.decoder.norm.weight"];

  // A tensor missing from the checkpoint is reported against the index.
  const std::string victim = "model.decoder.layers.0.layer_scalar";
  const std::string victim_shard = j["weight_map"][victim];
  {
    std::vector<OwnedTensor> t = ReadTensors(dir_ + "/" + victim_shard);
    std::erase_if(t, [&](const OwnedTensor& x) { return x.name == victim; });
    WriteTensors(dir_ + "/" + victim_shard, t);
    j["weight_map"].erase(victim);
    std::ofstream(index) << j.dump();
  }
  // The decoder scalar falls back to the encoder copy (same stored tensor role, spec §2.1).
  ASSERT_THAT(LoadCheckpoint(dir_), IsOk());

  json k = j;
  k["weight_map"]["model.decoder.layers.1.ghost"] = shard;
  std::ofstream(index) << k.dump();
  ExpectError("model.decoder.layers.1.ghost", shard);

  fs::remove(dir_ + "/" + shard);
  ExpectError(shard, index, absl::StatusCode::kNotFound);
  EXPECT_THAT(LoadCheckpoint(dir_).status().message(), HasSubstr("holding tensor '"));
}

TEST_F(CheckpointTest, SkipsVisionAndTiedLmHead) {
  Edit([](std::vector<OwnedTensor>& t) {
    t.push_back({"model.encoder.vision_tower.patch_embedder.input_proj.weight",
                 DType::kBF16,
                 {3, 4},
                 std::string(24, '\1')});
    t.push_back({"model.encoder.embed_vision.embedding_projection.weight",
                 DType::kF32,
                 {2},
                 std::string(8, '\0')});
    t.push_back({"lm_head.weight", DType::kBF16, {64, 16}, std::string(64 * 16 * 2, '\0')});
  });
  auto c = LoadCheckpoint(dir_);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(Bf16ToFloat(c->weights.embed_tokens[1]),
            Bf16ToFloat(RandomBf16(
                {"model.decoder.embed_tokens.weight", {64, 16}, InitFamily::kEmbed}, kSeed, 1)));
  Edit([&](std::vector<OwnedTensor>& t) { Find(t, "lm_head.weight")->shape = {32, 32}; });
  ExpectError("lm_head.weight", File());
}

TEST_F(CheckpointTest, LoadsF16AndF32Tensors) {
  const std::vector<float> norm(16, 0.375f);
  const std::vector<uint16_t> qn = {0x3C00, 0x3800, 0xB400, 0x0001, 0x4000, 0x3E00, 0x3555, 0x7BFF};
  Edit([&](std::vector<OwnedTensor>& t) {
    OwnedTensor* n = Find(t, "model.decoder.norm.weight");
    n->dtype = DType::kF32;
    n->bytes.assign(reinterpret_cast<const char*>(norm.data()), 64);
    OwnedTensor* q = Find(t, "model.decoder.layers.1.self_attn.k_norm.weight");
    q->dtype = DType::kF16;
    q->shape = {16};
    q->bytes.assign(32, '\0');
    std::memcpy(q->bytes.data(), qn.data(), 16);
    OwnedTensor* s = Find(t, "model.encoder.language_model.layers.1.layer_scalar");
    s->dtype = DType::kF32;
    const float v = 0.8125f;
    s->bytes.assign(reinterpret_cast<const char*>(&v), 4);
  });
  auto c = LoadCheckpoint(dir_);
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->weights.final_norm, norm);
  const std::vector<float>& kn = c->weights.layers[1].k_norm;
  ASSERT_EQ(kn.size(), 16u);
  EXPECT_EQ(kn[0], 1.0f);
  EXPECT_EQ(kn[1], 0.5f);
  EXPECT_EQ(kn[2], -0.25f);
  EXPECT_EQ(kn[3], 0x1p-24f);
  EXPECT_EQ(kn[7], 65504.0f);
  EXPECT_EQ(kn[8], 0.0f);
  EXPECT_EQ(c->weights.layers[1].encoder_layer_scalar, 0.8125f);
}

TEST_F(CheckpointTest, AcceptsEncoderPrefixFallback) {
  auto reference = LoadCheckpoint(dir_);
  ASSERT_THAT(reference, IsOk());
  // Move every backbone tensor except the decoder scalars under model.encoder.language_model.
  Edit([](std::vector<OwnedTensor>& t) {
    for (OwnedTensor& x : t) {
      if (x.name.rfind("model.decoder.", 0) == 0 &&
          x.name.find("layer_scalar") == std::string::npos &&
          x.name.find("self_conditioning") == std::string::npos) {
        x.name = "model.encoder.language_model." + x.name.substr(14);
      }
    }
  });
  auto moved = LoadCheckpoint(dir_);
  ASSERT_THAT(moved, IsOk());
  for (const TensorSpec& spec : ExpectedTensors(config_)) {
    EXPECT_EQ(LoadedValues(moved->weights, spec.name), LoadedValues(reference->weights, spec.name))
        << spec.name;
  }
  // Both copies present (tied duplicates): accepted, decoder preferred; a mis-shaped copy is not.
  Edit([](std::vector<OwnedTensor>& t) {
    OwnedTensor copy = t.front();
    for (const OwnedTensor& x : t) {
      if (x.name == "model.encoder.language_model.norm.weight") copy = x;
    }
    copy.name = "model.decoder.norm.weight";
    t.push_back(copy);
  });
  EXPECT_THAT(LoadCheckpoint(dir_), IsOk());
  Edit([&](std::vector<OwnedTensor>& t) {
    Find(t, "model.encoder.language_model.norm.weight")->shape = {2, 8};
  });
  ExpectError("model.encoder.language_model.norm.weight", File());
}

}  // namespace
}  // namespace dgserve

namespace dgserve {
namespace {

// A NaN or infinite weight is a load error naming the file and the tensor.
TEST(CheckpointResourcesTest, RejectsNonFiniteWeights) {
  const std::string dir = ::dgserve::testing::MakeTempDir("ckpt_nan");
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  ASSERT_THAT(WriteRandomCheckpoint(c, GenerationConfig{}, 1, dir), IsOk());
  // Overwrite the first value of layer 0's input_layernorm with a bf16 NaN (0x7FC0), finding
  // the tensor's bytes through the header's data offsets.
  const std::string name = "model.decoder.layers.0.input_layernorm.weight";
  std::string bytes;
  {
    std::ifstream in(dir + "/model.safetensors", std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, header_len));
  const uint64_t begin = header[name]["data_offsets"][0].get<uint64_t>();
  bytes[8 + header_len + begin] = char(0xC0);
  bytes[8 + header_len + begin + 1] = char(0x7F);
  std::ofstream(dir + "/model.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THAT(LoadCheckpoint(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(::testing::HasSubstr("model.safetensors"),
                             ::testing::HasSubstr("input_layernorm"),
                             ::testing::HasSubstr("non-finite"))));
  std::filesystem::remove_all(dir);
}

// A config whose weights cannot fit in this machine's memory is refused before any
// tensor is read (here the weight files do not even exist).
TEST(CheckpointResourcesTest, RefusesAModelLargerThanMemory) {
  const std::string dir = ::dgserve::testing::MakeTempDir("ckpt_huge");
  ModelConfig c = ::dgserve::testing::TinyConfig();
  c.vocab_size = 1 << 24;
  c.hidden_size = 1 << 14;  // 2^38 embedding values: 1 TiB in bf16, twice
  std::ofstream(dir + "/config.json") << ModelConfigToJson(c);
  EXPECT_THAT(LoadCheckpoint(dir),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("GB of memory")));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dgserve
