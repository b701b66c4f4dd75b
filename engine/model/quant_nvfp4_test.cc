// NVFP4 checkpoints (issue 37): ModelOpt's and compressed-tensors' ("nvfp4-pack-quantized")
// layouts, their refusals naming the field or tensor, hand-made tensors decoded value by value,
// the compressed-tensors form of a checkpoint giving the ModelOpt form's bits, and the weight-only
// NVFP4A16 form (input_activations null).
#include "engine/model/quant_test_fixture.h"

namespace dgserve {
namespace {

using namespace ::dgserve::quant_testing;  // NOLINT: the shared fixture and helpers
using ::testing::HasSubstr;

// ---- NVFP4 (ModelOpt) ----

TEST_F(QuantErrorTest, Nvfp4UnsupportedConfigsNameTheField) {
  auto qc = [](const char* key, json v) {
    return [key, v](json& c) { c["quantization_config"][key] = v; };
  };
  EXPECT_THAT(LoadEdited("nvfp4", nullptr, qc("quant_algo", "FP8")),
              HasSubstr("field 'quantization_config.quant_algo' is \"FP8\""));
  EXPECT_THAT(LoadEdited("nvfp4", nullptr, qc("group_size", 32)),
              HasSubstr("quantization_config.group_size' is 32"));
  EXPECT_THAT(LoadEdited("nvfp4", nullptr, qc("kv_cache_quant_algo", "FP8")),
              HasSubstr("quantization_config.kv_cache_quant_algo"));
  EXPECT_THAT(LoadEdited("nvfp4", nullptr, qc("exclude_modules", "lm_head")),
              HasSubstr("quantization_config.exclude_modules' must be a list"));
  // hf_quant_config.json alone (older ModelOpt exports): loads; its errors name that file.
  hf_quant_config_ = true;
  EXPECT_EQ(LoadEdited("nvfp4", nullptr, [](json& c) { c.erase("quantization_config"); }), "");
  hf_quant_config_ = false;
}

TEST_F(QuantErrorTest, Nvfp4MissingMistypedOrMisshapedTensorsAreNamed) {
  EXPECT_THAT(LoadEdited("nvfp4", [](auto& t) { Erase(t, kQ + ".weight_scale_2"); }),
              HasSubstr("'" + kQ + ".weight_scale_2' is missing"));
  EXPECT_THAT(LoadEdited("nvfp4", [](auto& t) { Erase(t, kQ + ".input_scale"); }),
              HasSubstr("'" + kQ + ".input_scale' is missing"));
  // weight_scale [64, 4] written as [32, 8].
  EXPECT_THAT(LoadEdited("nvfp4",
                         [](auto& t) {
                           for (auto& s : t) {
                             if (s.name == kQ + ".weight_scale") s.shape = {32, 8};
                           }
                         }),
              HasSubstr("tensor '" + kQ + ".weight_scale' has dtype F8_E4M3 and shape [32, 8]"));
  // The packed weight as F8_E4M3 instead of U8.
  EXPECT_THAT(LoadEdited("nvfp4",
                         [](auto& t) {
                           for (auto& s : t) {
                             if (s.name == kQ + ".weight") s.dtype = DType::kF8E4M3;
                           }
                         }),
              HasSubstr("tensor '" + kQ +
                        ".weight' has dtype F8_E4M3 and shape [64, 32] but the "
                        "nvfp4 quantization_config expects U8 [64, 32]"));
  // The unpacked width ([64, 64] bf16) where [64, 32] packed bytes are expected.
  static std::vector<uint16_t> zeros(64 * 64);
  EXPECT_THAT(
      LoadEdited(
          "nvfp4",
          [](auto& t) {
            Erase(t, kQ + ".weight");
            t.push_back(TensorFromBuffer(kQ + ".weight", DType::kBF16, {64, 64}, zeros.data()));
          }),
      HasSubstr("tensor '" + kQ + ".weight' has dtype BF16 and shape [64, 64]"));
  // A non-positive global scale.
  static const float negative = -1.0f;
  EXPECT_THAT(LoadEdited("nvfp4",
                         [](auto& t) {
                           Erase(t, kQ + ".weight_scale_2");
                           t.push_back(TensorFromBuffer(kQ + ".weight_scale_2", DType::kF32, {},
                                                        &negative));
                         }),
              HasSubstr("tensor '" + kQ + ".weight_scale_2' is -1"));
  // An expert's gate and up with different input scales (one activation quantization).
  const std::string up = "model.decoder.layers.1.experts.3.up_proj";
  static const float other = 0.25f;
  EXPECT_THAT(
      LoadEdited("nvfp4",
                 [&](auto& t) {
                   Erase(t, up + ".input_scale");
                   t.push_back(TensorFromBuffer(up + ".input_scale", DType::kF32, {}, &other));
                 }),
      HasSubstr("tensor '" + up + ".input_scale' is 0.25 but the module stacked with it"));
  // tiny-v512's expert down_proj has 24 inputs: written in bf16 and excluded; a config that
  // quantizes it is refused naming the module.
  EXPECT_THAT(LoadEdited("nvfp4", nullptr,
                         [](json& c) {
                           json& ex = c["quantization_config"]["exclude_modules"];
                           json kept = json::array();
                           for (const json& e : ex) {
                             if (!absl::EndsWith(e.get<std::string>(), "down_proj"))
                               kept.push_back(e);
                           }
                           ex = kept;
                         }),
              HasSubstr("module 'model.decoder.layers.0.experts.0.down_proj' has 24 input "
                        "features, not a multiple of 16"));
}

// A hand-made NVFP4 module, decoded value by value: the nibble order (element 2i in the low
// nibble), negative codes, per-block e4m3 scales, weight_scale_2 and input_scale.
TEST_F(QuantErrorTest, Nvfp4HandMadeTensorDecodesValueByValue) {
  // q_proj of layer 0: [64, 64] → bytes [64, 32], scales [64, 4].
  static std::vector<uint8_t> bytes(64 * 32), scales(64 * 4);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t((i * 37 + 11) & 0xff);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = uint8_t(0x30 + i % 16);  // 0.5 … 1.875
  bytes[0] = 0x9A;        // row 0: element 0 = code 0xA (−1), element 1 = code 0x9 (−0.5)
  bytes[8] = 0x27;        // row 0: element 16 = code 7 (6), element 17 = code 2 (1)
  bytes[32 + 31] = 0xF1;  // row 1: element 62 = code 1 (0.5), element 63 = code 0xF (−6)
  scales[0] = 0x38;       // row 0 block 0: 1.0
  scales[1] = 0x40;       // row 0 block 1: 2.0
  scales[4 + 3] = 0x01;   // row 1 block 3: 2⁻⁹ (subnormal)
  static const float g = 0.5f, in = 0.25f;
  std::string err = LoadEdited("nvfp4", [](auto& t) {
    for (const char* suffix : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale"}) {
      Erase(t, kQ + suffix);
    }
    t.push_back(TensorFromBuffer(kQ + ".weight", DType::kU8, {64, 32}, bytes.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_scale", DType::kF8E4M3, {64, 4}, scales.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_scale_2", DType::kF32, {1}, &g));
    t.push_back(TensorFromBuffer(kQ + ".input_scale", DType::kF32, {}, &in));
  });
  ASSERT_EQ(err, "");
  auto ck = LoadCheckpoint(*dir_ + "/edit" + std::to_string(n_ - 1));
  ASSERT_TRUE(ck.ok()) << ck.status();
  const cpu::PackedMatrix& m = ck->weights.layers[0].q_proj;
  ASSERT_NE(m.quant(), nullptr);
  const cpu::QuantMatrix& q = *m.quant();
  EXPECT_EQ(q.format(), cpu::QuantFormat::kNvfp4);
  EXPECT_EQ(q.InputScale(), 0.25f);
  EXPECT_EQ(q.WeightGlobal(0), 0.5f);
  EXPECT_EQ(q.RowScale(0), 0.125f);  // alpha = input_scale · weight_scale_2
  // The literal cases.
  EXPECT_EQ(m.At(0, 0), -0.5f);        // −1 · 1 · 0.5
  EXPECT_EQ(m.At(0, 1), -0.25f);       // −0.5 · 1 · 0.5
  EXPECT_EQ(m.At(0, 16), 6.0f);        // 6 · 2 · 0.5
  EXPECT_EQ(m.At(0, 17), 1.0f);        // 1 · 2 · 0.5
  EXPECT_EQ(m.At(1, 62), 0x1p-11f);    // 0.5 · 2⁻⁹ · 0.5
  EXPECT_EQ(m.At(1, 63), -0x3p-9f);    // −6 · 2⁻⁹ · 0.5
  EXPECT_EQ(q.Widened(0, 16), 12.0f);  // e2m1 · e4m3, the global in the epilogue
  // Every element from the bytes with the format's table and the e4m3 scale values
  // 0x30 + j: 2^(6−7) · (1 + j/8) for j < 8, 2^(7-7) · (1 + (j−8)/8) for j ≥ 8.
  auto scale_value = [](uint8_t code) {
    if (code == 0x01) return 0x1p-9f;
    return std::ldexp(1.0f + float(code & 7) / 8.0f, int((code >> 3) & 15) - 7);
  };
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 64; ++c) {
      const uint8_t byte = bytes[size_t(r) * 32 + c / 2];
      const int code = c % 2 == 0 ? byte & 15 : byte >> 4;
      const float want = E2m1Value(code) * scale_value(scales[size_t(r) * 4 + c / 16]) * 0.5f;
      ASSERT_EQ(m.At(r, c), want) << r << " " << c;
    }
  }
}

// ---- NVFP4 (compressed-tensors "nvfp4-pack-quantized") ----

// A ModelOpt exclude pattern (fnmatch, or a module's ancestor) as a compressed-tensors ignore
// entry: "re:" and the anchored regular expression.
std::string GlobToIgnore(const std::string& glob) {
  std::string re = "re:";
  for (char ch : glob) {
    if (ch == '*') {
      re += ".*";
    } else if (ch == '?') {
      re += '.';
    } else if (ch == '.') {
      re += "\\.";
    } else {
      re += ch;
    }
  }
  return re + "(\\..*)?$";
}

// The one independent check of the compressed-tensors layout (the other tests edit
// dgserve-quantize's own nvfp4_ct checkpoint): a hand-written converter.
// Writes the ModelOpt NVFP4 checkpoint `src` (under dir) in the compressed-tensors layout to
// `ct_out` — weight → weight_packed, weight_scale as it is, weight_global_scale = 1 /
// weight_scale_2, input_global_scale = 1 / input_scale (F32 [1]), config.json's
// quantization_config the nvfp4-pack-quantized preset — and to `mo_out` the same ModelOpt
// checkpoint with weight_scale_2 and input_scale replaced by float32(1 / float32(1 / x)): the
// values the compressed-tensors form decodes to, so that both hold the same weights.
void WriteCompressedTensorsNvfp4(const std::string& src, const std::string& ct_out,
                                 const std::string& mo_out) {
  auto reader = SafetensorsReader::OpenDir(src);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::deque<float> values;  // stable addresses for TensorFromBuffer
  std::vector<TensorSource> ct, mo;
  auto scalar = [&](const TensorView& v) {
    float f;
    std::memcpy(&f, v.data, 4);
    return f;
  };
  std::set<std::string> modules;
  for (const TensorView& v : reader->tensors()) {
    if (absl::EndsWith(v.name, ".weight_scale_2")) {
      modules.insert(v.name.substr(0, v.name.size() - std::string(".weight_scale_2").size()));
    }
  }
  ASSERT_FALSE(modules.empty());
  for (const TensorView& v : reader->tensors()) {
    const auto dot = v.name.rfind('.');
    const std::string module = v.name.substr(0, dot), suffix = v.name.substr(dot);
    if (!modules.count(module)) {
      ct.push_back(TensorFromBuffer(v.name, v.dtype, v.shape, v.data));
      mo.push_back(TensorFromBuffer(v.name, v.dtype, v.shape, v.data));
      continue;
    }
    if (suffix == ".weight_scale_2" || suffix == ".input_scale") {
      ASSERT_EQ(v.dtype, DType::kF32);
      const float x = scalar(v);
      values.push_back(1.0f / x);
      ct.push_back(TensorFromBuffer(
          module + (suffix == ".input_scale" ? ".input_global_scale" : ".weight_global_scale"),
          DType::kF32, {1}, &values.back()));
      values.push_back(1.0f / values.back());
      mo.push_back(TensorFromBuffer(v.name, DType::kF32, v.shape, &values.back()));
    } else {
      ct.push_back(TensorFromBuffer(suffix == ".weight" ? module + ".weight_packed" : v.name,
                                    v.dtype, v.shape, v.data));
      mo.push_back(TensorFromBuffer(v.name, v.dtype, v.shape, v.data));
    }
  }
  fs::create_directories(ct_out);
  fs::create_directories(mo_out);
  ASSERT_THAT(WriteSafetensors(ct_out, std::move(ct)), IsOk());
  ASSERT_THAT(WriteSafetensors(mo_out, std::move(mo)), IsOk());
  std::ifstream in(src + "/config.json");
  json c = json::parse(in);
  std::ofstream(mo_out + "/config.json") << c.dump(2);
  QuantizationConfig q;
  q.format = WeightFormat::kNvfp4;
  q.nvfp4_compressed_tensors = true;
  q.targets = {"Linear"};
  for (const json& e : c["quantization_config"]["exclude_modules"]) {
    q.ignore.push_back(GlobToIgnore(e.get<std::string>()));
  }
  c["quantization_config"] = json::parse(QuantizationConfigJson(q));
  std::ofstream(ct_out + "/config.json") << c.dump(2);
}

// The round trip: dgserve-quantize's ModelOpt checkpoint of tiny-v512 rewritten in the
// compressed-tensors layout loads to the same matrices (codes, block scales, globals, alpha,
// the activations' g) and runs to bit-identical logits.
TEST_F(QuantErrorTest, Nvfp4CompressedTensorsRoundTripMatchesModelOpt) {
  WriteCompressedTensorsNvfp4(*dir_ + "/nvfp4", *dir_ + "/nvfp4_conv", *dir_ + "/nvfp4_conv_mo");
  auto ct = LoadCheckpoint(*dir_ + "/nvfp4_conv");
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto mo = LoadCheckpoint(*dir_ + "/nvfp4_conv_mo");
  ASSERT_TRUE(mo.ok()) << mo.status();
  EXPECT_EQ(ct->weights.format, WeightFormat::kNvfp4);
  EXPECT_TRUE(ct->quant.nvfp4_compressed_tensors);
  const auto a = Matrices(ct->weights), b = Matrices(mo->weights);
  ASSERT_EQ(a.size(), b.size());
  int quantized = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const cpu::PackedMatrix& x = *a[i].second;
    const cpu::PackedMatrix& y = *b[i].second;
    ASSERT_EQ(x.quant() != nullptr, y.quant() != nullptr) << a[i].first;
    ASSERT_EQ(x.rows(), y.rows());
    ASSERT_EQ(x.cols(), y.cols());
    if (x.quant() == nullptr) {
      for (int r = 0; r < x.rows(); ++r) {
        for (int c = 0; c < x.cols(); ++c) ASSERT_EQ(x.At(r, c), y.At(r, c)) << a[i].first;
      }
      continue;
    }
    ++quantized;
    const cpu::QuantMatrix& qx = *x.quant();
    const cpu::QuantMatrix& qy = *y.quant();
    ASSERT_EQ(qx.format(), cpu::QuantFormat::kNvfp4);
    ASSERT_EQ(qx.InputScale(), qy.InputScale()) << a[i].first;
    ASSERT_EQ(qx.InputGlobal(), qy.InputGlobal()) << a[i].first;
    for (int r = 0; r < x.rows(); ++r) {
      ASSERT_EQ(qx.WeightGlobal(r), qy.WeightGlobal(r)) << a[i].first;
      ASSERT_EQ(qx.RowScale(r), qy.RowScale(r)) << a[i].first;
      for (int c = 0; c < x.cols(); ++c) {
        ASSERT_EQ(qx.Widened(r, c), qy.Widened(r, c)) << a[i].first << " " << r << " " << c;
      }
    }
  }
  EXPECT_GT(quantized, 0);
  const Pass pc = RunPasses(*ct, false), pm = RunPasses(*mo, false);
  ASSERT_EQ(pc.logits.size(), pm.logits.size());
  ASSERT_FALSE(pc.logits.empty());
  EXPECT_EQ(std::memcmp(pc.logits.data(), pm.logits.data(), pc.logits.size() * sizeof(float)), 0);
  EXPECT_EQ(pc.keys, pm.keys);
}

// A hand-made compressed-tensors NVFP4 module (in dgserve-quantize's nvfp4_ct checkpoint)
// decoded value by value: nibble order, codes, block scales and the reciprocal global scales.
TEST_F(QuantErrorTest, Nvfp4CompressedTensorsHandMadeTensorDecodesValueByValue) {
  static std::vector<uint8_t> bytes(64 * 32), scales(64 * 4);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t((i * 53 + 5) & 0xff);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0x38;  // 1.0
  bytes[0] = 0x3C;       // row 0: element 0 = code 0xC (−2), element 1 = code 3 (1.5)
  bytes[1] = 0xE5;       // row 0: element 2 = code 5 (3), element 3 = code 0xE (−4)
  bytes[32 + 8] = 0x70;  // row 1: element 16 = code 0 (0), element 17 = code 7 (6)
  scales[0] = 0x40;      // row 0 block 0: 2.0
  scales[4 + 1] = 0x30;  // row 1 block 1: 0.5
  // Divisors: W = e2m1 · e4m3 / 4; input_scale = 1/8, alpha = 1/32, g = 8.
  static const float wgs = 4.0f, igs = 8.0f;
  std::string err = LoadEdited("nvfp4_ct", [](auto& t) {
    for (const char* suffix :
         {".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale"}) {
      Erase(t, kQ + suffix);
    }
    t.push_back(TensorFromBuffer(kQ + ".weight_packed", DType::kU8, {64, 32}, bytes.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_scale", DType::kF8E4M3, {64, 4}, scales.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_global_scale", DType::kF32, {1}, &wgs));
    t.push_back(TensorFromBuffer(kQ + ".input_global_scale", DType::kF32, {1}, &igs));
  });
  ASSERT_EQ(err, "");
  auto ck = LoadCheckpoint(*dir_ + "/edit" + std::to_string(n_ - 1));
  ASSERT_TRUE(ck.ok()) << ck.status();
  const cpu::PackedMatrix& m = ck->weights.layers[0].q_proj;
  ASSERT_NE(m.quant(), nullptr);
  const cpu::QuantMatrix& q = *m.quant();
  EXPECT_EQ(q.format(), cpu::QuantFormat::kNvfp4);
  EXPECT_EQ(q.InputScale(), 0.125f);
  EXPECT_EQ(q.InputGlobal(), 8.0f);
  EXPECT_EQ(q.WeightGlobal(0), 0.25f);
  EXPECT_EQ(q.RowScale(0), 0.03125f);
  EXPECT_EQ(m.At(0, 0), -1.0f);   // −2 · 2 / 4
  EXPECT_EQ(m.At(0, 1), 0.75f);   // 1.5 · 2 / 4
  EXPECT_EQ(m.At(0, 2), 1.5f);    // 3 · 2 / 4
  EXPECT_EQ(m.At(0, 3), -2.0f);   // −4 · 2 / 4
  EXPECT_EQ(m.At(1, 16), 0.0f);   // 0
  EXPECT_EQ(m.At(1, 17), 0.75f);  // 6 · 0.5 / 4
  EXPECT_EQ(q.Widened(1, 17), 3.0f);
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 64; ++c) {
      const uint8_t byte = bytes[size_t(r) * 32 + c / 2];
      const int code = c % 2 == 0 ? byte & 15 : byte >> 4;
      const uint8_t sc = scales[size_t(r) * 4 + c / 16];
      const float s = sc == 0x40 ? 2.0f : sc == 0x30 ? 0.5f : 1.0f;
      ASSERT_EQ(m.At(r, c), E2m1Value(code) * s / 4.0f) << r << " " << c;
    }
  }
  // The activations are quantized with g = input_global_scale itself.
  std::vector<float> x(64), want(64), got(64);
  for (int c = 0; c < 64; ++c) x[c] = std::sin(0.7f * float(c)) * 3.0f;
  cpu::QuantizeRowNvfp4Global(x.data(), 64, 8.0f, want.data());
  cpu::QuantizeRowNvfp4Global(x.data(), 64, q.InputGlobal(), got.data());
  EXPECT_EQ(want, got);
  // g is input_global_scale itself, not float32(1 / float32(1 / it)): they differ here.
  static const float odd = 0x1.6d4fep+0f;
  ASSERT_NE(1.0f / (1.0f / odd), odd);
  err = LoadEdited("nvfp4_ct", [](auto& t) {
    Erase(t, kQ + ".input_global_scale");
    t.push_back(TensorFromBuffer(kQ + ".input_global_scale", DType::kF32, {1}, &odd));
  });
  ASSERT_EQ(err, "");
  auto ck2 = LoadCheckpoint(*dir_ + "/edit" + std::to_string(n_ - 1));
  ASSERT_TRUE(ck2.ok()) << ck2.status();
  const cpu::QuantMatrix& q2 = *ck2->weights.layers[0].q_proj.quant();
  EXPECT_EQ(q2.InputGlobal(), odd);
  EXPECT_EQ(q2.InputScale(), 1.0f / odd);
}

TEST_F(QuantErrorTest, Nvfp4CompressedTensorsRefusalsNameTheFieldOrTensor) {
  EXPECT_EQ(LoadEdited("nvfp4_ct", nullptr), "");
  auto qc = [](const char* path, json v) {
    return [path, v](json& c) { c["quantization_config"][json::json_pointer(path)] = v; };
  };
  EXPECT_THAT(LoadEdited("nvfp4_ct", nullptr, qc("/config_groups/group_0/weights/group_size", 32)),
              HasSubstr("field 'quantization_config.config_groups.group_0.weights.group_size' is "
                        "32"));
  EXPECT_THAT(
      LoadEdited("nvfp4_ct", nullptr,
                 qc("/config_groups/group_0/input_activations/group_size", 32)),
      HasSubstr("quantization_config.config_groups.group_0.input_activations.group_size' is 32"));
  EXPECT_THAT(LoadEdited("nvfp4_ct", nullptr, qc("/config_groups/group_0/weights/type", "int")),
              HasSubstr("config_groups.group_0.weights.type' is \"int\""));
  EXPECT_THAT(
      LoadEdited("nvfp4_ct", nullptr, qc("/config_groups/group_0/weights/strategy", "group")),
      HasSubstr("config_groups.group_0.weights.strategy' is \"group\""));
  EXPECT_THAT(LoadEdited("nvfp4_ct", nullptr,
                         qc("/config_groups/group_0/input_activations/dynamic", false)),
              HasSubstr("config_groups.group_0.input_activations.dynamic' is false"));
  // input_activations null is NVFP4A16 (weight-only), whose modules have no input_global_scale:
  // the W4A4 checkpoint's are then unexpected tensors.
  EXPECT_THAT(
      LoadEdited("nvfp4_ct", nullptr, qc("/config_groups/group_0/input_activations", nullptr)),
      HasSubstr(".input_global_scale' with shape [1] (not a DiffusionGemma text tensor"));
  EXPECT_THAT(LoadEdited("nvfp4_ct", nullptr, qc("/config_groups/group_0/input_activations", 4)),
              HasSubstr("config_groups.group_0.input_activations' must be the NVFP4 activation "
                        "scheme"));
  EXPECT_THAT(LoadEdited("nvfp4_ct", [](auto& t) { Erase(t, kQ + ".weight_global_scale"); }),
              HasSubstr("'" + kQ + ".weight_global_scale' is missing"));
  EXPECT_THAT(LoadEdited("nvfp4_ct", [](auto& t) { Erase(t, kQ + ".input_global_scale"); }),
              HasSubstr("'" + kQ + ".input_global_scale' is missing"));
  EXPECT_THAT(LoadEdited("nvfp4_ct", [](auto& t) { Erase(t, kQ + ".weight_scale"); }),
              HasSubstr("'" + kQ + ".weight_scale' is missing"));
  // Bad dtypes: the packed codes as F8_E4M3, the global scale as BF16.
  EXPECT_THAT(LoadEdited("nvfp4_ct",
                         [](auto& t) {
                           for (auto& s : t) {
                             if (s.name == kQ + ".weight_packed") s.dtype = DType::kF8E4M3;
                           }
                         }),
              HasSubstr("tensor '" + kQ +
                        ".weight_packed' has dtype F8_E4M3 and shape [64, 32] but "
                        "the nvfp4 quantization_config expects U8 [64, 32]"));
  static const uint16_t bf16_one = 0x3f80;
  EXPECT_THAT(LoadEdited("nvfp4_ct",
                         [](auto& t) {
                           Erase(t, kQ + ".weight_global_scale");
                           t.push_back(TensorFromBuffer(kQ + ".weight_global_scale", DType::kBF16,
                                                        {1}, &bf16_one));
                         }),
              HasSubstr("tensor '" + kQ + ".weight_global_scale' has dtype BF16"));
  // The ModelOpt name where compressed-tensors' is expected.
  EXPECT_THAT(LoadEdited("nvfp4_ct",
                         [](auto& t) {
                           for (auto& s : t) {
                             if (s.name == kQ + ".weight_packed") s.name = kQ + ".weight";
                           }
                         }),
              HasSubstr("'" + kQ + ".weight_packed' is missing"));
  // A zero global scale (a divisor).
  static const float zero = 0.0f;
  EXPECT_THAT(LoadEdited("nvfp4_ct",
                         [](auto& t) {
                           Erase(t, kQ + ".weight_global_scale");
                           t.push_back(TensorFromBuffer(kQ + ".weight_global_scale", DType::kF32,
                                                        {1}, &zero));
                         }),
              HasSubstr("tensor '" + kQ + ".weight_global_scale' is 0"));
}

// ---- Weight-only NVFP4 (compressed-tensors NVFP4A16: input_activations null) ----

// dgserve-quantize's NVFP4A16 checkpoint: config_groups' input_activations null, no
// input_global_scale tensors; it loads as weight-only NVFP4 matrices holding exactly the W4A4
// compressed-tensors checkpoint's codes, block scales and weight_scale_2 (the same weights), with
// alpha = weight_scale_2 (no input scale).
TEST_F(QuantErrorTest, Nvfp4A16LoadsAsWeightOnlyNvfp4) {
  std::ifstream in(*dir_ + "/nvfp4a16/config.json");
  const json c = json::parse(in);
  const json& qc = c["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "compressed-tensors");
  EXPECT_EQ(qc["format"], "nvfp4-pack-quantized");
  EXPECT_TRUE(qc["config_groups"]["group_0"]["input_activations"].is_null());
  EXPECT_EQ(qc["config_groups"]["group_0"]["weights"]["strategy"], "tensor_group");
  EXPECT_EQ(qc["config_groups"]["group_0"]["weights"]["group_size"], 16);
  auto reader = SafetensorsReader::OpenDir(*dir_ + "/nvfp4a16");
  ASSERT_TRUE(reader.ok()) << reader.status();
  int packed = 0;
  for (const TensorView& v : reader->tensors()) {
    EXPECT_FALSE(absl::EndsWith(v.name, ".input_global_scale")) << v.name;
    packed += absl::EndsWith(v.name, ".weight_packed");
  }
  EXPECT_GT(packed, 0);
  auto a = LoadCheckpoint(*dir_ + "/nvfp4a16");
  ASSERT_TRUE(a.ok()) << a.status();
  auto w4a4 = LoadCheckpoint(*dir_ + "/nvfp4_ct");
  ASSERT_TRUE(w4a4.ok()) << w4a4.status();
  EXPECT_EQ(a->quant.format, WeightFormat::kNvfp4);
  EXPECT_TRUE(a->quant.nvfp4_weight_only);
  EXPECT_FALSE(w4a4->quant.nvfp4_weight_only);
  EXPECT_STREQ(QuantizationName(a->quant), "nvfp4a16");
  EXPECT_STREQ(QuantizationName(w4a4->quant), "nvfp4");
  const auto x = Matrices(a->weights), y = Matrices(w4a4->weights);
  ASSERT_EQ(x.size(), y.size());
  int quantized = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const cpu::QuantMatrix* qx = x[i].second->quant();
    const cpu::QuantMatrix* qy = y[i].second->quant();
    ASSERT_EQ(qx == nullptr, qy == nullptr) << x[i].first;
    if (qx == nullptr) continue;
    ++quantized;
    ASSERT_TRUE(qx->nvfp4_weight_only()) << x[i].first;
    ASSERT_FALSE(qy->nvfp4_weight_only()) << x[i].first;
    ASSERT_EQ(qx->InputScale(), 1.0f) << x[i].first;
    for (int r = 0; r < qx->rows(); ++r) {
      ASSERT_EQ(qx->WeightGlobal(r), qy->WeightGlobal(r)) << x[i].first << " row " << r;
      ASSERT_EQ(qx->RowScale(r), qy->WeightGlobal(r)) << x[i].first << " row " << r;
      for (int col = 0; col < qx->cols(); ++col) {
        ASSERT_EQ(qx->Widened(r, col), qy->Widened(r, col)) << x[i].first << " " << r << " " << col;
      }
    }
  }
  EXPECT_GT(quantized, 0);
}

// A hand-made NVFP4A16 module decoded value by value (weight_global_scale a divisor), and its
// GEMM on a hand-computed row: the activations are not quantized (3.3 would become 3 under W4A4)
// and alpha is weight_scale_2 = 1 / weight_global_scale.
TEST_F(QuantErrorTest, Nvfp4A16HandMadeModuleRunsOnUnquantizedActivations) {
  static std::vector<uint8_t> bytes(64 * 32, 0), scales(64 * 4, 0x38);  // codes 0, scales 1
  bytes[0] = 0x3C;   // row 0: element 0 = code 0xC (−2), element 1 = code 3 (1.5)
  scales[0] = 0x40;  // row 0 block 0: 2.0
  static const float wgs = 4.0f;
  std::string err = LoadEdited("nvfp4a16", [](auto& t) {
    for (const char* suffix : {".weight_packed", ".weight_scale", ".weight_global_scale"}) {
      Erase(t, kQ + suffix);
    }
    t.push_back(TensorFromBuffer(kQ + ".weight_packed", DType::kU8, {64, 32}, bytes.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_scale", DType::kF8E4M3, {64, 4}, scales.data()));
    t.push_back(TensorFromBuffer(kQ + ".weight_global_scale", DType::kF32, {1}, &wgs));
  });
  ASSERT_EQ(err, "");
  auto ck = LoadCheckpoint(*dir_ + "/edit" + std::to_string(n_ - 1));
  ASSERT_TRUE(ck.ok()) << ck.status();
  const cpu::PackedMatrix& m = ck->weights.layers[0].q_proj;
  ASSERT_NE(m.quant(), nullptr);
  EXPECT_TRUE(m.quant()->nvfp4_weight_only());
  EXPECT_EQ(m.quant()->WeightGlobal(0), 0.25f);
  EXPECT_EQ(m.quant()->RowScale(0), 0.25f);
  EXPECT_EQ(m.At(0, 0), -1.0f);  // −2 · 2 / 4
  EXPECT_EQ(m.At(0, 1), 0.75f);  // 1.5 · 2 / 4
  EXPECT_EQ(m.At(1, 0), 0.0f);
  // x = (3.3, 1, 0, ...): y0 = 3.3 · (−1) + 1 · 0.75 = −2.55 (float32: −2 · 2 · 3.3 = −13.2,
  // + 3 · 1 = −10.2, · 0.25); W4A4 would have quantized 3.3 and 1 first.
  std::vector<float> x(64, 0.0f), y(64);
  x[0] = 3.3f;
  x[1] = 1.0f;
  cpu::Linear(x.data(), 1, m, y.data());
  EXPECT_EQ(y[0], 0.25f * std::fma(1.0f, 3.0f, -4.0f * 3.3f));
  EXPECT_EQ(y[1], 0.0f);
}

TEST_F(QuantErrorTest, Nvfp4A16RefusalsNameTheFieldOrTensor) {
  EXPECT_EQ(LoadEdited("nvfp4a16", nullptr), "");
  auto qc = [](const char* path, json v) {
    return [path, v](json& c) { c["quantization_config"][json::json_pointer(path)] = v; };
  };
  // Still refused: the weights' other schemes, a second group with activations (mixed), and the
  // W4A4 tensors' input_global_scale (not part of the format).
  EXPECT_THAT(LoadEdited("nvfp4a16", nullptr, qc("/config_groups/group_0/weights/group_size", 32)),
              HasSubstr("config_groups.group_0.weights.group_size' is 32"));
  EXPECT_THAT(LoadEdited("nvfp4a16", nullptr, qc("/config_groups/group_0/weights/num_bits", 8)),
              HasSubstr("config_groups.group_0.weights.num_bits' is 8"));
  EXPECT_THAT(LoadEdited("nvfp4a16", nullptr,
                         [](json& c) {
                           json& groups = c["quantization_config"]["config_groups"];
                           json g1 = groups["group_0"];
                           g1["targets"] = json::array({"re:nothing.*"});
                           g1["input_activations"] = {
                               {"num_bits", 4},     {"type", "float"},
                               {"symmetric", true}, {"strategy", "tensor_group"},
                               {"group_size", 16},  {"dynamic", "local"}};
                           groups["group_1"] = g1;
                         }),
              HasSubstr("config_groups.group_1.input_activations' differs from an earlier "
                        "group's"));
  static const float six = 6.0f;
  EXPECT_THAT(LoadEdited("nvfp4a16",
                         [](auto& t) {
                           t.push_back(TensorFromBuffer(kQ + ".input_global_scale", DType::kF32,
                                                        {1}, &six));
                         }),
              HasSubstr("unexpected tensor '" + kQ + ".input_global_scale'"));
  EXPECT_THAT(LoadEdited("nvfp4a16", [](auto& t) { Erase(t, kQ + ".weight_global_scale"); }),
              HasSubstr("'" + kQ + ".weight_global_scale' is missing"));
  static const float zero = 0.0f;
  EXPECT_THAT(LoadEdited("nvfp4a16",
                         [](auto& t) {
                           Erase(t, kQ + ".weight_global_scale");
                           t.push_back(TensorFromBuffer(kQ + ".weight_global_scale", DType::kF32,
                                                        {1}, &zero));
                         }),
              HasSubstr("tensor '" + kQ + ".weight_global_scale' is 0"));
  // dgserve-quantize: weight-only NVFP4 in ModelOpt's layout, or with another format, is refused.
  QuantizeOptions o;
  o.progress = false;
  o.format = WeightFormat::kNvfp4;
  o.group_size = 16;
  o.nvfp4_activations = Nvfp4Activations::kNone;
  auto s = QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4a16_modelopt", o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("compressed-tensors layout only (llm-compressor's NVFP4A16 preset)"));
  EXPECT_FALSE(fs::exists(*dir_ + "/nvfp4a16_modelopt"));
  o.format = WeightFormat::kW4A16;
  o.group_size = 32;
  s = QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/w4a16_none", o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("--format nvfp4 only, not w4a16"));
}

// dgserve-quantize's refusals for nvfp4.
TEST_F(QuantErrorTest, Nvfp4QuantizeRefusesAnotherGroupSizeAndRegexIgnores) {
  QuantizeOptions o;
  o.progress = false;
  o.format = WeightFormat::kNvfp4;
  o.group_size = 32;
  auto s = QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4_g32", o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("NVFP4 blocks are 16"));
  o.group_size = 16;
  o.ignore = {"re:.*(q|k)_proj"};
  s = QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4_re", o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("re:.*(q|k)_proj"));
  // The written configs: ModelOpt's quantization_config and hf_quant_config.json.
  std::ifstream in(*dir_ + "/nvfp4/config.json");
  const json c = json::parse(in);
  EXPECT_EQ(c["quantization_config"]["quant_method"], "modelopt");
  EXPECT_EQ(c["quantization_config"]["quant_algo"], "NVFP4");
  EXPECT_EQ(c["quantization_config"]["group_size"], 16);
  std::ifstream hin(*dir_ + "/nvfp4/hf_quant_config.json");
  const json h = json::parse(hin);
  EXPECT_EQ(h["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(h["quantization"]["exclude_modules"], c["quantization_config"]["exclude_modules"]);
}

}  // namespace
}  // namespace dgserve
