#include "engine/model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/config.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::MakeTempDir;
using ::dgserve::testing::StatusIs;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Writes `header` (raw JSON text, unpadded) with its length prefix and `data` to `path`.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data,
              uint64_t length_override = 0) {
  const uint64_t len = length_override != 0 ? length_override : header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &len, 8);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir("safetensors"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripsAllDtypesAndWritesStandardHeader) {
  const std::vector<uint16_t> bf = {FloatToBf16(1.5f), FloatToBf16(-2.0f),     FloatToBf16(0.1f),
                                    0x7F80 /* +inf */, 0x0001 /* subnormal */, 0x8000};
  const std::vector<uint16_t> half = {0x3C00, 0xC000, 0x0001, 0x7BFF};  // 1, -2, 2^-24, 65504
  const std::vector<float> f32 = {3.25f, -0.0f, 1e-30f};
  const float scalar = 7.0f;
  std::vector<TensorSource> tensors;
  tensors.push_back(TensorFromBuffer("b.bf16", DType::kBF16, {2, 3}, bf.data()));
  tensors.push_back(TensorFromBuffer("a.f16", DType::kF16, {4}, half.data()));
  tensors.push_back(TensorFromBuffer("c.f32", DType::kF32, {3, 1}, f32.data()));
  tensors.push_back(TensorFromBuffer("d.scalar", DType::kF32, {}, &scalar));
  tensors.push_back(TensorFromBuffer("e.empty", DType::kBF16, {0, 5}, nullptr));
  ASSERT_THAT(WriteSafetensorsFile(Path("x.safetensors"), std::move(tensors)), IsOk());

  // Standard header: 8-byte LE length, a multiple of 8, JSON with sorted keys, space padding.
  std::ifstream in(Path("x.safetensors"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len;
  std::memcpy(&len, bytes.data(), 8);
  EXPECT_EQ(len % 8, 0u);
  const std::string header = bytes.substr(8, len);
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"format\":\"pt\"},\"a.f16\":", 0), 0u) << header;
  EXPECT_LT(header.find("\"b.bf16\""), header.find("\"c.f32\""));

  auto file = SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), 5u);
  EXPECT_EQ(file->tensors()[0].name, "a.f16");
  const TensorView* b = file->Find("b.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  EXPECT_THAT(b->shape, ElementsAre(2, 3));
  EXPECT_EQ(b->file, Path("x.safetensors"));
  auto bv = ToFloat32(*b);
  ASSERT_THAT(bv, IsOk());
  for (size_t i = 0; i < bf.size(); ++i) {
    const float expect = Bf16ToFloat(bf[i]);
    EXPECT_EQ(std::memcmp(&(*bv)[i], &expect, 4), 0) << i;
  }
  auto hv = ToFloat32(*file->Find("a.f16"));
  ASSERT_THAT(hv, IsOk());
  EXPECT_THAT(*hv, ElementsAre(1.0f, -2.0f, 0x1p-24f, 65504.0f));
  auto fv = ToFloat32(*file->Find("c.f32"));
  ASSERT_THAT(fv, IsOk());
  EXPECT_EQ(std::memcmp(fv->data(), f32.data(), 12), 0);
  auto sv = ToFloat32(*file->Find("d.scalar"));
  ASSERT_THAT(sv, IsOk());
  EXPECT_THAT(*sv, ElementsAre(7.0f));
  EXPECT_EQ(file->Find("e.empty")->numel(), 0);
  EXPECT_EQ(file->Find("nope"), nullptr);
}

TEST_F(SafetensorsTest, LargeTensorConvertsInParallelExactly) {
  std::vector<uint16_t> data(1 << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
  std::vector<TensorSource> t;
  t.push_back(TensorFromBuffer("big", DType::kBF16, {1024, 1024}, data.data()));
  t.push_back(TensorFromBuffer("big16", DType::kF16, {1 << 20}, data.data()));
  ASSERT_THAT(WriteSafetensorsFile(Path("big.safetensors"), std::move(t)), IsOk());
  auto r = SafetensorsReader::OpenFile(Path("big.safetensors"));
  ASSERT_THAT(r, IsOk());
  auto v = ToFloat32(*r->Find("big"));
  auto h = ToFloat32(*r->Find("big16"));
  ASSERT_THAT(v, IsOk());
  ASSERT_THAT(h, IsOk());
  for (size_t i = 0; i < data.size(); ++i) {  // bitwise: the data holds NaNs as f16
    ASSERT_EQ(std::bit_cast<uint32_t>((*v)[i]), std::bit_cast<uint32_t>(Bf16ToFloat(data[i]))) << i;
    ASSERT_EQ(std::bit_cast<uint32_t>((*h)[i]), std::bit_cast<uint32_t>(HalfToFloat(data[i]))) << i;
  }
}

TEST_F(SafetensorsTest, ShardsAboveThresholdAndReadsBack) {
  std::vector<std::vector<float>> bufs;
  std::vector<TensorSource> tensors;
  for (int i = 0; i < 5; ++i) bufs.emplace_back(10, static_cast<float>(i));  // 40 bytes each
  for (int i = 0; i < 5; ++i) {
    tensors.push_back(TensorFromBuffer("t" + std::to_string(i), DType::kF32, {10}, bufs[i].data()));
  }
  SafetensorsWriteOptions opt;
  opt.max_shard_bytes = 100;  // two tensors per shard → 3 shards
  ASSERT_THAT(WriteSafetensors(dir_, tensors, opt), IsOk());
  EXPECT_FALSE(fs::exists(Path("model.safetensors")));
  for (const char* f : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                        "model-00003-of-00003.safetensors", "model.safetensors.index.json"}) {
    EXPECT_TRUE(fs::exists(Path(f))) << f;
  }
  auto text = ReadFileToString(Path("model.safetensors.index.json"));
  ASSERT_THAT(text, IsOk());
  json index = json::parse(*text);
  EXPECT_EQ(index["metadata"]["total_size"], 200);
  EXPECT_EQ(index["weight_map"]["t4"], "model-00003-of-00003.safetensors");
  auto r = SafetensorsReader::OpenDir(dir_);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->source(), Path("model.safetensors.index.json"));
  EXPECT_EQ(r->files().size(), 3u);
  ASSERT_EQ(r->tensors().size(), 5u);
  for (int i = 0; i < 5; ++i) {
    auto v = ToFloat32(*r->Find("t" + std::to_string(i)));
    ASSERT_THAT(v, IsOk());
    EXPECT_EQ((*v)[9], static_cast<float>(i));
  }
  // Rewriting below the threshold removes the stale shards and index.
  ASSERT_THAT(WriteSafetensors(dir_, tensors), IsOk());
  EXPECT_TRUE(fs::exists(Path("model.safetensors")));
  EXPECT_FALSE(fs::exists(Path("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(Path("model-00001-of-00003.safetensors")));
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  float x = 0;
  std::vector<TensorSource> dup;
  dup.push_back(TensorFromBuffer("a", DType::kF32, {1}, &x));
  dup.push_back(TensorFromBuffer("a", DType::kF32, {1}, &x));
  EXPECT_THAT(WriteSafetensors(dir_, std::move(dup)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a'")));
  std::vector<TensorSource> one;
  one.push_back(TensorFromBuffer("a", DType::kF32, {1}, &x));
  SafetensorsWriteOptions opt;
  opt.max_shard_bytes = 0;
  EXPECT_THAT(WriteSafetensors(dir_, std::move(one), opt),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

struct BadHeaderCase {
  const char* label;
  std::string header;
  size_t data_bytes;
  const char* expect;  // substring of the message besides the file name
};

TEST_F(SafetensorsTest, RejectsBadHeaders) {
  const std::string ok_entry = R"("w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  const BadHeaderCase cases[] = {
      {"invalid json", "{\"w\": {\"dtype\": ", 8, "not valid JSON"},
      {"not an object", "[1, 2, 3]", 8, "'{'"},
      {"unsupported dtype", R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8,
       "unsupported dtype 'F64'"},
      {"missing dtype", R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8, "dtype"},
      {"negative dim", R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8,
       "shape"},
      {"size mismatch", R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
       "needs 12"},
      {"out of range", R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", 8,
       "past the end of the data region"},
      {"decreasing", R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", 8,
       "decrease"},
      {"overlap",
       "{" + ok_entry + R"(, "x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 16,
       "overlap"},
      {"duplicate", "{" + ok_entry + ", " + ok_entry + "}", 8, "twice"},
      {"bad metadata", R"({"__metadata__": {"k": 1}})", 0, "__metadata__"},
  };
  for (const BadHeaderCase& c : cases) {
    const std::string path = Path("bad.safetensors");
    WriteRaw(path, c.header, std::string(c.data_bytes, '\0'));
    auto f = SafetensorsFile::Open(path);
    EXPECT_THAT(f, StatusIs(absl::StatusCode::kInvalidArgument,
                            AllOf(HasSubstr(path), HasSubstr(c.expect))))
        << c.label;
    if (std::string(c.header).find("\"w\"") != std::string::npos &&
        std::string(c.label) != "invalid json" && std::string(c.label) != "duplicate") {
      EXPECT_THAT(f.status().message(), HasSubstr("'w'")) << c.label;
    }
  }
  // Metadata of strings and a valid entry are accepted.
  WriteRaw(Path("ok.safetensors"), R"({"__metadata__": {"format": "pt"}, )" + ok_entry + "}",
           std::string(8, '\0'));
  EXPECT_THAT(SafetensorsFile::Open(Path("ok.safetensors")), IsOk());
}

TEST_F(SafetensorsTest, RejectsBadLengthAndTruncation) {
  const std::string path = Path("len.safetensors");
  WriteRaw(path, "{}", "", 0xFFFFFFFFFFFFull);
  EXPECT_THAT(SafetensorsFile::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("bad header length"))));
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_THAT(SafetensorsFile::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too short")));
  EXPECT_THAT(SafetensorsFile::Open(Path("missing.safetensors")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.safetensors")));
  EXPECT_THAT(SafetensorsReader::OpenDir(dir_), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(SafetensorsTest, IndexErrorsNameFilesAndTensors) {
  std::vector<float> v(4, 1.0f);
  std::vector<TensorSource> t;
  for (const char* n : {"a", "b", "c"})
    t.push_back(TensorFromBuffer(n, DType::kF32, {4}, v.data()));
  SafetensorsWriteOptions opt;
  opt.max_shard_bytes = 16;  // one tensor per shard
  ASSERT_THAT(WriteSafetensors(dir_, t, opt), IsOk());
  const std::string index_path = Path("model.safetensors.index.json");
  json index = json::parse(*ReadFileToString(index_path));
  auto write_index = [&](const json& j) { std::ofstream(index_path) << j.dump(); };

  json extra = index;  // listed in the index, missing from its shard
  extra["weight_map"]["zz"] = "model-00001-of-00003.safetensors";
  write_index(extra);
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model-00001-of-00003.safetensors"), HasSubstr("'zz'"),
                             HasSubstr("missing from this shard"))));

  // Present in a shard, absent from the index.
  write_index(index);
  const std::string shard2 = Path("model-00002-of-00003.safetensors");
  std::vector<TensorSource> extra_shard;
  extra_shard.push_back(TensorFromBuffer("b", DType::kF32, {4}, v.data()));
  extra_shard.push_back(TensorFromBuffer("b2", DType::kF32, {4}, v.data()));
  ASSERT_THAT(WriteSafetensorsFile(shard2, std::move(extra_shard)), IsOk());
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(shard2), HasSubstr("'b2'"), HasSubstr("not listed"))));
  std::vector<TensorSource> only_b;
  only_b.push_back(TensorFromBuffer("b", DType::kF32, {4}, v.data()));
  ASSERT_THAT(WriteSafetensorsFile(shard2, std::move(only_b)), IsOk());
  ASSERT_THAT(SafetensorsReader::OpenIndex(index_path), IsOk());

  json escaping = index;
  escaping["weight_map"]["a"] = "../elsewhere.safetensors";
  write_index(escaping);
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a'")));

  write_index(json::parse("{\"metadata\": {}}"));
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_map")));

  // Duplicated across shards: shard 3 also holds "a".
  write_index(index);
  std::vector<TensorSource> dup;
  dup.push_back(TensorFromBuffer("a", DType::kF32, {4}, v.data()));
  dup.push_back(TensorFromBuffer("c", DType::kF32, {4}, v.data()));
  ASSERT_THAT(WriteSafetensorsFile(Path("model-00003-of-00003.safetensors"), std::move(dup)),
              IsOk());
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'a'"), HasSubstr("duplicated"),
                             HasSubstr("model-00001-of-00003.safetensors"),
                             HasSubstr("model-00003-of-00003.safetensors"))));

  fs::remove(Path("model-00002-of-00003.safetensors"));
  EXPECT_THAT(SafetensorsReader::OpenIndex(index_path),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(index_path), HasSubstr("model-00002-of-00003.safetensors"),
                             HasSubstr("'b'"))));
}

}  // namespace
}  // namespace dgserve
