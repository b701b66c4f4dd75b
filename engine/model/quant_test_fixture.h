// What the quantized-checkpoint tests share (quant_test.cc, quant_nvfp4_test.cc, one binary):
// the weights' matrices by name and the fixture that writes the tiny-v512 checkpoint in bf16,
// FP8, W4A16 and NVFP4 (ModelOpt's layout, "nvfp4", compressed-tensors', "nvfp4_ct", and its
// weight-only NVFP4A16, "nvfp4a16") once per suite and loads edited copies of them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "common/bf16.h"
#include "common/fp8.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quant_config.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/safetensors.h"
#include "gmock/gmock.h"

namespace dgserve::quant_testing {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using json = nlohmann::json;

// Every matrix of the weights with its HF-like name (experts as "...experts.gate_up_proj[e]").
inline std::vector<std::pair<std::string, const cpu::PackedMatrix*>> Matrices(
    const ModelWeights& w) {
  std::vector<std::pair<std::string, const cpu::PackedMatrix*>> m;
  m.push_back({"sc_gate_proj", &w.sc_gate_proj});
  m.push_back({"sc_up_proj", &w.sc_up_proj});
  m.push_back({"sc_down_proj", &w.sc_down_proj});
  m.push_back({"lm_head", &w.lm_head});
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    for (auto [n, x] : std::vector<std::pair<const char*, const cpu::PackedMatrix*>>{
             {"q_proj", &l.q_proj},
             {"k_proj", &l.k_proj},
             {"v_proj", &l.v_proj},
             {"o_proj", &l.o_proj},
             {"mlp.gate_proj", &l.mlp_gate_proj},
             {"mlp.up_proj", &l.mlp_up_proj},
             {"mlp.down_proj", &l.mlp_down_proj},
             {"router", &l.router_proj}}) {
      m.push_back({p + n, x});
    }
    for (size_t e = 0; e < l.experts_gate_up_proj.size(); ++e) {
      m.push_back({p + "gate_up[" + std::to_string(e) + "]", &l.experts_gate_up_proj[e]});
      m.push_back({p + "down[" + std::to_string(e) + "]", &l.experts_down_proj[e]});
    }
  }
  return m;
}

class QuantErrorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::dgserve::testing::MakeTempDir("quant_err"));
    const fs::path golden = fs::path(::dgserve::testing::GoldenDir()) / "tiny-v512";
    auto cfgs = LoadConfigsFromModelDir(golden.string());
    ASSERT_TRUE(cfgs.ok());
    ASSERT_THAT(WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, *dir_ + "/bf16"),
                IsOk());
    QuantizeOptions o;
    o.progress = false;
    ASSERT_TRUE(QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/fp8", o).ok());
    o.format = WeightFormat::kW4A16;
    ASSERT_TRUE(QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/w4a16", o).ok());
    o.format = WeightFormat::kNvfp4;
    o.group_size = 16;
    ASSERT_TRUE(QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4", o).ok());
    o.nvfp4_layout = Nvfp4Layout::kCompressedTensors;
    ASSERT_TRUE(QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4_ct", o).ok());
    o.nvfp4_activations = Nvfp4Activations::kNone;
    ASSERT_TRUE(QuantizeCheckpoint(*dir_ + "/bf16", *dir_ + "/nvfp4a16", o).ok());
  }
  // A copy of `src` with its tensors edited and/or its config.json edited; returns the load's
  // error message ("" when it loads).
  std::string LoadEdited(const std::string& src,
                         const std::function<void(std::vector<TensorSource>&)>& tensors,
                         const std::function<void(json&)>& config = nullptr) {
    const std::string out = *dir_ + "/edit" + std::to_string(n_++);
    fs::create_directories(out);
    auto reader = SafetensorsReader::OpenDir(*dir_ + "/" + src);
    EXPECT_TRUE(reader.ok());
    std::vector<TensorSource> t;
    for (const TensorView& v : reader->tensors()) {
      t.push_back(TensorFromBuffer(v.name, v.dtype, v.shape, v.data));
    }
    if (tensors) tensors(t);
    EXPECT_THAT(WriteSafetensors(out, std::move(t)), IsOk());
    std::ifstream in(*dir_ + "/" + src + "/config.json");
    json c = json::parse(in);
    if (config) config(c);
    std::ofstream(out + "/config.json") << c.dump(2);
    if (hf_quant_config_) {
      const fs::path hf = fs::path(*dir_ + "/" + src) / "hf_quant_config.json";
      if (fs::exists(hf)) fs::copy_file(hf, fs::path(out) / "hf_quant_config.json");
    }
    auto ck = LoadCheckpoint(out);
    return ck.ok() ? "" : std::string(ck.status().message());
  }
  static void Erase(std::vector<TensorSource>& t, const std::string& name) {
    t.erase(std::remove_if(t.begin(), t.end(), [&](auto& s) { return s.name == name; }), t.end());
  }
  inline static std::string* dir_ = nullptr;
  int n_ = 0;
  bool hf_quant_config_ = false;  // LoadEdited copies hf_quant_config.json too
};

inline const std::string kQ = "model.decoder.layers.0.self_attn.q_proj";

// The e2m1 value of a code, restated from the format's table (ModelOpt's e2m1_values).
inline float E2m1Value(int code) {
  static const float v[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, 0, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  return v[code & 15];
}

struct Pass {
  std::vector<float> keys, logits;
};

// Two prompts encoded together and two canvases decoded together (the second with a soft
// embedding), or each alone.
inline Pass RunPasses(const Checkpoint& ck, bool batched) {
  const ModelConfig& c = ck.config;
  auto b = CreateCpuBackend(c, ck.weights);
  std::vector<int32_t> p1(21), p2(9), c1(c.canvas_length), c2(c.canvas_length);
  for (size_t i = 0; i < p1.size(); ++i) p1[i] = (i * 37 + 11) % c.vocab_size;
  for (size_t i = 0; i < p2.size(); ++i) p2[i] = (i * 53 + 3) % c.vocab_size;
  for (int i = 0; i < c.canvas_length; ++i) {
    c1[i] = (i * 13 + 1) % c.vocab_size;
    c2[i] = (i * 29 + 7) % c.vocab_size;
  }
  std::vector<float> soft(size_t(c.canvas_length) * c.hidden_size);
  for (size_t i = 0; i < soft.size(); ++i) soft[i] = std::sin(0.37f * float(i));
  ContiguousKvCache kv1(c, 256), kv2(c, 256);
  std::vector<float> l1(size_t(c.canvas_length) * c.vocab_size), l2(l1.size());
  EncodeInput e[2] = {{p1, &kv1}, {p2, &kv2}};
  DecodeInput d[2] = {{c1, nullptr, &kv1, l1.data()}, {c2, soft.data(), &kv2, l2.data()}};
  if (batched) {
    EXPECT_THAT(b->Encode(e), IsOk());
    EXPECT_THAT(b->Decode(d), IsOk());
  } else {
    for (int i = 0; i < 2; ++i) EXPECT_THAT(b->Encode({&e[i], 1}), IsOk());
    for (int i = 0; i < 2; ++i) EXPECT_THAT(b->Decode({&d[i], 1}), IsOk());
  }
  Pass out;
  for (int l = 0; l < c.num_layers; ++l) {
    const int w = c.KvHeads(l) * c.HeadDim(l);
    for (int pos = 0; pos < 21; ++pos) {
      out.keys.insert(out.keys.end(), kv1.KeyRow(l, pos), kv1.KeyRow(l, pos) + w);
    }
  }
  out.logits = l1;
  out.logits.insert(out.logits.end(), l2.begin(), l2.end());
  return out;
}

}  // namespace dgserve::quant_testing
